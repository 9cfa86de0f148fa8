"""Audio decoder benchmark: throughput in seconds of audio per second of decoding, batched (every
stream's chunk in one ``decode_windows`` call) against per stream (one call each), at 1, 8 and 32
streams; and the time to first audio of chunked streaming against one-shot decoding of an utterance.

    python -m audio_pipeline.bench.decoder [--decoder snac] [--weights DIR] [--streams 1,8,32] [--seconds 4]

Without ``--weights`` it writes a randomly initialised decoder of the published architecture (SNAC
24 kHz, the causal-conv test decoder) to a temporary directory: speed does not depend on the weights.
With ``--weights`` any decoder runs, e.g. the default voice's vocoder: ``--decoder mcep --weights
audio_pipeline/builtin/slt-en-v5/decoder --chunk 160 --chunk-size 32,160 --block-causal`` (its
streams decode 40-frame blocks). Codes are drawn at random within each frame position's limit.
Every figure is the best of ``--repeats`` runs; ratios compare runs of this one invocation.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from audio_pipeline.decoders import load_audio_decoder
from audio_pipeline.decoders.base import AudioDecoder
from audio_pipeline.decoders.streaming import DecoderStream, decode_windows

RANDOM_CHECKPOINTS = {"snac": "save_random_snac_checkpoint", "causal-conv": "save_random_causal_checkpoint"}


def best_seconds(run: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    return best


def random_codes(decoder: AudioDecoder, count: int, seed: int) -> torch.Tensor:
    """``count`` codes (whole frames), each drawn within its frame position's limit."""
    limits = torch.tensor(decoder.code_limits())
    draws = torch.rand(count // decoder.tokens_per_frame, len(limits), generator=torch.Generator().manual_seed(seed))
    return (draws * limits).long().reshape(-1)


def audio_seconds(decoder: AudioDecoder, codes: int) -> float:
    return codes // decoder.tokens_per_frame * decoder.samples_per_frame / decoder.sample_rate


def throughput(decoder: AudioDecoder, streams: int, chunk: int, block_causal: bool,
               repeats: int) -> tuple[float, float]:
    """Audio seconds per second for one ``chunk``-code chunk of each of ``streams`` streams:
    (all in one decode_windows call, one call per stream)."""
    codes = [random_codes(decoder, chunk, seed) for seed in range(streams)]

    def jobs():
        out = []
        for tokens in codes:
            stream = DecoderStream(decoder, chunk_size=[chunk], block_causal=block_causal)
            out.append((stream, stream.next_window(chunk, False), tokens))
        return out

    batched = best_seconds(lambda: decode_windows(decoder, jobs()), repeats)
    single = best_seconds(lambda: [decode_windows(decoder, [job]) for job in jobs()], repeats)
    total = streams * audio_seconds(decoder, chunk)
    return total / batched, total / single


def streamed(decoder: AudioDecoder, codes: torch.Tensor, chunk_size: list[int], buffer: int,
             block_causal: bool) -> None:
    stream = DecoderStream(decoder, chunk_size=chunk_size, buffer=buffer, block_causal=block_causal)
    while (window := stream.next_window(codes.numel(), True)) is not None:
        decode_windows(decoder, [(stream, window, codes[window.start:window.end])])


def first_chunk(decoder: AudioDecoder, codes: torch.Tensor, chunk_size: list[int], block_causal: bool) -> None:
    stream = DecoderStream(decoder, chunk_size=chunk_size, block_causal=block_causal)
    window = stream.next_window(chunk_size[0], False)
    decode_windows(decoder, [(stream, window, codes[:chunk_size[0]])])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m audio_pipeline.bench.decoder", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--decoder", default="snac",
                        help="snac (default), causal-conv (random weights unless --weights) or any decoder "
                             "with --weights; fed random codes within the decoder's code_limits()")
    parser.add_argument("--weights", help="decoder weights (default: random weights of the real architecture)")
    parser.add_argument("--streams", default="1,8,32", help="stream counts for the throughput table")
    parser.add_argument("--chunk", type=int, default=28, help="codes per stream in the throughput runs")
    parser.add_argument("--seconds", type=float, default=4.0, help="utterance length for time to first audio")
    parser.add_argument("--chunk-size", default="28,56", help="chunk_size schedule for time to first audio")
    parser.add_argument("--buffer", type=int, default=0, help="buffer for the whole-utterance streamed decode")
    parser.add_argument("--block-causal", action="store_true", help="decode block-causally")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default 1: on a busy host more threads spin and the figures "
                             "mean nothing; 0: torch's default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    chunk_size = [int(size) for size in args.chunk_size.split(",")]

    with tempfile.TemporaryDirectory() as scratch:
        weights, origin = args.weights, "weights " + str(args.weights)
        if weights is None:
            if args.decoder not in RANDOM_CHECKPOINTS:
                parser.error(f"--weights is required for decoder {args.decoder!r}")
            from audio_pipeline.testing import random_decoders

            save = getattr(random_decoders, RANDOM_CHECKPOINTS[args.decoder])
            weights, origin = str(save(Path(scratch) / args.decoder)), "random weights, default size"
        decoder = load_audio_decoder(args.decoder, weights, device=args.device)
    frame = decoder.tokens_per_frame
    utterance = random_codes(decoder, round(args.seconds * decoder.sample_rate / decoder.samples_per_frame) * frame, 99)
    first_chunk(decoder, utterance, chunk_size, args.block_causal)  # warm-up

    mode = "block-causal" if args.block_causal else "windows"
    print(f"decoder {args.decoder} ({origin}): {decoder.sample_rate} Hz, {decoder.samples_per_frame} samples per "
          f"{frame}-code frame; device {args.device}, torch threads {torch.get_num_threads()}, {mode}, "
          f"best of {args.repeats}")
    print(f"\nthroughput, one {args.chunk}-code chunk per stream ({audio_seconds(decoder, args.chunk):.2f} s of "
          "audio), in audio seconds per second:")
    print(f"{'streams':>8} | {'batched':>8} | {'per stream':>10} | {'batched / per stream':>20}")
    for count in (int(s) for s in args.streams.split(",")):
        batched, single = throughput(decoder, count, args.chunk, args.block_causal, args.repeats)
        print(f"{count:>8} | {batched:>8.2f} | {single:>10.2f} | {batched / single:>19.2f}x", flush=True)

    tokens_per_second = frame * decoder.sample_rate / decoder.samples_per_frame  # real-time generation
    first = best_seconds(lambda: first_chunk(decoder, utterance, chunk_size, args.block_causal), args.repeats)
    one_shot = best_seconds(lambda: decoder.decode(utterance.to(args.device)), args.repeats)
    whole = best_seconds(lambda: streamed(decoder, utterance, chunk_size, args.buffer, args.block_causal), args.repeats)
    n = utterance.numel()
    print(f"\ntime to first audio, {audio_seconds(decoder, n):.2f} s utterance ({n} codes), chunk_size={chunk_size}:")
    print(f"  decoding before the first audio: first chunk {first * 1e3:.1f} ms vs one-shot {one_shot * 1e3:.1f} ms "
          f"(chunked adds {(first - one_shot) * 1e3:+.1f} ms, {first / one_shot:.2f}x)")
    chunked_ttfa = chunk_size[0] / tokens_per_second + first
    one_shot_ttfa = n / tokens_per_second + one_shot
    print(f"  with real-time generation ({tokens_per_second:.1f} codes/s): chunked {chunked_ttfa:.2f} s vs one-shot "
          f"{one_shot_ttfa:.2f} s ({chunked_ttfa / one_shot_ttfa:.2f}x)")
    print(f"  decoding the whole utterance chunk by chunk (buffer {args.buffer}): {whole * 1e3:.1f} ms, "
          f"{whole / one_shot:.2f}x the one-shot decode")
    return 0


if __name__ == "__main__":
    sys.exit(main())
