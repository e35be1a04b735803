"""The sweep's picture: tok/s and ms/step against context, one line per spec mode, floor dashed.

The context axis is logarithmic with a tick at each measured context, labelled as the command
line writes it (1k, 32k, 256k); a floor is drawn with a marker at each point, so a sweep of a
single context shows it too; the title names the model (folder names, not absolute paths).
"""

from __future__ import annotations

from pathlib import Path


def context_label(n: int) -> str:
    """1024 -> '1k', 189440 -> '185k', 1536 -> '1.5k', 300 -> '300' (k = 1024, as --contexts)."""
    return f"{n / 1024:.4g}k" if n >= 1024 else str(n)


def model_title(result: dict) -> str:
    """'preset kimi-k2-tp8', or the checkpoint folders' names: 'shipped target + shipped drafter'."""
    if result.get("preset"):
        return f"preset {result['preset']}"
    source, _, rest = str(result.get("model", "")).partition(" (")
    names = []
    for part in source.split(" + "):
        path = Path(part.strip())
        names.append(f"shipped {path.name}" if path.parent.name == "assets" else path.name or part)
    return " + ".join(names) + (f" ({rest}" if rest else "")


def figure(result: dict):
    """The matplotlib Figure of a sweep result (two panels: tok/s and ms/step)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    fig, (ax_tok, ax_ms) = plt.subplots(1, 2, figsize=(12, 4.5))
    for mode in result["slopes"]:
        runs = sorted((r for r in result["runs"] if r["mode"] == mode), key=lambda r: r["context"])
        if not runs:
            continue
        ctx = [r["context"] for r in runs]
        line = ax_tok.plot(ctx, [r["tok_s"] for r in runs], "o-", label=mode)[0]
        color = line.get_color()
        floor = dict(linestyle="--", marker="_", markersize=14, color=color, alpha=0.6)
        floor_tok = [r["tokens_per_step"] / (r["floor_ms"] / 1e3) for r in runs]
        ax_tok.plot(ctx, floor_tok, label=f"{mode} at floor", **floor)
        ax_ms.plot(ctx, [r["ms_per_step"] for r in runs], "o-", color=color, label=mode)
        ax_ms.plot(ctx, [r["floor_ms"] for r in runs], label=f"{mode} floor", **floor)
    contexts = sorted({r["context"] for r in result["runs"]})
    for ax, ylabel in ((ax_tok, "decode tok/s"), (ax_ms, "ms / step")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.xaxis.set_major_locator(FixedLocator(contexts))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: context_label(int(round(x)))))
        if len(contexts) == 1:  # a lone point: some room either side
            ax.set_xlim(contexts[0] / 1.5, contexts[0] * 1.5)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    title = model_title(result)
    if result.get("extrapolated"):
        title += f" (extrapolated {result['layers_measured']}->{result['layers_reported']} layers)"
    layout = "scattered KV (page 1 shuffled)" if result.get("scattered") else f"page {result.get('page_size')}"
    meta = result.get("meta", {})
    fig.suptitle(f"{title}, {layout}, {meta.get('device', '')} {meta.get('commit', '')[:8]}", fontsize=10)
    fig.tight_layout()
    return fig


def plot_sweep(result: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig = figure(result)  # (selects the Agg backend before pyplot is imported)
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_beside(results: list[dict], path: str | Path) -> Path:
    """Several sweeps on one picture (decode tok/s over all timed steps against context): a color
    per spec mode, a line style per sweep (solid, dashed, dotted), labelled by preset and expert
    format. For a preset with INT4 routed experts beside its bf16 twin."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    fig, ax = plt.subplots(figsize=(10, 5))
    modes = list(dict.fromkeys(r["mode"] for res in results for r in res["runs"]))
    colors = {m: f"C{i % 10}" for i, m in enumerate(modes)}
    for res, style in zip(results, ("-", "--", ":", "-.")):
        name = f"{model_title(res)} ({res.get('expert_format', '?')})"
        for mode in modes:
            runs = sorted((r for r in res["runs"] if r["mode"] == mode), key=lambda r: r["context"])
            if runs:
                ax.plot([r["context"] for r in runs], [r["tok_s_mean"] for r in runs], style, marker="o",
                        color=colors[mode], label=f"{mode}, {name}")
    contexts = sorted({r["context"] for res in results for r in res["runs"]})
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.xaxis.set_major_locator(FixedLocator(contexts))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: context_label(int(round(x)))))
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("decode tok/s (all timed steps)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    meta = results[0].get("meta", {})
    ax.set_title(f"{' vs '.join(model_title(r) for r in results)}, {meta.get('device', '')} "
                 f"{meta.get('commit', '')[:8]}", fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
