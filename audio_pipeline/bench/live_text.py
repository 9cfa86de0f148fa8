"""Live text through the real server, fed the way an LLM streams it: how soon the first sentence
is heard after its text has arrived, and how soon anything is heard after the first word.

    python -m audio_pipeline.bench.live_text [--rate 15] [--sentences 4] [--model M | --random-model S] [--rounds 3]

It starts `audio-pipeline serve`, opens a SynthesizeStream call and sends the first ``--sentences``
sentences of tests/data/long_text.txt word by word (each word with its space is one token) at
``--rate`` tokens per second, then the end of input. It reports the delay from the moment the
first sentence's last token was sent to its first audio (the server knows the sentence is complete
when the next token arrives, one token interval later), the total audio and wall time, and the
longest playback stall after the first audio. A model that reads text as it comes (Kyutai TTS)
speaks before a sentence is complete: its figure is the delay from the first word.
``--random-model`` serves a random model of a real shape (as bench.serve's), e.g. kyutai-tts-tiny.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import time

from audio_pipeline.bench.long_text import DEFAULT_FILE
from audio_pipeline.bench.serve import playback_stall
from audio_pipeline.bench.server_process import Server


def sentences(count: int) -> list[str]:
    body = DEFAULT_FILE.read_text().split("\n\n", 1)[1]  # past the title
    return re.findall(r"[^.!?]+[.!?]", " ".join(body.split()))[:count]


async def one_round(target: str, texts: list[str], rate: float) -> tuple[float, float, float, float, float]:
    """(delay to first audio after the first sentence's last token, audio s, wall s, stall s,
    delay to first audio after the first word)."""
    from audio_pipeline_client import AsyncTTSClient

    first_sentence_done: list[float] = []
    first_word: list[float] = []

    async def tokens():
        for index, sentence in enumerate(texts):
            words = sentence.strip().split(" ")
            for position, word in enumerate(words):
                if not first_word:
                    first_word.append(time.perf_counter())
                yield word + " "
                if index == 0 and position == len(words) - 1:
                    first_sentence_done.append(time.perf_counter())
                await asyncio.sleep(1 / rate)

    arrivals = []
    started = time.perf_counter()
    async with AsyncTTSClient(target, retries=0, timeout=600) as client:
        async for chunk in client.stream_text(tokens()):
            if not chunk.final:
                arrivals.append((time.perf_counter(), chunk.samples.shape[0] / chunk.sample_rate))
    wall = time.perf_counter() - started
    return (arrivals[0][0] - first_sentence_done[0], sum(s for _, s in arrivals), wall, playback_stall(arrivals),
            arrivals[0][0] - first_word[0])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m audio_pipeline.bench.live_text", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=15.0, help="tokens per second (default 15)")
    parser.add_argument("--sentences", type=int, default=4, help="sentences sent (default 4)")
    parser.add_argument("--rounds", type=int, default=3, help="calls, one after another (default 3)")
    parser.add_argument("--model", help="--model for the server (default: the server's default model)")
    parser.add_argument("--random-model", metavar="SHAPE",
                        help="serve a random model of a real shape instead (testing/random_models.py's shapes)")
    parser.add_argument("--task-arg", action="append", default=[], metavar="NAME=VALUE",
                        help="server settings, as for `audio-pipeline serve` (repeatable)")
    args = parser.parse_args(argv)
    texts = sentences(args.sentences)
    model = args.model
    if args.random_model:
        import tempfile

        from audio_pipeline.testing.random_models import write_random_model

        model = str(write_random_model(tempfile.mkdtemp(prefix=f"random-{args.random_model}-"), args.random_model))
    server = Server(model, args.task_arg)
    try:
        server.wait_ready()
        print(f"server: {' '.join(server.command[3:])}", flush=True)
        print(f"{len(texts)} sentences, {sum(len(t.split()) for t in texts)} tokens at {args.rate:g} tokens/s; "
              f"first sentence: {texts[0].strip()!r}", flush=True)
        delays, from_word = [], []
        for round_index in range(args.rounds):
            delay, audio, wall, stall, word = asyncio.run(one_round(server.target, texts, args.rate))
            delays.append(delay)
            from_word.append(word)
            print(f"round {round_index}: first audio {1000 * word:.0f} ms after the first word, {1000 * delay:.0f} ms "
                  f"after the first sentence's last token ({1000 * (delay - 1 / args.rate):.0f} ms after the next "
                  f"token completed it); {audio:.1f} s of audio in {wall:.1f} s; longest playback stall "
                  f"{1000 * stall:.0f} ms", flush=True)
        print(f"median delay to first audio: {1000 * statistics.median(from_word):.0f} ms after the first word, "
              f"{1000 * statistics.median(delays):.0f} ms after the first sentence's last token")
    finally:
        server.stop()
        os.unlink(server.log.name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
