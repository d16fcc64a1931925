"""The step-able engine: rows join and leave a running batch, each with its own parameters, still lossless.

Reference for every greedy row: plain `generate` on that prompt alone (batch 1, fp32).
"""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessorList, StoppingCriteriaList
from transformers.generation import logits_process as lp
from transformers.generation.stopping_criteria import EosTokenCriteria

import hf_spin
from hf_spin.drafters import Draft, Drafter
from hf_spin.planning.plan import Preempt
from hf_spin.stats import DrafterStats
from hf_spin.step.engine import SpinEngine
from hf_spin.step.rows import CANCELLED, ERROR, LENGTH, STOPPED, Request

from .archs import EOS, VOCAB
from .speculation import assert_speculated
from .speculation import pool as spin_pool

POISON = 77  # a token id the fault-injection tests refuse on


pytestmark = pytest.mark.usefixtures("one_thread")


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Random prompts of different lengths (5, 8, 11, ...) without the poison token."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p = torch.randint(3, VOCAB, (5 + 3 * (i % 4),), generator=g).tolist()
        out.append([t if t != POISON else 3 for t in p])
    return out


def alone(target, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Plain greedy `generate` on one prompt: the tokens it produces (stopping at EOS)."""
    out = target.generate(input_ids=torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt) :].tolist()


def request(prompt, n, **kwargs) -> Request:
    return Request(
        prompt=prompt, max_new_tokens=n, stopping_criteria=StoppingCriteriaList([EosTokenCriteria(EOS)]), **kwargs
    )


def engine_totals(engine: SpinEngine) -> DrafterStats:
    """What every drafter of the engine did, summed."""
    return DrafterStats.total(engine.drafter_stats.values())


def run(engine: SpinEngine, schedule: dict[int, list[Request]]) -> list:
    """Step the engine, adding schedule[s] before step s; returns the rows in order of addition."""
    rows, step = [], 0
    while engine.has_work or any(s >= step for s in schedule):
        for req in schedule.get(step, []):
            rows.append(engine.add(req))
        engine.step()
        step += 1
        assert step < 500
    engine.close()
    return rows


@pytest.mark.parametrize("cache", ["rectangular", "packed"])
def test_rows_joining_at_different_steps_match_plain_generate_alone(target, drafter, cache):
    pool = spin_pool([drafter, "prompt_lookup"], policy="round_robin", cache=cache)
    engine = SpinEngine(target, pool)
    ps = prompts(6)
    lengths = [20, 7, 16, 1, 12, 18]  # rows stop at different steps too
    schedule = {
        0: [request(ps[0], lengths[0]), request(ps[1], lengths[1])],
        3: [request(ps[2], lengths[2])],
        4: [request(ps[3], lengths[3]), request(ps[4], lengths[4])],
        9: [request(ps[5], lengths[5])],
    }
    rows = run(engine, schedule)
    for row, p, n in zip(rows, ps, lengths):
        assert row.generated == alone(target, p, n), f"row {row.id}"
        assert row.finish_reason in (LENGTH, STOPPED)
    assert engine.rows == [] and engine.cache is None  # every row retired, the batch started afresh
    assert_speculated(engine_totals(engine))


def test_a_row_joining_an_emptied_batch_restarts_it(target, drafter):
    engine = SpinEngine(target, spin_pool([drafter]))
    ps = prompts(2, seed=4)  # neither row stops at EOS at once
    rows = run(engine, {0: [request(ps[0], 6)], 12: [request(ps[1], 9)]})  # the first row is long gone by step 12
    assert [r.generated for r in rows] == [alone(target, ps[0], 6), alone(target, ps[1], 9)]
    assert all(r.stats.drafted > 0 for r in rows) and rows[1].stats.accepted > 0, [r.stats for r in rows]


def test_running_rows_advance_while_rows_keep_arriving(target):
    """A new row arrives before every step: admissions alternate with steps, so the first row still
    finishes within about twice its own number of steps, with its exact tokens."""
    engine = SpinEngine(target, None)
    ps = prompts(40, seed=14)
    first = engine.add(request(ps[0], 10))
    steps = 0
    for p in ps[1:]:
        engine.add(request(p, 40))
        engine.step()
        steps += 1
        if first.done:
            break
    engine.close()
    assert first.done and steps <= 2 * 10 + 1
    assert first.generated == alone(target, ps[0], 10)


def test_plain_decoding_without_a_pool(target):
    engine = SpinEngine(target, None)
    ps = prompts(3, seed=4)
    rows = run(engine, {0: [request(ps[0], 10)], 2: [request(ps[1], 10), request(ps[2], 4)]})
    assert [r.generated for r in rows] == [alone(target, p, n) for p, n in zip(ps, [10, 10, 4])]
    assert all(r.stats.mean_accepted_length == 1.0 for r in rows)


def test_per_row_parameters_and_seeds(target, drafter):
    """A greedy row, two sampled rows with processors of their own and seeds, in one batch: the greedy
    row is exact, each seeded row gives the same tokens alone and in company, and its processors hold."""
    ps = prompts(3, seed=5)

    def sampled(seed, top_k):
        procs = LogitsProcessorList([lp.TemperatureLogitsWarper(0.8), lp.TopKLogitsWarper(top_k)])
        return Request(prompt=ps[1], max_new_tokens=15, do_sample=True, processors=procs, seed=seed, logprobs=True)

    def pool():
        return spin_pool([drafter], policy="fixed")

    engine = SpinEngine(target, pool())
    company = run(engine, {0: [request(ps[0], 15), sampled(7, 3)], 2: [sampled(8, 2)]})
    assert_speculated(engine_totals(engine))
    solo_a = run(SpinEngine(target, pool()), {0: [sampled(7, 3)]})[0]
    solo_b = run(SpinEngine(target, pool()), {0: [sampled(8, 2)]})[0]
    assert company[0].generated == alone(target, ps[0], 15)
    assert company[1].generated == solo_a.generated and company[2].generated == solo_b.generated
    assert company[1].generated != company[2].generated
    # top-k 2: every token was one of the 2 likeliest, so its probability after the warpers is >= 1/2 or it is the
    # top one
    assert len(company[2].logprobs) == len(company[2].generated) and all(lp_ <= 0 for lp_ in company[2].logprobs)
    assert min(company[2].logprobs) > -torch.log(torch.tensor(1e6)).item()  # nothing outside the top-k was drawn


def test_seeded_sampling_keeps_the_target_distribution(target, drafter):
    """Gumbel-max with noise fixed by (seed, position): over many seeds the first three tokens follow the
    target's (processed) distribution, the 2nd and 3rd verified at draft positions 0 and 1 of
    multi-token drafts. 3000 seeded rows of one prompt, checked by total variation against the exact
    probabilities (each token given the likeliest tokens before it)."""
    prompt = prompts(1, seed=9)[0]
    procs = LogitsProcessorList([lp.TemperatureLogitsWarper(1.5), lp.TopKLogitsWarper(4)])
    engine = SpinEngine(target, spin_pool([drafter]))
    n = 3000
    rows = run(
        engine,
        {0: [Request(prompt=prompt, max_new_tokens=4, do_sample=True, processors=procs, seed=s) for s in range(n)]},
    )
    assert_speculated(engine_totals(engine))
    # fewer rows share a longer prefix (3000, ~900, ~170): looser bounds, ~3x the expected TV of each count
    prefix, bound = [], {0: 0.04, 1: 0.08, 2: 0.15}
    for j in range(3):
        with torch.no_grad():
            logits = target(torch.tensor([prompt + prefix])).logits[0, -1]
        p = torch.softmax(procs(torch.tensor([prompt + prefix]), logits[None])[0], -1)
        tokens = torch.tensor([r.generated[j] for r in rows if r.generated[:j] == prefix])
        freq = torch.bincount(tokens, minlength=VOCAB).float() / len(tokens)
        tv = 0.5 * (freq - p).abs().sum()
        assert len(tokens) > 100 and tv < bound[j], (j, len(tokens), tv)
        prefix = prefix + [int(p.argmax())]


def test_cancelled_rows_leave_and_the_others_are_unchanged(target, drafter):
    engine = SpinEngine(target, spin_pool([drafter]))
    ps = prompts(3, seed=6)
    rows = [engine.add(request(p, 20)) for p in ps]
    engine.step()
    engine.step()
    engine.cancel(rows[1])
    engine.step()  # rows[1] retired here
    assert rows[1].finish_reason == CANCELLED and rows[1] not in engine.rows
    while engine.has_work:
        engine.step()
    engine.close()
    assert rows[0].generated == alone(target, ps[0], 20) and rows[2].generated == alone(target, ps[2], 20)
    assert_speculated(engine_totals(engine))


class PoisonDrafter(Drafter):
    """Raises whenever it is asked to draft for a row holding the poison token; else proposes nothing."""

    name = "poison"

    def draft(self, request):
        if any(POISON in request.sequences[b] for b in request.rows):
            raise RuntimeError("poisoned row (simulated drafter fault)")
        return Draft(tokens=[[] for _ in request.rows], q=[None] * len(request.rows))


def test_isolated_drafter_fault_bans_the_drafter_from_that_row_only(target, drafter):
    pool = spin_pool([PoisonDrafter(), drafter], policy="round_robin")
    engine = SpinEngine(target, pool, isolate_faults=True)
    ps = prompts(3, seed=7)
    ps[1] = ps[1] + [POISON]
    rows = run(engine, {0: [request(p, 14) for p in ps]})
    assert [r.generated for r in rows] == [alone(target, p, 14) for p in ps]  # still lossless
    assert rows[1].banned == {0} and not rows[0].banned and not rows[2].banned
    assert engine.usable == [True, True] and engine.drafter_stats["poison"].failures >= 1
    assert_speculated(engine.drafter_stats[pool.names[1]])  # the healthy drafter served rows 1 too
    assert rows[1].stats.accepted > 0


class Wrapped(torch.nn.Module):
    """Wraps a model: everything but what a subclass overrides (its forward) goes to the inner model."""

    def __init__(self, model):
        super().__init__()
        self.inner = model

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.inner, name)


class PoisonTarget(Wrapped):
    """Its forward raises when the poison token is among the tokens fed."""

    def forward(self, input_ids=None, position_ids=None, **kwargs):
        if (input_ids == POISON).any():
            raise RuntimeError("poisoned input (simulated target fault)")
        return self.inner(input_ids=input_ids, position_ids=position_ids, **kwargs)


class PoisonProposer(Drafter):
    """Proposes the poison token for rows whose prompt starts with MARK, nothing for the others."""

    name = "poison_proposer"
    MARK = 90

    def draft(self, request):
        tokens = [[POISON] if request.sequences[b][0] == self.MARK else [] for b in request.rows]
        return Draft(tokens=tokens, q=[None] * len(request.rows))


@pytest.mark.parametrize("cache", ["rectangular", "packed"])
def test_isolated_target_fault_fails_only_its_row(target, cache):
    """One row's prompt poisons the target's prefill, another's draft poisons a verification forward:
    those two rows fail with the error, the others finish exactly."""
    engine = SpinEngine(PoisonTarget(target), spin_pool([PoisonProposer()], cache=cache), isolate_faults=True)
    ps = prompts(4, seed=8)
    ps[1] = ps[1] + [POISON]  # fails at prefill (joining with another row)
    ps[3] = [PoisonProposer.MARK] + ps[3]  # fails at its first verification
    rows = run(engine, {0: [request(ps[0], 12)], 1: [request(ps[1], 12), request(ps[2], 12)], 2: [request(ps[3], 12)]})
    for failed in (rows[1], rows[3]):
        assert failed.finish_reason == ERROR and "poisoned input" in failed.error
    assert rows[3].generated == [alone(target, ps[3], 1)[0]]  # its prefill worked: one token
    assert rows[0].generated == alone(target, ps[0], 12) and rows[2].generated == alone(target, ps[2], 12)


def test_prompt_lookup_reports_the_length_of_the_match_it_continues():
    """The longest trailing n-gram found earlier (3, 2, then 1 tokens) gives the draft and its match length."""
    lookup = hf_spin.drafters.PromptLookupDrafter()
    assert lookup.find([5, 6, 7, 8, 5, 6, 7], 3) == ([8, 5, 6], 3)
    assert lookup.find([1, 2, 3, 4, 1, 2], 3) == ([3, 4, 1], 2)
    assert lookup.find([1, 2, 3, 4, 9, 2], 2) == ([3, 4], 1)
    assert lookup.find([1, 2, 3], 3) == ([], 0)
    request = hf_spin.drafters.DraftRequest([0, 1], [[5, 6, 7, 8, 5, 6, 7], [1, 2, 3]], [2, 2], False, None)
    draft = lookup.draft(request)
    assert (draft.tokens, draft.match_lengths) == ([[8, 5], []], [3, 0])


def test_prompt_lookup_finds_what_a_scan_of_every_ngram_finds():
    """The lookup searches the tokens' 4-byte words: a hit off a word boundary (ids whose bytes run across two
    tokens: 0x0100 beside 0x01, ids past 2^16 and 2^24, negative ones) must not count, and every branch, its order
    and its match length must be a plain scan's: every earlier n-gram with a successor, longest n first, latest
    first."""
    import random

    def scan(seq, k, branches, max_ngram, min_ngram):
        found = []
        for n in range(min(max_ngram, len(seq) - 1), min_ngram - 1, -1):
            for hit in range(len(seq) - 1 - n, -1, -1):
                if seq[hit : hit + n] == seq[-n:] and seq[hit + n : hit + n + k] not in [c for c, _ in found]:
                    found.append((seq[hit + n : hit + n + k], n))
                    if len(found) == branches:
                        return found, found[0][1]
        return found, found[0][1] if found else 0

    rng = random.Random(0)
    alphabets = [[1, 256, 65536, 16777216], [0, 1, 2], [1, 257, 65793, 2**30 + 1], [2**31 - 2, 2**31 - 1, -1, -256]]
    for _ in range(3000):
        seq = [rng.choice(rng.choice(alphabets)) for _ in range(rng.randint(0, 40))]
        max_ngram = rng.randint(1, 4)
        lookup = hf_spin.drafters.PromptLookupDrafter(max_ngram, rng.randint(1, max_ngram), 4)
        k, branches = rng.randint(1, 6), rng.randint(1, 4)
        assert lookup.find_all(seq, k, branches) == scan(seq, k, branches, max_ngram, lookup.min_ngram), seq


class ShadowingPolicy(hf_spin.policies.Policy):
    """Serves every row with drafter 0 and asks prompt lookup (drafter 1) for a shadow draft; records
    each row's sequence at plan time to recompute what the shadow should have been."""

    def __init__(self, engine_rows):
        super().__init__(hf_spin.policies.FixedLength(3))
        self.engine_rows, self.before, self.checked, self.hits = engine_rows, [], 0, 0

    def select(self, view):
        return [(0,)] * view.batch_size

    def plan(self, view):
        self.before = [(r, list(r.sequence)) for r in self.engine_rows()]
        plan = super().plan(view)
        return hf_spin.policies.Plan(plan.drafters, plan.k, shadow={1: {b: 4 for b in range(view.batch_size)}})

    def update(self, feedback):
        lookup = hf_spin.drafters.PromptLookupDrafter()
        for b, (row, seq) in enumerate(self.before):
            expected = lookup.lookup(seq, min(4, row.request.max_length - len(row.request.padding) - len(seq) - 1))
            committed = row.sequence[len(seq) : len(seq) + feedback.accepted[b] + 1]
            got_p, got_m = feedback.shadow_proposed[b].get(1, 0), feedback.shadow_matched[b].get(1, 0)
            n = next(
                (i for i, (x, y) in enumerate(zip(expected, committed)) if x != y), min(len(expected), len(committed))
            )
            assert (got_p, got_m) == (len(expected), n)
            self.checked += bool(expected)
            self.hits += n


