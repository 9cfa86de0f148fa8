"""The CUDA serving path on a GPU (skipped without one): FlashInfer's attention in the engine, the
decode buckets and their CUDA graphs, the overlap pipeline, the decoders, and the frame families.

The model here has Orpheus-3B's attention shape (head size 128, 3 query heads per key/value head)
at two layers, in bfloat16, so every step runs FlashInfer's decode or prefill kernel. Its weights
are scaled (layer weights std 0.04, the final norm 20) so that attention moves the output and the
logits spread (up to about 57) far more than bfloat16 moves them.

bfloat16 results depend on how a kernel splits its sums, which changes with the batch's shape, the
step's other rows and the CUDA-graph decode plan; the engine's scheduling depends on when requests
arrive. So two runs of the same requests must give the same tokens, except that a request may part
from the other run at a near-tie: where the two picks' logits, computed in float32 by transformers on
the CPU along the shared tokens, are within TIE of each other. A wrong attention step parts at a
clear choice, and fails. (On the CPU in bfloat16, the dense torch form: batched against alone, 5 of
6 requests part, every one at a float32 gap of 0.02 to 0.38.)
"""

from __future__ import annotations

import os

import pytest
import torch

from audio_pipeline.service.engine import TTSEngine
from audio_pipeline.layouts import orpheus
from helpers import audio_of, forced_logits, make_config, run_requests, run_texts, synthesize, wait_idle

#: CUDA_TESTS_DRY_RUN=1 runs these tests' own logic on the CPU (the torch attention
#: form, no graphs, no fp8), to check them before a GPU session.
DRY_RUN = os.environ.get("CUDA_TESTS_DRY_RUN") == "1"
DEVICE, KERNEL = ("cpu", "torch") if DRY_RUN else ("cuda", "flashinfer")
pytestmark = pytest.mark.skipif(not (DRY_RUN or torch.cuda.is_available()), reason="needs a CUDA GPU")

#: How close (float32 logits) two picks must be for a run to part there: about what bfloat16 moves
#: this model's logits (the dense torch form, bfloat16 against float32: at most 0.89 on the CPU).
TIE = 1.0
TEXTS = ["Hello there.", "A much longer sentence that makes a longer prompt for the model.", "Hi!",
         "Numbers: one two three four five.", "Short.", "Another prompt, of middling length."]
GREEDY = dict(temperature=0.0, repetition_penalty=1.0, max_tokens=140)
#: Settings that fix the batching mode (CUDA's own defaults would turn overlap and in-flight batching on).
PLAIN = ("enable_overlap_scheduler=false", "enable_in_flight_batching=false", "max_batch_size=8")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from safetensors.torch import load_file, save_file

    from audio_pipeline.testing.tiny_models import write_tiny_orpheus_model

    path = write_tiny_orpheus_model(tmp_path_factory.mktemp("cuda-orpheus"), seed=3, hidden_size=768,
                                    intermediate_size=1536, num_attention_heads=6, num_key_value_heads=2)
    state = load_file(str(path / "model.safetensors"))
    for name in state:
        if name.startswith("model.layers.") and name.endswith("proj.weight"):
            state[name] = state[name] * 2
    state["model.norm.weight"] = state["model.norm.weight"] * 20
    save_file(state, str(path / "model.safetensors"))
    return path


def engine_on_cuda(model_dir, *flags, **model) -> TTSEngine:
    # A cache of 1 GiB (not 90 % of the GPU): quick to allocate, and other test processes keep their room.
    model = {"dtype": "bfloat16", **model, "kv_cache": {"attention_kernel": KERNEL, "kv_cache_memory_bytes": 1 << 30,
                                                        **model.get("kv_cache", {})}}
    engine = TTSEngine(make_config(model_dir, *flags, model={"device": DEVICE, **model}))
    engine.start()
    return engine


