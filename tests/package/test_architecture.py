"""The package layering, checked from the source: no import cycles, no upward imports.

Data flows one way (retrieval -> kvcache -> online -> model execution; offline builds the
store; serve and bench only call down). The package never imports the studies or the
hardware benchmarks that live beside it (``studies/``, ``benchmarks/``): they use its public
API. Each top-level module or package has a layer; a module may import its own package and
anything in a lower layer, never a peer package of the same layer and never a higher one.
Imports inside functions count too: a lazy import is still a dependency. The test parses
every file with ``ast`` (nothing is imported).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "fusionrag"

#: Layer of each top-level module / package of ``fusionrag`` (lower = more basic).
LAYERS: dict[str, int] = {
    "errors": 0, "paths": 0, "files": 0, "version": 0,
    "prompt": 1, "sample": 1,
    "models": 2,
    "kvcache": 3,
    "retrieval": 4, "execution": 4,
    "online": 5, "offline": 5,
    "serve": 6, "integrations": 6, "vllm": 6,
    "bench": 7,
    "doctor": 8, "demo": 8, "cli_commands": 9, "cli": 10, "__init__": 10,
}


def _module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Every ``fusionrag.*`` module this file imports, at any depth of the file."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    pkg = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "fusionrag")
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative import
                base = pkg.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join([*base, node.module] if node.module else base)
            else:
                mod = node.module or ""
            if mod.split(".")[0] != "fusionrag":
                continue
            if mod == "fusionrag":  # from fusionrag import x: x is a module or a name of __init__
                found.update(f"fusionrag.{a.name}" for a in node.names)
            else:
                found.add(mod)
    return found


#: Top-level folders beside the package that use it and that it must never import.
OUTSIDE = ("studies", "benchmarks")


def outside_imports(path: Path) -> set[str]:
    """Modules of ``studies`` / ``benchmarks`` that this file imports, at any depth."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
        found.update(n for n in names if n.split(".")[0] in OUTSIDE)
    return found


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in SRC.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        graph[name] = {m if m in modules else m.rpartition(".")[0] for m in _imports(path)} - {name}
        graph[name] &= set(modules)
    return graph


def upward_edges(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for src, targets in graph.items():
        a = _top(src)
        for dst in targets:
            b = _top(dst)
            if a == b:
                continue
            if a not in LAYERS or b not in LAYERS:
                bad.append(f"{src} -> {dst}: give '{a if a not in LAYERS else b}' a layer in LAYERS")
            elif LAYERS[b] >= LAYERS[a]:
                kind = "peer" if LAYERS[b] == LAYERS[a] else "upward"
                bad.append(f"{src} (layer {LAYERS[a]}) -> {dst} (layer {LAYERS[b]}): {kind} import")
    return sorted(bad)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    assert cycles(_graph()) == []


def test_no_upward_or_peer_imports():
    assert upward_edges(_graph()) == []


def test_every_package_has_a_layer():
    tops = {_top(m) for m in _graph()}
    assert tops <= set(LAYERS), f"no layer for: {sorted(tops - set(LAYERS))}"


def test_the_package_imports_no_study_and_no_benchmark():
    bad = {str(p.relative_to(SRC)): sorted(m) for p in SRC.rglob("*.py") if (m := outside_imports(p))}
    assert bad == {}


def test_the_outside_check_catches_an_import_of_a_study(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from studies.paper import summarize\n    import benchmarks.gpu.gpu_bench\n")
    assert outside_imports(f) == {"studies.paper", "benchmarks.gpu.gpu_bench"}


@pytest.mark.slow  # seconds of real subprocesses
def test_importing_the_package_and_its_server_loads_no_plotting_library():
    """matplotlib is the ``bench`` extra: the engine and ``fusionrag serve`` never import it."""
    import subprocess
    import sys

    code = ("import sys, fusionrag; fusionrag.Engine; import fusionrag.serve.app, fusionrag.serve.launch, "
            "fusionrag.cli; assert 'matplotlib' not in sys.modules, 'matplotlib imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_checks_catch_a_cycle_and_an_upward_edge():
    graph = {"fusionrag.retrieval.a": {"fusionrag.offline.b"}, "fusionrag.offline.b": {"fusionrag.retrieval.a"}}
    assert cycles(graph) == [["fusionrag.offline.b", "fusionrag.retrieval.a"]]
    assert upward_edges(graph) == ["fusionrag.retrieval.a (layer 4) -> fusionrag.offline.b (layer 5): upward import"]


@pytest.mark.parametrize("limit", [420])
def test_no_module_is_much_over_400_lines(limit):
    long = {str(p.relative_to(SRC)): n for p in SRC.rglob("*.py") if (n := len(p.read_text().splitlines())) > limit}
    assert long == {}
