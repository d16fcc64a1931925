"""benchmarks/pool_bench.py's summary on hand-built records: each group's speed-up comes with the bootstrap
interval of its requests and runs, which tells a group below 0.97 from one inside the machine's noise."""

from __future__ import annotations

import pytest

from benchmarks import pool_bench

ENV = {
    "dtype": "float32",
    "max_new_tokens": 32,
    "draft_length": 8,
    "cache": "rectangular",
    "machine": "test",
    "processes": 1,
    "torch": "-",
    "transformers": "-",
    "hf_spin": "-",
    "repeats": 3,
}


def record(task: str, qid: int, plain: list[float], spin: list[float]) -> dict:
    """One batch-1 request of 32 tokens: each method's runs (seconds) and their median."""

    def entry(runs):
        return {"seconds": sorted(runs)[len(runs) // 2], "runs": runs, "identical": True}

    return {
        "question_id": qid,
        "task": task,
        "batch_size": 1,
        "new_tokens": 32,
        "methods": {"plain": entry(plain), "policy:lbss": entry(spin)},
    }


def test_without_noise_the_interval_is_the_speedup():
    records = [record("qa", q, [10.0] * 3, [8.0] * 3) for q in range(3)]
    row = pool_bench.summarize(records)[1]["qa"]["policy:lbss"]
    assert row["speedup"] == pytest.approx(1.25)
    assert row["interval"] == pytest.approx((1.25, 1.25))


def test_a_slower_group_lies_below_and_a_noisy_one_reaches_across():
    slower = [record("math", q, [10.0, 10.2, 9.9], [11.0, 11.2, 10.9]) for q in range(3)]  # 0.91x, little noise
    noisy = [record("rag", 10 + q, [10.0, 9.0, 11.0], [10.3, 9.2, 11.4]) for q in range(3)]  # 0.97x, +-10%
    summary = pool_bench.summarize(slower + noisy)[1]
    low, high = summary["math"]["policy:lbss"]["interval"]
    assert low <= summary["math"]["policy:lbss"]["speedup"] <= high < 0.97
    low, high = summary["rag"]["policy:lbss"]["interval"]
    assert low < 0.93 and high > 1.0  # one run's 0.97 cannot be told from 0.93 or 1.0 here
    plain_low, plain_high = summary["rag"]["plain"]["interval"]  # plain against itself: the noise band
    assert plain_low < 1.0 < plain_high
    table = pool_bench.markdown(pool_bench.summarize(slower + noisy), ENV)
    assert "90% interval" in table and f"{low:.2f}-{high:.2f}" in table