def speak(model_dir, *flags, texts=TEXTS, **model) -> list[list[int]]:
    engine = engine_on_cuda(model_dir, *flags, **model)
    try:
        assert engine.kv_cache.backend.name == model.get("kv_cache", {}).get("attention_kernel", KERNEL)
        contexts = run_texts(engine, texts, **GREEDY)
        prompts = [c.prompt_ids for c in contexts]
        return prompts, [c.generated for c in contexts], engine
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def reference(model_dir):
    """transformers' Llama in float32 on the CPU: the judge of near-ties."""
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def same_or_tie(reference, prompts, ours, theirs) -> list[str]:
    """For each request, '=' where both runs gave the same tokens, else 'tie@i (gap)' where they
    part at a near-tie: two speech tokens at i, or one run's end of speech at i against the other's
    speech token (the end is not recorded: the shorter run's tokens are the other's first i). GREEDY
    names no stop ids, so the one way to end before max_tokens is the layout's end of speech, and
    only on a frame boundary. Raises AssertionError (naming the request and the gap) where they part
    at a clear choice, or where a run ended off a frame boundary."""
    verdicts = []
    for index, (prompt, a, b) in enumerate(zip(prompts, ours, theirs)):
        if a == b:
            verdicts.append("=")
            continue
        at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        if at < min(len(a), len(b)):
            picks = a[at], b[at]
        else:  # one run is the other's first `at` tokens: it ended its speech there
            assert at > 0 and at % orpheus.TOKENS_PER_FRAME == 0, \
                f"request {index} ended after {at} tokens, off a frame boundary ({orpheus.TOKENS_PER_FRAME} tokens)"
            picks = (orpheus.END_OF_SPEECH, b[at]) if len(a) == at else (a[at], orpheus.END_OF_SPEECH)
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + a[:at]])).logits[0, -1]
        gap = (logits[picks[0]] - logits[picks[1]]).abs().item()
        assert gap <= TIE, f"request {index} parts at token {at}: {picks[0]} against {picks[1]}, float32 gap {gap:.3f}"
        verdicts.append(f"tie@{at} ({gap:.3f})")
    return verdicts


def test_flashinfer_serves_a_head_128_model_and_its_logits_are_as_close_to_float32_as_the_torch_forms(model_dir,
                                                                                                      reference):
    """Along the same tokens (a prompt step, then one decode step per token), FlashInfer's paged
    attention in bfloat16 is no further from transformers' float32 logits than the dense torch form
    in bfloat16 on the same GPU."""
    prompts, spoken, _ = speak(model_dir, *PLAIN, cuda_graphs=False)
    sequence, prompt_length = prompts[1] + spoken[1][:40], len(prompts[1])
    with torch.no_grad():
        want = reference(torch.tensor([sequence])).logits[0, prompt_length - 1:]
    errors = {}
    for kernel in (KERNEL, "torch"):
        engine = TTSEngine(make_config(model_dir, *PLAIN, model={"device": DEVICE, "cuda_graphs": False,
                                                                 "dtype": "bfloat16",
                                                                 "kv_cache": {"attention_kernel": kernel,
                                                                              "kv_cache_memory_bytes": 1 << 30}}))
        assert engine.kv_cache.backend.name == kernel
        got = forced_logits(engine, sequence, prompt_length).float().cpu()
        errors[kernel] = (got - want).abs().max().item()
    scale = want.abs().max().item()
    print(f"max |logit - float32|: {KERNEL} {errors[KERNEL]:.4f}, torch {errors['torch']:.4f} "
          f"(logits up to {scale:.1f})")
    assert errors[KERNEL] <= 1.5 * errors["torch"] + 1e-3 * scale


@pytest.mark.parametrize("flags,model", [
    pytest.param(PLAIN, {"cuda_graphs": False}, id="batched-exact"),
    pytest.param(PLAIN, {"cuda_graphs": False, "decode_buckets": [8]}, id="padded-eager"),
    pytest.param(PLAIN, {"cuda_graphs": True, "decode_buckets": [2, 4, 8]}, id="padded-graphs"),
    pytest.param(("max_batch_size=8",), {}, id="cuda-defaults"),  # overlap, in-flight batching, graphs
    pytest.param(("max_batch_size=8", "max_batch_input_tokens=16"), {}, id="chunked-prefill"),
])
def test_batched_greedy_speech_equals_one_at_a_time_on_cuda(model_dir, reference, flags, model):
    """Every batching mode on CUDA gives each request the tokens it gets alone (but for near-ties)."""
    prompts, alone, _ = speak(model_dir, "enable_overlap_scheduler=false", "enable_in_flight_batching=false",
                              "max_batch_size=1", cuda_graphs=False)
    _, batched, _ = speak(model_dir, *flags, **model)
    print("alone vs batched:", same_or_tie(reference, prompts, alone, batched))


