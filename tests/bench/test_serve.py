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
    res = json.loads(out.read_text())
    assert res["meta"]["commit"] and res["meta"]["date"] and res["meta"]["device_type"] == "cpu"
    rows = {(r["budget"], r["concurrency"]): r for r in res["rows"]}
    assert set(rows) == {(b, c) for b in ("off", 3, "auto") for c in (1, 3)}
    for (budget, c), r in rows.items():
        assert r["lossless"], (budget, c)  # greedy tokens equal spec off's, request by request
        assert r["generated"] == 6 * c and r["tok_s"] > 0 and r["steps"] >= 1
        assert r["captures"] == 0, (budget, c)  # every configuration warmed before it is timed
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
