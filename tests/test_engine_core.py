"""The engine core on a tiny random Llama: batching equals one-at-a-time, chunked prefill equals
unchunked, overlap and in-flight batching change nothing, no KV block outlives its request."""

from __future__ import annotations

import queue
import threading

import numpy as np
import pytest
import torch

from audio_pipeline.core.stop import StopReason
from audio_pipeline.service.engine import TTSEngine
from audio_pipeline.models.llama_model import candidate_groups
from helpers import GREEDY, TEXTS, forced_logits, make_config, run_texts, start_engine, wait_idle

@pytest.fixture(scope="module")
def reference_tokens(tiny_model_dir):
    """Each text run alone (batch of one), greedy."""
    engine = start_engine(tiny_model_dir, "max_batch_size=1")
    try:
        return [run_texts(engine, [t], **GREEDY)[0].generated for t in TEXTS]
    finally:
        engine.stop()


@pytest.mark.parametrize("flags", [
    pytest.param((), id="continuous-batching"),
    pytest.param(("max_batch_input_tokens=16",), id="chunked-prefill"),
    pytest.param(("enable_in_flight_batching=true", "max_batch_input_tokens=24"), id="in-flight-batching"),
    pytest.param(("enable_overlap_scheduler=true",), id="overlap"),
    pytest.param(("max_num_steps=4",), id="multi-step"),
    pytest.param(("enable_prioritize_first_decode=true", "ce_delay_ms=5", "min_batch_size_tg=2"), id="knobs"),
    pytest.param(("deadline_scheduling=false",), id="no-deadlines"),
    # Every stream due at once and a margin of a second: rounds end at every first chunk, prefill
    # steps are cut short or wait.
    pytest.param(("first_audio_target_ms=0", "deadline_margin_ms=1000", "max_batch_input_tokens=24"),
                 id="tight-deadlines"),
])
def test_concurrent_greedy_requests_equal_the_same_requests_one_at_a_time(tiny_model_dir, reference_tokens, flags):
    engine = start_engine(tiny_model_dir, *flags)
    try:
        contexts = run_texts(engine, TEXTS, **GREEDY)
        assert [c.generated for c in contexts] == reference_tokens
        assert all(c.stop_reason in (StopReason.END_OF_SPEECH, StopReason.MAX_TOKENS) for c in contexts)
        wait_idle(engine)
    finally:
        engine.stop()


def test_preemption_recomputes_and_gives_the_same_tokens(tiny_model_dir, reference_tokens):
    # 12 blocks of 16 tokens (256 bytes a token: the tiny model's 16-bit cache): the six requests
    # (prompt + 70 tokens each) cannot all stay resident.
    engine = start_engine(tiny_model_dir, "max_num_steps=1", "kvcache_ce_watermark=1.0",
                   model={"kv_cache": {"kv_cache_page_size": 16, "kv_cache_memory_bytes": 12 * 16 * 256}})
    try:
        assert engine.scheduler.block_manager.total_num_blocks == 12
        contexts = run_texts(engine, TEXTS, **GREEDY)
        assert engine.scheduler.num_preemptions > 0
        assert [c.generated for c in contexts] == reference_tokens
        wait_idle(engine)
    finally:
        engine.stop()


def test_sampled_requests_do_not_depend_on_their_batch(tiny_model_dir):
    kwargs = dict(temperature=0.9, top_p=0.9, top_k=200, max_tokens=56, seed=1234)
    engine = start_engine(tiny_model_dir)
    try:
        alone = run_texts(engine, [TEXTS[0]], **kwargs)[0].generated
        batched = run_texts(engine, TEXTS[:4], **kwargs)[0].generated
        assert batched == alone
    finally:
        engine.stop()


