"""The planner: how many tokens each row drafts and verifies, from measured costs and learned survival.

Policies choose drafters and cap k; the planner sizes within the cap. Every step, twice (docs/planning.md):

    ks = plan_k(caps, rooms, chosen, planner, row_ids, lags, padded)  # before drafting: k per row, 0 allowed
    # after: how much of each draft (or tree) to verify
    keep, _ = planner.trim(row_ids, drafts, chosen, matches, padded, trees)

Both maximise the step's expected committed tokens per second,

    rate(ks) = (B + sum_b sum_{i <= k_b} S_b(i)) / (t_verify(ks) + t_draft(ks)),

S_b(i) being the probability that row b's draft survives to position i (the product of the
per-position acceptances, `Acceptance`), t_verify the target's forward over the step's positions
(B + sum k packed, B (1 + max k) padded) and t_draft each drafter's forwards (its longest draft,
over the rows it serves, plus its catch-up on a row it has not drafted for lately, spread over the
steps the row is expected to have left (row_lengths.py): a draft model that has never seen a 1000-token
prompt must read it first, which pays back over a long answer and not over a short one), all from the
`CostProfile`.
Draft slots (b, i) are taken in order of S, most likely first (vLLM's adaptive verification
budget), and the best prefix wins; if no prefix beats a plain step (B / t_verify(B)) by MIN_GAIN,
the step is plain. What runs is what the evidence pays for (S read with a pessimistic prior) and,
beyond it, probes the exploration budget affords (exploration.py: one token long where verification
is not flat, priced with the row's catch-up in full): before drafting up to the optimistic size (an
upper bound on what the request has shown, so each new request may try a drafter that might pay on
it); after drafting up to the mean's, the drafting already paid for and, for prompt lookup, the
length of the match each draft continued known. A token tree is sized node by node: each node is a slot whose value is
its estimated acceptance (`Planner._node_values`), so trees grow where the next node pays, rows
sharing the step's budget. A drafter that cannot pay on this machine at any realistic acceptance
(`CostProfile.pays`) is never sized above 0.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Collection

from .acceptance import EVIDENCE_ONLY, PRIOR_ACCEPTANCE, PRIOR_WEIGHT, Acceptance
from .closed_batch import row_weights
from .cost_profile import CostProfile
from .exploration import LEARNED, ExplorationBudget
from .journal import StepJournal
from .plan import StepFeedback
from .row_lengths import RowLengths

# Standard deviations of optimism when sizing before drafting: an upper confidence bound on the
# request's acceptance with the drafter (its uncertainty: what this request has shown, not what all
# requests have), so every new request tries a drafter that might pay on it, and one that has shown
# what it does on the request is judged at about its mean.
OPTIMISM = 1.0
# A speculative step must beat a plain one by this factor: inside it the estimates' noise could
# make a plan that only ties plain decoding cost time.
MIN_GAIN = 1.02


class Planner:
    """Sizes every step's drafts against the `CostProfile` (see the module docstring)."""

    def __init__(self, profile: CostProfile):
        self.profile = profile
        self.acceptance = Acceptance(len(profile.drafters))
        self.paying: list[bool] = []  # per drafter: can it pay here (`judge`, again as the profile is refined)
        self.warned = False  # said once that nothing can pay
        self.steps = 0
        self.drafted_last: set[int] = set()  # drafters that drafted in the last step learned from
        self.lock = threading.Lock()  # a pipeline sizes one micro-batch while another's step is learned from
        self.budget = ExplorationBudget()  # what probes may lose in a call (exploration.py)
        self.journal = StepJournal.from_env()  # the step log, where $HF_SPIN_STEP_LOG names one (journal.py)
        self.lengths = RowLengths()  # how long rows run: a catch-up is spread over a row's expected steps left
        self.weights: dict[int, float] = {}  # row id -> its token's worth this step (`size`; closed_batch.py)
        self.judge()

    def __getstate__(self) -> dict:  # copied (AssistantPool.snapshot) without its lock
        return {k: v for k, v in self.__dict__.items() if k != "lock"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, lock=threading.Lock())

    @property
    def can_win(self) -> bool:
        """Whether any drafter can pay on this machine (else every step is plain)."""
        return any(self.paying)

    def judge(self) -> None:
        """Judge the drafters against the profile (again, as it is refined); the first time none can
        pay, say so: a warning naming the measured costs, then plain decoding."""
        self.paying = [self.profile.pays(d) for d in range(len(self.profile.drafters))]
        if not self.can_win and not self.warned:
            self.warned = True
            warnings.warn(f"hf_spin: {self.profile.outlook()}. Decoding plainly.", stacklevel=2)

    def _curve(
        self,
        row: int,
        drafters: tuple[int, ...],
        k: int,
        match: dict[int, int] | None,
        optimism: float,
        prior: tuple[float, float] = (PRIOR_ACCEPTANCE, PRIOR_WEIGHT),
    ) -> list[float]:
        """[k] survival of request `row` drafted by `drafters` (several: the best of them at each position)."""
        curves = [
            self.acceptance.survival(d, row, k, (match or {}).get(d), optimism, prior)
            for d in drafters
            if self.paying[d]
        ]
        if len(curves) <= 1:
            return curves[0] if curves else []
        return [max(c[i] for c in curves) for i in range(k)]

    def _best(
        self,
        curves: list[list[float]],
        chosen: list[tuple[int, ...]],
        padded: bool,
        catch_up: list[dict[int, float]] | None = None,
    ) -> list[int]:
        """[B] draft lengths of the best prefix of the slots ranked by survival; all 0 when no prefix
        beats a plain step by MIN_GAIN. `catch_up` ([B] drafter -> seconds a step of the row's catch-up, spread
        over its steps left): before drafting, the drafters' forwards and these are charged too. Where only some
        rows must catch up, the slots are also ranked with those rows last, and the better prefix wins: at batch 4
        one new 300-token prompt, its slots as likely as its neighbours', would otherwise come first and price
        their drafts out with its catch-up."""
        B = len(curves)
        if self._nothing_pays(curves, chosen, catch_up is not None):
            return [0] * B
        slots = sorted(
            ((s, i + 1, b) for b, curve in enumerate(curves) for i, s in enumerate(curve)), key=lambda x: (-x[0], x[1])
        )
        orders = [slots]
        late = [any(v > 0 for v in c.values()) for c in catch_up] if catch_up is not None else []
        if any(late) and not all(late):
            orders.append(sorted(slots, key=lambda x: late[x[2]]))  # stable: by survival within each part
        _, prefix = max((self._best_prefix(order, chosen, padded, catch_up) for order in orders), key=lambda r: r[0])
        ks = [0] * B
        for _, i, b in prefix:
            ks[b] = max(ks[b], i)
        return ks

    def _nothing_pays(self, curves: list[list[float]], chosen: list[tuple[int, ...]], drafting: bool) -> bool:
        """Whether no prefix of the slots can beat a plain step (`_best_prefix`'s rule), by a bound: a prefix whose
        deepest slot is at position L earns at most every slot up to L, and costs at least the cheapest verification
        a drafting step may run and, where drafting is priced, L forwards of the cheapest drafter chosen. Most steps
        of a drafter that is rarely right end here, without ranking and pricing every slot."""
        profile, B = self.profile, len(curves)
        target = self._plain_rate(B)
        # the cheapest forward and a drafting step's own work, as `verify_seconds` prices it
        verify = profile.target.floor(B) + profile.verify_seconds(B, B + 1) - profile.target.verify(B + 1, B)
        drafters = {d for ds in chosen for d in ds}
        forward = min((profile.least_draft_seconds(d) for d in drafters), default=0.0) if drafting else 0.0
        value = float(B)
        for depth in range(max(map(len, curves), default=0)):
            value += sum(c[depth] for c in curves if depth < len(c))
            if self._beats(value / (verify + (depth + 1) * forward), target * (1 - 1e-9)):
                return False
        return True

    def _plain_rate(self, rows: int) -> float:
        """Tokens a second a plan must beat: a plain step's, raised by MIN_GAIN."""
        return MIN_GAIN * rows / self.profile.plain_seconds(rows)

    @staticmethod
    def _beats(rate: float, best: float) -> bool:
        """Whether a plan at `rate` expected tokens a second beats `best` (a plain step's rate raised by MIN_GAIN, or
        a better plan's)."""
        return rate > best

    def _best_prefix(
        self,
        slots: list[tuple[float, int, int]],
        chosen: list[tuple[int, ...]],
        padded: bool,
        catch_up: list[dict[int, float]] | None,
    ) -> tuple[float, list[tuple[float, int, int]]]:
        """(rate, slots): the prefix of `slots` ([(survival, position, row)], each row's in position order) with
        the most expected tokens per second, the empty one unless some prefix beats a plain step by MIN_GAIN."""
        profile, B = self.profile, len(chosen)
        ks, value, total, longest, caught = [0] * B, float(B), 0, 0, {}
        longest_of, served, draft_of = {}, {}, {}  # per drafter: its longest draft, rows served, predicted seconds
        best_rate, best_m = self._plain_rate(B), 0
        verify = {}  # positions -> the verification's seconds: a prefix's verifications repeat
        for m, (s, i, b) in enumerate(slots, 1):
            if catch_up is not None:
                if ks[b] == 0:
                    self._add_catch_up(caught, catch_up[b], padded)
                for d in chosen[b]:
                    rows, longest_d = served.get(d, 0) + (ks[b] == 0), max(longest_of.get(d, 0), i)
                    if (rows, longest_d) != (served.get(d), longest_of.get(d)):  # priced again only if it grew
                        served[d], longest_of[d] = rows, longest_d
                        draft_of[d] = profile.draft_seconds_for_rows(d, longest_d, rows)
            total, longest, value = total + i - ks[b], max(longest, i), value + s
            ks[b] = i
            positions = B * (1 + longest) if padded else B + total
            if positions not in verify:
                verify[positions] = profile.verify_seconds(B, positions)
            seconds = verify[positions] + sum(draft_of.values()) + sum(caught.values())
            if self._beats(value / seconds, best_rate):
                best_rate, best_m = value / seconds, m
        return best_rate, slots[:best_m]

    def size(
        self,
        row_ids: list[int],
        lags: list[dict[int, int]],
        rooms: list[int | None],
        chosen: list[tuple[int, ...]],
        caps: list[int],
        padded: bool,
        unencoded: list[set[int]] | None = None,
        closed: bool = False,
    ) -> list[int]:
        """[B] draft length per row before drafting, at most `caps` ([B], the policy's k already
        capped by the row's room: `plan_k`, which calls this), 0 allowed.
        lags: [B] drafter -> committed tokens its state lacks (`Drafter.synced`); rooms: [B] tokens
        each row may still generate (None: unknown); unencoded: [B] the chosen drafters whose own
        encoder has yet to read the row (`Drafter.unencoded`), None: none; closed: the batch takes no new
        rows (a `generate` call's), so a row's tokens are worth what they bring its end forward
        (closed_batch.py), here and in this step's `trim`."""
        with self.lock:
            curves = [
                self._curve(r, ds, k, None, OPTIMISM) if ds and k > 0 else [] for r, ds, k in zip(row_ids, chosen, caps)
            ]
            unencoded = unencoded or [set() for _ in lags]
            left = [self.lengths.left(r, room) for r, room in zip(row_ids, rooms)]  # [B] tokens each row may add
            if closed:
                spreads, rates = [self.lengths.spread(n) for n in left], [self.lengths.rate(r) for r in row_ids]
                weights = row_weights(left, spreads, rates, self.profile.plain_seconds)
            else:
                weights = [1.0] * len(row_ids)
            self.weights.update(zip(row_ids, weights))
            self.budget.expect(row_ids, left, self.profile.plain_seconds(len(row_ids)))
            rows = len(row_ids) if padded else 1  # a padded catch-up forward runs every row at the longest lag
            seconds = [
                {d: self._catch_up_seconds({d: n}, u, rows) for d, n in lag.items()} for lag, u in zip(lags, unencoded)
            ]  # [B] drafter -> seconds
            spread = [
                {d: self._spread(t, n, c) for d, t in s.items()} for n, s, c in zip(left, seconds, curves)
            ]  # [B] drafter -> the least a catch-up is charged a step
            ks = self._best(_weighted(curves, weights), chosen, padded, spread)  # [B] one sd up: what probes may reach
            return self._explore(row_ids, caps, ks, chosen, padded, spread, seconds, weights)

    def _explore(
        self,
        row_ids: list[int],
        caps: list[int],
        ks: list[int],
        chosen: list[tuple[int, ...]],
        padded: bool,
        catch_up: list[dict[int, float]],
        full: list[dict[int, float]],
        weights: list[float],
    ) -> list[int]:
        """[B] the optimistic sizes `ks` cut to what the exploration budget affords (exploration.py): the
        plan the evidence pays for (a pessimistic prior), and beyond it probes, shortest first.
        catch_up: [B] drafter -> seconds charged a step for the row's catch-up (`size`); full: the whole of it;
        weights: [B] each row's token's worth (closed_batch.py)."""
        if any(ks):  # lower curves over the same slots pay no better: nothing one sd up, no evidence plan, no probe
            bounds = [
                self._curve(r, self._evidenced(r, ds), k, None, 0.0, EVIDENCE_ONLY) if ds and k > 0 else []
                for r, ds, k in zip(row_ids, chosen, caps)
            ]
            exploit = self._best(_weighted(bounds, weights), chosen, padded, catch_up)  # [B]
            # [B] rows drafted by model-free drafters alone: drafted as sized one sd up, for nothing; `trim` judges the
            # draft, its match known, and buys a probe there
            free = [bool(ds) and all(self.profile.drafters[d] is None for d in ds) for ds in chosen]
            wanted = [e if f else k for k, e, f in zip(ks, exploit, free)]
            # a failed probe wastes its rows' catch-ups: charged in full, a drafter the pool has never seen too
            sized, probe = self._probe(row_ids, exploit, wanted, chosen, padded, full)
            sized = [k if f else s for k, s, f in zip(ks, sized, free)]
        else:  # a plain step (most steps where drafting does not pay): no second pass, no probe
            exploit, sized, probe = ks, ks, 0.0
        B = len(ks)
        if self.journal is not None:
            self.journal.note(
                row_ids,
                caps=list(caps),
                optimistic=list(ks),
                exploit=list(exploit),
                sized=list(sized),
                probe_seconds=probe,
                budget_left=self.budget.left,
                expected_seconds=self._seconds(sized, chosen, padded, catch_up),
                plain_seconds=self.profile.plain_seconds(B),
            )
        return sized

    def _probe(
        self,
        row_ids: list[int],
        exploit: list[int],
        wanted: list[int],
        chosen: list[tuple[int, ...]],
        padded: bool,
        catch_up: list[dict[int, float]] | None,
    ) -> tuple[list[int], float]:
        """([B] sizes, seconds charged): `exploit` ([B], what the estimates expect to pay) and, beyond it
        toward `wanted` ([B]), the longest probe the exploration budget affords (exploration.py; a drafter the pool
        is still learning, from the pool's account too: `_learning`). The first rung is one token on one row, the row
        where it costs least (at batch 4 a new drafter's first probe reads the shortest prompt, not four); then a token
        beyond the plan on every row, two, ..."""

        def added(trial: list[int]) -> tuple[list[int], float]:
            return trial, self._seconds(trial, chosen, padded, catch_up) - base

        base = self._seconds(exploit, chosen, padded, catch_up)
        wanting = [b for b, (k, e) in enumerate(zip(wanted, exploit)) if k > e]
        learning = any(self._learning(d) for b in wanting for d in chosen[b])  # the pool's account lends too
        probes = []  # [(ks, seconds added to the exploit plan)]
        if len(wanting) > 1:
            one = [[e + (b == w) for b, e in enumerate(exploit)] for w in wanting]
            probes.append(min((added(trial) for trial in one), key=lambda p: p[1]))
        for extra in range(1, max((k - e for k, e in zip(wanted, exploit)), default=0) + 1):
            probes.append(added([max(e, min(k, e + extra)) for k, e in zip(wanted, exploit)]))
        drafting = (lambda ks: self._drafting_seconds(ks, chosen, padded, catch_up)) if catch_up is not None else None
        plain = self.profile.plain_seconds(len(wanted))
        return self.budget.afford(row_ids, exploit, probes, plain, learning, drafting)

    def _evidenced(self, row: int, drafters: tuple[int, ...]) -> tuple[int, ...]:
        """Of `drafters`, those whose evidence from other requests may plan request `row`'s exploit drafts: a model
        drafter's always (the request's own evidence of it costs drafts), a model-free drafter's once the request
        holds evidence of its own. A model-free draft costs nothing to make and is learned from whether verified or
        cut (`trim`; followed past its step: step/continuations.py), so a request's first one is a probe, not a
        verification paid for on what other requests showed (prompt lookup on summaries says little of a math
        question). LBSS's shadow drafts measure it on every request, which holds evidence of its own by then."""
        return tuple(d for d in drafters if self.profile.drafters[d] is not None or self.acceptance.seen(d, row) > 0)

    def _learning(self, drafter: int) -> bool:
        """Whether the pool's account lends the drafter's probes (exploration.py): fewer observations of it than the
        evidence alone drafts from (`LEARNED`), and those mostly right (at least the prior's acceptance): a drafter
        wrong on its first probe is probed on the calls' own shares alone."""
        accepted, rejected = self.acceptance.pooled[drafter]
        return accepted + rejected < LEARNED and accepted >= PRIOR_ACCEPTANCE * (accepted + rejected)

    def _seconds(
        self, ks: list[int], chosen: list[tuple[int, ...]], padded: bool, catch_up: list[dict[int, float]] | None
    ) -> float:
        """Predicted seconds of a step drafting ks ([B]): its verify forward and, before drafting (catch_up
        given), its drafting (`_drafting_seconds`); as `_best` prices it."""
        B = len(ks)
        tokens = B * (1 + max(ks, default=0)) if padded else B + sum(ks)
        drafting = self._drafting_seconds(ks, chosen, padded, catch_up) if catch_up is not None else 0.0
        return self.profile.verify_seconds(B, tokens) + drafting

    def _drafting_seconds(
        self, ks: list[int], chosen: list[tuple[int, ...]], padded: bool, catch_up: list[dict[int, float]]
    ) -> float:
        """Predicted seconds of a step's drafting of ks ([B]): each drafter's longest draft over the rows it serves
        and the catch-ups (`catch_up`: [B] drafter -> seconds) of the rows that draft."""
        longest, served, caught = {}, {}, {}
        for k, ds, c in zip(ks, chosen, catch_up):
            for d in ds if k > 0 else ():
                longest[d], served[d] = max(longest.get(d, 0), k), served.get(d, 0) + 1
            if k > 0:
                self._add_catch_up(caught, c, padded)
        drafts = sum(self.profile.draft_seconds_for_rows(d, longest[d], served[d]) for d in longest)
        return drafts + sum(caught.values())

    @staticmethod
    def _add_catch_up(caught: dict[int, float], row: dict[int, float], padded: bool) -> None:
        """Add a drafting row's catch-ups (drafter -> seconds) to the step's (drafter -> seconds). A drafter
        catches up on all its rows in one forward: padded, every row at the longest lag, priced so per row
        (`size`), so the step pays the dearest row's; packed, the rows' tokens, so their sum."""
        for d, seconds in row.items():
            caught[d] = max(caught.get(d, 0.0), seconds) if padded else caught.get(d, 0.0) + seconds

    def worth_catching_up(
        self,
        row_ids: list[int],
        drafter: int,
        lags: list[int],
        rooms: list[int],
        unencoded: list[bool] | None = None,
        padded_rows: int = 1,
    ) -> list[bool]:
        """[B] whether to run an idle catch-up (a policy's `Plan.catch_up`: feeding a drafter a row it does not
        draft now) on each row: where it pays for itself (drafting the row with `drafter` alone, at what the
        evidence says, the exploit plan's pessimistic prior, with this catch-up of `lags` ([B] tokens) spread
        over the row's steps left (`rooms`, [B] tokens), beats a plain step), or else as the first half of a probe:
        bought from the exploration budget at the catch-up's full price (with the drafter's encoder where
        `unencoded`, [B]) only if the budget covers the probe's first rung after it too (`_first_rung`), since a
        catch-up alone learns nothing. Bought alone, SmolLM2's catch-up of a Spec-Bench prompt took a 32-token
        request's whole share and left none for a probe: 2-3% of the request lost (AMD EPYC, float32, LBSS).
        Never for a drafter that cannot pay here.
        padded_rows: the rows the drafter's catch-up forward runs over whichever it feeds (a rectangular cache pads
        every row of the batch to the longest chunk): a row's catch-up is priced as that many rows of its lag."""
        if not self.paying[drafter]:
            return [False] * len(row_ids)
        with self.lock:
            out = []
            for r, lag, room, fresh in zip(row_ids, lags, rooms, unencoded or [False] * len(row_ids)):
                seconds = self._catch_up_seconds({drafter: lag}, {drafter} if fresh else (), padded_rows)
                curve = self._curve(r, (drafter,), min(room, self.profile.max_k), None, 0.0, EVIDENCE_ONLY)
                spread = self._spread(seconds, self.lengths.left(r, room), curve)
                pays = self._best([curve], [(drafter,)], False, [{drafter: spread}])[0] > 0
                out.append(pays or self.budget.spend(seconds, then=self._first_rung(drafter, padded_rows)))
                if out[-1] and self.journal is not None:
                    paid_by = "evidence" if pays else "budget"
                    name = self.profile.names[drafter]
                    self.journal.event("idle_catch_up", row=r, drafter=name, lag=lag, seconds=seconds, paid_by=paid_by)
            return out

    def _learn_catch_up(self, drafter: int, lag: int, forwards: int, seconds: float) -> None:
        """A model drafter's draft of `forwards` tokens on one row took `seconds`, its first forward reading the
        `lag` committed tokens it lacked: that forward's cost at `lag` positions is learned (`observe_catch_up`), the
        rest priced at its one-token forwards. A draft model sits out most steps where it does not pay, so a probe's
        draft is where its catch-ups show what they cost; the default pool runs no idle catch-ups, and without this
        its catch-ups stayed priced from the grid (`ForwardCost.bound`) however they ran."""
        cost = self.profile.drafters[drafter]
        if cost is not None and lag > 1:
            self.profile.observe_catch_up(drafter, lag, max(seconds - (forwards - 1) * cost.predict(1), 1e-6))

    def observe_host(self, rows: int, kind: str, seconds: float) -> None:
        """A step of `rows` rows of `kind` (plain, widened, drafting: cost_profile.py) spent `seconds` in the engine's
        own work: every step is priced with it from now on (`CostProfile.host_seconds`)."""
        with self.lock:
            self.profile.observe_host(rows, kind, seconds)

    def learns_prefill(self, positions: int) -> bool:
        """Whether a prefill forward over `positions` positions teaches the target's cost (`observe_prefill`): a
        timing, which on a GPU waits for the forward, only then."""
        return self.profile.target.learns(positions)

    def observe_prefill(self, rows: int, positions: int, seconds: float) -> None:
        """A prefill forward over `rows` rows, `positions` in all, took `seconds` (`CostProfile.observe_prefill`)."""
        with self.lock:
            self.profile.observe_prefill(rows, positions, seconds)

    def observe_catch_up(self, drafter: int, positions: int, seconds: float) -> None:
        """An idle catch-up ran: `drafter`'s forward over `positions` positions took `seconds` (its cost past the grid,
        what `_catch_up_seconds` prices)."""
        with self.lock:
            self.profile.observe_catch_up(drafter, positions, seconds)

    def _first_rung(self, drafter: int, rows: int) -> float:
        """Seconds a probe's first rung adds to a plain step of `rows` rows: one token drafted on one row and
        verified beside the others' (`rows` > 1: a padded forward, every row two positions)."""
        added = self.profile.verify_seconds(rows, 2 * rows) - self.profile.plain_seconds(rows)
        return added + self.profile.draft_seconds_for_rows(drafter, 1, 1)

    def _catch_up_seconds(self, lags: dict[int, int], unencoded: Collection[int] = (), rows: int = 1) -> float:
        """Seconds a row's model drafters would spend catching up on the tokens they lack (the whole
        prompt, for a drafter new to the row), and those in `unencoded` running their own encoder over
        the row first (`ForwardCost.encoder`); `rows`: the rows a catch-up forward runs over (padded), each at
        the row's lag."""
        seconds = 0.0
        for d, lag in lags.items():
            cost = self.profile.drafters[d]
            if cost is not None and lag > 1:  # one token (the last step's bonus) is every step's own catch-up
                seconds += cost.bound(rows * lag) - cost.predict(1)  # far past the grid: read pessimistically
            if cost is not None and d in unencoded:
                seconds += cost.encoder
        return seconds

    @staticmethod
    def _spread(seconds: float, room: int | None, curve: list[float]) -> float:
        """A catch-up's seconds a step, spread over the row's steps left: its room over the tokens a
        step commits at this curve. 0 with no room known."""
        return seconds / max(room / (1.0 + sum(curve)), 1.0) if room is not None and curve else 0.0

    def trim(
        self,
        row_ids: list[int],
        drafts: list[list[int]],
        chosen: list[tuple[int, ...]],
        matches: list[dict[int, int]],
        padded: bool,
        trees: list | None = None,
    ) -> tuple[list[int], list[list[float] | None]]:
        """([B] how many tokens of each row's draft, or nodes of its token tree, to verify, the drafting
        being paid for; [B] per node of a row's tree its estimated acceptance (`_node_values`), None for
        a chain): a tree keeps that many of its likeliest nodes, node by node across the batch."""
        trees = trees or [None] * len(drafts)
        with self.lock:
            weights = [self.weights.get(r, 1.0) for r in row_ids]  # [B] as `size` valued the rows this step
            values = [
                self._node_values(r, ds, t, m) if t is not None else None
                for r, ds, t, m in zip(row_ids, chosen, trees, matches)
            ]
            curves = [
                (sorted(v, reverse=True) if any(v) else [])
                if v is not None
                else (self._curve(r, ds, len(d), m, 0.0) if d else [])
                for r, d, ds, m, v in zip(row_ids, drafts, chosen, matches, values)
            ]
            keep = self._best(_weighted(curves, weights), chosen, padded)  # [B] what pays at the mean
            # what the evidence alone pays for, or a probe bought before drafting; beyond that, a probe
            bounds = [
                (
                    sorted(self._node_values(r, self._evidenced(r, ds), t, m, EVIDENCE_ONLY), reverse=True)
                    if any(v)
                    else []
                )
                if v is not None
                else (self._curve(r, self._evidenced(r, ds), len(d), m, 0.0, EVIDENCE_ONLY) if d else [])
                for r, d, ds, t, m, v in zip(row_ids, drafts, chosen, trees, matches, values)
            ]
            evidence = self._best(_weighted(bounds, weights), chosen, padded)
            floor = [max(e, p) for e, p in zip(evidence, self.budget.bought(row_ids))]
            if any(k > f for k, f in zip(keep, floor)):
                keep, _ = self._probe(row_ids, floor, keep, chosen, padded, None)
            if self.journal is not None:
                self.journal.note(row_ids, drafts=[len(d) for d in drafts], kept=list(keep))
            return keep, values

    def _node_values(
        self,
        row: int,
        drafters: tuple[int, ...],
        tree,
        match: dict[int, int] | None,
        prior: tuple[float, float] = (PRIOR_ACCEPTANCE, PRIOR_WEIGHT),
    ) -> list[float]:
        """[N] the probability that each node of a row's token tree is accepted. A node's heaviest child (the chain
        the drafters' evidence is about) is accepted after it with the chain's conditional acceptance at its depth
        (S(d) / S(d - 1)); its other children only where that child is not, with the drafters' learned acceptance of
        such siblings (`Acceptance.alternative`), shared by weight. Prompt lookup's four continuations of a one-token
        match are equal siblings: valued each as its chain, a RAG row expected one token a step from them, verified
        eight nodes a step and got none (AMD EPYC, bf16). A child is never worth more than its parent."""
        depths = tree.depths()
        chain = self._curve(row, drafters, max(depths, default=0), match, 0.0, prior)  # [D] S(d)
        if not chain:
            return [0.0] * len(tree)
        conditional = [s / above if above > 0 else 0.0 for s, above in zip(chain, [1.0] + chain[:-1])]  # [D]
        sibling = max(self.acceptance.alternative(d, prior) for d in drafters if self.paying[d])
        out = [0.0] * len(tree)
        for parent in [-1] + list(range(len(tree))):  # parents before children: out[parent] is final
            kids = tree.children(parent)
            if not kids:
                continue
            base, top = out[parent] if parent >= 0 else 1.0, tree.heaviest_child(parent)
            c = conditional[depths[top] - 1]
            rest = sum(tree.weights[k] for k in kids if k != top)  # the siblings' weight
            for k in kids:
                if k == top:
                    out[k] = base * c
                elif rest > 0:
                    out[k] = base * (1.0 - c) * sibling * tree.weights[k] / rest
        return out

    def update(self, feedback: StepFeedback) -> None:
        """Learn from a step: the target's timed forward, each drafter's timed call, and every draft
        (served, shadow, or cut by `trim`) against the tokens the step committed."""
        with self.lock:
            self._learn(feedback)

    def end_rows(self, row_ids: list[int], lengths: list[int | None]) -> None:
        """These rows left the batch having generated `lengths` tokens ([B] each; None: cut short): how long
        rows run here."""
        with self.lock:
            self.lengths.end(row_ids, lengths)
            self.budget.end_rows(row_ids)
            for r in row_ids:
                self.weights.pop(r, None)

    def _learn(self, feedback: StepFeedback) -> None:
        profile, acceptance = self.profile, self.acceptance
        self.lengths.committed(feedback.row_ids, [a + 1 for a in feedback.accepted])
        acceptance.decay()
        B = feedback.batch_size
        rows = B + feedback.filler_rows  # the forward's
        priced = profile.target.predict(feedback.verified_tokens(), rows)  # before this step teaches it
        timed = not feedback.cold  # a step that set up a graph timed that, not its forwards: nothing to learn from
        if feedback.verify_seconds > 0 and timed:
            profile.observe_verify(
                rows, feedback.verified_tokens(), feedback.verify_seconds, plain=not any(feedback.drafted)
            )
        drafting = set()
        for d, seconds in enumerate(feedback.draft_seconds):
            lengths = [p[d] for p in feedback.proposed if d in p] + [p[d] for p in feedback.shadow_proposed if d in p]
            if lengths:
                drafting.add(d)
            if not (timed and lengths and seconds > 0):
                continue
            # after a step it sat out, a drafter first catches up on every token since: not a draft's cost
            if d in self.drafted_last:
                profile.observe_draft(d, max(lengths), len(lengths), seconds)
            elif B == 1 and d not in feedback.plan.catch_up:
                self._learn_catch_up(d, feedback.lags[0].get(d, 0) if feedback.lags else 0, max(lengths), seconds)
        self.drafted_last = drafting
        for b in range(B):
            committed = feedback.accepted[b] + 1
            for proposed, matched in (
                (feedback.proposed[b], feedback.matched[b]),
                (feedback.shadow_proposed[b], feedback.shadow_matched[b]) if feedback.shadow_proposed else ({}, {}),
            ):
                for d, p in proposed.items():
                    match = feedback.match_lengths[b].get(d) if feedback.match_lengths else None
                    acceptance.observe(d, feedback.row_ids[b], p, matched.get(d, 0), committed, match)
            for d, (seen, p, m, c, match) in (feedback.continued[b] if feedback.continued else {}).items():
                acceptance.observe(d, feedback.row_ids[b], p, m, c, match, seen)
            outcome = feedback.alternatives[b] if feedback.alternatives else None
            if outcome is not None and len(feedback.proposed[b]) == 1:  # one drafter's tree
                acceptance.observe_alternatives(next(iter(feedback.proposed[b])), outcome)
        measured = (priced, feedback.verify_seconds) if feedback.verify_seconds > 0 else (0.0, 0.0)
        drafting = sum(feedback.draft_seconds) - feedback.idle_seconds  # the drafting the step's plan priced
        self.budget.settle(feedback.row_ids, feedback.accepted, profile.plain_seconds(B), measured, drafting, timed)
        if self.journal is not None:
            self.journal.close(
                feedback.row_ids,
                verify_seconds=feedback.verify_seconds,
                draft_seconds=feedback.draft_seconds,
                verified=feedback.drafted,
                accepted=feedback.accepted,
            )
        self.steps += 1
        if self.steps % 64 == 0:  # the profile has been refined: judge the drafters again
            self.judge()


