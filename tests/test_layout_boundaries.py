"""The package's layout keeps its word: what the serving runtime imports, and what it does not."""

import subprocess
import sys

#: The serving runtime: the server with both doors, the in-process CLI, the engine.
RUNTIME = ("audio_pipeline.server.app", "audio_pipeline.http.app", "audio_pipeline.http.stream_socket",
           "audio_pipeline.cli", "audio_pipeline.service.engine")


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
    assert "audio_pipeline.service.engine" in loaded
    assert not {m for m in loaded if m.startswith("audio_pipeline.testing")}


def test_the_tiny_test_model_is_written_by_the_testing_package_on_request(tmp_path, monkeypatch):
    """builtin:tiny-orpheus is the one runtime path into audio_pipeline.testing: asked for, it is
    written (once) from there."""
    from audio_pipeline.builtin import resolve_builtin_model

    monkeypatch.setenv("AUDIO_PIPELINE_CACHE", str(tmp_path))
    path = resolve_builtin_model("tiny-orpheus")
    assert (path / "config.json").is_file() and path.is_relative_to(tmp_path)
    assert resolve_builtin_model("tiny-orpheus") == path


#: The package's layers, top to bottom: a module imports from its own layer or the ones below it,
#: never from one above, not even inside a function or for type checkers only. The configuration
#: sits below what it configures (it reads the families' declared defaults from the layouts);
#: the models below the decoders, which load their weights with the models' readers.
LAYERS = (
    ("doors and tools", {"server", "http", "cli", "config_reference", "bench", "testing"}),
    ("service", {"service"}),
    ("core", {"core"}),
    ("decoders", {"decoders"}),
    ("models", {"models"}),
    ("config", {"config"}),
    ("layouts", {"layouts"}),
    ("foundations", {"checkpoints", "text", "audio", "builtin", "cuda"}),
    ("errors", {"errors"}),
)


def package_of(module: str) -> str:
    """``audio_pipeline.core.scheduler`` -> ``core``; a top-level module is its own package."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports anywhere in it: inside functions and under
    ``if TYPE_CHECKING:`` too (a type-only import is still a dependency of the text)."""
    import ast
    from pathlib import Path

    package = Path(__file__).resolve().parent.parent / "audio_pipeline"

    def name_of(path: Path) -> str:
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    modules = {name_of(path): path for path in package.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def test_every_package_has_a_layer():
    packages = {package_of(m) for m in import_graph()} - {""}
    placed = set().union(*(members for _, members in LAYERS))
    assert packages <= placed, f"packages in no layer of LAYERS: {sorted(packages - placed)}"


def test_no_module_imports_from_a_layer_above_its_own():
    """Imports go down the layers (doors -> service -> core -> decoders -> models -> config ->
    layouts -> foundations -> errors), type-only and function-level imports included."""
    rank = {package: index for index, (_, members) in enumerate(LAYERS) for package in members}
    names = {package: layer for layer, members in LAYERS for package in members}
    graph = import_graph()
    upward = sorted(f"{a} ({names[package_of(a)]}) -> {b} ({names[package_of(b)]})"
                    for a in graph if package_of(a) in rank
                    for b in graph[a] if package_of(b) in rank and rank[package_of(b)] < rank[package_of(a)])
    assert not upward, "imports from a higher layer:\n" + "\n".join(upward)


def test_the_doors_are_peers_over_the_service():
    """No module of the HTTP door imports the gRPC server, even inside a function; loaded, the
    service and the engine bring neither door nor the generated protobuf code."""
    graph = import_graph()
    crossing = sorted((a, b) for a in graph if a.startswith("audio_pipeline.http")
                      for b in graph[a] if b.startswith("audio_pipeline.server"))
    assert not crossing, f"the HTTP door imports the gRPC server: {crossing}"
    below = imported_by("audio_pipeline.service.speech", "audio_pipeline.service.engine")
    assert "audio_pipeline.core.engine_core" in below
    assert not {m for m in below if m.startswith(("audio_pipeline.server", "audio_pipeline.http"))}
    assert not {m for m in below if m.startswith("audio_pipeline_client")}


def test_no_two_modules_import_each_other_even_inside_functions_or_for_types():
    """Imports go one way: no cycle among the package's modules, type-only imports included."""
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
