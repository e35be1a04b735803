"""Imports run down the request path (STYLE.md 16): server -> engine -> speculative -> models ->
kernels -> kvcache / config, what several layers share sits below all of them, nothing imports
upward or in a circle, and the serving path never imports the benchmarks.

The AST of every module under src/treeflash is walked (imports inside functions count; those
under `if TYPE_CHECKING:` do not: they never run). A unit is a subpackage (`models`) or a
top-level module (`config`, `cli`); `treeflash` is the package's `__init__` (the public API).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PKG = SRC / "treeflash"

# Each unit's rank: a unit may import units of its own rank or below, never above. The top rank
# (entry points and tools) may import each other as long as there is no circle.
RANKS = {
    # shared by every layer: frozen configs, the switches a user sets, the shard layout, the cost model
    "config": 0, "quantization": 0, "knobs": 0, "runtime": 0, "sharding": 0, "costs": 0, "progress": 0,
    "kvcache": 1,
    "kernels": 2, "graph_capture": 2,
    # what plain decoding and the speculative walk share: logits into token choices
    "models": 3, "sampling": 3,
    "memory": 4, "memory_plan": 4, "parallel": 4,
    "speculative": 5,
    "engine": 6,
    # the public API, the commands and the tools around the engine
    "treeflash": 7, "server": 7, "flags": 7, "cli": 7, "bench": 7, "doctor": 7, "doctor_cli": 7,
    "train": 7, "assets": 7,
}
SERVING = ("engine", "server", "speculative", "models", "kernels", "kvcache", "parallel", "config",
           "quantization", "knobs", "runtime", "sharding", "costs", "memory", "sampling", "graph_capture")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    rel = Path(*name.split("."))
    return (SRC / rel).with_suffix(".py").is_file() or (SRC / rel / "__init__.py").is_file()


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the import nodes under `if TYPE_CHECKING:` (never executed)."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
            skip.update(id(n) for n in ast.walk(node))
    return skip


def imports_of(path: Path) -> set[str]:
    """The treeflash modules that `path` imports, `from a import b` resolved to `a.b` where b is one."""
    me = module_name(path)
    tree = ast.parse(path.read_text(), str(path))
    skip = _type_checking_nodes(tree)
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "treeflash")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = me.split(".") if path.name == "__init__.py" else me.split(".")[:-1]
                base = ".".join(pkg[: len(pkg) - node.level + 1] + ([base] if base else []))
            if base.split(".")[0] != "treeflash":
                continue
            subs = [f"{base}.{a.name}" for a in node.names if is_module(f"{base}.{a.name}")]
            out.update(subs or [base])
    out.discard(me)
    return out


def unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "treeflash"


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return {module_name(p): imports_of(p) for p in sorted(PKG.rglob("*.py"))}


def edges(graph):
    for a, targets in graph.items():
        for b in sorted(targets):
            yield a, b


def upward(graph) -> list[str]:
    return [f"{a} -> {b}" for a, b in edges(graph) if RANKS[unit(a)] < RANKS[unit(b)]]


@pytest.mark.slow
def test_every_unit_has_a_rank(graph):
    assert {unit(m) for m in graph} <= set(RANKS), {unit(m) for m in graph} - set(RANKS)


def test_nothing_imports_upward(graph):
    bad = upward(graph)
    assert not bad, "imports against the request path:\n" + "\n".join(bad)


@pytest.mark.parametrize("low", ["kernels", "models", "speculative", "kvcache", "config"])
def test_lower_layers_never_import_the_engine_or_tools(graph, low):
    high = {"engine", "server", "bench", "doctor", "doctor_cli", "cli", "flags"}
    bad = [f"{a} -> {b}" for a, b in edges(graph) if unit(a) == low and unit(b) in high]
    assert not bad, "\n".join(bad)


def _cycle(nodes: dict[str, set[str]]) -> list[str] | None:
    """One circle of `nodes` (name -> names it imports), or None."""
    state, stack = {}, []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(nodes.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (found := visit(m)):
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(nodes):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_no_circle_between_units(graph):
    units: dict[str, set[str]] = {}
    for a, b in edges(graph):
        if unit(a) != unit(b):
            units.setdefault(unit(a), set()).add(unit(b))
    assert _cycle(units) is None, " -> ".join(_cycle(units))


def test_no_circle_between_modules(graph):
    mods: dict[str, set[str]] = {}
    for a, b in edges(graph):
        mods.setdefault(a, set()).add(b)
    assert _cycle(mods) is None, " -> ".join(_cycle(mods))


def test_the_serving_path_never_reaches_the_benchmarks(graph):
    """Following every import (lazy ones too) from any module of the serving path."""
    seen, todo = set(), [m for m in graph if unit(m) in SERVING]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        todo.extend(graph.get(m, ()))
    bench = sorted(m for m in seen if unit(m) in ("bench", "doctor", "doctor_cli", "cli"))
    assert not bench, bench


def test_the_checks_see_a_planted_violation():
    """The checks themselves, on a made-up graph: an upward edge and a circle are found."""
    planted = {"treeflash.models.mla": {"treeflash.engine.graphs"}, "treeflash.engine.graphs": {"treeflash.models.mla"}}
    assert upward(planted) == ["treeflash.models.mla -> treeflash.engine.graphs"]
    assert _cycle(planted) == ["treeflash.engine.graphs", "treeflash.models.mla", "treeflash.engine.graphs"]


def test_the_walk_sees_lazy_and_relative_imports():
    """The walker itself: an import inside a function counts, one under TYPE_CHECKING does not."""
    assert "treeflash.parallel.executor" in imports_of(PKG / "engine" / "llm.py")  # inside a method
    assert "treeflash.config" not in imports_of(PKG / "quantization.py")  # TYPE_CHECKING only
    assert "treeflash.knobs" in imports_of(PKG / "cli.py")  # `from treeflash import knobs`
