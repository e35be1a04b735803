"""What the Triton launchers share about the device: its SM count, and the arrival counters of
split-K (zeros every call leaves at zero). Triton-free."""

from __future__ import annotations

import torch


def num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


_counters: dict = {}


def tile_counters(device: torch.device, n: int) -> torch.Tensor:
    """Split K's arrival counters: zeros that every call leaves at zero (the last program of a
    tile resets its own), one buffer a (device, stream), grown outside graph capture. Under
    capture without one large enough, a fresh zeroed buffer (its memset is captured with it)."""
    key = (device, torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0)
    buf = _counters.get(key)
    if buf is not None and buf.numel() >= n:
        return buf
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    buf = torch.zeros(max(n, 1024), device=device, dtype=torch.int32)
    if not capturing:
        _counters[key] = buf
    return buf
