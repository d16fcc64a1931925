"""Exploration within a budget (hf_spin/planning/exploration.py), on injected cost structures.

The default path (a cost profile, the planner) on five machines it may meet, as t(N) of the target's
forward over N positions (a plain step = 0.1 s): flat (a GPU, an AMX CPU), AVX-512 bf16 (8 tokens
~1.3 steps), AVX2 float32 (~1.8 steps), AVX2 bf16 (~6 steps), float32 with a slow 2-3 token GEMM. Where no drafter
pays, a run costs within 3% of plain decoding's (the clock totals of both runs, prefill included); probes are one
token long where verification is not flat, and what they lose stays inside the budget.
"""

from __future__ import annotations

import pytest
import torch

import hf_spin
from benchmarks.injected_costs import STRUCTURES, CostClock, profile_of, table
from hf_spin.drafters import Draft
from hf_spin.planning.acceptance import EVIDENCE_ONLY, PRIOR_ACCEPTANCE, PRIOR_WEIGHT
from hf_spin.planning.exploration import SHARE
from hf_spin.planning.planner import OPTIMISM, Planner
from hf_spin.step.continuations import follow, start

from .archs import EOS, VOCAB, tiny_model
from .test_planning import Scripted, case, run

DRAFT_TOKEN = 0.3  # a draft model's forward, in plain steps (a 0.5B drafter for a 1.5B target)
# A draft model whose forwards cost next to nothing: probes bought before drafting (a model-free drafter's draft is
# made whatever it is worth, and judged after: `trim`)
NEARLY_FREE = table(lambda n: 1e-6 * n)


def plain_clock(target, prompts, clock, new_tokens) -> float:
    start = clock.now
    target.generate(prompts, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, eos_token_id=EOS)
    return clock.now - start


@pytest.mark.parametrize("structure", list(STRUCTURES))
@pytest.mark.parametrize("kind", ["model-free", "model"])
@pytest.mark.parametrize("batch", [1, 4])
def test_where_nothing_pays_the_default_path_costs_what_plain_does(structure, kind, batch):
    """Drafts that are never right (a scripted drafter at 0%, or an unrelated draft model at ~0%): the
    default path's run costs at most 3% more than plain `generate`'s on every cost structure, and the
    probes' net loss stays inside the budget (SHARE of the call's plain time)."""
    new_tokens = 100
    target, prompts, plain, refs = case(batch=batch, new_tokens=new_tokens)
    cost = table(STRUCTURES[structure])
    clock = CostClock()
    clock.hook(target, cost)
    if kind == "model":
        drafter = tiny_model("llama", seed=1)  # unrelated weights: its guesses are almost never the target's
        clock.hook(drafter, table(lambda n: DRAFT_TOKEN * STRUCTURES[structure](n)))
        profile = profile_of(cost, [table(lambda n: DRAFT_TOKEN * STRUCTURES[structure](n))], ["drafter"])
    else:
        drafter = Scripted(refs, [0.0] * batch)
        profile = profile_of(cost, [None], ["scripted"])
    pool = hf_spin.AssistantPool([drafter], profile=profile)
    out = run(target, prompts, pool, clock, new_tokens=new_tokens)
    assert torch.equal(out, plain)
    spin = clock.now
    plain_seconds = plain_clock(target, prompts, clock, new_tokens)
    assert spin <= 1.03 * plain_seconds, f"{structure}: {spin:.2f}s against plain {plain_seconds:.2f}s"
    budget = pool.planner.budget
    assert budget.spent <= SHARE * (budget.plain_seconds + budget.expected) + 1e-9


