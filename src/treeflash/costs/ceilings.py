"""The ceilings a floor is taken against: memory bandwidth (bytes/s) and matmul rate (flop/s),
the H200's measured figures on an H200 and, on any other device, a quick probe once a process."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

H200_BANDWIDTH = 4.24e12  # bytes/s, measured copy on one H200 (DESIGN.md)
H200_MATMUL = 779e12  # flop/s, measured bf16 matmul on one H200


@dataclass(frozen=True)
class Ceilings:
    bandwidth: float  # bytes/s
    matmul: float  # flop/s
    source: str

    def floor_s(self, nbytes: float, flops: float) -> float:
        return max(nbytes / self.bandwidth, flops / self.matmul)

    def to_dict(self) -> dict:
        return asdict(self)


def measure_ceilings(device: torch.device, dtype: torch.dtype, seconds: float = 0.3) -> Ceilings:
    """A quick copy and matmul probe (where no measured figure is on record: the CPU, a GPU that
    is not in KNOWN_GPUS)."""
    n = 1 << 24 if device.type == "cpu" else 1 << 28
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_s = _best(lambda: dst.copy_(src), device, seconds)
    m = 512 if device.type == "cpu" else 8192
    a = torch.randn(m, m, dtype=dtype, device=device)
    mm_s = _best(lambda: a @ a, device, seconds)
    return Ceilings(2 * n / copy_s, 2 * m**3 / mm_s, f"measured on {device_name(device)} (copy, {m}^3 matmul)")


# GPUs whose ceilings were measured with care (a name substring of torch.cuda.get_device_name)
KNOWN_GPUS = {"H200": Ceilings(H200_BANDWIDTH, H200_MATMUL, "H200 measured ceilings (DESIGN.md)")}
_probed: dict[tuple[str, torch.dtype], Ceilings] = {}


def default_ceilings(device: torch.device, dtype: torch.dtype, bandwidth: float | None = None,
                     matmul: float | None = None) -> Ceilings:
    """The H200's figures on an H200 (DESIGN.md); on any other device a quick probe, once a
    process (an H100's floor against an H200's ceilings would overstate every fraction by the
    gap between the two GPUs); flags override either."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    name = device_name(device)
    base = next((c for key, c in KNOWN_GPUS.items() if device.type == "cuda" and key in name), None)
    if base is None:
        key = (str(device), dtype)
        if key not in _probed:
            _probed[key] = measure_ceilings(device, dtype)
        base = _probed[key]
    if bandwidth is None and matmul is None:
        return base
    return Ceilings(bandwidth or base.bandwidth, matmul or base.matmul, base.source + ", overridden")


def _best(fn, device: torch.device, seconds: float) -> float:
    fn()
    best, t_end = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return platform.processor() or platform.machine() or "cpu"