def test_shadow_drafts_are_compared_with_the_committed_tokens_and_never_verified(target, drafter):
    """Plan.shadow: prompt lookup drafts every row unverified; the feedback's counts are what its
    draft shares with the committed tokens, and the output is plain generate's."""
    pool = spin_pool(
        [drafter, "prompt_lookup"], tree=False
    )  # chains: a tree would end the run in too few steps to count
    engine = SpinEngine(target, pool)
    policy = engine.policy = ShadowingPolicy(lambda: engine.rows)
    ps = [p * 3 for p in prompts(3, seed=2)]  # repeated prompts: prompt lookup finds matches
    rows = run(engine, {0: [request(p, 12) for p in ps]})
    assert [r.generated for r in rows] == [alone(target, p, 12) for p in ps]
    assert policy.checked >= 3 and policy.hits >= 1, (policy.checked, policy.hits)
    assert all(set(r.stats.drafters) <= {pool.names[0]} for r in rows)  # a shadow never serves


class PreemptingPolicy(ShadowingPolicy):
    """Serves every row with drafter 0 and lets prompt lookup (drafter 1) preempt it where its
    draft has at least `least` tokens and continues a match of at least `min_match`; checks each
    step against the lookup recomputed by hand, and the match length reported for it."""

    def __init__(self, engine_rows, least, min_match):
        super().__init__(engine_rows)
        self.least, self.min_match, self.preempted, self.kept, self.kept_with_draft = least, min_match, 0, 0, 0

    def plan(self, view):
        plan = super().plan(view)
        return hf_spin.policies.Plan(
            plan.drafters,
            plan.k,
            preempt={1: {b: Preempt(4, self.least, self.min_match) for b in range(view.batch_size)}},
        )

    def update(self, feedback):
        lookup = hf_spin.drafters.PromptLookupDrafter()
        for b, (row, seq) in enumerate(self.before):
            room = min(4, row.request.max_length - len(row.request.padding) - len(seq) - 1)
            expected, match = lookup.find(seq, room)
            if room > 0:
                assert feedback.match_lengths[b].get(1) == match
            if (
                len(expected) >= self.least and match >= self.min_match
            ):  # served by lookup, its draft verified; drafter 0 skipped the row
                assert (
                    feedback.plan.drafters[b] == (1,)
                    and feedback.proposed[b] == {1: len(expected)}
                    and feedback.drafted[b] == len(expected)
                )
                assert 1 not in feedback.shadow_proposed[b]
                self.preempted += 1
            else:  # too short, or a too short match: drafter 0 serves, the lookup draft counts as a shadow draft
                assert feedback.plan.drafters[b] == (0,) and 1 not in feedback.proposed[b]
                assert feedback.shadow_proposed[b].get(1, 0) == len(expected)  # none on a row with no room left
                assert 1 not in feedback.shadow_proposed[b] or feedback.plan.shadow[1][b] == 4
                self.kept += 1
                self.kept_with_draft += bool(expected)


