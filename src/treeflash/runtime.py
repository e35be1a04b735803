"""How a model runs, as opposed to what it is: which implementation each fused step uses.

`RuntimeOptions` is a frozen dataclass handed to the target, the drafter and the speculative
step when they are built (`TargetModel(cfg, parallel, options)`, `DFlashDrafter(..., options=...)`,
`SpecDecoder(..., options=...)`, `LLM(..., runtime_options=...)`) and kept by every module that
chooses between a fused launch and the readable torch ops it replaced (STYLE.md 4: chosen by
config, never by a global). Every default is the measured fastest choice
(benchmarks/DESIGN_NOTES.md section 4 has the figures); the alternatives stay for A/B
measurements and bug reports. A command takes them as
`--runtime-option NAME=VALUE` (repeatable; `--runtime-option help` lists them), and a benchmark
records the ones set away from their defaults (`changed`) beside its figures.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace

AUTO = "auto"
_TRUE, _FALSE = ("1", "true", "on", "yes"), ("0", "false", "off", "no")


def _doc(text: str, values: tuple[str, ...] | None = None, ints: tuple[int, ...] = ()) -> dict:
    """A field's metadata: its effect, accepted values (None: a bool, or integers), integer counts."""
    return {"doc": text, "values": values, "ints": ints}


@dataclass(frozen=True)
class RuntimeOptions:
    fused_kernels: str | None = field(default=None, metadata=_doc(
        "the fused path's kernels: auto = Triton on CUDA at inference, the plain torch ops elsewhere; "
        "triton = the Triton kernels on any device (the interpreter on a CPU: how the tests run the "
        "CUDA path); torch = the fused path with each kernel's torch twin", (AUTO, "triton", "torch")))
    fused_norm: bool = field(default=True, metadata=_doc(
        "the fused path on CUDA: RMSNorm, rotary, MLA's latent prep and absorb, the drafter's steps as "
        "Triton launches (0: the torch ops)"))
    fused_a: bool = field(default=True, metadata=_doc(
        "MLA's kv_a and q_a projections as one GEMM (0: two)"))
    mla_prep: bool = field(default=True, metadata=_doc(
        "MLA's kv norm, k_pe rotation, cache store and q_a norm in one launch (0: four)"))
    head_matmul: bool = field(default=True, metadata=_doc(
        "MLA's absorb / expand one launch each (0: einsums and their copies)"))
    rope_in_absorb: bool = field(default=True, metadata=_doc(
        "q_pe's rotation inside the absorb launch at <= 32 rows in 16-bit (0: its own launch)"))
    fused_gate: bool = field(default=True, metadata=_doc(
        "the MoE router's scoring and top-k one Triton launch on CUDA (0: the torch ops)"))
    split_router: bool = field(default=True, metadata=_doc(
        "a large router's logits by the split launch at decode sizes (0: a float32 GEMM)"))
    moe_shared: bool = field(default=True, metadata=_doc(
        "the shared experts inside the grouped MoE call (0: their own MLP)"))
    moe_tiles: tuple[int, ...] | None = field(default=None, metadata=_doc(
        "the grouped MoE call's tiles, BN:BK:DOWN_BN:DOWN_BK:STAGES[:GU_WARPS:DOWN_WARPS] (tuning; "
        "auto: kernels/moe_gemm.py's)", ints=(5, 7)))
    moe_split_k: int | None = field(default=None, metadata=_doc(
        "a fixed split-K count for the grouped MoE call's gate_up (1: off; auto: planned per call)", ints=(1,)))
    w4a16_tiles: tuple[int, ...] | None = field(default=None, metadata=_doc(
        "the INT4 (W4A16) MoE portable kernel's tiles, BLOCK_M:GU_N:GU_KW:DOWN_N:DOWN_KW:SHARED_K:STAGES"
        "[:GU_WARPS:DOWN_WARPS] (tuning; auto: kernels/moe_w4a16/portable.py's)", ints=(7, 9)))
    w4a16_split_k: int | None = field(default=None, metadata=_doc(
        "a fixed split-K count for the INT4 MoE call's gate_up, whichever kernel runs it (1: off; auto: "
        "planned per call)", ints=(1,)))
    drafter_attention: str | None = field(default=None, metadata=_doc(
        "the drafter's attention: auto = Triton on CUDA, torch elsewhere; or pinned", (AUTO, "torch", "triton")))
    # the speculative step's (speculative/): each 0 keeps the path its fusion replaced
    overlap: bool | None = field(default=None, metadata=_doc(
        "the overlapped speculative step, the next step's drafting queued before the host reads this "
        "one's (auto: on for CUDA; 0 / 1: off / on anywhere)"))
    fused_tree: bool = field(default=True, metadata=_doc(
        "the DDTree build one launch on CUDA (0: the torch ops)"))
    tree_into_verify: bool = field(default=True, metadata=_doc(
        "the draft graph writes the tree into the verify graph's inputs (0: the verify copies it)"))
    fused_walk: bool = field(default=True, metadata=_doc(
        "the accept walk after verify one launch on CUDA (0: the torch ops)"))
    fused_topk: bool = field(default=True, metadata=_doc(
        "the drafter's top-k log-probs one launch a row on CUDA (0: torch's log_softmax + topk)"))

    def changed(self) -> dict[str, str]:
        """The options set away from their defaults, {name: value as given}: what a benchmark
        result records, so that an A/B run's figures cannot pass for the defaults'."""
        default = RuntimeOptions()
        return {f.name: _show(getattr(self, f.name)) for f in fields(self)
                if getattr(self, f.name) != getattr(default, f.name)}

    def notes(self) -> list[str]:
        """One line per option away from its default: its value, the default and its effect."""
        return [f"--runtime-option {name}={value} (default {_show(getattr(RuntimeOptions(), name))}): "
                f"{_FIELDS[name].metadata['doc']}" for name, value in self.changed().items()]

    @classmethod
    def parse(cls, items: Sequence[str]) -> RuntimeOptions:
        """`NAME=VALUE` strings (`--runtime-option`) into options; ValueError naming the problem."""
        changes = {}
        for item in items:
            name, sep, raw = item.partition("=")
            name = name.strip().replace("-", "_")
            if name not in _FIELDS:
                raise ValueError(f"--runtime-option {item!r}: no option {name!r}; one of {', '.join(_FIELDS)} "
                                 "(--runtime-option help describes each)")
            if not sep:
                raise ValueError(f"--runtime-option {item!r}: expected NAME=VALUE")
            changes[name] = _value(_FIELDS[name], raw.strip())
        return replace(cls(), **changes)


