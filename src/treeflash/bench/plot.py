"""The sweep's picture: tok/s and ms/step against context, one line per spec mode, floor dashed."""

from __future__ import annotations

from pathlib import Path


def plot_sweep(result: dict, path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, (ax_tok, ax_ms) = plt.subplots(1, 2, figsize=(12, 4.5))
    for mode in result["slopes"]:
        runs = sorted((r for r in result["runs"] if r["mode"] == mode), key=lambda r: r["context"])
        if not runs:
            continue
        ctx = [r["context"] for r in runs]
        line = ax_tok.plot(ctx, [r["tok_s"] for r in runs], "o-", label=mode)[0]
        color = line.get_color()
        floor_tok = [r["tokens_per_step"] / (r["floor_ms"] / 1e3) for r in runs]
        ax_tok.plot(ctx, floor_tok, "--", color=color, alpha=0.6, label=f"{mode} at floor")
        ax_ms.plot(ctx, [r["ms_per_step"] for r in runs], "o-", color=color, label=mode)
        ax_ms.plot(ctx, [r["floor_ms"] for r in runs], "--", color=color, alpha=0.6, label=f"{mode} floor")
    for ax, ylabel in ((ax_tok, "decode tok/s"), (ax_ms, "ms / step")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    title = result.get("preset") or result.get("model", "")
    if result.get("extrapolated"):
        title += f" (extrapolated {result['layers_measured']}->{result['layers_reported']} layers)"
    layout = "scattered KV (page 1 shuffled)" if result.get("scattered") else f"page {result.get('page_size')}"
    meta = result.get("meta", {})
    fig.suptitle(f"{title}, {layout}, {meta.get('device', '')} {meta.get('commit', '')[:8]}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
