"""The sweep's plot reads as the command line does: contexts 1k..256k on the x axis, a floor even
for one context, the model's name (not its absolute path) in the title (issue 43, item 10)."""

from __future__ import annotations

import pytest

from treeflash.bench.plot import context_label, figure, model_title


def result(contexts, model="/home/u/ckpts/DeepSeek-V3-tiny + /home/u/ckpts/tiny-DFlash", preset=None):
    runs = [{"mode": mode, "context": c, "tok_s": 100.0 / (1 + c / 65536), "tokens_per_step": 1.0 + (mode == "ddtree"),
             "floor_ms": 1.0 + c / 65536, "ms_per_step": 3.0 + c / 32768}
            for c in contexts for mode in ("off", "ddtree")]
    return {"runs": runs, "slopes": {"off": {}, "ddtree": {}}, "model": model, "preset": preset, "page_size": 64,
            "meta": {"device": "NVIDIA H100 80GB HBM3", "commit": "c6ca0c2520"}}


def labels(ax) -> list[str]:
    ax.figure.canvas.draw()
    return [t.get_text() for t in ax.get_xticklabels() if t.get_text()]


@pytest.mark.parametrize("n, text", [(1024, "1k"), (189440, "185k"), (262144, "256k"), (1536, "1.5k"), (300, "300")])
def test_context_labels_are_the_command_lines(n, text):
    assert context_label(n) == text


@pytest.mark.slow
def test_x_axis_reads_1k_to_256k():
    contexts = [1024, 8192, 32768, 65536, 131072, 189440, 262144]
    fig = figure(result(contexts))
    for ax in fig.axes:
        assert labels(ax) == ["1k", "8k", "32k", "64k", "128k", "185k", "256k"]


@pytest.mark.slow
def test_a_single_context_draws_its_floor():
    fig = figure(result([32768]))
    for ax in fig.axes:
        floors = [line for line in ax.get_lines() if "floor" in line.get_label()]
        assert len(floors) == 2  # off and ddtree
        for line in floors:
            assert len(line.get_xdata()) == 1 and line.get_marker() not in (None, "None", "", " ")
        assert labels(ax) == ["32k"]


def test_title_names_the_model_not_its_path():
    title = figure(result([1024, 2048]))._suptitle.get_text()
    assert "DeepSeek-V3-tiny + tiny-DFlash" in title and "/home" not in title
    shipped = "/x/src/treeflash/assets/target + /x/src/treeflash/assets/drafter (tp 2, ep 1)"
    assert model_title(result([1], model=shipped)) == "shipped target + shipped drafter (tp 2, ep 1)"
    assert model_title(result([1], preset="kimi-k2-tp8")) == "preset kimi-k2-tp8"
