"""Exploration within a budget: what the planner may spend on drafts its estimates do not expect to pay.

Before drafting, the planner reads each request's survival one sd up (`planner.OPTIMISM`): a new
request tries a drafter that might pay on it. Where verification is flat such a probe costs almost
nothing; where it is not (a CPU without fast bf16 matmuls verifies 8 tokens at ~6 plain steps) an
8-token probe at 0% acceptance costs 5 plain steps, and a pool probing every new request ran 0.94x
plain decoding (docs/planning.md, "Exploration").

What the estimates expect to pay is the plan at the mean read with a pessimistic prior (`exploit`:
the usual prior's guess of 0.6 is no expectation; a pool that has seen a drafter right 22 times in
25 expects about 0.8 of it, 4 of 4 0.67; a model-free drafter's evidence from other requests counts once the
request has shown some of its own: `Planner._evidenced`). Drafting beyond it is a probe, priced at its worst case:
the seconds it adds to the step (its tokens all rejected, its catch-up wasted; a drafter's first probe too). A
probe is bought only where the budget covers that, and the budget is a share (`SHARE`) of the plain time of the
call's tokens: those committed so far and those its running rows are expected to commit still
(row_lengths.py), so a request's probes may lose 2% of its own plain time from its first step, and
no more: what earlier calls left unspent is not carried into one request. One exception, learning: a
drafter the pool has little evidence of yet (fewer than `LEARNED` observations, decayed, and those
mostly right: `Planner._learning`) may also be probed from the pool's account, the same share of the
plain time of every call so far, less what learning probes have lost: a draft model whose first probe
(its catch-up of a prompt) costs more than a short call's share is tried once the pool has decoded
enough, and what it learns serves every later call. It stays learning until the evidence alone can draft
it or its guesses fail: one token right is no plan, and a probe dearer than a short call's share (a
GPU's 5 ms step, a 0.5B token and its engine work: 1-1.5 steps against 32 tokens' 0.64) would never be
bought again on the call's share alone. The account lends a call at most the call's own share, so no
call loses more than twice its share: a first probe that costs 10% of a 32-token request on a CPU waits
for a request long enough to afford it. The tokens a probe gets accepted
beyond the exploit plan are refunded at plain decoding's price (to the account it drew on first), so
a probe that pays funds the next; and what its step cost beyond the prices it was bought at is charged once the
step is measured (`Probe.overrun`), so the accounts hold what probes lost, not what they were expected to.
A probe is as short as what it must learn: one token tells whether the drafter's guesses hold on the
request; it grows only while each extra token adds at most `FREE` of a plain step (flat verification: a
GPU, an AMX CPU, where long probes cost nothing). An idle
catch-up the evidence does not pay for is bought from the same budget (`spend`). The same rule on
every machine, read from its profile.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

# The share of the plain time so far that probes may lose.
SHARE = 0.02
# A probe grows past one token only while each extra token adds at most this share of a plain step.
FREE = 0.01
# Observations (decayed) of a drafter below which the pool's account lends its probes: what the evidence-only plan
# needs to draft a good drafter on its own (4 of 4 right reads 0.67 under the pessimistic prior: acceptance.py).
LEARNED = 4.0


class ExplorationBudget:
    """Seconds the planner may still lose on probes in a call, and what it has lost (charged at each probe's
    worst case, then what its step cost beyond its price (`Probe.overrun`), refunded by what it got accepted)."""

    def __init__(self, share: float = SHARE):
        self.share = share
        self.pool_plain_seconds = 0.0  # the plain time of every call's committed tokens (the learning account)
        self.learning_spent = 0.0  # what learning probes have drawn on it, less their refunds
        self.begin()

    def begin(self) -> None:
        """A new call (`generate`, or a server's engine): nothing committed, expected or spent yet."""
        self.plain_seconds = 0.0  # what plain decoding would have taken for the call's tokens committed so far
        # ... and, per running row, for the tokens it is expected to commit still (`expect`; a pipeline's lanes
        # each set their own rows')
        self.expected_rows: dict[int, float] = {}
        self.spent = 0.0  # probes' seconds, less their refunds
        self.lent = 0.0  # what the learning account has lent this call's probes, less their refunds
        # row ids -> the probe bought for the step of these rows, until the step is settled
        self.open: dict[tuple[int, ...], Probe] = {}

    @property
    def expected(self) -> float:
        """The plain time of the tokens the running rows are expected to commit still."""
        return sum(self.expected_rows.values())

    @property
    def call_share(self) -> float:
        """The share of the plain time of the call's tokens (committed and expected): what it may lose to probes,
        and what the pool's account may lend it besides."""
        return self.share * (self.plain_seconds + self.expected)

    @property
    def left(self) -> float:
        """The call's account."""
        return self.call_share - self.spent

    @property
    def lendable(self) -> float:
        """What the pool's account may still lend this call for the probes of a drafter it has little evidence
        of (`LEARNED`): its balance, and at most the call's own share."""
        balance = self.share * self.pool_plain_seconds - self.learning_spent
        return max(min(balance, self.call_share - self.lent), 0.0)

    def expect(self, row_ids: list[int], tokens_left: list[int | None], plain_step: float) -> None:
        """Rows `row_ids` (a step's batch) are expected to commit `tokens_left` ([B], None: unknown, none counted)
        more, in steps of `plain_step` seconds each for the batch: a row's share of a step each."""
        for r, n in zip(row_ids, tokens_left):
            self.expected_rows[r] = (n or 0) * plain_step / max(len(row_ids), 1)

    def end_rows(self, row_ids: list[int]) -> None:
        """These rows left: nothing more is expected of them."""
        for r in row_ids:
            self.expected_rows.pop(r, None)

    def afford(
        self,
        row_ids: list[int],
        exploit: list[int],
        probes: list[tuple[list[int], float]],
        plain_step: float,
        learning: bool = False,
        drafting: Callable[[list[int]], float] | None = None,
    ) -> tuple[list[int], float]:
        """(ks, seconds charged): of `probes` ([(ks, seconds it adds to the exploit plan)], a token a row
        beyond it, two, ...), the longest whose tokens past the first probe's add at most `FREE` of
        `plain_step` each, if the budget covers it; the exploit plan (charged nothing) where not even the
        first probe is covered. learning: a drafter the pool has little evidence of is probed, so the pool's account
        adds to the call's, and is drawn on first. drafting: bought before drafting, ks -> the seconds the step's
        drafting (its catch-ups in full) is priced at (what `settle` holds its measured drafting to); None after."""
        pool = self.lendable if learning else 0.0
        chosen = (exploit, 0.0)
        for ks, seconds in probes:
            extra = sum(ks) - sum(probes[0][0])
            if seconds > self.left + pool or seconds > probes[0][1] + FREE * plain_step * extra:
                break
            chosen = (ks, seconds)
        if chosen[1] > 0:
            drawn = min(chosen[1], pool)
            self.learning_spent += drawn
            self.lent += drawn
            self.spent += chosen[1] - drawn
            before = self.open.get(tuple(row_ids), Probe(exploit, exploit))  # bought before drafting, trimmed after
            self.open[tuple(row_ids)] = Probe(
                [min(a, b) for a, b in zip(before.exploit, exploit)],
                [max(a, b) for a, b in zip(before.probed, chosen[0])],
                before.drawn + drawn,
                before.charged + chosen[1],
                before.drafting if drafting is None else drafting(chosen[0]),
            )
        return chosen

    def spend(self, seconds: float, then: float = 0.0) -> bool:
        """Buy something whose worth is unknown (an idle catch-up the evidence does not pay for) at `seconds`,
        if the budget covers it and `then` seconds more (the probe it is the first half of); nothing is refunded."""
        if seconds + then > self.left:
            return False
        self.spent += seconds
        return True

    def bought(self, row_ids: list[int]) -> list[int]:
        """[B] the sizes a probe bought for this step's rows (0 where none)."""
        probe = self.open.get(tuple(row_ids))
        return probe.probed if probe is not None else [0] * len(row_ids)

    def settle(
        self,
        row_ids: list[int],
        accepted: list[int],
        plain_step: float,
        verify: tuple[float, float] = (0.0, 0.0),
        drafting: float = 0.0,
        timed: bool = True,
    ) -> None:
        """A step of `len(row_ids)` rows accepted `accepted` ([B]) draft tokens: earn its share of the plain
        time of what it committed; a probe's, charge what it cost beyond its price (`Probe.overrun`: verify is the
        step's forward (priced, measured), drafting its measured drafting; not where the step set up a graph, not
        `timed`: that time is no probe's) and refund its tokens accepted beyond the exploit plan."""
        B = len(row_ids)
        earned = (sum(accepted) + B) / B * plain_step
        self.plain_seconds += earned
        self.pool_plain_seconds += earned
        probe = self.open.pop(tuple(row_ids), None)
        if probe is None:
            return
        extra = probe.overrun(verify, drafting, plain_step) if timed else 0.0
        lent = extra * probe.drawn / probe.charged if probe.charged > 0 else 0.0  # as the price was drawn
        self.learning_spent += lent
        self.lent += lent
        self.spent += extra - lent
        refund = sum(max(0, min(a, p) - e) for a, p, e in zip(accepted, probe.probed, probe.exploit)) / B * plain_step
        back = min(refund, probe.drawn)  # to the learning account first, what it lent
        self.learning_spent -= back
        self.lent -= back
        self.spent -= refund - back


@dataclass
class Probe:
    """A probe bought for a step: the sizes the exploit plan and the probe gave its rows ([B] each), the seconds
    charged for it (`drawn` of them on the learning account), and, bought before drafting, the drafting's price."""

    exploit: list[int]
    probed: list[int]
    drawn: float = 0.0
    charged: float = 0.0
    drafting: float | None = None

    def overrun(self, verify: tuple[float, float], drafting: float, plain_step: float) -> float:
        """Seconds the probe cost beyond its charge: the step's forward and drafting (where it bought the drafting)
        measured against their prices (`verify`: (priced, measured)), the probe's part of it: its charge over what
        the step was priced beyond a plain one (all of it where the exploit plan was plain). Negative where the step
        cost less, never below refunding the charge. Charged at its price alone, a probe that a machine's stale
        profile or a busy neighbour made dearer would be bought again and again at that price."""
        over = verify[1] - verify[0] + (drafting - self.drafting if self.drafting is not None else 0.0)
        excess = verify[0] + (self.drafting or 0.0) - plain_step  # what the step was priced beyond a plain one
        share = min(self.charged / excess, 1.0) if excess > self.charged else 1.0
        return max(over * share, -self.charged)