@pytest.mark.parametrize("structure", list(STRUCTURES))
def test_a_probe_is_one_token_beyond_what_pays_unless_verification_is_flat(structure):
    """A fresh request and a drafter the pool has seen right 6 (8) times in 10: one sd up it might pay for
    k tokens on the request, the evidence alone (no prior) for fewer. With budget left the planner
    drafts one token beyond the latter where verification is not flat (as many as its verification width holds
    where a wider forward costs less: docs/planning.md, "Verification width"), all of the former where it is
    flat; with none left, only the latter."""
    cost = table(STRUCTURES[structure])
    planner = Planner(profile_of(cost, [NEARLY_FREE], ["drafter"]))
    planner.acceptance.pooled[0] = [8.0, 2.0] if structure == "avx2_bf16" else [6.0, 4.0]  # a probe's room to grow

    def best(optimism: float, prior: tuple[float, float] = (PRIOR_ACCEPTANCE, PRIOR_WEIGHT)) -> int:
        curve = planner.acceptance.survival(0, 0, 8, optimism=optimism, prior=prior)
        return planner._best([curve], [(0,)], True, [{}])[0]

    exploit, optimistic = best(0.0, EVIDENCE_ONLY), best(OPTIMISM)
    planner.budget.plain_seconds = 100 * cost.predict(1)  # a hundred plain steps so far: probes are affordable
    ks = planner.size([0], [{}], [64], [(0,)], [8], padded=True)
    free = cost.width(exploit + 2) - 1  # drafts a one-token probe's verification holds at no extra cost (widths)
    assert ks == ([optimistic] if structure == "flat" else [min(optimistic, free)]), (exploit, optimistic, ks)
    assert exploit + 1 < optimistic or structure == "flat"  # the case tells a k-token probe from a 1-token one
    planner.end_rows([0], [None])  # the request leaves; the next finds the call's budget spent
    planner.budget.spent = SHARE * (planner.budget.plain_seconds + 64 * cost.predict(1))  # its 64 tokens' share too
    assert planner.size([1], [{}], [64], [(0,)], [8], padded=True) == [exploit]


def test_a_drafter_that_cannot_pay_is_not_caught_up_either(monkeypatch):
    """LBSS asks idle drafters to catch up on rows they may serve next (`Plan.catch_up`); a draft model
    that costs 10 target steps a token can never pay, so the planner sizes it 0 and the engine skips
    its catch-ups too: it spends no time at all."""
    target, prompts, plain, _ = case(batch=2, new_tokens=30)
    drafter = tiny_model("llama", seed=1)
    clock = CostClock()
    clock.hook(target, table(STRUCTURES["flat"]))
    clock.hook(drafter, table(lambda n: 1.0 * n))
    profile = profile_of(table(STRUCTURES["flat"]), [table(lambda n: 1.0 * n), None], ["drafter", "prompt_lookup"])
    pool = hf_spin.AssistantPool([drafter, "prompt_lookup"], policy="lbss", profile=profile)
    calls = []
    monkeypatch.setattr(pool.drafters[0], "catch_up", lambda *a, **kw: calls.append(a))
    out = run(target, prompts, pool, clock, new_tokens=30)
    assert torch.equal(out, plain)
    assert pool.planner.paying == [False, True] and calls == []
    assert pool.last_stats.drafters[pool.names[0]].draft_seconds == 0.0


@pytest.mark.parametrize("structure", ["avx2_fp32", "avx2_bf16"])
def test_idle_catch_ups_run_only_where_the_evidence_pays_them(structure):
    """LBSS asks idle drafters to catch up on rows they may serve next. A cheap draft model (a twentieth of a
    target step a token: it could pay at high acceptance) that the evidence never shows right on these rows
    is not caught up on them: at batch 4 on a CPU-like structure, with prompts of 200 tokens (a catch-up costs a
    drafter 200 positions), the run stays within 3% of plain."""
    new_tokens = 60
    target, prompts, plain, _ = case(batch=4, new_tokens=new_tokens, prompt_length=200)
    fn = STRUCTURES[structure]
    clock = CostClock()
    clock.hook(target, table(fn))
    drafter = tiny_model("llama", seed=1)  # unrelated weights: almost never the target's token
    clock.hook(drafter, table(lambda n: 0.05 * fn(n)))
    profile = profile_of(table(fn), [table(lambda n: 0.05 * fn(n)), None], ["drafter", "prompt_lookup"])
    pool = hf_spin.AssistantPool([drafter, "prompt_lookup"], policy="lbss", profile=profile)
    out = run(target, prompts, pool, clock, new_tokens=new_tokens)
    assert torch.equal(out, plain)
    spin = clock.now
    assert pool.planner.paying[0]  # the draft model could pay: only the evidence keeps its catch-ups off
    assert spin <= 1.03 * plain_clock(target, prompts, clock, new_tokens), pool.last_stats.drafters