def test_cuda_graphs_give_the_eager_tokens_of_the_same_buckets(model_dir, reference):
    """The captured decode graphs replay what the eager forward computes at the same padded shapes."""
    prompts, eager, _ = speak(model_dir, *PLAIN, cuda_graphs=False, decode_buckets=[2, 4, 8])
    _, graphs, _ = speak(model_dir, *PLAIN, cuda_graphs=True, decode_buckets=[2, 4, 8])
    print("eager vs graphs:", same_or_tie(reference, prompts, eager, graphs))


def test_overlap_gives_the_tokens_of_the_same_steps_read_one_by_one(model_dir, reference):
    prompts, plain, _ = speak(model_dir, *PLAIN, cuda_graphs=True, decode_buckets=[2, 4, 8])
    _, overlap, _ = speak(model_dir, "enable_overlap_scheduler=true", "enable_in_flight_batching=false",
                          "max_batch_size=8", cuda_graphs=True, decode_buckets=[2, 4, 8])
    print("plain vs overlap:", same_or_tie(reference, prompts, plain, overlap))


@pytest.mark.skipif(DRY_RUN, reason="an fp8 cache needs FlashInfer")
def test_an_fp8_cache_speaks_within_ties_of_the_bfloat16_one(model_dir, reference):
    """An fp8 cache rounds keys and values to 3 mantissa bits: the speech may part from bfloat16's
    sooner, but only where float32 finds the two picks close (a looser TIE, four times)."""
    prompts, bf16, _ = speak(model_dir, *PLAIN)
    _, fp8, engine = speak(model_dir, *PLAIN, kv_cache={"cache_dtype": "fp8_e4m3"})
    assert engine.kv_cache.cache.keys[0].dtype == torch.float8_e4m3fn
    global TIE
    tie, TIE = TIE, 4 * TIE
    try:
        print("bf16 vs fp8:", same_or_tie(reference, prompts, bf16, fp8))
    finally:
        TIE = tie


