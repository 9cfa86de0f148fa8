"""Audio decoder benchmark: throughput in seconds of audio per second, batched (every stream's chunk in
one ``decode_windows`` call) against per stream (one call each), at 1, 8 and 32 streams; and the
time to first audio that chunked streaming adds (or saves) against one-shot decoding.

    python -m audio_pipeline.bench.decoder [--decoder snac] [--weights DIR] [--streams 1,8,32]

Without ``--weights`` it writes a randomly initialised decoder of the published architecture
(SNAC 24 kHz, or causal-conv) to a temporary directory: speed does not depend on the weights.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

from audio_pipeline.decoders import load_audio_decoder
from audio_pipeline.decoders.streaming import DecoderStream, decode_windows


def _best(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def throughput(decoder, streams: int, chunk: int, repeats: int) -> tuple[float, float]:
    """Seconds of audio per second for ``streams`` chunks of ``chunk`` codes: (batched, per stream)."""
    generator = torch.Generator().manual_seed(streams)
    tokens = [torch.randint(0, 4096, (chunk,), generator=generator) for _ in range(streams)]

    def jobs():
        out = []
        for t in tokens:
            stream = DecoderStream(decoder, chunk_size=[chunk])
            out.append((stream, stream.next_window(chunk, False), t))
        return out

    audio_seconds = streams * chunk // decoder.tokens_per_frame * decoder.samples_per_frame / decoder.sample_rate
    batched = _best(lambda: decode_windows(decoder, jobs()), repeats)
    single = _best(lambda: [decode_windows(decoder, [job]) for job in jobs()], repeats)
    return audio_seconds / batched, audio_seconds / single


def first_audio(decoder, chunk_size: list[int], frames: int, repeats: int) -> tuple[float, float]:
    """Decode time before the first audio: (first chunk of ``chunk_size``, one-shot of ``frames`` frames)."""
    tokens = torch.randint(0, 4096, (frames * decoder.tokens_per_frame,), generator=torch.Generator().manual_seed(1))

    def first_chunk():
        stream = DecoderStream(decoder, chunk_size=chunk_size)
        window = stream.next_window(chunk_size[0], False)
        decode_windows(decoder, [(stream, window, tokens[:chunk_size[0]])])

    return _best(first_chunk, repeats), _best(lambda: decoder.decode(tokens), repeats)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m audio_pipeline.bench.decoder", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--decoder", default="snac", help="registered decoder name (snac or causal-conv)")
    parser.add_argument("--weights", help="decoder weights (default: random weights of the real architecture)")
    parser.add_argument("--streams", default="1,8,32")
    parser.add_argument("--chunk", type=int, default=28, help="codes per chunk in the throughput runs")
    parser.add_argument("--utterance-frames", type=int, default=48,
                        help="utterance length for the time-to-first-audio comparison (48 frames = 4.1 s)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        weights = args.weights
        if weights is None:
            if args.decoder == "snac":
                from audio_pipeline.decoders.snac import save_random_snac_checkpoint

                weights = str(save_random_snac_checkpoint(Path(scratch) / "snac"))
            elif args.decoder == "causal-conv":
                from audio_pipeline.decoders.causal_conv import save_random_causal_checkpoint

                weights = str(save_random_causal_checkpoint(Path(scratch) / "causal"))
            else:
                parser.error("--weights is required for this decoder")
        decoder = load_audio_decoder(args.decoder, weights)
        decode_windows(decoder, [(s := DecoderStream(decoder, chunk_size=[args.chunk]),
                                  s.next_window(args.chunk, False), torch.zeros(args.chunk, dtype=torch.long))])
        print(f"decoder {args.decoder}: {decoder.sample_rate} Hz, {decoder.samples_per_frame} samples per "
              f"{decoder.tokens_per_frame}-code frame; chunks of {args.chunk} codes; torch threads "
              f"{torch.get_num_threads()}")
        print(f"{'streams':>7} {'batched audio s/s':>18} {'per-stream audio s/s':>21} {'batched/per-stream':>19}")
        for count in (int(s) for s in args.streams.split(",")):
            batched, single = throughput(decoder, count, args.chunk, args.repeats)
            print(f"{count:>7} {batched:>18.2f} {single:>21.2f} {batched / single:>18.2f}x", flush=True)
        chunked, one_shot = first_audio(decoder, [28, 56], args.utterance_frames, args.repeats)
        print(f"time to first audio, decode only: chunk_size=[28, 56] first chunk {chunked * 1000:.1f} ms; "
              f"one-shot decode of {args.utterance_frames} frames {one_shot * 1000:.1f} ms "
              f"(chunked adds {(chunked - one_shot) * 1000:+.1f} ms; ratio {chunked / one_shot:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