@pytest.mark.parametrize("structure", ["avx512_bf16", "avx2_fp32"])
def test_a_call_spends_only_its_own_budget(structure):
    """What earlier calls left unspent is not carried into a call: a pool whose budget a long plain history
    left untouched probes a 24-token request (a drafter right 0% of the time) only as far as 2% of the request's
    own plain time, so the request runs within 2% of plain `generate` (the clock, prefill included)."""
    new_tokens = 24
    target, prompts, plain, refs = case(batch=1, new_tokens=new_tokens)
    cost = table(STRUCTURES[structure])
    clock = CostClock()
    clock.hook(target, cost)
    pool = hf_spin.AssistantPool([Scripted(refs, [0.0])], profile=profile_of(cost, [None], ["scripted"]))
    run(target, prompts, pool, clock, new_tokens=1)  # the pool meets the target: its planner is made
    pool.planner.budget.plain_seconds = 1000 * cost.predict(1)  # as if a thousand plain steps had spent nothing
    start = clock.now
    out = run(target, prompts, pool, clock, new_tokens=new_tokens)
    assert torch.equal(out, plain)
    spin = clock.now - start
    plain_seconds = plain_clock(target, prompts, clock, new_tokens)
    assert spin <= (1 + SHARE) * plain_seconds + 1e-9, f"{structure}: {spin:.2f}s against plain {plain_seconds:.2f}s"


def test_the_pool_lends_a_drafters_probes_until_it_is_known_or_wrong():
    """A GPU-like flat profile (a 5 ms step, a 0.5B-like drafter at 0.355 of it) and a 16-token call: a probe (the
    row's 52-token catch-up with its first draft token, one drafter forward: 0.355 of a step) costs more than the
    call's own share of 15 steps to come (0.3 of a step), so only the pool's account can buy it. The account lends
    for a drafter the pool has not seen, and for one right on the few observations it has (below `LEARNED`); not for
    one wrong on its first probe, nor for one whose evidence is enough to plan from without a loan. Lent or not,
    what a call may lose stays twice its share."""
    from hf_spin.planning.exploration import LEARNED

    step = 0.005
    target = table(lambda n: step)
    drafter = table(lambda n: 0.355 * step)
    for pooled, drafts, lends in (
        ([0.0, 0.0], True, True),  # never seen: its first probe
        ([1.0, 0.0], True, True),  # right on its first probe: one token is no plan
        ([LEARNED - 0.5, 0.0], True, True),
        ([0.0, 1.0], False, False),  # wrong on its first probe: the calls' own shares alone
        ([1.0, 1.0], False, False),  # right half the time: below the prior's acceptance
        ([LEARNED, 0.0], True, False),  # known: the evidence alone drafts it, no loan
    ):
        planner = Planner(profile_of(target, [drafter], ["drafter"]))
        planner.acceptance.pooled[0] = list(pooled)
        planner.budget.pool_plain_seconds = 10_000 * step
        sized = planner.size([0], [{0: 52}], [15], [(0,)], [8], padded=True)
        assert (sized[0] > 0) == drafts, pooled
        assert (planner.budget.lent > 0) == lends, pooled
        assert planner.budget.spent + planner.budget.lent <= 2 * planner.budget.call_share + 1e-12


