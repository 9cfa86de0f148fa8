"""model.quantization (int8 dynamic quantization of the decoder layers' linears) and model.compile
with decode buckets (static graphs for bucketed decode steps, the eager module for everything else)."""

import pytest
import torch
from torch.ao.nn.quantized.dynamic import Linear as DynamicQuantizedLinear

from audio_pipeline.service.engine import TTSEngine
from audio_pipeline.models.llama_model import StaticBucketForward, check_quantization
from helpers import make_config, run_texts, start_engine

TEXTS = ["Hello there.", "A much longer sentence that makes a longer prompt for the model.", "Hi!",
         "Numbers: one two three four five.", "Short."]
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
#: Largest |int8 logits - float32 logits| allowed on the tiny model: measured 0.023 (above the 0.02 a
#: float16 cache keeps; on the built-in voice int8 moved decode logits by up to 3.4, so it is no default).
INT8_LOGITS_ATOL = 0.05


def test_int8_quantizes_the_layers_linears_only(tiny_model_dir):
    model = TTSEngine(make_config(tiny_model_dir, "model.quantization=int8")).model.model
    for layer in model.model.layers:
        for name in PROJECTIONS:
            assert isinstance(layer.get_submodule(name), DynamicQuantizedLinear), name
    assert type(model.lm_head) is torch.nn.Linear and type(model.model.embed_tokens) is torch.nn.Embedding
    assert model.lm_head.weight.dtype == torch.float32


def test_int8_is_refused_off_float32_and_off_the_cpu(tiny_model_dir):
    with pytest.raises(ValueError, match=r"model\.quantization=int8 needs a float32 model"):
        TTSEngine(make_config(tiny_model_dir, "model.quantization=int8", "model.dtype=bfloat16"))
    with pytest.raises(ValueError, match=r"model\.quantization=int8 runs on the CPU only"):
        check_quantization("int8", torch.device("cuda"), torch.float32)


def test_int8_logits_stay_close_to_float32(tiny_model_dir):
    """The same prompts' logits through both models (one ragged prefill step each)."""
    engines = [TTSEngine(make_config(tiny_model_dir, f"model.quantization={q}")) for q in ("none", "int8")]
    generator = torch.Generator().manual_seed(0)
    vocab = engines[0].model.huggingface_config.vocab_size
    lengths = [5, 17, 9]
    tokens = torch.randint(0, vocab, (sum(lengths),), generator=generator)
    positions = torch.cat([torch.arange(n) for n in lengths])
    logits = []
    for engine in engines:
        model, kv = engine.model, engine.kv_cache
        ids = [f"seq{i}" for i in range(len(lengths))]
        for seq_id, n in zip(ids, lengths):
            kv.claim(seq_id)
            kv.block_manager.alloc(seq_id, n)
        with torch.inference_mode():
            hidden = model.forward(tokens, positions, kv.batch(ids, [0] * len(lengths), lengths))
            logits.append(model.model.compute_logits(hidden))
    torch.testing.assert_close(logits[1], logits[0], atol=INT8_LOGITS_ATOL, rtol=0)


def test_int8_greedy_tokens_follow_float32_at_first(tiny_model_dir):
    """int8 greedy output is not identical: measured on these prompts (70 tokens each) the first
    difference came at tokens 38, 49, never, 25 and 2 on the tiny model (and never, never, 7, 34,
    23 on the built-in voice). Every request still completes, and its first two tokens agree."""
    tokens = []
    for quantization in ("none", "int8"):
        engine = start_engine(tiny_model_dir, f"model.quantization={quantization}")
        try:
            tokens.append([c.generated for c in run_texts(engine, TEXTS, max_tokens=70, temperature=0.0)])
        finally:
            engine.stop()
    assert [len(t) for t in tokens[0]] == [len(t) for t in tokens[1]]
    assert [t[:2] for t in tokens[0]] == [t[:2] for t in tokens[1]]


def test_compile_with_buckets_runs_static_decode_graphs_and_eager_prompts(tiny_model_dir):
    """Greedy tokens equal the eager engine's; bucketed decode steps ran the compiled forward and
    the prompt steps (arbitrary lengths) the eager module."""
    tokens, calls = [], {"compiled": 0, "eager": 0}
    for compile in ("false", "true"):
        engine = start_engine(tiny_model_dir, f"model.compile={compile}", "model.decode_buckets=2,4,8")
        try:
            if compile == "true":
                forward = engine.model.forward
                assert isinstance(forward, StaticBucketForward) and forward.buckets == {2, 4, 8}
                for name in calls:
                    attribute = "compiled" if name == "compiled" else "module"
                    inner = getattr(forward, attribute)

                    def counted(*args, _inner=inner, _name=name, **kwargs):
                        calls[_name] += 1
                        return _inner(*args, **kwargs)

                    setattr(forward, attribute, counted)
            tokens.append([c.generated for c in run_texts(engine, TEXTS, max_tokens=70, temperature=0.0)])
        finally:
            engine.stop()
    assert tokens[0] == tokens[1]
    assert calls["compiled"] > 0 and calls["eager"] > 0
