"""Our Llama implementation against transformers' own forward, on tiny random checkpoints: Llama
(tied, untied with llama3 RoPE), Qwen2 (biased q/k/v projections, as NeuTTS Air's backbone) and
Qwen3 (each head's query and key normalized, as Qwen3-TTS's talker)."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from audio_pipeline.config import KVCacheConfig
from audio_pipeline.core.kv_cache import PagedKVCacheManager
from audio_pipeline.models.llama import LlamaForCausalLM
from audio_pipeline.models.llama_model import LlamaPipelineModel
from audio_pipeline.testing.tiny_models import write_tiny_orpheus_model
from audio_pipeline.models.weights import load_safetensors_into

# float32 on CPU; the two implementations order a few reductions differently.
LOGITS_ATOL = 1e-4


def paged_manager(config, block_size=4, num_blocks=64, attention_kernel="auto"):
    """A real paged KV cache for driving the model directly (small blocks: sequences span several)."""
    params = LlamaPipelineModel.get_kv_params(config, 1, KVCacheConfig(kv_cache_page_size=block_size), torch.float32)
    return PagedKVCacheManager(params, torch.device("cpu"), num_blocks, enable_prefix_caching=False,
                               attention_kernel=attention_kernel, num_heads=config.num_attention_heads)


def load_ours(model_dir):
    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    load_safetensors_into(model, model_dir, torch.float32, torch.device("cpu"))
    model.reset_rotary(torch.device("cpu"))
    return model.eval()


def write_tiny_qwen3(path, *, vocab_size: int, seed: int = 0):
    """A random Qwen3ForCausalLM (``save_pretrained``); transformers starts the query and key norms
    at one, where a missing norm would go unnoticed: here they are drawn."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from neutts_model import TINY_QWEN2

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(Qwen3Config(vocab_size=vocab_size, head_dim=32, **TINY_QWEN2))
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.endswith(("q_norm.weight", "k_norm.weight")):
                    parameter.uniform_(0.5, 1.5)
    model.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module", params=["tied", "untied_llama3_rope", "qwen2", "qwen3"])
