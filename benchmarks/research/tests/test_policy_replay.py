"""benchmarks/research/policy_replay.py on a hand-made recording: the replayed engine commits the recorded
greedy tokens, proposes each drafter's recorded draft at the position it reached, charges the
fitted costs, and the fits recover known costs."""

from __future__ import annotations

import pytest

from benchmarks.research import policy_replay
from hf_spin.policies import make_policy
from tests.sim import SimDrafter, SimVerify

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
        "question_id": 1,
        "task": "t",
        "held_out": False,
        "prompt_length": P,
        "plain_seconds": 2.0,
        "prefill_seconds": 0.5,
        "verify": [],
        "out": out,
        "positions": N,
        "drafts": drafts,
        "draft_seconds": {},
    }
    return {"env": {"draft_length": k}, "drafters": [], "requests": [request]}


def call(requests: list[dict], drafter: SimDrafter, verify: SimVerify):
    return policy_replay.Run(requests, [N] * len(requests), True, verify, {drafter.name: drafter}, 0.5, 2.0)


@pytest.mark.parametrize("name, steps, accepted", [("exact", 2, 6), ("wrong", 8, 0), ("half", 4, 4)])
def test_replay_commits_the_recorded_tokens_with_each_drafter(name, steps, accepted):
    """8 tokens after the prefill's: the exact drafter commits 4 a step (3 accepted + 1), so 2
    steps; the wrong one 1 a step, 8 steps; "half" 2 a step, 4 steps. Seconds: the prefill, then per
    step a verify of 1 + drafted tokens and one forward per drafted token."""
    verify = SimVerify(0.1, 0.01)
    drafter = SimDrafter(name, {}, forward_seconds=0.02)
    (record,) = policy_replay.replay(
        [call(recording()["requests"], drafter, verify)], [name], make_policy("fixed", 3), noise=0.0, seed=0
    )
    drafted = {"exact": 3, "wrong": 1, "half": 2}[name]
    assert record["target_forwards"] == steps + 1 and record["accepted"] == accepted, record
    assert record["drafted"] == steps * drafted and record["chosen"] == {name: steps}
    assert (
        record["seconds"]
        == record["row_seconds"]
        == pytest.approx(0.5 + steps * (verify.seconds(1 + drafted) + 0.02 * drafted))
    )


def test_a_replayed_batch_pads_verification_and_rows_leave_when_done():
    """Two rows, the exact drafter's drafts recorded on row 0's tokens: row 0 commits 4 a step and
    is done after 2 steps, row 1 (other tokens) commits 1 a step for 8. While both run a step
    verifies 2 x (1 + 3) padded tokens and drafts 3 forwards for 2 rows; then 1 x 4 and 1 row."""
    first = recording()["requests"][0]
    second = {**first, "question_id": 2, "out": [200 + t for t in first["out"]]}
    verify = SimVerify(0.1, 0.01)
    drafter = SimDrafter("exact", {}, forward_seconds=0.02, token_seconds=0.005)
    done, slow = policy_replay.replay(
        [call([first, second], drafter, verify)], ["exact"], make_policy("fixed", 3), noise=0.0, seed=0
    )
    both = verify.seconds(2 * 4) + 3 * (0.02 + 2 * 0.005)
    alone = verify.seconds(4) + 3 * (0.02 + 0.005)
    assert (done["target_forwards"], slow["target_forwards"]) == (3, 9)
    assert (done["accepted"], slow["accepted"]) == (6, 0)
    assert done["row_seconds"] == pytest.approx(0.5 + 2 * both)
    assert done["seconds"] == slow["seconds"] == slow["row_seconds"] == pytest.approx(0.5 + 2 * both + 6 * alone)


def test_batch_costs_split_a_forward_into_a_fixed_and_a_per_row_part():
    one_row = SimDrafter("d", {}, forward_seconds=0.02, catch_up_seconds=0.001)
    fitted = policy_replay.batch_drafter(one_row, 0.05, rows=4)  # 20 ms on one row, 50 ms on four
    assert (fitted.forward_seconds, fitted.token_seconds, fitted.catch_up_seconds) == pytest.approx((0.01, 0.01, 0.001))
    assert fitted.seconds([3, 3, 3, 3], 0) == pytest.approx(3 * 0.05)


def test_plain_seconds_scale_the_recorded_rate_to_the_positions():
    request = recording()["requests"][0]  # 2.0 s for 12 tokens after a 0.5 s prefill: 1.5 / 11 a step
    assert policy_replay.plain_seconds(request) == pytest.approx(0.5 + (N - 1) * 1.5 / 11)