def _weighted(curves: list[list[float]], weights: list[float]) -> list[list[float]]:
    """[B] each row's survival curve (or node values) times its token's worth (closed_batch.py)."""
    return [[s * w for s in c] for c, w in zip(curves, weights)] if any(w != 1.0 for w in weights) else curves


def plan_k(
    caps: list[int],
    rooms: list[int],
    chosen: list[tuple[int, ...]],
    planner: Planner | None = None,
    row_ids: list[int] | None = None,
    lags: Callable[[], list[dict[int, int]]] | None = None,
    padded: bool = True,
    unencoded: Callable[[], list[set[int]]] | None = None,
    closed: bool = False,
) -> list[int]:
    """[B] how many tokens each row drafts this step: the one place a step's k is decided, with a
    cost profile or without one (profile "off": no planner).

    The rule: row b drafts at most min(caps[b], rooms[b]) tokens, and the planner sizes within that.
    - caps ([B], `Plan.k`): the policy's k is an upper bound, never a demand;
    - rooms ([B], `Row.draft_room`): the draft tokens a row may still verify before its length limit
      (the recovered or bonus token must fit too), so no step generates past it;
    - planner: picks each row's k in [0, cap] from measured costs and learned survival (`Planner.size`:
      0 where a plain step pays more); without one the cap is the k.
    A row no drafter serves (chosen[b] empty) drafts 0. row_ids, lags (called only with a planner:
    [B] drafter -> committed tokens its state lacks), padded and unencoded (called likewise: [B] drafters
    whose own encoder has yet to read the row) and closed (the batch takes no new rows) are what `Planner.size`
    reads. After drafting, `Planner.trim` may only shorten a draft.
    """
    ks = [max(0, min(cap, room)) if ds else 0 for cap, room, ds in zip(caps, rooms, chosen)]
    if planner is None:
        return ks
    fresh = unencoded() if unencoded is not None else None
    sized = planner.size(row_ids, lags(), [room + 1 for room in rooms], chosen, ks, padded, fresh, closed)
    assert all(0 <= k <= cap for k, cap in zip(sized, ks)), f"the planner sized {sized} past the caps {ks}"
    return sized