def model_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "qwen3":
        return write_tiny_qwen3(path, vocab_size=150000, seed=3)
    if request.param == "qwen2":
        from neutts_model import write_tiny_qwen2

        return write_tiny_qwen2(path, vocab_size=150000, seed=3)
    overrides = {}
    if request.param == "untied_llama3_rope":
        overrides = dict(tie_word_embeddings=False, max_position_embeddings=16384,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    return write_tiny_orpheus_model(path, seed=3, with_decoder=False, **overrides)


@pytest.mark.parametrize("fused", [False, True], ids=["layers", "fused"])
@pytest.mark.parametrize("attention_kernel", ["auto", "torch"])
def test_logits_match_transformers_for_a_ragged_batch(model_dir, attention_kernel, fused):
    """Both attention forms (the native kernel that auto picks on CPU, and the torch form), with the
    checkpoint's layers as they are and fused (model.fuse_layers: one q/k/v product, one gate/up
    product, torch's rms_norm; what CUDA runs)."""
    from audio_pipeline.models.llama import fuse_layers

    ours = load_ours(model_dir)
    if fused:
        assert fuse_layers(ours) == ours.config.num_hidden_layers
        assert not any(name.endswith(("q_proj.weight", "gate_proj.weight")) for name in ours.state_dict())
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(0)
    sequences = [torch.randint(0, 150000, (n,), generator=generator) for n in (5, 17, 2, 9)]
    splits = [len(s) - min(3, len(s) - 1) for s in sequences]  # both passes non-empty
    kv = paged_manager(ours.config, attention_kernel=attention_kernel)
    assert kv.backend.name == ("torch" if attention_kernel == "torch" else "native")
    ids = [f"seq{i}" for i in range(len(sequences))]
    for seq_id, s in zip(ids, sequences):
        kv.claim(seq_id)
        kv.block_manager.alloc(seq_id, len(s))
    got = [[] for _ in sequences]
    with torch.no_grad():
        expected = [reference(s[None]).logits[0] for s in sequences]
        # Two ragged batches: every sequence's prefix, then the rest of each on top of the cache.
        for spans in ([(0, k) for k in splits], [(k, len(s)) for k, s in zip(splits, sequences)]):
            tokens = torch.cat([s[a:b] for s, (a, b) in zip(sequences, spans)])
            positions = torch.cat([torch.arange(a, b) for a, b in spans])
            lengths = [b - a for a, b in spans]
            starts = [sum(lengths[:i]) for i in range(len(lengths))]
            batch = kv.batch(ids, [a for a, _ in spans], lengths)
            logits = ours.compute_logits(ours(tokens, positions, batch))
            for i, (start, length) in enumerate(zip(starts, lengths)):
                got[i].append(logits[start:start + length])
    for want, parts in zip(expected, got):
        torch.testing.assert_close(torch.cat(parts), want, atol=LOGITS_ATOL, rtol=0)


def test_qwen2_biases_load_under_their_checkpoint_names(tmp_path):
    """Qwen2's q/k/v projections have biases and its output projection none, as the file says."""
    from neutts_model import write_tiny_qwen2

    model_dir = write_tiny_qwen2(tmp_path, vocab_size=300, seed=1)
    stored = load_file(str(model_dir / "model.safetensors"))
    ours = load_ours(model_dir)
    for name in ("q_proj", "k_proj", "v_proj"):
        key = f"model.layers.1.self_attn.{name}.bias"
        assert torch.equal(ours.state_dict()[key], stored[key]) and stored[key].abs().sum() > 0
    assert "model.layers.0.self_attn.o_proj.bias" not in stored and ours.model.layers[0].self_attn.o_proj.bias is None


def test_qwen3_query_and_key_norms_load_under_their_checkpoint_names(tmp_path):
    model_dir = write_tiny_qwen3(tmp_path, vocab_size=300, seed=1)
    stored = load_file(str(model_dir / "model.safetensors"))
    ours = load_ours(model_dir)
    for name in ("q_norm", "k_norm"):
        key = f"model.layers.1.self_attn.{name}.weight"
        assert torch.equal(ours.state_dict()[key], stored[key]) and stored[key].shape == (32,)
        assert not torch.equal(stored[key], torch.ones(32))


def test_sliding_window_attention_is_refused_naming_the_field(tmp_path):
    from neutts_model import write_tiny_qwen2

    model_dir = write_tiny_qwen2(tmp_path, vocab_size=300, use_sliding_window=True, sliding_window=16,
                                 max_window_layers=0)
    with pytest.raises(ValueError, match="use_sliding_window"):
        load_ours(model_dir)


def test_sharded_checkpoint_loads_identically(model_dir, tmp_path):
    state = load_file(str(model_dir / "model.safetensors"))
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    weight_map = {}
    for shard, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(tmp_path / shard))
        weight_map.update({k: shard for k in keys})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (tmp_path / "config.json").write_text((model_dir / "config.json").read_text())
    whole, sharded = load_ours(model_dir), load_ours(tmp_path)
    for (name, a), (_, b) in zip(whole.state_dict().items(), sharded.state_dict().items()):
        assert torch.equal(a, b), name


def test_mismatched_checkpoint_is_a_clear_error(model_dir, tmp_path):
    state = load_file(str(model_dir / "model.safetensors"))
    state.pop("model.norm.weight")
    state["model.extra.weight"] = torch.zeros(2)
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((model_dir / "config.json").read_text())
    with pytest.raises(ValueError, match=r"missing \['model.norm.weight'\].*unexpected \['model.extra.weight'\]"):
        load_ours(tmp_path)


def test_no_weights_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_safetensors_into(torch.nn.Linear(1, 1), tmp_path, torch.float32, torch.device("cpu"))