def test_the_expected_tokens_of_every_lane_count_in_the_calls_budget():
    """A pipeline's lanes size their own rows on one planner: the call's budget counts what every lane's rows are
    expected to commit (each row a share of its batch's plain step), and nothing for a row that left."""
    from hf_spin.planning.exploration import ExplorationBudget

    budget = ExplorationBudget()
    budget.expect([1, 2], [10, 30], plain_step=0.2)  # lane A: two rows, 0.1 s of each step a row
    budget.expect([3], [40], plain_step=0.15)  # lane B: one row
    assert budget.expected == pytest.approx(1.0 + 3.0 + 6.0)
    budget.expect([1, 2], [9, None], plain_step=0.2)  # lane A again: its rows' own, row 2's length unknown
    assert budget.expected == pytest.approx(0.9 + 0.0 + 6.0)
    budget.end_rows([3])
    assert budget.expected == pytest.approx(0.9) and budget.left == pytest.approx(SHARE * 0.9)


@pytest.mark.parametrize("acceptance", [0.25, 0.9])
def test_a_drafting_steps_own_host_work_is_priced(monkeypatch, acceptance):
    """Flat costs (a GPU's captured forwards) and a drafting step that costs the engine half a plain step of its own
    work (the Python of planning, merging, the verdict and commit, around a 4-5 ms forward): the profile learns it
    (`CostProfile.host_seconds`) and prices every step with it. A drafter right 25% of the time then pays less than
    its steps' host work, and the default path costs within 3% of plain decoding; one right 90% of the time still
    pays."""
    from hf_spin.step.engine import SpinEngine

    host, new_tokens = 0.05, 100
    target, prompts, plain, refs = case(batch=1, new_tokens=new_tokens)
    cost = table(STRUCTURES["flat"])
    clock = CostClock()
    clock.hook(target, cost)
    commit = SpinEngine._commit_step

    def costly_commit(self, proposal, outcome):  # a drafting step's own work, on the clock
        clock.now += host if any(proposal.drafts) else 0.0
        return commit(self, proposal, outcome)

    monkeypatch.setattr(SpinEngine, "_commit_step", costly_commit)
    pool = hf_spin.AssistantPool([Scripted(refs, [acceptance])], profile=profile_of(cost, [None], ["scripted"]))
    out = run(target, prompts, pool, clock, new_tokens=new_tokens)
    assert torch.equal(out, plain)
    spin = clock.now
    plain_seconds = plain_clock(target, prompts, clock, new_tokens)
    assert pool.cost_profile.host_seconds(1, "drafting") == pytest.approx(host, rel=0.01)
    if acceptance < 0.5:
        assert spin <= 1.03 * plain_seconds, f"{spin:.2f}s against plain {plain_seconds:.2f}s"
    else:
        assert spin < 0.7 * plain_seconds, f"{spin:.2f}s against plain {plain_seconds:.2f}s"


@pytest.mark.parametrize("structure", ["avx2_fp32", "small_gemm_fp32"])
def test_a_probe_is_charged_what_it_cost_where_the_profile_under_reads(structure):
    """The profile says one thing and the machine does another (a stale cached profile, a busy neighbour): here every
    forward over more than one position, and every drafter forward, costs 4x its excess over the profile's. Drafts that
    are never right: the probes' seconds the budget counts (charged, less refunds, on the call's account and what the
    pool's lent it) are what they cost on the clock beyond plain `generate`, not what they were priced at, so the
    budget stops buying them once they have spent it."""
    lie, new_tokens = 4.0, 100
    target, prompts, plain, _ = case(batch=1, new_tokens=new_tokens)
    fn = STRUCTURES[structure]
    clock = CostClock()
    clock.hook(target, table(lambda n: fn(1) + lie * (fn(n) - fn(1))))
    drafter = tiny_model("llama", seed=1)  # unrelated weights: its guesses are almost never the target's
    clock.hook(drafter, table(lambda n: lie * DRAFT_TOKEN * fn(n)))
    profile = profile_of(table(fn), [table(lambda n: DRAFT_TOKEN * fn(n))], ["drafter"])
    pool = hf_spin.AssistantPool([drafter], profile=profile)
    out = run(target, prompts, pool, clock, new_tokens=new_tokens)
    assert torch.equal(out, plain)
    spin = clock.now
    lost = spin - plain_clock(target, prompts, clock, new_tokens)
    budget = pool.planner.budget
    assert pool.last_stats.drafters[pool.names[0]].drafted > 0  # probes ran
    assert lost == pytest.approx(budget.spent + budget.lent, abs=0.005 * spin), (lost, budget.spent, budget.lent)


