"""Exploration within a budget: what the planner may spend on drafts its estimates do not expect to pay.

Before drafting, the planner reads each request's survival one sd up (`planner.OPTIMISM`): a new
request tries a drafter that might pay on it. Where verification is flat such a probe costs almost
nothing; where it is not (a CPU without fast bf16 matmuls verifies 8 tokens at ~6 plain steps) an
8-token probe at 0% acceptance costs 5 plain steps, and a pool probing every new request ran 0.94x
plain decoding (docs/planning.md, "Exploration").

What the estimates expect to pay is the plan at the mean read with a pessimistic prior (`exploit`:
the usual prior's guess of 0.6 is no expectation; a pool that has seen a drafter right 22 times in
25 expects about 0.8 of it, 4 of 4 0.67). Drafting beyond it is a probe, priced at its worst case:
the seconds it adds to the step (its tokens all rejected, its catch-up wasted; a drafter's first probe too). A
probe is bought only where the budget covers that, and the budget is a share (`SHARE`) of the plain time of the
call's tokens: those committed so far and those its running rows are expected to commit still
(row_lengths.py), so a request's probes may lose 2% of its own plain time from its first step, and
no more: what earlier calls left unspent is not carried into one request. One exception, learning:
a drafter the pool has no evidence of yet may also be probed from the pool's account, the same
share of the plain time of every call so far, less what first probes have lost: a draft model whose
first probe (its catch-up of a prompt) costs more than a short call's share is tried once the pool
has decoded enough, and what it learns serves every later call. The account lends a call at most the
call's own share, so no call loses more than twice its share: a first probe that costs 10% of a
32-token request on a CPU waits for a request long enough to afford it. The tokens a probe gets accepted
beyond the exploit plan are refunded at plain decoding's price (to the account it drew on first), so
a probe that pays funds the next. A probe is as short as what it must learn: one token tells whether the
drafter's guesses hold on the request; it grows only while each extra token adds at most `FREE`
of a plain step (flat verification: a GPU, an AMX CPU, where long probes cost nothing). An idle
catch-up the evidence does not pay for is bought from the same budget (`spend`). The same rule on
every machine, read from its profile.
"""

from __future__ import annotations

# The share of the plain time so far that probes may lose.
SHARE = 0.02
# A probe grows past one token only while each extra token adds at most this share of a plain step.
FREE = 0.01


class ExplorationBudget:
    """Seconds the planner may still lose on probes in a call, and what it has lost (charged at each probe's
    worst case, refunded by what it got accepted)."""

    def __init__(self, share: float = SHARE):
        self.share = share
        self.pool_plain_seconds = 0.0  # the plain time of every call's committed tokens (the learning account)
        self.learning_spent = 0.0  # what first probes have drawn on it, less their refunds
        self.begin()

    def begin(self) -> None:
        """A new call (`generate`, or a server's engine): nothing committed, expected or spent yet."""
        self.plain_seconds = 0.0  # what plain decoding would have taken for the call's tokens committed so far
        # ... and, per running row, for the tokens it is expected to commit still (`expect`; a pipeline's lanes
        # each set their own rows')
        self.expected_rows: dict[int, float] = {}
        self.spent = 0.0  # probes' seconds, less their refunds
        self.lent = 0.0  # what the learning account has lent this call's first probes, less their refunds
        # row ids -> (exploit ks, probed ks, seconds drawn on the learning account)
        self.open: dict[tuple[int, ...], tuple[list[int], list[int], float]] = {}

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
        """What the pool's account may still lend this call for the first probes of a drafter it has no evidence
        of: its balance, and at most the call's own share."""
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
    ) -> tuple[list[int], float]:
        """(ks, seconds charged): of `probes` ([(ks, seconds it adds to the exploit plan)], a token a row
        beyond it, two, ...), the longest whose tokens past the first probe's add at most `FREE` of
        `plain_step` each, if the budget covers it; the exploit plan (charged nothing) where not even the
        first probe is covered. learning: a drafter the pool has no evidence of is probed, so the pool's account
        adds to the call's, and is drawn on first."""
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
            before = self.open.get(tuple(row_ids), (exploit, exploit, 0.0))  # bought before drafting, trimmed after
            self.open[tuple(row_ids)] = (
                [min(a, b) for a, b in zip(before[0], exploit)],
                [max(a, b) for a, b in zip(before[1], chosen[0])],
                before[2] + drawn,
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
        return self.open.get(tuple(row_ids), (None, [0] * len(row_ids), 0.0))[1]

    def settle(self, row_ids: list[int], accepted: list[int], plain_step: float) -> None:
        """A step of `len(row_ids)` rows accepted `accepted` ([B]) draft tokens: earn its share of the plain
        time of what it committed, and refund a probe its tokens accepted beyond the exploit plan."""
        B = len(row_ids)
        earned = (sum(accepted) + B) / B * plain_step
        self.plain_seconds += earned
        self.pool_plain_seconds += earned
        exploit, probed, drawn = self.open.pop(tuple(row_ids), (None, None, 0.0))
        if probed is not None:
            refund = sum(max(0, min(a, p) - e) for a, p, e in zip(accepted, probed, exploit)) / B * plain_step
            back = min(refund, drawn)  # to the learning account first, what it lent
            self.learning_spent -= back
            self.lent -= back
            self.spent -= refund - back
