"""Shared fixtures: a tiny random Orpheus-layout model written to disk, and a real server on a free port."""

from __future__ import annotations

import os

import pytest

# Built-in models and anything else cached go to a throwaway folder, never the user's cache.
os.environ.setdefault("AUDIO_PIPELINE_CACHE", os.path.join(os.environ.get("TMPDIR", "/tmp"),
                                                           f"audio-pipeline-test-cache-{os.getuid()}"))

#: Small enough to keep tests fast, large enough for several chunks.
TEST_MAX_TOKENS = 140

#: The longest modules on a 2-core machine (pytest --durations, 2026-11-27: Ray's two replicas, the
#: native kernels' builds for other instruction sets, real servers and whole voices), longest first.
LONG_MODULES = ("test_ray_serve", "test_kernels", "test_serve_bench", "test_builtin_voice", "test_neutts",
                "test_cpu_linear", "test_cli", "test_reliability", "test_model_settings", "test_metrics")


def pytest_collection_modifyitems(config, items):
    """The long modules run first: xdist's ``--dist loadfile`` hands modules to its workers in this
    order, and a long module handed out last keeps one worker busy while the others have finished."""
    rank = {name: i for i, name in enumerate(LONG_MODULES)}

    def module_rank(item) -> int:
        module = getattr(item, "module", None)
        return rank.get(module.__name__.rpartition(".")[2] if module else "", len(LONG_MODULES))

    items.sort(key=module_rank)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from threads, and on a shared 2-core host threads spin for ages:
    a module that decodes with tiny models uses ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from audio_pipeline.testing.tiny_models import write_tiny_orpheus_model

    return write_tiny_orpheus_model(tmp_path_factory.mktemp("tiny-orpheus"), seed=0)


#: Every test's voices folder (saved cloned voices) lies under one root, removed when the process exits.
_VOICES_ROOT = None


def scratch_voices_dir() -> str:
    """An empty voices folder of its own, removed with the others at exit (atexit: pytest may hold
    this module twice, as its plugin and as the tests' import, so no session hook sees every one)."""
    import atexit
    import shutil
    import tempfile

    global _VOICES_ROOT
    if _VOICES_ROOT is None:
        _VOICES_ROOT = tempfile.mkdtemp(prefix="audio-pipeline-test-voices-")
        atexit.register(shutil.rmtree, _VOICES_ROOT, ignore_errors=True)
    return tempfile.mkdtemp(prefix="voices-", dir=_VOICES_ROOT)


def complete_all(engine, contexts, timeout: float = 300):
    """Submits ``contexts`` to a started engine at once and waits until every one completes (an
    error event fails the test)."""
    import queue

    events = queue.Queue()
    for context in contexts:
        engine.submit(context, events.put)
    finished = 0
    while finished < len(contexts):
        event = events.get(timeout=timeout)
        assert event.kind != "error", event
        finished += event.kind == "complete"
    return contexts


def make_config(model_dir, *flags, **overrides):
    from audio_pipeline.config import AudioGenerationConfig

    # AUDIO_PIPELINE_TEST_DEVICE=cuda runs the engine tests on a GPU (the CPU is the default), and
    # AUDIO_PIPELINE_TEST_DTYPE=float32 keeps them in float32 there (auto would be bfloat16), so the
    # tests that compare with a float32 reference hold their tolerances on the CUDA code path.
    device = os.environ.get("AUDIO_PIPELINE_TEST_DEVICE", "cpu")
    dtype = os.environ.get("AUDIO_PIPELINE_TEST_DTYPE", "auto")
    model = {"model_path": str(model_dir), "device": device, "dtype": dtype, **overrides.pop("model", {})}
    overrides.setdefault("voices_dir", scratch_voices_dir())
    return AudioGenerationConfig.load(env={}, audio_flags=["chunk_size=28,56", f"sampling.max_tokens={TEST_MAX_TOKENS}",
                                                           "grace_period_s=5", *flags], model=model, **overrides)


@pytest.fixture(scope="session")
def tts_server(tiny_model_dir):
    """A real server (gRPC on a free port) running the tiny model; ``.target``, ``.engine``."""
    from audio_pipeline.testing.background import BackgroundServer

    server = BackgroundServer(make_config(tiny_model_dir, "max_queue_size_tg=64")).start()
    yield server
    server.stop()


@pytest.fixture
def idle_server(tts_server):
    """The shared server, checked to hold no request or KV reservation before and after the test."""
    wait_idle(tts_server.engine)
    yield tts_server
    wait_idle(tts_server.engine)


def wait_idle(engine, timeout=60.0):
    """Waits until the engine holds nothing (no request, no KV block); fails naming what is still held."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        load = engine.core.load
        blocks = engine.scheduler.block_manager
        if load == (0, 0) and not blocks.sequences and blocks.num_used_blocks == 0:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"engine not idle: (queued, running)={load}, KV sequences={blocks.sequences}, "
                                 f"blocks used={blocks.num_used_blocks}")
        time.sleep(0.02)


def run_contexts(engine, contexts, timeout=120.0):
    """Submits ``contexts`` together, waits for each one's last event (it must complete), then for
    the engine to hold nothing."""
    import queue

    events = {c.request_id: queue.Queue() for c in contexts}
    for context in contexts:
        engine.submit(context, events[context.request_id].put)
    for context in contexts:
        while (event := events[context.request_id].get(timeout=timeout)).kind == "audio":
            pass
        assert event.kind == "complete", event.error
    wait_idle(engine)