def test_a_model_free_drafters_first_draft_on_a_request_is_a_probe():
    """Earlier requests showed prompt lookup and a draft model right 22 times in 25. On a new request, with no budget
    left for probes (AVX2 float32: a failed 8-token verification costs most of a plain step), the draft model's draft
    is verified on that evidence; prompt lookup's is drafted (one sd up, charging nothing: it costs nothing to make)
    and cut, since the request holds no evidence of its own of it; learned from all the same (its first token against
    the committed one), the request's next draft is verified."""
    cost = table(STRUCTURES["avx2_fp32"])
    planner = Planner(profile_of(cost, [None, NEARLY_FREE], ["lookup", "drafter"]))
    planner.acceptance.pooled = [[22.0, 3.0], [22.0, 3.0]]  # earlier requests': right 22 times in 25, each
    draft = [[7] * 8]
    assert planner.size([0], [{}], [64], [(0,)], [8], padded=False) == [8]  # drafted one sd up
    assert planner.budget.spent == 0  # nothing bought: the draft costs nothing
    planner.budget.spent = planner.budget.call_share  # the call's share spent: no probe is affordable
    assert planner.trim([0], draft, [(1,)], [{}], padded=False)[0][0] >= 4  # the draft model's: on the pool's word
    assert planner.trim([0], draft, [(0,)], [{}], padded=False)[0] == [0]  # cut: a probe the budget cannot afford
    planner.acceptance.observe(0, 0, proposed=8, matched=8, committed=1)  # the cut draft's first token was right
    assert planner.trim([0], draft, [(0,)], [{}], padded=False)[0][0] >= 4


def test_a_model_free_draft_is_followed_past_its_step_until_a_token_is_wrong():
    """`follow`: a draft that matched its step's token and holds more is scored against the tokens committed after
    it, each step's newly revealed positions once, until one is wrong (or the draft is used up); one a drafter a row."""
    pending = {}
    start(pending, {0: [5, 6, 7, 8], 1: [5, 9]}, 10, [5], [True, False], {0: 3})  # drafter 1 is a model drafter
    start(pending, {0: [6, 7]}, 11, [6], [True, False], {})  # drafter 0 is followed already: not again
    assert list(pending) == [0]
    sequence = list(range(10)) + [5]
    assert follow(sequence, pending) == {}  # nothing committed since its step
    assert follow(sequence + [6], pending) == {0: (1, 4, 2, 2, 3)}  # position 2 right
    assert follow(sequence + [6, 7, 0], pending) == {0: (2, 4, 3, 4, 3)}  # 3 right, 4 wrong: done
    assert pending == {}


@pytest.mark.parametrize("truth", [1, 8])
def test_cut_model_free_drafts_teach_their_later_positions(monkeypatch, truth):
    """Every draft cut (nothing verified): a model-free drafter right on its first `truth` positions of each draft
    (then wrong) is learned at its later positions from the tokens the next steps commit, as verification would
    have: position 2 right where its drafts hold, wrong where they stop after a token."""
    target, prompts, plain, refs = case(batch=1, new_tokens=30)
    drafter = Scripted(refs, [1.0])
    draft = drafter.draft
    drafter.draft = (
        lambda request: Draft(  # right on `truth` positions, then wrong
            [t[:truth] + [(x + 1) % VOCAB or 3 for x in t[truth:]] for t in draft(request).tokens],
            [None] * len(request.rows),
        )
    )
    monkeypatch.setattr(Planner, "trim", lambda self, rows, drafts, *a, **kw: ([0] * len(drafts), [None] * len(drafts)))
    clock = CostClock()
    clock.hook(target, table(STRUCTURES["flat"]))
    pool = hf_spin.AssistantPool([drafter], profile=profile_of(table(STRUCTURES["flat"]), [None], ["scripted"]))
    assert torch.equal(run(target, prompts, pool, clock, new_tokens=30), plain)
    right, wrong = pool.planner.acceptance.counts[(0, None, 2)]
    assert (right > 0 and wrong == 0) if truth == 8 else (right == 0 and wrong > 0)