def test_steps_without_a_draft_model_verify_at_plain_generates_rate():
    """The fit's paired forwards took 0.11 s for one token; plain `generate` 0.1375 s a step
    (1.5 s over 11 steps): sustained 1.25. A drafter without parameters (prompt lookup) drafts
    between back-to-back target forwards, so its steps verify at 1.25x the fit; a draft model's
    steps at the fit. Plain decoding recorded faster than the fit leaves the fit alone."""
    request = recording()["requests"][0]
    verify = policy_replay.sustain(SimVerify(0.1, 0.01), [(policy_replay.plain_step(request), 1)])
    assert verify.sustained == pytest.approx(1.5 / 11 / 0.11)
    lookup = SimDrafter("exact", {}, kind="prompt_lookup", num_parameters=0)
    model = SimDrafter("exact", {}, forward_seconds=0.02)
    (free,) = policy_replay.replay(
        [call([request], lookup, verify)], ["exact"], make_policy("fixed", 3), noise=0.0, seed=0
    )
    (paid,) = policy_replay.replay(
        [call([request], model, verify)], ["exact"], make_policy("fixed", 3), noise=0.0, seed=0
    )
    assert free["seconds"] == pytest.approx(0.5 + 2 * verify.seconds(4) * verify.sustained)
    assert paid["seconds"] == pytest.approx(0.5 + 2 * (verify.seconds(4) + 3 * 0.02))
    assert policy_replay.sustain(SimVerify(0.2, 0.01), [(0.1, 1)]).sustained == 1.0


def test_cost_fits_recover_known_costs():
    fitted = policy_replay.fit_verify([(n, 0.2 + 0.01 * n**0.5) for n in range(1, 7)])
    assert (fitted.base, fitted.per_token, fitted.power) == pytest.approx((0.2, 0.01, 0.5), abs=1e-6)
    # first call: the prompt and the first token fed (P + 1 tokens at 1 ms) and 3 forwards at 20 ms
    request = recording()["requests"][0]
    request["draft_seconds"] = {"exact": [0.001 * (P + 1) + 0.06] + [0.02 * 3] * (N - 2)}
    fitted = policy_replay.fit_drafter({"name": "exact", "kind": "model", "num_parameters": 1}, [request])
    assert (fitted.forward_seconds, fitted.catch_up_seconds) == pytest.approx((0.02, 0.001))


def test_runs_follow_the_bench_warm_up_then_held_out_then_measured():
    base = recording()["requests"][0]
    rec = {"requests": [{**base, "question_id": i, "held_out": i == 3} for i in (1, 2, 3)]}
    verify, d = SimVerify(0.1, 0.01), SimDrafter("exact", {}, forward_seconds=0.02)
    alone = policy_replay.runs(rec, verify, [d], 1, [])
    assert [([r["question_id"] for r in c.requests], c.positions, c.kept) for c in alone] == [
        ([1], [policy_replay.WARM_UP_TOKENS], False),
        ([3], [N], False),
        ([1], [N], True),
        ([2], [N], True),
    ]
    # batch 2: the recorded batches' own costs, verification fitted on B x n padded tokens
    batches = [
        {"question_ids": [3], "held_out": True},
        {
            "question_ids": [1, 2],
            "held_out": False,
            "plain_seconds": 3.0,
            "prefill_seconds": 0.7,
            "verify": [[n, 0.2 + 0.01 * 2 * n] for n in range(1, 5)],
            "draft_forward_seconds": {"exact": 0.03},
        },
    ]
    calls = policy_replay.runs(rec, verify, [d], 2, batches)
    assert [([r["question_id"] for r in c.requests], c.kept) for c in calls] == [
        ([1], False),
        ([3], False),
        ([1, 2], True),
    ]
    batch = calls[-1]
    assert (batch.plain_seconds, batch.prefill_seconds) == (3.0, 0.7)
    assert batch.verify.seconds(8) == pytest.approx(0.2 + 0.01 * 8)
    # plain generate's steps: (3.0 - 0.7) s over N - 1 steps of B = 2 rows, against the fit's 0.22 s
    assert batch.verify.sustained == pytest.approx(2.3 / (N - 1) / 0.22)
    assert (batch.drafters["exact"].forward_seconds, batch.drafters["exact"].token_seconds) == pytest.approx(
        (0.01, 0.01)
    )
