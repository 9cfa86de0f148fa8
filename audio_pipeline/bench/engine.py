"""Engine throughput benchmark: aggregate speech tokens/s at 1, 8 and 32 concurrent streams, each
as a ratio to the same requests run one at a time through transformers' ``generate``, measured in
the same run on the same model.

    python -m audio_pipeline.bench.engine [--streams 1,8,32] [--tokens 210] [--model DIR]

Without ``--model`` it writes the tiny random test model to a temporary directory. Both sides
generate exactly ``--tokens`` tokens per request (greedy, ``min_tokens = max_tokens``); the engine
side is the whole engine (scheduler, paged KV cache, sampler and the chunked audio decoder), the
baseline is the bare language model.
"""

from __future__ import annotations

import argparse
import queue
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def _prompts(count: int) -> list[str]:
    subjects = ["The weather", "Our train", "This recipe", "The museum", "A small dog", "The meeting", "My phone",
                "The river"]
    endings = ["is late today.", "looks wonderful in the spring.", "needs two more minutes.",
               "opens at nine in the morning.", "will be quieter tomorrow."]
    return [f"{subjects[i % len(subjects)]} {endings[i % len(endings)]} Number {i}." for i in range(count)]


def run_engine(engine, texts: list[str], tokens: int) -> tuple[float, list[float]]:
    """Seconds for all ``texts`` submitted at once; and each request's time to first audio."""
    events: queue.Queue = queue.Queue()
    contexts = [engine.create_context(t, temperature=0.0, max_tokens=tokens, min_tokens=tokens) for t in texts]
    started = time.perf_counter()
    for context in contexts:
        engine.submit(context, events.put)
    first_audio: list[float] = []
    finished = 0
    while finished < len(contexts):
        event = events.get()
        if event.kind == "error":
            raise RuntimeError(event.error)
        if event.kind == "complete":
            finished += 1
            first_audio.append(event.usage.time_to_first_audio_seconds)
    elapsed = time.perf_counter() - started
    for context in contexts:
        if len(context.generated) != tokens:
            raise RuntimeError(f"a request generated {len(context.generated)} tokens, not {tokens}")
    return elapsed, first_audio


def run_transformers(model, prompts: list[list[int]], tokens: int) -> float:
    """Seconds for ``prompts`` one at a time through ``generate`` (greedy, exactly ``tokens`` new)."""
    started = time.perf_counter()
    with torch.inference_mode():
        for prompt in prompts:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=tokens, min_new_tokens=tokens,
                                 do_sample=False, pad_token_id=0, attention_mask=torch.ones(1, len(prompt),
                                                                                             dtype=torch.long))
            if out.shape[1] - len(prompt) != tokens:
                raise RuntimeError("transformers generated a different number of tokens")
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m audio_pipeline.bench.engine", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", default="1,8,32", help="comma-separated concurrent stream counts")
    parser.add_argument("--tokens", type=int, default=210, help="speech tokens per request (a multiple of 7)")
    parser.add_argument("--model", help="model directory (default: the tiny random test model)")
    parser.add_argument("--task-arg", action="append", default=[], metavar="NAME=VALUE",
                        help="engine settings, as for `audio-pipeline serve`")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args(argv)
    streams = [int(s) for s in args.streams.split(",")]
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import LlamaForCausalLM

    from audio_pipeline.config import AudioGenerationConfig
    from audio_pipeline.service.engine import TTSEngine

    with tempfile.TemporaryDirectory() as scratch:
        if args.model:
            model_dir = Path(args.model)
        else:
            from audio_pipeline.testing.tiny_models import write_tiny_orpheus_model

            model_dir = write_tiny_orpheus_model(Path(scratch) / "tiny", seed=0)
        config = AudioGenerationConfig.load(
            env={}, audio_flags=["chunk_size=28,56", f"max_batch_size={max(streams)}", *args.task_arg],
            model={"model_path": str(model_dir), "device": "cpu"})
        engine = TTSEngine(config)
        engine.start()
        engine.warmup()
        baseline = LlamaForCausalLM.from_pretrained(model_dir, dtype=engine.model.dtype).eval()
        baseline.generation_config.eos_token_id = None
        print(f"model: {model_dir} ({sum(p.numel() for p in baseline.parameters()) / 1e6:.1f}M parameters), "
              f"{args.tokens} tokens per request, torch threads {torch.get_num_threads()}")
        print(f"{'streams':>7} {'engine tok/s':>13} {'generate tok/s':>15} {'ratio':>7} {'median TTFA s':>14} "
              f"{'max TTFA s':>11}")
        try:
            for count in streams:
                texts = _prompts(count)
                prompts = [engine.create_context(t, max_tokens=args.tokens).prompt_ids for t in texts]
                ours, first_audio = run_engine(engine, texts, args.tokens)
                theirs = run_transformers(baseline, prompts, args.tokens)
                ours_rate = count * args.tokens / ours
                theirs_rate = count * args.tokens / theirs
                print(f"{count:>7} {ours_rate:>13.0f} {theirs_rate:>15.0f} {ours_rate / theirs_rate:>6.1f}x "
                      f"{statistics.median(first_audio):>14.3f} {max(first_audio):>11.3f}", flush=True)
        finally:
            engine.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
