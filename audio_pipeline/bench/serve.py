"""Serving benchmark through the real server: N concurrent streaming clients against `audio-pipeline serve`.

    python -m audio_pipeline.bench.serve [--streams 1,8,16,32,64] [--no-search] [--model builtin:slt-en-v5]
                                         [--task-arg NAME=VALUE ...] [--rounds 1]
    python -m audio_pipeline.bench.serve --device cuda --random-model orpheus-3b [--streams 1,64,128,256,512]
    python -m audio_pipeline.bench.serve --random-model qwen3-tts-0.6b --utterance-tokens 75 [--streams 1,4]
    python -m audio_pipeline.bench.serve --arrival poisson --rps 1,2,4,8 [--duration 30] [--door http|grpc]
    python -m audio_pipeline.bench.serve --random-model orpheus-tiny --emulate-step-ms 9.6 --emulate-decoder-ms 2.5 \
        --streams 64,256 --task-arg chunk_size=28

``--emulate-step-ms`` runs the server on an emulated device (testing/emulated_device.py): every model
step (its sampling included: on a GPU that is device work) a sleep of that many milliseconds and
every audio decoder call one of ``--emulate-decoder-ms``, the host side (engine loop, scheduler,
runner staging, doors, encoders, the engine core's process with ``--task-arg
engine_process=subprocess``) as served, so a GPU server's host behaviour can be measured on a CPU;
the report then has no memory floor.

``--arrival poisson`` runs the open-loop benchmark instead (bench/open_loop.py: requests arriving
at random moments, judged by stalls and audible first audio); the rest of this describes the
simultaneous-start mode.

With ``--random-model`` the server runs a randomly initialised model of a real shape (Orpheus-3B:
Llama 3.2 3B with a random SNAC 24 kHz decoder; Qwen3-TTS-12Hz-0.6B: its talker, code predictor
and a random 12 Hz speech tokenizer; the weights drawn on the device at load: nothing to
download) and every stream is exactly ``--utterance-tokens`` speech tokens long (min_tokens =
max_tokens), since a random model's end of speech means nothing, and the plain forward is skipped.

It starts `audio-pipeline serve` in a subprocess (default settings unless ``--task-arg`` or
``--model`` say otherwise), waits for it to report SERVING, then for each N starts N streams at once
(or, with ``--spread S``, one every S/N seconds) with the client library (`AsyncTTSClient.stream`)
and records when every audio chunk arrives.

Per stream:
- TTFA: request sent to first audio chunk received.
- RTF: request sent to the completion received, over the seconds of audio received.
- stall: a player that starts at the first chunk and plays continuously waits
  ``max_k(arrival_k - t_first - audio_before_k)`` (at least 0); the stream *holds real time* when
  that is at most 100 ms.
- TTFT (the server's, mean over the round): arrival at the engine to the first speech token, the
  part of the TTFA spent queueing and in prefill.

It prints, per N: TTFA p50/p99, RTF median, streams holding real time, the worst stall, TTFT,
aggregate x real time (all audio over the round's wall time), forward passes per second and the
engine's time split (from the server's /metrics: scheduling, inputs, model, sampling, update, audio
decoding, delivery, in ms per forward pass; audio decoding on the decoder thread is its own time,
beside the loop's). With the search on, it then finds the largest N at which every stream holds real time with TTFA p99 under 300 ms.

In the same run it times a plain padded-batch forward of the same model (contiguous per-sequence
KV, one ``scaled_dot_product_attention`` per layer, eager torch, in this process) at batch 1 and 16,
and prints the engine's time per decode forward pass (every phase of its decode steps, over their
forward passes) at N = 1 and 16 as a ratio to it.

Every run (CPU or GPU, built-in or random model) also sets each N against the memory floor. Before
the server starts it measures the read bandwidth (a float32 sum over 512 MiB, far past the caches)
with one thread, the engine's threads and all cores, and prints it once. From the model's config
and the dtypes the server runs with (weights: model.dtype; KV cache: the dtype the server's start-up
log names, else as ``resolve_cache_dtype`` derives it, ``--task-arg model.kv_cache.cache_dtype=...``
honoured) a second table gives per decode forward pass, from the round's /metrics: its rows
(sequences: requests per decode step) and tokens (generated tokens after each request's first, over
the decode passes: the built-in voice feeds 2 a row, a sample and the token its layout forces), the
mean context a row reads (estimated as prompt tokens plus half the generated tokens per request),
the KV bytes read (rows x context x 2 x layers x kv_heads x head_dim x element size), the weight
bytes (the decoder layers' linear projections only: the engine computes logits only over each row's
candidate ids, so the lm_head is left out, as are the embeddings and norms), the weight FLOPs
(2 x linear parameters x tokens), the achieved GB/s and
GFLOP/s over the model phase's ms per pass (the main table's ``model`` column), the floor (bytes over
the engine-thread read bandwidth), and the model phase and the round's wall time per pass as
multiples of it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

from audio_pipeline.bench.server_process import Server
from audio_pipeline.bench.stats import percentile

#: A stream holds real time when its player never waits longer than this.
STALL_LIMIT_S = 0.1
#: The search's TTFA goal (p99).
TTFA_P99_LIMIT_S = 0.3

TEXTS = [
    "The train to the coast leaves from platform four at a quarter past nine.",
    "Please remember to water the plants on the balcony while we are away.",
    "A small dog ran across the garden and hid behind the old wooden fence.",
    "Our meeting has moved to Thursday afternoon, right after lunch.",
    "The museum opens at ten and stays open late on Friday evenings.",
    "She painted the kitchen a warm yellow that caught the morning light.",
    "If the weather holds, we will walk along the river after dinner.",
    "The library keeps a quiet room upstairs for anyone who needs to read.",
    "He found his keys in the pocket of the coat he wore yesterday.",
    "Every winter the lake freezes and the children skate near the shore.",
    "The package should arrive on Monday, but it may take another day.",
    "Turn left at the second light and the hotel is on your right.",
]

#: Engine step phases, in the order the benchmark prints them (the server's tts_step_phase_seconds).
PHASES = ("schedule", "inputs", "model", "sample", "update", "decode", "deliver")


@dataclass
class StreamResult:
    ttfa: float
    rtf: float
    stall: float
    audio_seconds: float
    #: The word timings the stream carried.
    words: tuple = ()


def playback_stall(arrivals: list[tuple[float, float]]) -> float:
    """How long a player that starts at the first chunk waits at most: arrivals are (time, seconds
    of audio in that chunk)."""
    if not arrivals:
        return float("inf")
    first = arrivals[0][0]
    played = 0.0
    worst = 0.0
    for arrival, seconds in arrivals:
        worst = max(worst, arrival - first - played)
        played += seconds
    return worst


async def one_stream(client, text: str, tokens: int | None = None, delay: float = 0.0) -> StreamResult:
    """One streamed request, sent after ``delay`` seconds; with ``tokens``, exactly that many speech tokens."""
    if delay:
        await asyncio.sleep(delay)
    arrivals: list[tuple[float, float]] = []
    words: list = []
    sent = time.perf_counter()
    async for chunk in client.stream(text, min_tokens=tokens, max_tokens=tokens):
        now = time.perf_counter()
        if chunk.final:
            audio = sum(seconds for _, seconds in arrivals)
            return StreamResult(ttfa=arrivals[0][0] - sent if arrivals else float("inf"),
                                rtf=(now - sent) / audio if audio else float("inf"),
                                stall=playback_stall(arrivals), audio_seconds=audio, words=tuple(words))
        words += chunk.words
        if chunk.samples.shape[0]:  # a chunk with only word timings plays nothing
            arrivals.append((now, chunk.samples.shape[0] / chunk.sample_rate))
    raise RuntimeError("the stream ended without its completion")


async def run_round(target: str, count: int, offset: int, tokens: int | None = None, spread: float = 0.0
                    ) -> tuple[list[StreamResult], float]:
    """``count`` streams, started at once or evenly over ``spread`` seconds; (their results, the
    round's wall seconds)."""
    from audio_pipeline_client import AsyncTTSClient

    async with AsyncTTSClient(target, retries=0) as client:
        started = time.perf_counter()
        results = await asyncio.gather(*(one_stream(client, TEXTS[(offset + i) % len(TEXTS)], tokens,
                                                    delay=spread * i / count)
                                         for i in range(count)))
        return list(results), time.perf_counter() - started


def step_split(before: dict[str, float], after: dict[str, float]) -> tuple[int, dict[str, float]]:
    """(model forward passes, mean engine milliseconds per forward pass in each phase) between two scrapes."""
    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    steps = int(sum(delta(k) for k in after if k.startswith("tts_forward_passes_total")))
    split = {phase: 1000 * delta(f'tts_step_phase_seconds_total{{phase="{phase}"}}') / max(steps, 1)
             for phase in PHASES}
    return steps, split


def decode_step_ms(before: dict[str, float], after: dict[str, float]) -> float:
    """Mean milliseconds of engine time per decode forward pass (all phases of decode steps, over
    their forward passes: a multi-step decode step runs several) between two scrapes."""
    key = 'tts_forward_passes_total{kind="tg"}'
    steps = after.get(key, 0) - before.get(key, 0)
    seconds = (after.get('tts_decode_step_seconds_total', 0) - before.get('tts_decode_step_seconds_total', 0))
    return 1000 * seconds / steps if steps else float("nan")


@dataclass
class RoundSummary:
    count: int
    results: list[StreamResult]
    wall: float
    steps: int
    split: dict[str, float]
    decode_ms: float
    #: Prompt tokens of the round's requests (computed in prefill plus found in the prefix cache).
    prompt_tokens: int = 0
    #: Tokens the round's requests generated (sampled, and forced by the layout).
    output_tokens: int = 0
    #: Decode (tg) forward passes.
    decode_passes: int = 0
    #: Decode steps, and the requests in them all (the server's tts_batch_size histogram).
    decode_steps: int = 0
    decode_step_rows: int = 0
    #: Mean seconds from a request's arrival at the engine to its first speech token (the server's
    #: tts_time_to_first_token_seconds): what of the TTFA is queueing and prefill.
    ttft: float = float("nan")

    @property
    def requests(self) -> int:
        return len(self.results)

    @property
    def rows_per_pass(self) -> float:
        """Mean sequences in a decode forward pass (requests per decode step): at most N, fewer
        while streams start and end. Each reads its keys and values once a pass."""
        return self.decode_step_rows / self.decode_steps if self.decode_steps else float(self.count)

    @property
    def tokens_per_pass(self) -> float:
        """Mean tokens a decode forward pass computes: every generated token but each request's last
        is fed back, and its first was sampled by its prefill, over the decode passes. A layout
        that forces tokens feeds them in the pass with the sample before them (the built-in voice:
        4 tokens a frame in 2 passes, 2 tokens per sequence a pass)."""
        if not self.decode_passes:
            return self.rows_per_pass
        return max(0, self.output_tokens - self.requests) / self.decode_passes

    @property
    def mean_context(self) -> float:
        """Estimated mean KV length a decode row reads: a request's prompt tokens and half its
        generated tokens (its context grows by one a pass from the prompt to prompt + generated)."""
        if not self.requests:
            return 0.0
        return (self.prompt_tokens + self.output_tokens / 2) / self.requests

    @property
    def holding(self) -> int:
        return sum(r.stall <= STALL_LIMIT_S for r in self.results)

    @property
    def passes_per_audio_second(self) -> float:
        """Engine forward passes per second of audio delivered (per stream: every pass serves all)."""
        audio = sum(r.audio_seconds for r in self.results)
        return self.steps * self.count / audio if audio else float("nan")

    @property
    def ttfa_p99(self) -> float:
        return percentile([r.ttfa for r in self.results], 99)

    @property
    def passes(self) -> bool:
        return self.holding == len(self.results) and self.ttfa_p99 < TTFA_P99_LIMIT_S

    def row(self) -> str:
        ttfa = [r.ttfa for r in self.results]
        audio = sum(r.audio_seconds for r in self.results)
        split = " ".join(f"{self.split[p]:>6.2f}" for p in PHASES)
        return (f"{self.count:>4} {1000 * percentile(ttfa, 50):>8.0f} {1000 * percentile(ttfa, 99):>8.0f} "
                f"{statistics.median(r.rtf for r in self.results):>7.3f} "
                f"{self.holding:>4}/{len(self.results):<4} {max(r.stall for r in self.results):>7.2f} "
                f"{1000 * self.ttft:>6.0f} "
                f"{audio / self.wall:>7.1f}x {self.steps / self.wall:>7.0f} {split}")


HEADER = (f"{'N':>4} {'TTFA p50':>8} {'TTFA p99':>8} {'RTF med':>7} {'holding':>9} {'stall s':>7} {'TTFT':>6} "
          f"{'x real':>8} {'fwd/s':>7} " + " ".join(f"{p[:6]:>6}" for p in PHASES))


def measure(server: Server, count: int, rounds: int, offset: int, tokens: int | None = None,
            spread: float = 0.0) -> RoundSummary:
    before = server.metrics()
    results: list[StreamResult] = []
    wall = 0.0
    for r in range(rounds):
        got, seconds = asyncio.run(run_round(server.target, count, offset + r * count, tokens, spread))
        results += got
        wall += seconds
    after = server.metrics()
    steps, split = step_split(before, after)

    def delta(key: str) -> int:
        return round(after.get(key, 0.0) - before.get(key, 0.0))

    return RoundSummary(count, results, wall, steps, split, decode_step_ms(before, after),
                        prompt_tokens=delta("tts_input_tokens_total") + delta("tts_prefix_cache_hit_tokens_total"),
                        output_tokens=delta("tts_output_tokens_total"),
                        decode_passes=delta('tts_forward_passes_total{kind="tg"}'),
                        decode_steps=delta('tts_batch_size_count{kind="tg"}'),
                        decode_step_rows=delta('tts_batch_size_sum{kind="tg"}'),
                        ttft=(after.get("tts_time_to_first_token_seconds_sum", 0.0)
                              - before.get("tts_time_to_first_token_seconds_sum", 0.0))
                        / max(delta("tts_time_to_first_token_seconds_count"), 1))


def search(server: Server, summaries: dict[int, RoundSummary], rounds: int, print_row,
           tokens: int | None = None, spread: float = 0.0) -> int:
    """Largest N that passes: doubling past the largest passing N measured, then bisection."""
    passing = [n for n, s in summaries.items() if s.passes]
    failing = [n for n, s in summaries.items() if not s.passes]
    low = max(passing, default=0)
    high = min((n for n in failing if n > low), default=None)

    def probe(n: int) -> bool:
        if n not in summaries:
            summaries[n] = measure(server, n, rounds, offset=n, tokens=tokens, spread=spread)
            print_row(summaries[n])
        return summaries[n].passes

    while high is None:
        candidate = max(1, low * 2)
        if candidate > 512:
            return low
        if probe(candidate):
            low = candidate
        else:
            high = candidate
    while high - low > max(1, low // 16):
        middle = (low + high) // 2
        if probe(middle):
            low = middle
        else:
            high = middle
    return low


def plain_forward_ms(model: str | None, batch: int, context: int, repeats: int = 50) -> float:
    """Milliseconds per decode step of a plain padded batch of the same model: contiguous KV per
    sequence ([B, kv_heads, L, D] per layer), one SDPA per layer, one new token per row."""
    import torch
    import torch.nn.functional as F

    from audio_pipeline.config import DEFAULT_MODEL
    from audio_pipeline.checkpoints.loading import resolve_model_dir
    from audio_pipeline.models.llama import rotate_half
    from audio_pipeline.models.registry import pipeline_model_class
    from audio_pipeline.models.weights import load_safetensors_into
    from transformers import AutoConfig

    model_dir = resolve_model_dir(model or DEFAULT_MODEL)
    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):  # the checkpoint's own module (a frame head's depth head loads, unused here)
        lm = pipeline_model_class(config).module_class(config)
    load_safetensors_into(lm, model_dir, torch.float32, torch.device("cpu"))
    lm.reset_rotary(torch.device("cpu"))
    lm.eval()
    attn = lm.model.layers[0].self_attn
    heads, kv_heads, dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
    caches = [(torch.randn(batch, kv_heads, context + repeats + 1, dim),
               torch.randn(batch, kv_heads, context + repeats + 1, dim)) for _ in lm.model.layers]
    tokens = torch.randint(0, config.vocab_size, (batch,))

    @torch.inference_mode()
    def step(position: int) -> torch.Tensor:
        x = lm.model.embed_tokens(tokens)
        cos, sin = lm.rotary(torch.full((batch,), position), x.dtype)
        cos, sin = cos[:, None, :], sin[:, None, :]
        for layer, (keys, values) in zip(lm.model.layers, caches):
            a = layer.self_attn
            h = layer.input_layernorm(x)
            q = a.q_proj(h).view(batch, heads, dim)
            k = a.k_proj(h).view(batch, kv_heads, dim)
            v = a.v_proj(h).view(batch, kv_heads, dim)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            keys[:, :, position] = k
            values[:, :, position] = v
            out = F.scaled_dot_product_attention(q[:, :, None], keys[:, :, :position + 1],
                                                 values[:, :, :position + 1], enable_gqa=heads != kv_heads)
            x = x + a.o_proj(out.reshape(batch, heads * dim))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return lm.compute_logits(lm.model.norm(x))

    for i in range(5):
        step(context + i)
    started = time.perf_counter()
    for i in range(repeats):
        step(context + i)
    return 1000 * (time.perf_counter() - started) / repeats


#: Batch sizes the plain padded forward is timed at.
PLAIN_BATCHES = (1, 16, 32)


#: The buffer read_bandwidth sums: far larger than any cache (this machine's L3 is tens of MiB).
READ_BYTES = 512 << 20


def read_bandwidth(device: str, threads: int = 1, size: int = READ_BYTES, repeats: int = 5) -> float:
    """Bytes per second a read-dominated pass moves: a float32 sum over ``size`` bytes (one
    8-byte result written), best of ``repeats``, with ``threads`` intra-op threads on the CPU
    (the caller's setting is restored)."""
    import torch

    buffer = torch.ones(size // 4, dtype=torch.float32, device=device)
    cuda = device.startswith("cuda")
    previous = torch.get_num_threads()
    if not cuda:
        torch.set_num_threads(threads)
    try:
        best = float("inf")
        for _ in range(repeats + 1):  # the first pass warms up (pages, kernels)
            if cuda:
                torch.cuda.synchronize(device)
            started = time.perf_counter()
            buffer.sum().item()
            best = min(best, time.perf_counter() - started)
        return size / best
    finally:
        torch.set_num_threads(previous)
        del buffer


#: Bytes per element of the weight and KV cache dtypes (by their configuration and torch names).
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8_e4m3": 1, "float8_e4m3fn": 1}


@dataclass
class ServedSettings:
    """What the server this benchmark starts resolves its settings to (as the engine does)."""

    #: The model's config.json.
    model_config: dict
    device: str
    #: Weight dtype name (model.dtype, auto: bfloat16 on GPU, float32 on CPU).
    weight_dtype: str
    #: KV cache dtype name as derived here (model.kv_cache.cache_dtype, see resolve_cache_dtype);
    #: the server's own start-up log line wins where there is one.
    cache_dtype: str
    #: The engine's intra-op threads (model.num_threads, else 1 on CPU).
    threads: int

    @classmethod
    def of(cls, model: str | None, device: str | None, task_args: list[str]) -> "ServedSettings":
        import json

        from audio_pipeline.config import AudioGenerationConfig
        from audio_pipeline.checkpoints.loading import resolve_device, resolve_dtype, resolve_model_dir
        from audio_pipeline.models.llama_model import resolve_cache_dtype
        from audio_pipeline.core.runtime import default_num_threads

        chosen = {key: value for key, value in (("model_path", model), ("device", device)) if value}
        config = AudioGenerationConfig.load(audio_flags=task_args, **({"model": chosen} if chosen else {}))
        resolved_device = resolve_device(config.model.device)
        dtype = resolve_dtype(config.model.dtype, resolved_device)
        cache_dtype = resolve_cache_dtype(config.model.kv_cache, dtype, resolved_device)
        model_config = json.loads((resolve_model_dir(config.model.model_path) / "config.json").read_text())
        # A config that nests its language model (Qwen3-TTS's talker): the floor is that model's
        # passes (its code predictor's run in the sampling phase).
        model_config = model_config.get("talker_config", model_config)
        threads = config.model.num_threads or default_num_threads(resolved_device)
        return cls(model_config, str(resolved_device), str(dtype).removeprefix("torch."),
                   str(cache_dtype).removeprefix("torch."), threads)


@dataclass(frozen=True)
class PassCost:
    """What one decode forward pass must read and compute, from the model's config.

    Weights: the linear layers of every decoder layer (q, k, v, o, gate, up, down). The output
    projection is left out: the engine computes logits only over each row's candidate ids (its
    frame slot's codebook and the stop ids), a sliver of the vocabulary; so is the embedding table
    (read only at the pass's rows) and the norms (a vector per layer). KV: every row reads its
    keys and values at every layer, ``2 x layers x kv_heads x head_dim`` elements per context token
    in the KV cache's dtype.
    """

    #: Parameters of the decoder layers' linear projections (and of a depth head's).
    linear_params: int
    #: Bytes per weight.
    weight_dtype_bytes: int
    #: Bytes of keys and values per context token, all layers.
    kv_bytes_per_token: int

    @classmethod
    def of(cls, config: dict, weight_dtype: str, cache_dtype: str) -> "PassCost":
        """From a Hugging Face Llama config (config.json as a dict) and the dtype names in force."""
        hidden, layers = config["hidden_size"], config["num_hidden_layers"]
        head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
        q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
        per_layer = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * config["intermediate_size"]
        head = config.get("frame_head") or {}  # a frame-per-pass model's depth head (models/frame_head.py)
        depth = head.get("num_layers", 2) * 3 * hidden * head.get("intermediate_size", 0) if head else 0
        return cls(layers * per_layer + depth, DTYPE_BYTES[weight_dtype], 2 * kv * layers * DTYPE_BYTES[cache_dtype])

    @property
    def weight_bytes(self) -> int:
        """Weight bytes a pass reads (once, whatever its batch)."""
        return self.linear_params * self.weight_dtype_bytes

    def kv_bytes(self, rows: float, context: float) -> float:
        """KV bytes a pass of ``rows`` rows at a mean ``context`` tokens reads."""
        return rows * context * self.kv_bytes_per_token

    def bytes(self, rows: float, context: float) -> float:
        return self.weight_bytes + self.kv_bytes(rows, context)

    def flops(self, tokens: float) -> float:
        """Weight FLOPs of a pass of ``tokens`` tokens: a multiply and an add per linear weight per
        token (attention's own, about 4 x context x heads x head_dim per token and layer, are left out)."""
        return 2 * self.linear_params * tokens

    def floor_ms(self, rows: float, context: float, bandwidth: float) -> float:
        """The shortest a pass can take: its bytes over the read bandwidth (bytes per second)."""
        return 1000 * self.bytes(rows, context) / bandwidth


FLOOR_HEADER = (f"{'N':>4} {'rows':>6} {'tokens':>6} {'ctx':>6} {'KV MB':>8} {'W MB':>8} {'GFLOP':>7} "
                f"{'model ms':>9} {'GB/s':>7} {'GFLOP/s':>8} {'floor ms':>9} {'x floor':>8} "
                f"{'wall ms':>8} {'x floor':>8}")


#: The memory-floor table's explanation.
FLOOR_NOTE = ("per decode forward pass (/metrics): rows = sequences (requests per decode step), tokens = tokens "
              "computed (generated tokens after each request's first / decode passes), ctx = mean KV tokens a "
              "row reads (prompt + half the generated tokens per request); KV MB = rows x ctx x bytes per token; "
              "GFLOP = 2 x linear parameters x tokens; GB/s and GFLOP/s over the model phase's ms per pass; "
              "floor = (KV + weight bytes) / read bandwidth; wall ms = round wall time / forward passes")


def floor_row(summary: "RoundSummary", cost: PassCost, bandwidth: float) -> str:
    """One N's line of the memory-floor table: per forward pass, the KV and weight bytes read and
    the weight FLOPs at the round's mean rows, tokens and context, the achieved GB/s and GFLOP/s over
    the model phase's ms per pass, the floor (bytes over ``bandwidth``) and the model phase and the
    round's wall time per pass as multiples of it."""
    rows, tokens, context = summary.rows_per_pass, summary.tokens_per_pass, summary.mean_context
    model_ms = summary.split["model"]
    wall_ms = 1000 * summary.wall / max(summary.steps, 1)
    total, floor, flops = cost.bytes(rows, context), cost.floor_ms(rows, context, bandwidth), cost.flops(tokens)
    nan = float("nan")
    return (f"{summary.count:>4} {rows:>6.1f} {tokens:>6.1f} {context:>6.0f} "
            f"{cost.kv_bytes(rows, context) / 1e6:>8.2f} {cost.weight_bytes / 1e6:>8.2f} {flops / 1e9:>7.3f} "
            f"{model_ms:>9.2f} {total / model_ms / 1e6 if model_ms else nan:>7.1f} "
            f"{flops / model_ms / 1e6 if model_ms else nan:>8.1f} {floor:>9.3f} "
            f"{model_ms / floor:>7.1f}x {wall_ms:>8.2f} {wall_ms / floor:>7.1f}x")


def floor_report(summaries: dict[int, "RoundSummary"], served: ServedSettings, bandwidth: float,
                 logged_cache_dtype: str | None = None) -> list[str]:
    """The memory-floor table: what a pass reads (one line), a row per N, the explanation. The KV
    cache's dtype is the server's logged one where given, else the one ``served`` derives."""
    c = served.model_config
    if "hidden_size" not in c:  # a config laid out otherwise (Kyutai TTS's): no floor from it
        return ["memory floor: not computed (the model's config.json does not name a Llama's sizes)"]
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    cache_dtype = logged_cache_dtype or served.cache_dtype
    cache_source = "the server's log" if logged_cache_dtype else "derived"
    cost = PassCost.of(c, served.weight_dtype, cache_dtype)
    return [f"memory floor per forward pass: {c['num_hidden_layers']} layers, hidden {c['hidden_size']}, "
            f"{c['num_key_value_heads']} kv heads x {head_dim}, intermediate {c['intermediate_size']}; weights "
            f"{served.weight_dtype}, {cost.linear_params / 1e6:.2f} M linear parameters = "
            f"{cost.weight_bytes / 1e6:.2f} MB a pass (the layers and any depth head: the engine computes logits for each row's "
            f"candidate ids, not the whole lm_head); KV cache {cache_dtype} ({cache_source}), "
            f"{cost.kv_bytes_per_token} bytes per context token; read bandwidth {bandwidth / 1e9:.1f} GB/s",
            FLOOR_HEADER, *(floor_row(summaries[n], cost, bandwidth) for n in sorted(summaries)), FLOOR_NOTE]


def emulated(args: argparse.Namespace) -> tuple[float, float] | None:
    """(step ms, decoder ms) of the emulated device the arguments ask for, else None."""
    step = getattr(args, "emulate_step_ms", None)
    return None if step is None else (step, getattr(args, "emulate_decoder_ms", 0.0))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m audio_pipeline.bench.serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", default="1,8,16,32,64", help="comma-separated concurrent stream counts")
    parser.add_argument("--no-search", dest="search", action="store_false",
                        help="skip the search for the largest N that holds real time")
    parser.add_argument("--model", help="--model for the server (default: the server's default model)")
    parser.add_argument("--task-arg", action="append", default=[], metavar="NAME=VALUE",
                        help="server settings, as for `audio-pipeline serve` (repeatable)")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of N streams per measurement")
    parser.add_argument("--context", type=int, default=400,
                        help="KV length of the plain padded forward's sequences (default 400, about the mean "
                             "KV length of the benchmark's streams with the built-in voice)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of the plain padded forward in this process (default 1)")
    parser.add_argument("--device", help="--device for the server (cpu, cuda, cuda:N; default: the server's)")
    parser.add_argument("--random-model", metavar="SHAPE",
                        help="serve a randomly initialised model of this shape instead of --model: orpheus-3b "
                             "(Llama 3.2 3B + SNAC 24 kHz), orpheus-tiny, qwen3-tts-0.6b or qwen3-tts-1.7b (talker, code "
                             "predictor, 12 Hz speech tokenizer) or qwen3-tts-tiny, kyutai-tts-1.6b (the published "
                             "shape as far as it is known: testing/random_models.py) or kyutai-tts-tiny")
    parser.add_argument("--utterance-tokens", type=int, default=490,
                        help="with --random-model, speech tokens per stream (default 490: 70 Orpheus frames, 6 s; "
                             "a Qwen3-TTS token is an 80 ms frame: 75 is 6 s)")
    parser.add_argument("--spread", type=float, default=0.0, metavar="SECONDS",
                        help="start each round's N streams evenly over this many seconds instead of all at once "
                             "(default 0); TTFA is counted from each stream's own start")
    parser.add_argument("--start-timeout", type=float, default=600.0,
                        help="seconds the server may take to start (load, profile, capture graphs) before the "
                             "benchmark stops it and fails, keeping its log (default 600)")
    parser.add_argument("--server-log", metavar="PATH",
                        help="write the server's log here and keep it (default: a temporary file, deleted after a "
                             "run that succeeds, kept and named after one that fails)")
    parser.add_argument("--arrival", choices=("simultaneous", "poisson"), default="simultaneous",
                        help="simultaneous: N streams start at once (or over --spread), as above; poisson: requests "
                             "arrive open loop at --rps (bench/open_loop.py: stalls and audible first audio as "
                             "listeners hear them; the search finds the highest rate with no stalled request)")
    parser.add_argument("--emulate-step-ms", type=float, metavar="MS",
                        help="emulate the device: every model step of the server, its sampling included, is a "
                             "sleep of MS (valid tokens drawn at random) and, with --emulate-decoder-ms, every audio "
                             "decoder call a sleep (silence); the host side runs as served, so a GPU server's host "
                             "behaviour can be measured on a CPU (testing/emulated_device.py)")
    parser.add_argument("--emulate-decoder-ms", type=float, default=0.0, metavar="MS",
                        help="with --emulate-step-ms, milliseconds of each audio decoder call (default 0)")
    from audio_pipeline.bench import open_loop

    open_loop.add_arguments(parser, shared=False)
    args = parser.parse_args(argv)
    if args.emulate_step_ms is None and args.emulate_decoder_ms:
        parser.error("--emulate-decoder-ms needs --emulate-step-ms")
    if args.emulate_step_ms is not None and args.arrival == "poisson":
        parser.error("--emulate-step-ms: an emulated device speaks silence, which no listener hears; the open loop's "
                     "audible first audio needs real speech (use --arrival simultaneous)")
    if args.arrival == "poisson":
        return open_loop.run(args)
    counts = [int(s) for s in args.streams.split(",")]
    # Every stream of a round rides one client connection: the server must let it open them all
    # (its limits.max_concurrent_streams, 100 by default, refuses the rest with RST_STREAM).
    if not any(arg.startswith("limits.max_concurrent_streams=") for arg in args.task_arg):
        args.task_arg.append(f"limits.max_concurrent_streams={max(1024, 2 * max(counts))}")

    import torch

    torch.set_num_threads(args.threads)
    tokens = args.utterance_tokens if args.random_model else None
    model_dir = None
    if args.random_model:
        from audio_pipeline.testing.random_models import write_random_model

        model_dir = tempfile.mkdtemp(prefix=f"random-{args.random_model}-")
        args.model = str(write_random_model(model_dir, args.random_model))
    elif args.emulate_step_ms is None:
        plain = {b: plain_forward_ms(args.model, b, args.context) for b in PLAIN_BATCHES}
        print(f"plain padded forward ({args.threads} thread(s), context {args.context}): "
              + ", ".join(f"batch {b} {ms:.2f} ms" for b, ms in plain.items()) + " per step", flush=True)
    served = ServedSettings.of(args.model, args.device, args.task_arg)
    emulate = emulated(args)
    # Measured before the server starts, so that nothing else of this run competes for memory.
    if emulate is not None:
        bandwidth = 0.0
        print(f"emulated device: a model step is {emulate[0]:g} ms, an audio decoder call {emulate[1]:g} ms "
              "(sleeps; a random valid code sampled, silent audio)", flush=True)
    elif served.device.startswith("cuda"):
        bandwidth = read_bandwidth(served.device)
        where = f"{served.device} {bandwidth / 1e9:.0f} GB/s"
    else:
        # One core, the engine's threads (model.num_threads; 1 by default on CPU) and all cores.
        bandwidths = {t: read_bandwidth("cpu", t) for t in sorted({1, served.threads, os.cpu_count() or 1})}
        bandwidth = bandwidths[served.threads]
        where = (", ".join(f"{t} thread{'s' if t > 1 else ''} {b / 1e9:.1f} GB/s" for t, b in bandwidths.items())
                 + f"; the floor uses the engine's {served.threads} thread{'s' if served.threads > 1 else ''}")
    if emulate is None:
        print(f"read bandwidth (a float32 sum over {READ_BYTES >> 20} MiB, best of 5): {where}", flush=True)

    # Stopped by a time limit (SIGTERM), the benchmark still stops its server and keeps the log: a
    # server left behind holds the GPU's memory, and the next run fails for want of it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    server = Server(args.model, args.task_arg, device=args.device, log_path=args.server_log,
                    start_timeout=args.start_timeout, emulate=emulate)
    succeeded = False
    try:
        server.wait_ready()
        print(f"server: {' '.join(server.command[3:])}", flush=True)
        logged_cache_dtype = server.kv_cache_dtype()
        measure(server, 2, 1, offset=0, tokens=tokens)  # warm-up
        print(HEADER + "   (engine phases: ms per forward pass)", flush=True)
        summaries: dict[int, RoundSummary] = {}
        for count in counts:
            summaries[count] = measure(server, count, args.rounds, offset=count, tokens=tokens, spread=args.spread)
            print(summaries[count].row(), flush=True)
        if args.search:
            best = search(server, summaries, args.rounds, lambda s: print(s.row(), flush=True), tokens,
                          args.spread)
            print(f"largest N with every stream holding real time (stall <= {1000 * STALL_LIMIT_S:.0f} ms) and "
                  f"TTFA p99 < {1000 * TTFA_P99_LIMIT_S:.0f} ms: {best}")
        if emulate is None:  # an emulated step has no memory floor
            print("\n".join(floor_report(summaries, served, bandwidth, logged_cache_dtype)), flush=True)
        if args.random_model or emulate is not None:
            succeeded = True
            return 0
        first = summaries[min(summaries)]
        per_audio_second = first.passes_per_audio_second
        # Every stream needs this many passes per second of its audio, and one pass serves the whole
        # batch: real time at any N needs a pass of batch N within this budget.
        print(f"forward passes per second of audio (N={first.count}): {per_audio_second:.1f}; real time needs a "
              f"forward pass of batch N within {1000 / per_audio_second:.2f} ms (plain padded forward: "
              + ", ".join(f"{ms:.2f} ms at batch {b}" for b, ms in plain.items()) + ")")
        for batch in (1, 16):
            if batch in summaries:
                engine_ms = summaries[batch].decode_ms
                print(f"engine time per decode forward pass at N={batch}: {engine_ms:.2f} ms = "
                      f"{engine_ms / plain[batch]:.1f}x the plain padded forward at batch {batch}")
        succeeded = True
    finally:
        server.finish(succeeded, keep_log=bool(args.server_log), model_dir=model_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
