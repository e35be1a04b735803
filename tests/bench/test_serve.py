"""bench serve on the CPU at tiny size: every (budget, concurrency) round, lossless against spec
off, warmed before it is timed (no graph captured inside a timed round), the table and the JSON
(device, date, commit)."""

from __future__ import annotations

import json

import pytest

from treeflash.cli import main


@pytest.mark.slow
def test_serve_table_and_json(pair, tmp_path, capsys):
    target, drafter = pair
    out = tmp_path / "s.json"
    rc = main(["bench", "serve", "--model", str(target), "--drafter", str(drafter), "--device", "cpu",
               "--concurrency", "1,3", "--tree-budget", "off,3,auto", "--max-tokens", "6", "--prompt-len", "8",
               "--cuda-graphs", "--out", str(out)])  # (on the CPU: the graphs' static path, eagerly)
    assert rc == 0
    text = capsys.readouterr().out
    assert "| concurrency | off tok/s | 3 tok/s | auto tok/s | auto/best other |" in text
    assert "tokens compared with spec off in float32; spec off against itself at a smaller batch: 1/1" in text
    res = json.loads(out.read_text())
    assert res["meta"]["commit"] and res["meta"]["date"] and res["meta"]["device_type"] == "cpu"
    rows = {(r["budget"], r["concurrency"]): r for r in res["rows"]}
    assert set(rows) == {(b, c) for b in ("off", 3, "auto") for c in (1, 3)}
    for (budget, c), r in rows.items():
        assert r["lossless"], (budget, c)  # greedy tokens equal spec off's, request by request
        assert r["generated"] == 6 * c and r["tok_s"] > 0 and r["steps"] >= 1
        assert r["captures"] == 0, (budget, c)  # every configuration warmed before it is timed
        assert r["agreed_before_divergence"] == [] and r["warm_s"] >= 0 and r["capture_s"] == 0
        if budget == "off" and c == 3:  # prompt 0 ran at 1 request too: float32 gives its tokens again
            assert r["off_vs_other_batch"] == {"compared": 1, "same": 1, "agreed_before_divergence": []}
        if budget == "off":
            assert r["plain_steps"] == 0 and not r["spec_steps_by_budget"]
        elif budget == 3:
            assert set(r["spec_steps_by_budget"]) == {"3"} and r["plain_steps"] == 0
        else:
            assert sum(r["spec_steps_by_budget"].values()) + r["plain_steps"] >= 5 * c


@pytest.mark.parametrize("argv, words", [(["--tree-budget", "fast"], "expected an integer"),
                                         (["--concurrency", "0"], "must be >= 1")])
def test_serve_bad_flags(argv, words, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "serve", "--preset", "tiny", "--device", "cpu", *argv])
    assert e.value.code == 2 and words in capsys.readouterr().err


def test_serve_line_says_where_tokens_diverged():
    """A round whose tokens differ from spec off: how many requests, the dtype, and the equal tokens
    before the first difference (a late flip reads as a near-tie, an early one as a bug)."""
    import torch

    from treeflash.bench.serve import _line, first_divergence

    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1 and first_divergence([1, 2], [1, 2, 3]) == 2
    row = {"budget": 7, "concurrency": 8, "tok_s": 1.0, "decode_tok_s": 2.0, "steps": 9, "warm_s": 1.5,
           "captures": 2, "capture_s": 0.25, "lossless": False, "same_as_off": 5, "generated": 8 * 96,
           "agreed_before_divergence": [40, 71, 90]}
    line = _line(row, torch.bfloat16)
    assert ("3/8 requests' tokens differ from spec off (bfloat16; first difference after 40-90 equal "
            "tokens of 96)") in line
    assert "2 graph(s) captured in the timed round (0.250 s)" in line and "warm-up 1.5 s" in line