def test_a_drafters_stats_count_what_was_verified_not_what_trim_cut(monkeypatch):
    """`trim` verifies at most one token of each 6-token draft: the drafter's `drafted`, `longest_draft` and steps
    are what the target verified (its row's counts), `proposed` all six; its acceptance is over the verified tokens
    (the demo's "drafted 41, accepted 1, longest draft 8" was of one verified token at a time: AVX2 bf16)."""
    target, prompts, plain, refs = case(batch=1, new_tokens=30)
    drafter = Scripted(refs, [1.0])
    trim = Planner.trim
    monkeypatch.setattr(
        Planner, "trim", lambda self, *a, **kw: (lambda k, v: ([min(n, 1) for n in k], v))(*trim(self, *a, **kw))
    )
    clock = CostClock()
    clock.hook(target, table(STRUCTURES["flat"]))
    profile = profile_of(table(STRUCTURES["flat"]), [None], ["scripted"])
    pool = hf_spin.AssistantPool([drafter], draft_length=6, profile=profile)
    assert torch.equal(run(target, prompts, pool, clock, new_tokens=30), plain)
    d, row = pool.last_stats.drafters["scripted"], pool.last_stats.rows[0]
    assert d.longest_draft == 1 and d.drafted == row.drafted == d.steps > 0 and d.accepted == row.accepted
    assert d.proposed >= 3 * d.drafted


@pytest.mark.parametrize("cold", [False, True])
def test_a_step_that_sets_up_a_graph_is_charged_to_no_probe_and_teaches_no_cost(cold):
    """A probe's step whose forward took 30 plain steps: charged to the probe (`Probe.overrun`) and learned by the
    profile where it ran at that cost; where it compiled or captured a graph (`StepFeedback.cold`: a first run at
    a shape, once per process on a GPU), that time is set-up, so the probe is charged its price alone and the
    profile keeps its prices."""
    from hf_spin.planning.plan import Plan, StepFeedback

    cost = table(STRUCTURES["avx2_fp32"])
    planner = Planner(profile_of(cost, [NEARLY_FREE], ["drafter"]))
    planner.budget.plain_seconds = 1000 * cost.predict(1)  # probes are affordable
    ks = planner.size([0], [{}], [64], [(0,)], [8], padded=True)
    assert ks == [1] and planner.budget.spent > 0  # a probe was bought: a drafter the pool has never seen
    charged, priced = planner.budget.spent + planner.budget.lent, planner.profile.target.predict(1 + ks[0])
    feedback = StepFeedback(
        row_ids=[0],
        plan=Plan([(0,)], ks),
        drafted=ks,
        accepted=[0],
        proposed=[{0: ks[0]}],
        matched=[{0: 0}],
        draft_seconds=[0.0],
        verify_seconds=30 * cost.predict(1),
        padded=True,
        cold=cold,
    )
    planner.update(feedback)
    budget = planner.budget
    if cold:
        assert budget.spent + budget.lent == pytest.approx(charged)
        assert planner.profile.target.predict(1 + ks[0]) == pytest.approx(priced)
    else:
        assert budget.spent + budget.lent == pytest.approx(charged + 30 * cost.predict(1) - priced)
        assert planner.profile.target.predict(1 + ks[0]) > 1.5 * priced
