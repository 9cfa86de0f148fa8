"""Real-time factor and time to first audio of the built-in voice through the engine, at 1 and 8
concurrent streams (held-out sentences, the engine's default sampling unless --temperature).

    python -m recipes.builtin_voice.bench [--model builtin:lpc-en] [--streams 1,8] [--task-arg chunk_size=8,40]

RTF = wall time of the batch / seconds of audio each stream got (mean over streams): below 1 is
faster than real time for every stream at once.
"""

from __future__ import annotations

import argparse
import queue
import statistics
import time

import torch


def run(engine, texts: list[str], overrides: dict) -> tuple[float, list[float], list[float]]:
    """(wall seconds for all texts at once, each request's seconds of audio, each one's time to first audio)."""
    events: queue.Queue = queue.Queue()
    contexts = [engine.create_context(t, **overrides) for t in texts]
    started = time.perf_counter()
    for context in contexts:
        engine.submit(context, events.put)
    audio: list[float] = []
    first: list[float] = []
    while len(audio) < len(contexts):
        event = events.get()
        if event.kind == "error":
            raise RuntimeError(event.error)
        if event.kind == "complete":
            audio.append(event.usage.audio_samples / engine.sample_rate)
            first.append(event.usage.time_to_first_audio_seconds)
    return time.perf_counter() - started, audio, first


def main(argv: list[str] | None = None) -> int:
    from audio_pipeline.config import AudioGenerationConfig
    from audio_pipeline.service.engine import TTSEngine
    from recipes.builtin_voice.corpus import held_out

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin:lpc-en")
    parser.add_argument("--streams", default="1,8")
    parser.add_argument("--temperature", type=float)
    parser.add_argument("--repeats", type=int, default=2, help="batches per stream count (the first is a warm-up)")
    parser.add_argument("--task-arg", action="append", default=[], metavar="NAME=VALUE")
    args = parser.parse_args(argv)
    streams = [int(s) for s in args.streams.split(",")]
    config = AudioGenerationConfig.load(env={}, audio_flags=[f"max_batch_size={max(streams)}", *args.task_arg],
                                        model={"model_path": args.model, "device": "cpu"})
    engine = TTSEngine(config)
    engine.start()
    engine.warmup()
    overrides = {} if args.temperature is None else {"temperature": args.temperature}
    texts = held_out(40)
    print(f"model {args.model}, torch threads {torch.get_num_threads()}, chunk_size {config.chunk_size}, "
          f"buffer {config.buffer}, block_causal {config.block_causal}, sampling {overrides or 'engine defaults'}")
    print(f"{'streams':>7} {'audio s/stream':>15} {'wall s':>7} {'RTF':>6} {'median TTFA s':>14} {'max TTFA s':>11}")
    try:
        for count in streams:
            for repeat in range(args.repeats):
                batch = [texts[(repeat * count + i) % len(texts)] for i in range(count)]
                wall, audio, first = run(engine, batch, overrides)
            mean_audio = statistics.mean(audio)
            print(f"{count:>7} {mean_audio:>15.2f} {wall:>7.2f} {wall / mean_audio:>6.2f} "
                  f"{statistics.median(first):>14.3f} {max(first):>11.3f}", flush=True)
    finally:
        engine.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
