"""The speculative step reaches the target only through `speculative.target.SpecTarget`: every
`target.<name>` the step's modules use is a member of it, and the engine has every member."""

from __future__ import annotations

import ast
from pathlib import Path

from treeflash.speculative import target as target_mod
from treeflash.speculative.target import SpecTarget

SPEC = Path(target_mod.__file__).parent
STEP_MODULES = ("decoder.py", "plain.py", "overlap.py", "host.py")


def members() -> set[str]:
    tree = ast.parse((SPEC / "target.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == SpecTarget.__name__)
    names = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
    return names | {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)}


def used_on_target(path: Path) -> set[str]:
    """Attributes read off a name `target` (the step's parameter for the engine)."""
    return {n.attr for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "target"}


def test_the_step_uses_nothing_of_the_target_beyond_the_protocol():
    allowed = members()
    assert {"forward", "logits", "commit", "verify_graphs", "device"} <= allowed
    used = {name: used_on_target(SPEC / name) for name in STEP_MODULES}
    assert used["decoder.py"] and used["plain.py"]  # (the walk finds the parameter at all)
    assert not {n: u - allowed for n, u in used.items() if u - allowed}
    for name in STEP_MODULES:  # no reach past it: the engine's executor, pool, model, request list
        text = (SPEC / name).read_text()
        assert not [w for w in ("engine.", ".executor", ".pool", "target.model", ".running") if w in text], name


def test_the_engine_is_a_spec_target(pair):
    from treeflash import LLM

    engine = LLM(pair[0], device="cpu", dtype="float32").engine
    assert not [m for m in members() if not hasattr(engine, m)]
