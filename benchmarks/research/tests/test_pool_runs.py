"""benchmarks/research/pool_runs.py on hand-made runs: the spread of a request between runs, the oracle's
maximum over noise, and per-task ratios to a reference method."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks.research import pool_runs


def record(qid: int, task: str, seconds: dict[str, float]) -> dict:
    """A batch-1 request of 10 tokens with these seconds per method."""
    return {
        "question_id": qid,
        "task": task,
        "batch_size": 1,
        "new_tokens": 10,
        "methods": {m: {"seconds": s, "identical": True} for m, s in seconds.items()},
    }


def run(a: float, b: float) -> dict[int, dict]:
    """Two requests: on request 1 spin:a takes `a` seconds and spin:b 4 s; on request 2 the reverse."""
    return {
        1: record(1, "x", {"plain": 5.0, "spin:a": a, "spin:b": 4.0, "policy:p": 2.0}),
        2: record(2, "y", {"plain": 5.0, "spin:a": 4.0, "spin:b": b, "policy:p": 2.0}),
    }


def test_identical_runs_have_no_spread_and_no_oracle_noise():
    runs = [run(2.0, 2.0), run(2.0, 2.0)]
    assert pool_runs.spreads(runs, [1, 2], ["plain", "spin:a"]) == {"plain": 0.0, "spin:a": 0.0}
    assert pool_runs.oracle_noise(runs, [1, 2]) == [1.0, 1.0]


def test_spread_is_one_runs_sd_of_log_goodput():
    # spin:a on request 1: 2 s in one run, 2e s in the other; on request 2 the same in both
    runs = [run(2.0, 2.0), run(2.0 * math.e, 2.0)]
    diffs = [1.0, 0.0]  # log goodput differences, request 1 and 2
    expected = math.sqrt(sum((d - 0.5) ** 2 for d in diffs) / 2) / math.sqrt(2)
    assert pool_runs.spreads(runs, [1, 2], ["spin:a"])["spin:a"] == pytest.approx(expected)


def test_the_oracle_in_hindsight_over_one_chosen_in_another_run():
    # Run 0: spin:a is best on request 1 (2 s); in run 1 noise makes spin:b (4 s) beat it (5 s).
    runs = [run(2.0, 2.0), run(5.0, 2.0)]
    noise = pool_runs.oracle_noise(runs, [1, 2])
    # run 0 read with run 1's choice (spin:b, 4 s, on request 1): (10/2 + 10/2) / (10/4 + 10/2)
    assert noise[0] == pytest.approx((5 + 5) / (2.5 + 5))
    # run 1 read with run 0's choice (spin:a, 5 s): its hindsight picks spin:b (4 s)
    assert noise[1] == pytest.approx((2.5 + 5) / (2 + 5))


def test_per_task_ratios_to_the_reference_and_oracle_fraction():
    table = pool_runs.per_task([run(2.0, 2.0)], [1, 2], "policy:p", "spin:a")
    assert table["x"]["spin:a"] == 1.0
    assert table["x"]["spin:b"] == pytest.approx(2.0 / 4.0)
    assert table["y"]["spin:b"] == pytest.approx(4.0 / 2.0)
    assert table["ALL"]["policy:p"] == pytest.approx((5 + 5) / (5 + 2.5))
    assert table["ALL"]["oracle fraction"] == 1.0  # the policy matches the best method on each request


def test_a_run_without_its_first_requests():
    # bench order 2, 1, 3: the policy is slow on its first request (2) and matches spin:a after it
    by_id = run(2.0, 2.0)
    by_id[2]["methods"]["policy:p"]["seconds"] = 8.0
    by_id[1]["methods"]["policy:p"]["seconds"] = 2.0
    by_id[3] = record(3, "x", {"plain": 5.0, "spin:a": 2.0, "spin:b": 4.0, "policy:p": 2.0})
    ordered = {q: by_id[q] for q in (2, 1, 3)}
    assert pool_runs.after_first(ordered, [1, 2, 3], 1) == [1, 3]
    assert (
        pool_runs.per_task([ordered], pool_runs.after_first(ordered, [1, 2, 3], 1), "policy:p", "spin:a")["ALL"][
            "policy:p"
        ]
        == 1.0
    )
    assert pool_runs.per_task([ordered], [1, 2, 3], "policy:p", "spin:a")["ALL"]["policy:p"] == pytest.approx(
        (5 + 1.25 + 5) / (5 + 2.5 + 5)
    )
    text = pool_runs.markdown([Path("r")], 1, [1, 2, 3], [ordered], "policy:p", "spin:a", skip=1)
    assert "policy:p / spin:a after the first 1 |" in text
    assert "After the first 1 requests of each run, over all runs: policy:p / spin:a 1.000" in text


def test_learning_curve_and_its_plot(tmp_path):
    pytest.importorskip("matplotlib")  # in the [test] extra; a bare install reads the curve but cannot draw it
    # bench order 2, 1, 3: the policy at half spin:a's speed on its first request, level after it
    by_id = run(2.0, 2.0)
    by_id[2]["methods"]["policy:p"]["seconds"] = 8.0  # spin:a: 4 s on request 2
    by_id[3] = record(3, "x", {"plain": 5.0, "spin:a": 2.0, "spin:b": 4.0, "policy:p": 2.0})
    ordered = {q: by_id[q] for q in (2, 1, 3)}
    ratios, cumulative = pool_runs.learning_curve(ordered, [1, 2, 3], "policy:p", "spin:a")
    assert ratios == pytest.approx([0.5, 1.0, 1.0])  # speeds 10/8 against 10/4, then equal
    assert cumulative == pytest.approx([0.5, (1.25 + 5) / (2.5 + 5), (1.25 + 5 + 5) / (2.5 + 5 + 5)])
    out = tmp_path / "curve.png"
    pool_runs.plot(out, [Path("cold"), Path("warm")], [ordered, run(2.0, 2.0)], [1, 2], "policy:p", "spin:a")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_runs_with_other_methods_are_read_on_the_methods_they_share():
    # one run also timed assisted generation, and in both an assisted baseline crashed on request 2
    # and one run timed a third single drafter, faster than the others: not an oracle candidate
    wider, narrower = run(2.0, 2.0), run(2.0, 2.0)
    for r in wider.values():
        r["methods"]["assisted:a"] = {"seconds": 3.0, "identical": True}
        r["methods"]["spin:c"] = {"seconds": 1.0, "identical": True}
    for r in (wider, narrower):
        r[1]["methods"]["assisted:b"] = {"seconds": 3.0, "identical": True}
        r[2]["methods"]["assisted:b"] = {"error": "RuntimeError()"}
    runs = [wider, narrower]
    assert pool_runs.shared_methods(runs, [1, 2]) == ["plain", "spin:a", "spin:b", "policy:p"]
    assert set(pool_runs.per_task(runs, [1, 2], "policy:p", "spin:a")["ALL"]) == {
        "plain",
        "spin:a",
        "spin:b",
        "policy:p",
        "oracle fraction",
    }
    assert "assisted:" not in pool_runs.markdown([Path("a"), Path("b")], 1, [1, 2], runs, "policy:p", "spin:a")
    assert pool_runs.single_drafters(pool_runs.shared_methods(runs, [1, 2])) == ["spin:a", "spin:b"]
    assert pool_runs.oracle_noise(runs, [1, 2]) == [1.0, 1.0]
    assert pool_runs.per_task(runs, [1, 2], "policy:p", "spin:a")["ALL"]["oracle fraction"] == 1.0


def test_load_reads_the_newest_json_at_the_batch_size(tmp_path):
    records = list(run(2.0, 2.0).values()) + [
        {**record(3, "x", {"plain": 1.0}), "batch_size": 4, "requested_batch_size": 4}
    ]
    (tmp_path / "pool_bench-20260101-000000.json").write_text(json.dumps({"records": []}))
    (tmp_path / "pool_bench-20260102-000000.json").write_text(json.dumps({"records": records}))
    bs, by_id = pool_runs.load(tmp_path, None)
    assert (bs, sorted(by_id)) == (1, [1, 2])
    assert sorted(pool_runs.load(tmp_path, 4)[1]) == [3]
    with pytest.raises(SystemExit, match="not 2"):
        pool_runs.load(tmp_path, 2)