@pytest.mark.skipif(DRY_RUN, reason="captures CUDA graphs")
def test_the_captured_token_sampling_draws_the_eager_ids_and_serves(model_dir, reference):
    """The decode steps' token sampling replayed from its CUDA graph (core/sample_graphs.py) draws
    the ids the same function computes eagerly on the bucket's inputs, for greedy, penalized,
    top-k and nucleus rows under both rules; and served speech with it is the speech of the same
    buckets' graphs with eager sampling (but for near-ties)."""
    import numpy as np

    from audio_pipeline.core.sample_graphs import _rule, draw_ids
    from audio_pipeline.core.sampler import FLOAT_FIELDS

    engine = engine_on_cuda(model_dir, *PLAIN, cuda_graphs=True, decode_buckets=[2, 4, 8])
    try:
        runner = engine.core.runner
        graphs = runner.sample_graphs
        assert graphs is not None and graphs.captured
        cuda, codebook, (first, slots) = runner.device, graphs.codebook, graphs.span
        torch.manual_seed(0)
        count = 7  # in the bucket of 8
        states = (torch.randn(count, engine.model.model.config.hidden_size, device=cuda) * 4).to(engine.model.dtype)
        floats = np.zeros((len(FLOAT_FIELDS), count), dtype=np.float32)
        floats[FLOAT_FIELDS.index("temperature")] = [0.0, 0.0, 0.9, 0.7, 1.0, 1.3, 0.6]
        floats[FLOAT_FIELDS.index("top_p")] = [1.0, 1.0, 0.9, 1.0, 0.95, 0.8, 1.0]
        floats[FLOAT_FIELDS.index("min_p")] = [0.0, 0.0, 0.0, 0.0, 0.05, 0.0, 0.0]
        floats[FLOAT_FIELDS.index("repetition_penalty")] = [1.0, 1.5, 1.1, 1.0, 1.0, 1.2, 1.0]
        floats[FLOAT_FIELDS.index("frequency_penalty")] = [0.0, 0.5, 0.0, 0.0, 0.0, 0.0, 0.3]
        floats[FLOAT_FIELDS.index("uniform")] = np.random.default_rng(0).random(count)
        starts = first + codebook * (torch.arange(count, device=cuda) % slots)
        blocked = torch.zeros(count, codebook + 1, dtype=torch.bool, device=cuda)
        blocked[::2, codebook] = True  # the stop id only where the speech may end
        table = torch.poisson(torch.full((count, codebook), 0.05, device=cuda))
        for prefix, top_k in ((True, [codebook + 1, codebook + 1, 20, 50, 64, 10, 30]),
                              (False, [codebook + 1, 40, codebook + 1, 50, codebook + 1, 10, 200])):
            staged = {"starts": starts, "extra_ids": torch.full((count, 1), engine.layout.end_of_speech, device=cuda),
                      "blocked": blocked, "floats": torch.from_numpy(floats).to(cuda),
                      "top_k": torch.tensor(top_k, device=cuda), "count_rows": torch.arange(count, device=cuda)}
            rows = _rule(codebook, prefix)
            with torch.inference_mode():
                replayed = graphs.run(states, staged, table, rows).clone()
                eager = draw_ids(engine.model, graphs.bucket_inputs(count), rows, graphs.span)[:count]
            in_range = (replayed >= starts) & (replayed < starts + codebook)
            assert (in_range | (replayed == engine.layout.end_of_speech)).all()
            assert torch.equal(replayed, eager), f"prefix rule {prefix}: {replayed.tolist()} != {eager.tolist()}"
            print(f"token sampling, prefix rule {prefix}: graph = eager: {replayed.tolist()}")
    finally:
        engine.stop()
    prompts, eager_sampling, _ = speak(model_dir, *PLAIN, cuda_graphs=True, decode_buckets=[2, 4, 8],
                                       sample_graphs=False)
    _, captured, served = speak(model_dir, *PLAIN, cuda_graphs=True, decode_buckets=[2, 4, 8])
    assert served.core.runner.sample_graphs.replays > 100
    print("eager sampling vs captured:", same_or_tie(reference, prompts, eager_sampling, captured))


