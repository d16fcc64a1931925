"""benchmarks/policy_replay.py on a hand-made recording: the replayed engine commits the recorded
greedy tokens, proposes each drafter's recorded draft at the position it reached, charges the
fitted costs, and the fits recover known costs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
policy_replay = pytest.importorskip("policy_replay")

from hf_spin.policies import make_policy  # noqa: E402

from .sim import SimDrafter, SimVerify  # noqa: E402

P, N = 5, 9  # prompt tokens, generated tokens recorded (the prefill's first one included)


def recording(k: int = 3) -> dict:
    """One request: the target's greedy tokens 100, 101, ...; "exact" drafts the next k of them at
    every position, "wrong" one token that never matches, "half" the right first token then a wrong one."""
    out = [100 + i for i in range(N + k)]
    drafts = {
        "exact": [[]] + [out[g : g + k] for g in range(1, N)],
        "wrong": [[]] + [[7] for _ in range(1, N)],
        "half": [[]] + [[out[g], 7] for g in range(1, N)],
    }
    request = {
        "question_id": 1, "task": "t", "held_out": False, "prompt_length": P, "plain_seconds": 2.0, "prefill_seconds": 0.5,
        "verify": [], "out": out, "positions": N, "drafts": drafts, "draft_seconds": {},
    }
    return {"env": {"draft_length": k}, "drafters": [], "requests": [request]}


@pytest.mark.parametrize("name, steps, accepted", [("exact", 2, 6), ("wrong", 8, 0), ("half", 4, 4)])
def test_replay_commits_the_recorded_tokens_with_each_drafter(name, steps, accepted):
    """8 tokens after the prefill's: the exact drafter commits 4 a step (3 accepted + 1), so 2
    steps; the wrong one 1 a step, 8 steps; "half" 2 a step, 4 steps. Seconds: the prefill, then per
    step a verify of 1 + drafted tokens and one forward per drafted token."""
    rec = recording()
    verify = SimVerify(0.1, 0.01)
    drafter = SimDrafter(name, {}, forward_seconds=0.02)
    (record,) = policy_replay.replay(rec, [drafter], make_policy("fixed", 3), verify, noise=0.0, seed=0)
    drafted = {"exact": 3, "wrong": 1, "half": 2}[name]
    assert record["target_forwards"] == steps + 1 and record["accepted"] == accepted, record
    assert record["drafted"] == steps * drafted and record["chosen"] == {name: steps}
    assert record["seconds"] == pytest.approx(0.5 + steps * (verify.seconds(1 + drafted) + 0.02 * drafted))


def test_plain_seconds_scale_the_recorded_rate_to_the_positions():
    request = recording()["requests"][0]  # 2.0 s for 12 tokens after a 0.5 s prefill: 1.5 / 11 a step
    assert policy_replay.plain_seconds(request) == pytest.approx(0.5 + (N - 1) * 1.5 / 11)


def test_cost_fits_recover_known_costs():
    verify = [[n, 0.2 + 0.01 * n**0.5] for n in range(1, 7)]
    request = {**recording()["requests"][0], "verify": verify}
    fitted = policy_replay.fit_verify([request])
    assert (fitted.base, fitted.per_token, fitted.power) == pytest.approx((0.2, 0.01, 0.5), abs=1e-6)
    # first call: the prompt and the first token fed (P + 1 tokens at 1 ms) and 3 forwards at 20 ms
    request["draft_seconds"] = {"exact": [0.001 * (P + 1) + 0.06] + [0.02 * 3] * (N - 2)}
    fitted = policy_replay.fit_drafter({"name": "exact", "kind": "model", "num_parameters": 1}, [request])
    assert (fitted.forward_seconds, fitted.catch_up_seconds) == pytest.approx((0.02, 0.001))
