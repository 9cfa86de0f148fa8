"""The package's layout keeps its word: what the serving runtime imports, and what it does not."""

import subprocess
import sys

#: The serving runtime: the server with both doors, the in-process CLI, the engine.
RUNTIME = ("audio_pipeline.server.app", "audio_pipeline.http.app", "audio_pipeline.http.stream_socket",
           "audio_pipeline.cli", "audio_pipeline.engine")


def imported_by(*modules: str) -> set[str]:
    """The audio_pipeline modules a fresh interpreter has loaded after importing ``modules``."""
    code = ("import sys\n" + "".join(f"import {m}\n" for m in modules)
            + "print('\\n'.join(m for m in sys.modules if m.startswith('audio_pipeline')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(out.split())


def test_the_runtime_imports_no_test_support():
    """Tiny and random model writers and the background server live in audio_pipeline.testing,
    which the server, the doors, the CLI and the engine never import."""
    loaded = imported_by(*RUNTIME)
    assert "audio_pipeline.engine" in loaded
    assert not {m for m in loaded if m.startswith("audio_pipeline.testing")}


def test_the_tiny_test_model_is_written_by_the_testing_package_on_request(tmp_path, monkeypatch):
    """builtin:tiny-orpheus is the one runtime path into audio_pipeline.testing: asked for, it is
    written (once) from there."""
    from audio_pipeline.builtin import resolve_builtin_model

    monkeypatch.setenv("AUDIO_PIPELINE_CACHE", str(tmp_path))
    path = resolve_builtin_model("tiny-orpheus")
    assert (path / "config.json").is_file() and path.is_relative_to(tmp_path)
    assert resolve_builtin_model("tiny-orpheus") == path