@pytest.mark.parametrize("least, min_match", [(1, 0), (3, 0), (1, 3)])
def test_a_preempting_drafter_serves_the_rows_its_draft_is_long_enough_for(target, drafter, least, min_match):
    """Plan.preempt: prompt lookup drafts first; rows it proposes `least` tokens or more for, from a
    match of `min_match` tokens or more, verify its draft and the planned drafter skips them, the
    others keep their drafter and the lookup draft is their shadow draft; the output is plain
    generate's. With min_match 3 some rows keep their drafter although lookup had a draft for them.
    Chains (tree=False): the counts below are of lookup's chain, not of a tree of its continuations."""
    pool = spin_pool([drafter, "prompt_lookup"], tree=False)
    engine = SpinEngine(target, pool)
    policy = engine.policy = PreemptingPolicy(lambda: engine.rows, least, min_match)
    ps = [p * 3 for p in prompts(3, seed=2)]  # repeated prompts: prompt lookup finds matches
    rows = run(engine, {0: [request(p, 24) for p in ps]})
    assert [r.generated for r in rows] == [alone(target, p, 24) for p in ps]
    assert policy.preempted >= 1 and policy.kept >= 1, (policy.preempted, policy.kept)
    if min_match > 1:
        assert policy.kept_with_draft >= 1
