"""The engine carries out every part of a Plan, still lossless: several drafters voting on a row,
the confidence stop, idle drafters catching up, and the row start/end notices a policy relies on."""

from __future__ import annotations

import pytest
import torch

import hf_spin
from hf_spin.policies import BatchView, Plan, Policy, StepFeedback

from .archs import ragged_batch, tiny_model

MAX_NEW_TOKENS = 20


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", seed=0)


@pytest.fixture(scope="module")
def other():
    return tiny_model("llama", seed=1)


class Scripted(Policy):
    """Returns the same plan every step and records what the engine told it."""

    def __init__(self, drafters, k=4, weights=None, catch_up=None, min_confidence=0.0):
        super().__init__()
        self.choice, self.k, self.weights, self.catch_up, self.min_confidence = (
            drafters,
            k,
            weights,
            catch_up or {},
            min_confidence,
        )
        self.started: list[int] = []
        self.ended: list[int] = []
        self.feedback: list[StepFeedback] = []

    def start_rows(self, view: BatchView, rows: list[int]) -> None:
        self.started += [view.row_ids[b] for b in rows]

    def end_rows(self, row_ids: list[int]) -> None:
        self.ended += row_ids

    def select(self, view: BatchView) -> list[tuple[int, ...]]:
        return [self.choice] * view.batch_size

    def plan(self, view: BatchView) -> Plan:
        B = view.batch_size
        catch_up = {d: list(range(B)) for d in self.catch_up}
        return Plan(self.select(view), [self.k] * B, self.min_confidence, self.weights, catch_up)

    def update(self, feedback: StepFeedback) -> None:
        self.feedback.append(feedback)


def run(target, pool, batch=4):
    ids, mask = ragged_batch(batch, 12, seed=5)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
    out = target.generate(custom_generate=hf_spin.generate, assistant_pool=pool, **kwargs)
    return out, target.generate(**kwargs)


@pytest.mark.parametrize("weights, accurate_wins", [([1.0, 0.1], True), ([0.1, 1.0], False)])
def test_vote_follows_the_heavier_drafter_and_stays_lossless(target, other, weights, accurate_wins):
    # drafter 0 is the target itself (always right in fp32), drafter 1 another seed (mostly wrong)
    policy = Scripted((0, 1), weights=weights)
    pool = hf_spin.AssistantPool(
        [hf_spin.ModelDrafter(target, name="self"), other], policy=policy, tree=False
    )  # the vote's heaviest path
    out, ref = run(target, pool)
    assert torch.equal(out, ref)
    stats = pool.last_stats
    assert (
        stats.drafters["self"].target_forwards == stats.drafters[pool.names[1]].target_forwards > 0
    )  # both voted every step
    # every verified path came from the vote; the self drafter is credited with its own matches
    assert all(set(p) == {0, 1} for f in policy.feedback for p, k in zip(f.proposed, f.plan.k) if k > 0)
    if accurate_wins:
        assert stats.acceptance_rate > 0.9
    else:
        assert stats.acceptance_rate < 0.5


def test_confidence_stop_shortens_drafts(target, other):
    drafted = {}
    for threshold in (0.0, 0.999):
        policy = Scripted((0,), k=6, min_confidence=threshold)
        pool = hf_spin.AssistantPool(
            [other], policy=policy, tree=False
        )  # a chain's stop (a tree keeps a depth's children)
        out, ref = run(target, pool)
        assert torch.equal(out, ref)
        drafted[threshold] = [d for f in policy.feedback for d in f.drafted]
    assert all(d == 6 or d == 0 for d in drafted[0.0][: len(drafted[0.0]) // 2])  # k unless max_length cut it
    # a random tiny model is never 99.9% sure: every draft stops after its first token
    assert max(drafted[0.999]) == 1


class Spy(hf_spin.ModelDrafter):
    """Checks that after a catch-up its cache covers each caught-up row's committed tokens."""

    caught_up = 0

    def catch_up(self, rows, sequences):
        super().catch_up(rows, sequences)
        for row in rows:
            assert self.cached[row] == sequences[row]
            assert int(self.cache.lengths[row]) == len(sequences[row])  # the last token too (fed for its logits)
        Spy.caught_up += len(rows)


def test_catch_up_keeps_an_idle_drafter_current(target, other):
    spy = Spy(target, name="spy")
    pool = hf_spin.AssistantPool([other, spy], policy=Scripted((0,), catch_up=[1]))
    out, ref = run(target, pool)
    assert torch.equal(out, ref)
    assert Spy.caught_up > 0 and pool.last_stats.drafters["spy"].draft_seconds > 0


def test_policy_hears_rows_start_and_end(target, other):
    policy = Scripted((0,))
    pool = hf_spin.AssistantPool([other], policy=policy)
    run(target, pool, batch=3)
    assert policy.started == [0, 1, 2]
    assert sorted(policy.ended) == [0, 1, 2]
    first = policy.feedback[0]
    assert first.batch_size == 3 and first.measured_row_seconds(0) > 0