def test_no_block_or_request_is_held_after_the_runs(model_dir):
    engine = engine_on_cuda(model_dir, "max_batch_size=8")
    try:
        run_texts(engine, TEXTS, **GREEDY)
        wait_idle(engine)
    finally:
        engine.stop()


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "snac-graphs"])
def test_the_engine_streams_on_cuda_the_audio_of_its_windows_decoded_one_by_one(model_dir, graphs):
    """On CUDA the audio is decoded on the decoder thread (its own stream) while the loop goes on:
    each request's chunks arrive in order, before its completion, and are the audio of its windows
    decoded one at a time, in order, on a stream of its own (within batched-kernel rounding); with
    SNAC's graphs on, the engine's decoder calls replay them."""
    import queue

    from audio_pipeline.decoders.streaming import DecoderStream, decode_windows

    flags = ["audio_decoder_config.cuda_graphs=true"] if graphs and not DRY_RUN else []
    engine = engine_on_cuda(model_dir, "max_batch_size=8", "chunk_size=28,56", *flags)
    try:
        assert engine.core._decoder is not None or DRY_RUN
        events: queue.Queue = queue.Queue()
        contexts = [engine.create_context(t, **{**GREEDY, "min_tokens": 140}) for t in TEXTS[:4]]
        for context in contexts:
            engine.submit(context, events.put)
        audio = {c.request_id: [] for c in contexts}
        settings = engine.core.streaming
        done = 0
        while done < len(contexts):
            event = events.get(timeout=120)
            assert event.kind != "error", event.error
            assert event.request_id in audio, "an event after the request's completion"
            if event.kind == "audio":
                audio[event.request_id].append(torch.from_numpy(event.samples))
                continue
            done += 1
            chunks = audio.pop(event.request_id)
            context = next(c for c in contexts if c.request_id == event.request_id)
            alone = DecoderStream(engine.decoder, chunk_size=settings.chunk_size, buffer=settings.buffer,
                                  block_causal=settings.block_causal, prepend=settings.prepend)
            want = []
            while (window := alone.next_window(len(context.generated), finished=True)) is not None:
                want += decode_windows(engine.decoder, [(alone, window, context.speech_codes(window.start, window.end))])
            assert len(chunks) == len(want) >= 3
            for got, expected in zip(chunks, want):
                torch.testing.assert_close(got, expected.float(), atol=1e-3 * expected.abs().max().item() + 1e-5, rtol=0)
        wait_idle(engine)
        if graphs and not DRY_RUN:  # the chunks above (served and alone) were replayed from SNAC's graphs
            graphs = engine.decoder.graphs
            assert graphs is not None and graphs.replays > 0, "SNAC decoded eagerly on CUDA"
            frames = [n // 7 for n in settings.chunk_size[:1]]  # the first window, prepared at start-up
            assert all((frames[0], bucket) in graphs.shapes for bucket in graphs.sizes)
            print(f"served: SNAC graph replays {graphs.replays}, shapes {graphs.shapes}, "
                  f"captured in {graphs.capture_seconds:.2f} s")
    finally:
        engine.stop()


# --- decoders -------------------------------------------------------------------------------------

def test_snacs_captured_decode_gives_the_eager_audio(tmp_path):
    """decode_batch replayed from SNAC's CUDA graphs (the 24 kHz model's shape) equals the eager
    call on the same device within float tolerance: padded buckets, more rows than the largest
    bucket, a bucket's leftover rows, each row's noise offset."""
    from audio_pipeline.decoders import load_audio_decoder
    from audio_pipeline.decoders.snac import SNAC_24KHZ_CONFIG
    from audio_pipeline.decoders.snac_graphs import SNACGraphs
    from audio_pipeline.testing.random_decoders import save_random_snac_checkpoint

    path = save_random_snac_checkpoint(tmp_path / "snac", seed=6, **SNAC_24KHZ_CONFIG)
    # One batched call per length on either device (the CPU's default splits them).
    eager = load_audio_decoder("snac", str(path), {"cuda_graphs": False, "max_batch_frames": None}, device=DEVICE)
    captured = load_audio_decoder("snac", str(path), {"max_batch_frames": None, "cuda_graphs": not DRY_RUN},
                                  device=DEVICE)
    if DRY_RUN:
        captured.graphs = SNACGraphs(captured, capture=False)
    assert captured.graphs is not None and eager.graphs is None
    generator = torch.Generator().manual_seed(2)
    worst = 0.0
    for count, frames in ((3, 4), (70, 2), (5, 8), (2, 4), (1, 12)):
        codes = torch.randint(0, 4096, (count, frames * 7), generator=generator)
        offsets = torch.randint(0, 900, (count,), generator=generator).tolist()
        want = eager.decode_batch(list(codes), frame_offsets=offsets)
        got = captured.decode_batch(list(codes), frame_offsets=offsets)
        for g, w in zip(got, want):
            assert g.shape == w.shape and g.device.type == "cpu"
            scale = w.abs().max().item()
            worst = max(worst, (g - w).abs().max().item() / max(scale, 1e-9))
            torch.testing.assert_close(g, w, atol=1e-3 * scale + 1e-5, rtol=0)
    # 70 rows of 2 frames: a call of 64 and one of 8
    assert captured.graphs.shapes == [(4, 4), (2, 64), (2, 8), (8, 8), (4, 2), (12, 1)]
    assert captured.graphs.replays == 6
    print(f"SNAC graphs against eager: largest difference {worst:.2e} of the window's peak; captured 6 in "
          f"{captured.graphs.capture_seconds:.2f} s")


def _decoder_pair(name, path):
    from audio_pipeline.decoders import load_audio_decoder

    return load_audio_decoder(name, str(path)), load_audio_decoder(name, str(path), device=DEVICE)


@pytest.mark.parametrize("name", ["snac", "mimi", "neucodec"])
def test_each_decoder_on_cuda_equals_the_cpu(name, tmp_path):
    """The same codes decode to the same audio on CUDA as on the CPU (float32; within the
    tolerance of TF32 convolutions), alone and batched."""
    from audio_pipeline.testing.random_decoders import (
        save_random_mimi_checkpoint,
        save_random_neucodec_checkpoint,
        save_random_snac_checkpoint,
    )

    writer = {"snac": save_random_snac_checkpoint, "mimi": save_random_mimi_checkpoint,
              "neucodec": save_random_neucodec_checkpoint}[name]
    cpu, cuda = _decoder_pair(name, writer(tmp_path / name, seed=5))
    assert torch.device(cuda.device).type == DEVICE
    generator = torch.Generator().manual_seed(1)
    batch = [torch.randint(0, getattr(cpu, "codebook_size", 4096), (frames * cpu.tokens_per_frame,),
                           generator=generator) for frames in (12, 5, 20)]
    want = [cpu.decode(codes) for codes in batch]
    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False  # float32 convolutions, as on the CPU
    try:
        got = cuda.decode_batch([codes.to(DEVICE) for codes in batch])
    finally:
        torch.backends.cudnn.allow_tf32 = tf32
    for w, g in zip(want, got):
        assert g.shape == w.shape  # audio comes back on the CPU from either device
        torch.testing.assert_close(g.float().cpu(), w.float(), atol=1e-3 * w.abs().max().item() + 1e-5, rtol=0)


# --- the frame families ---------------------------------------------------------------------------

def test_the_builtin_frame_voice_speaks_on_cuda_as_on_the_cpu():
    """The default voice (head size 48: the torch form on CUDA; its prompt folded, its decoder
    equalised) in float32: the same greedy frames on both devices, served to the end."""
    from audio_pipeline.config import DEFAULT_MODEL

    spoken = {}
    for device in ("cpu", DEVICE):
        engine = TTSEngine(make_config(DEFAULT_MODEL, model={"device": device, "dtype": "float32",
                                                             "kv_cache": {"cache_dtype": "float32"}}))
        engine.start()
        try:
            if device == "cuda":
                assert engine.kv_cache.backend.name == "torch"
                assert engine.model.devices[0].type == "cuda"
            contexts = run_texts(engine, ["Hello from the GPU.", "A second sentence, spoken at the same time."],
                                 temperature=0.0)
            spoken[device] = [c.frames for c in contexts]
        finally:
            engine.stop()
    assert spoken[DEVICE] == spoken["cpu"] and all(len(frames) > 20 for frames in spoken["cpu"])


@pytest.mark.slow
def test_csm_is_served_on_cuda_over_grpc(tmp_path):
    """A tiny CSM (backbone, depth decoder, Mimi) behind the real gRPC server on CUDA: a request
    streams audio to its completion."""
    from audio_pipeline.testing.background import BackgroundServer
    from csm_model import write_tiny_csm

    model_dir = write_tiny_csm(tmp_path / "csm", seed=0)
    server = BackgroundServer(make_config(model_dir, "chunk_size=32,64", "sampling.max_tokens=40",
                                          model={"device": DEVICE})).start()
    try:
        assert server.engine.model.devices[0].type == DEVICE
        chunks = synthesize(server.target, "Hello from the GPU.", seed=3, temperature=0.9)
        usage = chunks[-1].complete.usage
        heard = sum(len(a) for a in audio_of(chunks))
        assert usage.generated_tokens > 0
        assert heard == usage.generated_tokens * server.engine.decoder.samples_per_frame
    finally:
        server.stop()


def test_qwen3_tts_gives_the_references_greedy_frames_on_cuda(tmp_path):
    """Qwen3-TTS (its talker, code predictor and 12 Hz decoder: head size 8, the torch form) in
    float32 on the GPU: the reference's greedy frames for a CustomVoice and an in-context Base case,
    batched, and audio streamed to the end."""
    from qwen3_tts_cases import case_array, case_info, case_request, model_copy

    for kind, names, streaming in (("custom_voice", ["custom_voice_serena_en_nonstreaming",
                                                     "custom_voice_ryan_instruct"], False),
                                   ("base", ["base_icl_streaming_long_text", "base_xvector_streaming"], True)):
        config = make_config(model_copy(tmp_path, kind, "english", streaming), "normalize_text=false",
                             "chunk_size=16,32", model={"device": DEVICE, "dtype": "float32",
                                                        "kv_cache": {"cache_dtype": "float32"}})
        engine = TTSEngine(config)
        engine.start()
        try:
            assert engine.model.devices[0].type == DEVICE and engine.decoder_device.type == DEVICE
            contexts = run_requests(engine, [case_request(name) for name in names],
                                    [case_info(name)[1]["text"] for name in names])
        finally:
            engine.stop()
        for name, context in zip(names, contexts):
            assert context.frames == case_array(name, "codes.npy").tolist(), name


def test_kyutai_tts_gives_the_references_greedy_frames_on_cuda(tmp_path):
    """Kyutai TTS (its backbone over the paged cache with the sliding window: the torch form, as
    FlashInfer is given no window; the depth transformer; the text rule on the host; Mimi) in float32
    on the GPU, the CUDA defaults on (overlap, in-flight batching): the reference's fed text ids,
    codes and timestamps for two voices batched and a generation past the attention window, the
    audio within 1e-3, and a dialogue served over gRPC."""
    import numpy as np

    from audio_pipeline.testing.background import BackgroundServer
    from helpers import pcm_of, run_to_completion
    from kyutai_tts_cases import FIXTURES, check, dialogue, load_case, requests_of

    directory = FIXTURES / "models" / "distilled"
    engine = TTSEngine(make_config(directory, "chunk_size=96,128", "sampling.max_tokens=400",
                                   model={"device": DEVICE, "dtype": "float32", "kv_cache": {"cache_dtype": "float32"}}))
    engine.start()
    try:
        assert engine.model.devices[0].type == DEVICE and engine.decoder_device.type == DEVICE
        requests = requests_of(engine, ["distilled_batch", "distilled_long"])
        results = run_to_completion(engine, [context for context, _, _ in requests])
        for (context, name, item), chunks in zip(requests, results):
            check(context, chunks, name, item, atol=1e-3)
    finally:
        engine.stop()
    server = BackgroundServer(make_config(directory, "chunk_size=96,128", "sampling.max_tokens=400",
                                          model={"device": DEVICE, "dtype": "float32",
                                                 "kv_cache": {"cache_dtype": "float32"}})).start()
    try:
        document, voice = dialogue(load_case("distilled_dialog"), 0)
        chunks = synthesize(server.target, document, voice=voice, temperature=0.0, ssml=True)
        np.testing.assert_allclose(pcm_of(chunks).astype(np.float32) / 32768,
                                   np.load(FIXTURES / "cases" / "distilled_dialog" / "audio_0.npy"), atol=1e-3, rtol=0)
    finally:
        server.stop()


@pytest.mark.skipif(DRY_RUN, reason="CUDA graphs need a GPU")
def test_a_frame_models_captured_step_and_depth_frame_compute_the_eager_ones(tmp_path):
    """Qwen3-TTS at its real head size (128: FlashInfer) in bfloat16, two small layers: the talker's
    captured decode step reads each position's frame and text id as the eager step does; the code
    predictor's captured frame is the eager frame at the same bucket, for greedy and sampled rows
    under both sampling rules; and served requests replay both."""
    import numpy as np

    from audio_pipeline.core.kv_cache.paged import PagedBatch
    from audio_pipeline.core.sampler import FLOAT_FIELDS, SamplingRows
    from audio_pipeline.testing.random_models import write_random_model
    from audio_pipeline_kernels import StepMetadata

    path = write_random_model(tmp_path / "qwen3", "qwen3-tts-small", seed=1)
    engine = TTSEngine(make_config(path, "normalize_text=false", "chunk_size=16,32", "max_batch_size=8",
                                   model={"device": DEVICE, "dtype": "bfloat16", "decode_buckets": [1, 2, 4, 8],
                                          "kv_cache": {"kv_cache_memory_bytes": 1 << 28}}))
    engine.start()
    try:
        runner = engine.core.runner
        model, kv, sampling = runner.model, runner.kv, runner.frame_sampling
        assert kv.backend.name == "flashinfer" and runner.graphs is not None and sampling.graphs is not None
        cuda = runner.device
        torch.manual_seed(0)

        # The talker: four rows at position 0 of the scratch page (as at capture), random inputs.
        size, scratch = 4, kv.cache.scratch_block
        metadata = StepMetadata.build([[scratch]] * size, [0] * size, [1] * size, kv.page_size)
        step = {"tokens": torch.randint(0, 64, (size,), device=cuda),
                "positions": torch.zeros(size, dtype=torch.long, device=cuda),
                "slots": torch.full((size,), scratch * kv.page_size, dtype=torch.long, device=cuda)}
        inputs = {"frames": torch.randint(0, 64, (size, 16), device=cuda),
                  "text_ids": torch.randint(0, 512, (size,), device=cuda)}
        with torch.inference_mode():
            replayed = runner.graphs.run(size, step, metadata, inputs).float().clone()
            eager = model.forward(step["tokens"], step["positions"],
                                  PagedBatch(kv.cache, metadata, step["slots"], kv.backend.plan(metadata)),
                                  **inputs).float()
            no_text = runner.graphs.run(size, step, metadata, {**inputs, "text_ids": torch.full_like(
                inputs["text_ids"], -1)}).float().clone()
        tolerance = 1e-2 * eager.abs().max().item()
        print(f"talker: graph against eager max|diff| {(replayed - eager).abs().max().item():.5f} "
              f"(tolerance {tolerance:.5f}); without the text track {(no_text - eager).abs().max().item():.3f}")
        torch.testing.assert_close(replayed, eager, atol=tolerance, rtol=0)
        assert (no_text - eager).abs().max().item() > 10 * tolerance  # the graph reads the text ids

        # The code predictor: three rows (one greedy, two sampled) in the bucket of four.
        rows_count, codebook, depth = 3, 64, 15
        states = torch.randn(rows_count, model.model.config.hidden_size, device=cuda).to(model.dtype)
        codes = torch.randint(0, codebook, (rows_count,), device=cuda)
        floats = np.zeros((depth, len(FLOAT_FIELDS), rows_count), dtype=np.float32)
        floats[:, FLOAT_FIELDS.index("temperature")] = [0.0, 0.9, 1.2]
        floats[:, FLOAT_FIELDS.index("top_p")] = [1.0, 0.8, 0.95]
        floats[:, FLOAT_FIELDS.index("repetition_penalty")] = 1.0
        floats[:, FLOAT_FIELDS.index("uniform")] = np.random.default_rng(0).random((depth, rows_count))
        blocked = torch.zeros(rows_count, codebook + 1, dtype=torch.bool, device=cuda)
        blocked[:, codebook] = True
        for prefix, top_k in ((True, [codebook + 1, 50, 20]), (False, [codebook + 1, codebook + 1, 30])):
            staged = {"depth_starts": torch.zeros(rows_count, dtype=torch.long, device=cuda),
                      "depth_extra": torch.zeros(rows_count, 1, dtype=torch.long, device=cuda),
                      "depth_blocked": blocked, "depth_floats": torch.from_numpy(floats).to(cuda),
                      "depth_top_k": torch.tensor(top_k, device=cuda)}
            empty = np.zeros(0, dtype=np.int64)
            rule = SamplingRows(codebook, empty, empty, empty, empty, empty, empty, any_sampling=True,
                                prefix_suffices=prefix, prefix_may_suffice=prefix)
            with torch.inference_mode():
                replayed = sampling.graphs.run(states, codes, staged, rule).clone()
                bucket = sampling.graphs.bucket_inputs(rows_count)
                eager = sampling.frames(bucket["states"], bucket["codes"], bucket, rule)[:rows_count]
            assert replayed.shape == (rows_count, 16) and replayed[:, 0].tolist() == codes.tolist()
            assert ((replayed >= 0) & (replayed < codebook)).all()
            assert torch.equal(replayed, eager), f"prefix rule {prefix}: {replayed.tolist()} != {eager.tolist()}"

        # Served: a greedy and a seeded request, each 24 frames, through both kinds of graph.
        before = (runner.graphs.replays, sampling.graphs.replays)
        contexts = run_texts(engine, ["Hello from the GPU.", "A second sentence."], voice="ryan", temperature=0.0,
                             min_tokens=24, max_tokens=24)
        contexts += run_texts(engine, ["A third one, sampled."], voice="ryan", temperature=0.9, seed=5,
                              min_tokens=24, max_tokens=24)
        assert [len(c.frames) for c in contexts] == [24, 24, 24]
        assert runner.graphs.replays > before[0] and sampling.graphs.replays > before[1]
        print("served: decode graph replays", runner.graphs.replays - before[0], "depth graph replays",
              sampling.graphs.replays - before[1])
    finally:
        engine.stop()
