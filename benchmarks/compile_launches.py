"""Compile every Triton / Gluon kernel launch of `treeflash.kernels` for sm_90 on a machine without
a GPU: the launchers run on CPU tensors with TRITON_INTERPRET=0 while every `kernel[grid](...)`
of a kernel defined under treeflash.kernels is captured instead of run (`capture`: JITFunction.run
is replaced, so a new kernel is covered without editing this file), and each distinct launch is
specialised by the JIT's own binder for a CUDA sm_90 target (pointer / int divisibility by 16,
constexprs, num_warps / num_stages / ... launch options; `specialise`) and compiled with
`triton.compile` (GluonASTSource for Gluon kernels). Reports registers, stack (spills) and shared
memory a launch, or the compile error's first lines. The launches come from `compile_cases.py`
(every kernel module's launchers at small and Kimi K2 TP8 shapes, bf16 and fp8_e4m3 caches).

    TRITON_INTERPRET=0 PYTHONPATH=/tmp/t36site:src python benchmarks/compile_launches.py \
        [--only kv_ops,dcp_merge] [--out report.json]

Run it under the GPU's Triton (3.6 on the H100 / H200 image). Exit 1 when a launch does not compile.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess as sp
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

if __name__ == "__main__":  # compiled kernels, not interpreted ones (set before triton loads)
    os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

SM90 = GPUTarget("cuda", 90, 32)
PACKAGE = "treeflash.kernels"


@dataclass
class Launch:
    """One captured `kernel[grid](*args, **kwargs)` and the case that made it."""

    kernel: JITFunction
    grid: object
    args: tuple
    kwargs: dict
    case: str = ""

    @property
    def name(self) -> str:
        return f"{self.kernel.fn.__module__}.{self.kernel.fn.__name__}"


@dataclass
class Captured:
    launches: list[Launch] = field(default_factory=list)
    case: str = ""


@contextlib.contextmanager
def capture(package: str = PACKAGE):
    """Within: every launch of a JIT (Triton or Gluon) kernel defined under `package` is recorded
    in the yielded `Captured` and not run (it returns None); other kernels run as usual."""
    got, real = Captured(), JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        if warmup or not self.fn.__module__.startswith(package):
            return real(self, *args, grid=grid, warmup=warmup, **kwargs)
        got.launches.append(Launch(self, grid, args, dict(kwargs), got.case))
        return None

    JITFunction.run = run
    try:
        yield got
    finally:
        JITFunction.run = real


def _backend(target: GPUTarget = SM90):
    from triton.compiler.compiler import make_backend

    return make_backend(target)


def specialise(launch: Launch, backend=None):
    """(source, options) of `launch` as the JIT specialises it for `backend`'s target (default
    sm_90): the kernel's own binder (types, 16-divisibility of pointers and ints, constexprs,
    launch options) and its `_pack_args`, as `JITFunction.run` does before compiling."""
    from triton.compiler import ASTSource

    backend = backend or _backend()
    kern, kw = launch.kernel, dict(launch.kwargs)
    kw.setdefault("debug", kern.debug or False)
    binder = create_function_from_signature(kern.signature, kern.params, backend)
    bound, spec, options = binder(*launch.args, **kw)
    options, signature, constexprs, attrs = kern._pack_args(backend, kw, bound, spec, options)
    if kern.is_gluon():
        from triton.experimental.gluon._runtime import GluonASTSource as source_type
    else:
        source_type = ASTSource
    return source_type(kern, signature, constexprs, attrs), options


def key(launch: Launch) -> str:
    """What makes two launches one compile: the kernel and its specialisation."""
    src, options = specialise(launch)
    return f"{launch.name}|{src.hash()}|{sorted(options.__dict__.items())}"


def usage(compiled) -> dict:
    """Registers and stack from the cubin (cuobjdump of Triton's bundled CUDA tools), shared memory."""
    bindir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        res = sp.run([str(bindir / "cuobjdump"), "-res-usage", f.name], capture_output=True, text=True).stdout
    reg = re.search(r"REG:(\d+) STACK:(\d+)", res)
    return {"registers": int(reg.group(1)) if reg else None, "stack": int(reg.group(2)) if reg else None,
            "shared": compiled.metadata.shared}


def compile_launch(launch: Launch) -> dict:
    """Compile one launch for sm_90: its usage, or {"error": the exception's first lines}."""
    t0 = time.perf_counter()
    try:
        src, options = specialise(launch)
        rec = usage(triton.compile(src, target=SM90, options=options.__dict__))
    except Exception as exc:  # noqa: BLE001 - a launch that does not compile is the result
        rec = {"error": error_text(exc)}
    rec["compile_s"] = round(time.perf_counter() - t0, 2)
    return rec


def error_text(exc: BaseException, most: int = 3000) -> str:
    """A compile error in a few lines: down the chain of causes, each Triton CompilationError as
    its kernel, position and source line, then the innermost message (e.g. the NameError of a
    plain global); another exception as its first lines."""
    out, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        node, src = getattr(exc, "node", None), getattr(exc, "src", None)
        if src is not None and node is not None and hasattr(node, "lineno"):
            lines = src.splitlines()
            name = next((ln.split("(")[0][4:] for ln in lines if ln.startswith("def ")), "?")
            at = lines[node.lineno - 1].strip() if 0 < node.lineno <= len(lines) else ""
            out.append(f"{type(exc).__name__} in {name} at {node.lineno}:{node.col_offset}: {at}")
            msg = getattr(exc, "error_message", None)
            if msg and exc.__cause__ is None:
                out.extend(str(msg).splitlines()[:8])
        else:
            out.extend(f"{type(exc).__name__}: {exc}".strip().splitlines()[:12])
        exc = exc.__cause__
    return "\n".join(out)[:most]


def describe(launch: Launch) -> dict:
    """The launch's specialisation in a few words (signature types, constexprs, options)."""
    src, options = specialise(launch)
    cx = {launch.kernel.arg_names[p[0]]: repr(v) for p, v in src.constants.items()}
    return {"kernel": launch.name, "case": launch.case, "grid": repr(launch.grid),
            "signature": " ".join(f"{k}:{v}" for k, v in src.signature.items() if v != "constexpr"),
            "constexprs": cx, "num_warps": options.num_warps, "num_stages": options.num_stages}


def collect(only: set[str] | None = None, tests: list[str] | None = None) -> list[Launch]:
    """The launches of every case in `compile_cases.MODULES` (or those whose module is in `only`),
    then those of the pytest paths `tests` (`compile_cases.run_tests`)."""
    import compile_cases

    with capture() as got, compile_cases.fake_sm90():
        for module, name, fn in compile_cases.cases():
            if only and module not in only:
                continue
            got.case = f"{module}: {name}"
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - a case that cannot launch is reported
                print(f"case {got.case} FAILED before launching: {type(exc).__name__}: {exc}", flush=True)
                got.launches.append(Launch(None, None, (), {"error": f"{type(exc).__name__}: {exc}"}, got.case))
        if tests:
            compile_cases.run_tests(tests, got)
    return got.launches


def distinct(launches: list[Launch]) -> dict[str, list[Launch]]:
    out: dict[str, list[Launch]] = {}
    for ln in launches:
        if ln.kernel is not None:
            out.setdefault(key(ln), []).append(ln)
    return out


_POOL_GROUPS: list[list[Launch]] = []


def _compile_index(i: int) -> dict:
    return compile_launch(_POOL_GROUPS[i][0])


def compile_all(groups: list[list[Launch]], jobs: int):
    """compile_launch of each group's first launch, in order; `jobs` > 1: in forked workers."""
    if jobs <= 1:
        yield from (compile_launch(g[0]) for g in groups)
        return
    import multiprocessing

    _POOL_GROUPS[:] = groups
    with multiprocessing.get_context("fork").Pool(jobs) as pool:
        yield from pool.imap(_compile_index, range(len(groups)))


def cap_tests(groups: dict[str, list[Launch]], most: int) -> dict[str, list[Launch]]:
    """`groups` less the test-only ones past `most` a kernel (evenly spaced among its test-only
    specialisations, in the order the tests made them): the tests make hundreds."""
    from_tests: dict[str, list[str]] = {}
    for k, group in groups.items():
        if all(ln.case.startswith("tests: ") for ln in group):
            from_tests.setdefault(group[0].name, []).append(k)
    drop = set()
    for keys in from_tests.values():
        keep = {keys[round(i * (len(keys) - 1) / max(most - 1, 1))] for i in range(min(most, len(keys)))}
        drop |= set(keys) - keep
    return {k: g for k, g in groups.items() if k not in drop}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="", help="comma-separated case modules (compile_cases.MODULES)")
    p.add_argument("--tests", nargs="*", default=[],
                   help="pytest paths run under the capture too (their launches before each failing check)")
    p.add_argument("--tests-cap", type=int, default=8,
                   help="compile at most this many test-only specialisations a kernel (0: all)")
    p.add_argument("--out", default="", help="JSON path for the report")
    p.add_argument("--jobs", type=int, default=1, help="compile in this many forked processes")
    p.add_argument("--capture-only", action="store_true", help="list the distinct launches, compile none")
    args = p.parse_args(argv)
    launches = collect(set(args.only.split(",")) if args.only else None, args.tests)
    case_errors = [{"case": ln.case, "error": ln.kwargs["error"]} for ln in launches if ln.kernel is None]
    groups = distinct(launches)
    found = len(groups)
    if args.tests_cap:
        groups = cap_tests(groups, args.tests_cap)
    print(f"{len(launches) - len(case_errors)} launches captured, {found} distinct, compiling {len(groups)} "
          f"for sm_90", flush=True)
    if args.capture_only:
        for group in groups.values():
            print(json.dumps(describe(group[0]) | {"launches": len(group)}))
        return 1 if case_errors else 0
    rows, failed = [], 0
    for i, (group, result) in enumerate(zip(groups.values(), compile_all(list(groups.values()), args.jobs))):
        rec = describe(group[0]) | {"cases": sorted({ln.case for ln in group})[:20], "launches": len(group)} | result
        failed += "error" in rec
        rows.append(rec)
        status = (f"FAILED {rec['error'].splitlines()[0][:300]}" if "error" in rec else
                  f"ok, {rec['registers']} registers, stack {rec['stack']}, shared {rec['shared']}")
        print(f"[{i + 1}/{len(groups)}] {rec['kernel']} ({rec['case']}; warps {rec['num_warps']}): {status}",
              flush=True)
    summary = summarise(rows, case_errors) | {"captured": len(launches) - len(case_errors), "distinct": found}
    if args.out:
        Path(args.out).write_text(json.dumps(summary | {"launches": rows, "case_errors": case_errors}, indent=1))
    print(json.dumps(summary, indent=1))
    return 1 if failed or case_errors else 0


def summarise(rows: list[dict], case_errors: list[dict]) -> dict:
    kernels: dict[str, dict] = {}
    for r in rows:
        k = kernels.setdefault(r["kernel"], {"compiled": 0, "failed": 0})
        k["failed" if "error" in r else "compiled"] += 1
    return {"triton": triton.__version__, "torch": torch.__version__, "target": "cuda sm_90",
            "distinct_launches": len(rows), "failed": sum("error" in r for r in rows),
            "case_errors": len(case_errors), "kernels": kernels}


if __name__ == "__main__":
    sys.exit(main())
