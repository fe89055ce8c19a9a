"""The package's shape: every subpackage ships, imports run one way, no import cycles.

The import graph is read from the source (every ``import``, lazy ones inside functions too;
``if TYPE_CHECKING:`` blocks excepted), so a wrong-way or circular import fails here before it
can tangle the tree. Layers, lowest first (a layer may import only the ones listed for it):
errors -> io/text/kv/kernels -> cpu/models -> model -> backends -> engine -> openai -> api ->
serve/tui/cli.
"""

from __future__ import annotations

import ast
import collections
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# package -> folder (pyproject's package-dir): the root folders install under localmoe.
ROOTS = {"localmoe": "localmoe", "localmoe.backends": "backends", "localmoe.kernels": "kernels",
         "localmoe.models": "models", "localmoe.tui": "tui"}

# What each top-level part of localmoe may import (besides itself, errors and the root package).
ALLOWED = {
    "io": set(), "text": set(), "kv": set(), "kernels": set(),
    "cpu": {"io"},
    "models": {"io"},
    "model": {"io", "cpu", "models", "kernels"},
    "backends": {"io", "kv", "cpu", "kernels", "model", "models"},
    "engine": {"io", "text", "kv", "kernels", "backends"},  # kernels: the GPU sampler
    "openai": {"engine", "text"},
    "api": {"engine", "io", "openai"},
    "serve": {"api", "openai", "engine", "backends", "io", "text", "kv"},
    "tui": {"api", "engine", "io", "text"},
    "cli": {"api", "engine", "backends", "cpu", "io", "kv", "serve", "tui", "text"},
    "testing": {"io", "text", "model", "models", "kv", "cpu", "kernels", "backends"},
    "__main__": {"cli"},
}


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg, folder in ROOTS.items():
        for p in (ROOT / folder).rglob("*.py"):
            parts = [x for x in p.relative_to(ROOT / folder).with_suffix("").parts if x != "__init__"]
            name = ".".join([pkg, *parts])
            if folder == "localmoe" and len(parts) and f"localmoe.{parts[0]}" in ROOTS:
                continue
            mods[name] = p
    return mods


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    tree = ast.parse(path.read_text())
    skip = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test):
            skip |= {id(x) for b in n.body for x in ast.walk(b)}
    out = set()
    for n in ast.walk(tree):
        if id(n) in skip:
            continue
        if isinstance(n, ast.Import):
            out |= {a.name for a in n.names if a.name in mods}
        elif isinstance(n, ast.ImportFrom):
            if n.level:
                base = name.split(".")
                keep = len(base) - n.level + (1 if path.name == "__init__.py" else 0)
                target = ".".join(base[:keep] + ([n.module] if n.module else []))
            else:
                target = n.module or ""
            subs = {f"{target}.{a.name}" for a in n.names if f"{target}.{a.name}" in mods}
            out |= subs if len(subs) == len(n.names) else ({target} & mods.keys()) | subs
    out.discard(name)
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(m, p, mods) for m, p in mods.items()}


def _part(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_every_subpackage_is_listed_in_pyproject():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    on_disk = {m for m, p in _modules().items() if p.name == "__init__.py"}
    assert set(cfg["packages"]) == on_disk, "pyproject [tool.setuptools] packages is out of date"


def test_imports_run_one_way():
    wrong = []
    for mod, deps in _graph().items():
        src = _part(mod)
        if mod == "localmoe":  # the root's lazy re-exports (LLM, __version__)
            continue
        for dep in deps:
            dst = _part(dep)
            if dst in ("", "errors", src) or dst in ALLOWED.get(src, set()):
                continue
            wrong.append(f"{mod} -> {dep}")
    assert not wrong, "imports against the layering:\n" + "\n".join(sorted(wrong))


def test_no_import_cycles():
    graph = _graph()
    graph.pop("localmoe", None)
    index, low, stack, on, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in list(graph):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_the_graph_sees_lazy_imports():
    """The checker itself: a lazy import inside a function counts (so the tests above can fail)."""
    graph = _graph()
    assert any(d.startswith("localmoe.openai") for d in graph["localmoe.api"])
    assert any(_part(d) == "backends" for d in graph["localmoe.engine.engine"])
    assert collections.Counter(_part(m) for m in graph)["kv"] >= 5
