"""Fixtures only: a tiny random Orpheus-layout model written to disk, a real server on a free port,
one torch thread; and the order modules run in. What tests share besides fixtures is in helpers.py,
which tests import as ``from helpers import ...`` (never from here)."""

from __future__ import annotations

import os

import pytest

from helpers import make_config, wait_idle

# Built-in models and anything else cached go to a throwaway folder, never the user's cache.
os.environ.setdefault("AUDIO_PIPELINE_CACHE", os.path.join(os.environ.get("TMPDIR", "/tmp"),
                                                           f"audio-pipeline-test-cache-{os.getuid()}"))

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



@pytest.fixture
def idle(server):
    """The module's own ``server`` (one with HTTP), holding no request before and after the test."""
    wait_idle(server.engine)
    yield server
    wait_idle(server.engine)


@pytest.fixture
def client(idle):
    """The ``openai`` package's client on ``idle``'s HTTP door."""
    import openai

    with openai.OpenAI(base_url=f"{idle.http_url}/v1", api_key="unused", max_retries=0) as client:
        yield client
