"""The floors' ceilings follow the device: the H200's measured figures only on an H200, a probe
(once a process) anywhere else, so an H100's fractions are not taken against an H200's ceilings."""

from __future__ import annotations

import torch

from treeflash.costs import ceilings as floors  # bench/floors.py re-exports them


def test_h200_figures_only_on_an_h200_and_one_probe_elsewhere(monkeypatch):
    probes = []

    def probe(device, dtype, seconds=0.3):
        probes.append(str(device))
        return floors.Ceilings(3.0e12, 700e12, f"probe of {device}")

    monkeypatch.setattr(floors, "measure_ceilings", probe)
    monkeypatch.setattr(floors, "_probed", {})
    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(floors, "device_name", lambda d: "NVIDIA H200")
    c = floors.default_ceilings(gpu, torch.bfloat16)
    assert (c.bandwidth, c.matmul) == (4.24e12, 779e12) and not probes
    monkeypatch.setattr(floors, "device_name", lambda d: "NVIDIA H100 80GB HBM3")
    c = floors.default_ceilings(gpu, torch.bfloat16)
    assert (c.bandwidth, c.matmul) == (3.0e12, 700e12) and probes == ["cuda:0"]
    assert floors.default_ceilings(gpu, torch.bfloat16) is c and probes == ["cuda:0"]  # once
    o = floors.default_ceilings(gpu, torch.bfloat16, bandwidth=2e12)
    assert (o.bandwidth, o.matmul) == (2e12, 700e12) and o.source.endswith("overridden")
    cpu = floors.default_ceilings(torch.device("cpu"), torch.float32)
    assert cpu.source == "probe of cpu" and probes == ["cuda:0", "cpu"]