def _show(value) -> str:
    if value is None:
        return AUTO
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, tuple):
        return ":".join(map(str, value))
    return str(value)


def _value(f, raw: str):
    meta, name = f.metadata, f.name
    if meta["values"] is not None:
        if raw not in meta["values"]:
            raise ValueError(f"--runtime-option {name}={raw!r}: expected one of {', '.join(meta['values'])}")
        return None if raw == AUTO else raw
    if meta["ints"]:
        return _ints(name, raw, meta["ints"])
    if raw == AUTO and f.default is None:  # a bool whose default the device decides
        return None
    if raw.lower() in _TRUE or raw.lower() in _FALSE:
        return raw.lower() in _TRUE
    auto = ", or auto" if f.default is None else ""
    raise ValueError(f"--runtime-option {name}={raw!r}: expected 1 or 0 (true / false){auto}")


def _ints(name: str, raw: str, counts: tuple[int, ...]):
    if raw == AUTO:
        return None
    try:
        vals = tuple(int(v) for v in raw.split(":"))
    except ValueError:
        vals = ()
    if len(vals) not in counts or min(vals) < 1:
        raise ValueError(f"--runtime-option {name}={raw!r}: expected {' or '.join(map(str, counts))} positive "
                         "integers separated by ':', or auto")
    return vals[0] if counts == (1,) else vals


def describe() -> str:
    """Every option with its default and effect (`--runtime-option help`)."""
    default = RuntimeOptions()
    lines = ["runtime options (--runtime-option NAME=VALUE, repeatable; defaults are the measured fastest):"]
    for f in fields(RuntimeOptions):
        lines.append(f"  {f.name}={_show(getattr(default, f.name))}: {f.metadata['doc']}")
    return "\n".join(lines)


_FIELDS = {f.name: f for f in fields(RuntimeOptions)}
DEFAULT = RuntimeOptions()