def test_shared_prompt_prefixes_hit_the_prefix_cache(tiny_model_dir):
    engine = start_engine(tiny_model_dir, model={"kv_cache": {"kv_cache_page_size": 8}})
    try:
        first, second = (run_texts(engine, [text], **GREEDY)[0].prompt_ids for text in
                         ("The same fairly long preamble text, then one.", "The same fairly long preamble text, then two."))
        shared = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
        stats = engine.scheduler.block_manager.prefix_stats
        # The second prompt reuses every full page of the first it shares, and only those.
        assert stats.hit_tokens == shared // 8 * 8 >= 32 and 0 < stats.hit_rate < 1
        rendered = engine.metrics.render().decode()
        assert f"tts_prefix_cache_hit_rate {stats.hit_rate}" in rendered
        wait_idle(engine)
    finally:
        engine.stop()


@pytest.mark.parametrize("flags", [(), ("enable_overlap_scheduler=true", "enable_in_flight_batching=true")],
                         ids=["plain", "overlap"])
def test_no_block_is_held_after_cancelled_and_failed_requests(tiny_model_dir, flags, reference_tokens, caplog):
    """Cancelled and failed requests end with their reason and leave nothing behind, also with
    overlap, where a step of them is still in flight when they end."""
    engine = start_engine(tiny_model_dir, *flags)
    try:
        events: queue.Queue = queue.Queue()
        contexts = [engine.create_context(t, temperature=0.0, max_tokens=700) for t in TEXTS]
        for context in contexts:
            engine.submit(context, events.put)
        while not any(c.generated for c in contexts):
            threading.Event().wait(0.01)
        for context in contexts:
            engine.cancel(context.request_id)
        last = {}
        while len(last) < len(contexts):
            event = events.get(timeout=60)
            if event.kind != "audio":
                last[event.request_id] = event
        assert all(c.stop_reason == StopReason.CANCELLED for c in contexts), [c.stop_reason for c in contexts]
        assert {(e.kind, e.stop_reason) for e in last.values()} == {("complete", StopReason.CANCELLED)}
        wait_idle(engine)

        # A step that fails (a broken decoder here) fails its requests and frees their blocks.
        original = engine.decoder.decode_batch
        engine.decoder.decode_batch = lambda codes, **_: (_ for _ in ()).throw(RuntimeError("decoder exploded"))
        try:
            events = queue.Queue()
            context = engine.create_context("fail me", temperature=0.0, max_tokens=70)
            engine.submit(context, events.put)
            while (event := events.get(timeout=60)).kind == "audio":
                pass
            # The client reads that decoding failed; the exception itself is in the server's log.
            assert event.kind == "error" and event.error == "audio decoding failed (the server's log has the details)"
            assert "decoder exploded" in caplog.text
            assert context.stop_reason == StopReason.FAILED
        finally:
            engine.decoder.decode_batch = original
        wait_idle(engine)
        # ... and the engine goes on serving: the same tokens as before the failure.
        assert run_texts(engine, TEXTS[:1], **GREEDY)[0].generated == reference_tokens[0]
    finally:
        engine.stop()


def test_a_cache_too_small_for_every_request_at_once_preempts_and_recomputes_the_same_speech(tiny_model_dir,
                                                                                            reference_tokens):
    """Twelve 16-token pages cannot hold the six requests together: the scheduler preempts, the
    preempted requests are recomputed from their tokens, and every request speaks what it speaks
    alone, ended as it ends alone; no block outlives them."""
    engine = start_engine(tiny_model_dir, "max_num_steps=1", "kvcache_ce_watermark=1.0",
                   model={"kv_cache": {"kv_cache_page_size": 16, "kv_cache_memory_bytes": 12 * 16 * 256}})
    try:
        contexts = run_texts(engine, TEXTS, **GREEDY)
        assert engine.scheduler.num_preemptions > 0
        assert [c.generated for c in contexts] == reference_tokens
        assert {c.stop_reason for c in contexts} <= {StopReason.END_OF_SPEECH, StopReason.MAX_TOKENS}
        wait_idle(engine)
        assert engine.scheduler.block_manager.sequences == []
    finally:
        engine.stop()


