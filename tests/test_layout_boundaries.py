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


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports anywhere in it (inside functions too; imports
    only for type checkers aside)."""
    import ast
    from pathlib import Path

    package = Path(__file__).resolve().parent.parent / "audio_pipeline"

    def name_of(path: Path) -> str:
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    modules = {name_of(path): path for path in package.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        typing_only = {id(node) for block in ast.walk(tree)
                       if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
                       for child in block.body for node in ast.walk(child)}
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def test_the_doors_are_peers_over_the_service():
    """No module of the HTTP door imports the gRPC server, even inside a function; loaded, the
    service and the engine bring neither door nor the generated protobuf code."""
    graph = import_graph()
    crossing = sorted((a, b) for a in graph if a.startswith("audio_pipeline.http")
                      for b in graph[a] if b.startswith("audio_pipeline.server"))
    assert not crossing, f"the HTTP door imports the gRPC server: {crossing}"
    below = imported_by("audio_pipeline.service.speech", "audio_pipeline.engine")
    assert "audio_pipeline.core.engine_core" in below
    assert not {m for m in below if m.startswith(("audio_pipeline.server", "audio_pipeline.http"))}
    assert not {m for m in below if m.startswith("audio_pipeline_client")}


def test_no_two_modules_import_each_other_even_inside_functions():
    """Imports go one way: no cycle among the package's modules."""
    graph = import_graph()

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            current = todo.pop()
            if current == goal:
                return True
            if current not in seen:
                seen.add(current)
                todo.extend(graph[current])
        return False

    cycles = sorted((a, b) for a in graph for b in graph[a] if reaches(b, a))
    assert not cycles, f"modules that import each other (directly or through others): {cycles}"