def test_stop_token_ids_end_the_speech(tiny_model_dir):
    engine = start_engine(tiny_model_dir)
    try:
        plain = run_texts(engine, [TEXTS[1]], **GREEDY)[0]
        # A frame-start token that did not occur before: as a stop id, generation ends right there.
        frame = engine.layout.tokens_per_frame
        cut = next(i for i in range(frame, len(plain.generated), frame)
                   if plain.generated[i] not in plain.generated[:i])
        stopped = run_texts(engine, [TEXTS[1]], stop_token_ids=[plain.generated[cut]], **GREEDY)[0]
        assert stopped.stop_reason == StopReason.END_OF_SPEECH
        assert stopped.generated == plain.generated[:cut]
    finally:
        engine.stop()


def test_logits_constraint_never_emits_a_broken_frame(tiny_model_dir):
    engine = start_engine(tiny_model_dir)
    try:
        contexts = run_texts(engine, TEXTS[:3], temperature=1.5, top_p=1.0, max_tokens=140, seed=5)
        layout = engine.layout
        for context in contexts:
            assert len(context.generated) % layout.tokens_per_frame == 0
            for position, token in enumerate(context.generated):
                assert layout.is_valid_token(token, position)
    finally:
        engine.stop()


def test_a_request_larger_than_the_whole_cache_is_refused(tiny_model_dir):
    from audio_pipeline.errors import InvalidArgument

    engine = start_engine(tiny_model_dir, model={"kv_cache": {"kv_cache_page_size": 16, "kv_cache_memory_bytes": 4 * 16 * 256}})
    try:
        context = engine.create_context("too long for this cache", temperature=0.0, max_tokens=140)
        with pytest.raises(InvalidArgument, match="sampling.max_tokens: .*more than the whole cache"):
            engine.submit(context, lambda event: None)
        wait_idle(engine)
    finally:
        engine.stop()


def test_logits_of_the_paged_model_match_transformers(tiny_model_dir):
    from transformers import LlamaForCausalLM as Reference

    engine = TTSEngine(make_config(tiny_model_dir))
    reference = Reference.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    context = engine.create_context("Compare logits with transformers.", temperature=0.0, max_tokens=14)
    prompt = context.prompt_ids
    kv = engine.kv_cache
    kv.claim(context.request_id)
    kv.block_manager.alloc(context.request_id, len(prompt))
    with torch.inference_mode():  # the prompt as one step of the runner's forward, on the paged cache
        hidden = engine.model.forward(torch.tensor(prompt), torch.arange(len(prompt)),
                                      kv.batch([context.request_id], [0], [len(prompt)]))
        ours = engine.model.model.compute_logits(hidden[-1:])[0]
    with torch.no_grad():
        theirs = reference(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    kv.release(context.request_id)


def test_candidate_logits_equal_the_same_columns_of_the_full_logits(tiny_model_dir):
    engine = TTSEngine(make_config(tiny_model_dir))
    hidden = torch.randn(5, engine.model.huggingface_config.hidden_size)
    layout = engine.layout
    ranges = [layout.token_range(p) for p in (0, 1, 2, 0, 6)]
    extra = torch.tensor([[layout.end_of_speech, 128009]] * 5)
    order, groups = candidate_groups(np.array([start for start, _ in ranges]))
    assert [(a, b) for a, b, _ in groups] == [(0, 2), (2, 3), (3, 4), (4, 5)]  # slot 0's two rows share one product
    got = engine.model.compute_candidate_logits(hidden, groups, torch.from_numpy(order), extra, layout.codebook_size)
    full = engine.model.model.compute_logits(hidden)
    for row, (start, end) in enumerate(ranges):
        want = torch.cat([full[row, start:end], full[row, extra[row]]])
        torch.testing.assert_close(got[row], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("weights", [None, "missing"])
def test_missing_decoder_weights_are_refused_before_the_language_model_loads(tmp_path, weights):
    """A plain Orpheus directory (no decoder shipped) or a decoder path that is not there is refused
    naming the setting, before the weights load: here they are not even readable."""
    from audio_pipeline.testing.tiny_models import write_tiny_orpheus_model

    model_dir = write_tiny_orpheus_model(tmp_path / "plain", with_decoder=False)
    (model_dir / "model.safetensors").write_bytes(b"not a checkpoint")
    overrides = {} if weights is None else {"audio_decoder_weights": str(tmp_path / weights)}
    with pytest.raises(ValueError, match="audio_decoder_weights: .*(ships no snac decoder|does not exist)"):
        TTSEngine(make_config(model_dir, **overrides))


def test_auto_cache_dtype_is_float16_where_the_native_kernel_reads_a_float32_models_cache():
    """model.kv_cache.cache_dtype=auto: float16 for a float32 model on CPU whose attention runs in
    the native kernel (measured faster through the server), else the model's own dtype."""
    from audio_pipeline.config import KVCacheConfig
    from audio_pipeline.models.llama_model import resolve_cache_dtype
    from audio_pipeline_kernels import native_attention

    cpu, cuda, f32 = torch.device("cpu"), torch.device("cuda"), torch.float32
    native = native_attention() is not None
    assert resolve_cache_dtype(KVCacheConfig(), f32, cpu) == (torch.float16 if native else f32)
    assert resolve_cache_dtype(KVCacheConfig(attention_kernel="native"), f32, cpu) == (torch.float16 if native
                                                                                        else f32)
    assert resolve_cache_dtype(KVCacheConfig(attention_kernel="torch"), f32, cpu) == f32
    assert resolve_cache_dtype(KVCacheConfig(), torch.bfloat16, cpu) == torch.bfloat16
    assert resolve_cache_dtype(KVCacheConfig(), f32, cuda) == f32
    assert resolve_cache_dtype(KVCacheConfig(), torch.bfloat16, cuda) == torch.bfloat16
    assert resolve_cache_dtype(KVCacheConfig(cache_dtype="float32"), f32, cpu) == f32
    assert resolve_cache_dtype(KVCacheConfig(cache_dtype="bfloat16"), f32, cpu) == torch.bfloat16


@pytest.mark.parametrize("cache_dtype,expected,backend", [("auto", torch.float16, "native"),
                                                           ("float32", torch.float32, "native"),
                                                           ("bfloat16", torch.bfloat16, "native"),
                                                           ("float16", torch.float16, "native"),
                                                           ("fp8_e4m3", torch.float8_e4m3fn, "torch")])
def test_cache_dtype_stores_the_kv_cache_in_that_dtype(tiny_model_dir, cache_dtype, expected, backend):
    """model.kv_cache.cache_dtype takes effect: the cache holds that dtype (auto: float16 for this
    float32 model on CPU; the CPU kernel reads 16-bit caches, widening them as it loads; fp8 goes to
    the torch form) and requests run to the end."""
    engine = start_engine(tiny_model_dir, model={"kv_cache": {"cache_dtype": cache_dtype}})
    try:
        manager = engine.kv_cache
        assert {t.dtype for t in manager.cache.keys + manager.cache.values} == {expected}
        assert manager.backend.name == backend
        [context] = run_texts(engine, ["Hello there."], **GREEDY)
        assert context.stop_reason in (StopReason.END_OF_SPEECH, StopReason.MAX_TOKENS)
        # Whole frames of speech tokens, each in its slot, that decode to their frames' audio.
        codes = engine.layout.tokens_to_codes(context.generated)
        assert codes.numel() >= engine.layout.tokens_per_frame and codes.numel() % engine.layout.tokens_per_frame == 0
        assert engine.decoder.decode(codes).numel() == codes.numel() // 7 * engine.decoder.samples_per_frame
    finally:
        engine.stop()
    config = make_config(tiny_model_dir, model={"kv_cache": {"cache_dtype": cache_dtype, "attention_kernel": "native"}})
    if backend == "native":
        TTSEngine(config).stop()
    else:
        with pytest.raises(ValueError, match="attention_kernel=native"):
            TTSEngine(config)


#: Max abs difference of the logits over a 16-bit cache from those over a float32 cache: every
#: logit of the vocabulary, teacher-forced through the float32 engine's greedy speech for the first
#: three TEXTS (140 tokens each; the prompt in one step, then a token per step, as decoding runs).
#: Measured: the tiny model (logits within +-1.7) bfloat16 6.5e-4, float16 1.0e-4; the built-in
#: voice (logits within +-18) bfloat16 8.0e-2, float16 6.3e-3; the default voice (slt-en-v5, one
#: position per frame: 140 frames, its frames' codes in the inputs; logits within +-28) bfloat16
#: 6.1e-2, float16 6.4e-3. The bounds are about three times that.
LOGIT_TOLERANCE = {("tiny", "bfloat16"): 2e-3, ("tiny", "float16"): 3e-4,
                   ("builtin:slt-en", "bfloat16"): 0.25, ("builtin:slt-en", "float16"): 0.02,
                   ("builtin:slt-en-v5", "bfloat16"): 0.2, ("builtin:slt-en-v5", "float16"): 0.02}
#: Of those texts, how many the 16-bit cache may speak (greedy) otherwise than the float32 cache.
#: Measured: none with float16; with bfloat16 one of slt-en's (17 of its 140 tokens, from the 67th
#: on), none of the default voice's (nor of the earlier defaults', slt-en-frame and slt-en-v4).
GREEDY_TEXTS_DIFFERING = {"float16": 0, "bfloat16": 1}


def greedy_and_logits(model, cache_dtype, sequences=None):
    """The greedy speech of the first three TEXTS with that cache, and the logits along
    ``sequences`` ((tokens, prompt length) each; by default that speech's own)."""
    # The prompt's products in float32 (model.prompt_dtype): the cache's rounding alone is measured.
    engine = start_engine(model, model={"kv_cache": {"cache_dtype": cache_dtype}, "prompt_dtype": "float32"})
    try:
        assert engine.kv_cache.backend.name == "native"
        contexts = run_texts(engine, TEXTS[:3], temperature=0.0, max_tokens=140)
    finally:
        engine.stop()
    spoken = [c.generated for c in contexts]

    def frames(context):
        if context.prompt_frames is None:
            return None
        return torch.cat([context.prompt_frames, torch.tensor(context.frames, dtype=torch.long).reshape(-1, 4)])

    sequences = sequences or [(c.prompt_ids + c.generated, len(c.prompt_ids), frames(c)) for c in contexts]
    return spoken, sequences, [forced_logits(engine, *sequence) for sequence in sequences]


@pytest.fixture(scope="module", params=["tiny", "builtin:slt-en", "builtin:slt-en-v5"])
def float32_cache_run(request, tiny_model_dir):
    model = tiny_model_dir if request.param == "tiny" else request.param
    return request.param, model, greedy_and_logits(model, "float32")


@pytest.mark.parametrize("cache_dtype", ["bfloat16", "float16"])
def test_a_16_bit_cache_keeps_the_logits_within_tolerance_of_float32(float32_cache_run, cache_dtype):
    """The engine with model.kv_cache.cache_dtype=bfloat16 / float16 (keys and values rounded as they
    are written, widened by the native kernel as they are read) gives logits within
    LOGIT_TOLERANCE of the float32 cache's along the same tokens, and speaks (greedy) what the
    float32 cache speaks, on all but GREEDY_TEXTS_DIFFERING of the texts."""
    name, model, (spoken32, sequences, logits32) = float32_cache_run
    spoken, _, logits = greedy_and_logits(model, cache_dtype, sequences)
    worst = max((got - want).abs().max().item() for got, want in zip(logits, logits32))
    assert worst <= LOGIT_TOLERANCE[name, cache_dtype]
    assert worst > 0  # the cache is 16-bit: rounding shows
    assert sum(a != b for a, b in zip(spoken, spoken32)) <= GREEDY_TEXTS_DIFFERING[cache_dtype]
