"""Acceptance: what the planner believes each drafter's drafts survive, per position, learned from every step.

    acceptance.observe(drafter, row, proposed, matched, committed, match)   # after a step
    acceptance.survival(drafter, row, k, match)                            # [k] S(i), when sizing

A draft's position i survives with the product of the conditional acceptances of positions 1..i; each is a
posterior mean over decayed counts in three levels (pooled, per position, per match length) and the request's
own factor (docs/planning.md, "The planner"). The planner (planner.py) reads it to size drafts and trees.
"""

from __future__ import annotations

import math

from .estimates import acceptance_with_prior

# Acceptance assumed before any evidence (typical of small same-family drafters and of prompt lookup
# on text that repeats), and the pseudo-observations behind it.
PRIOR_ACCEPTANCE = 0.6
PRIOR_WEIGHT = 2.0
# Pseudo-observations behind a drafter's pooled acceptance when estimating one position, and behind
# a position's acceptance when estimating it for one match length: a few observations of its own move it.
LEVEL_WEIGHT = 4.0
# Forgetting per step, for every count: acceptance drifts with the text, and evidence against a
# drafter fades (half-life ~35 steps), so a drafter judged not worth drafting is measured again.
SURVIVAL_DECAY = 0.98
# The prior read where a plan must be what the estimates expect to pay (`Planner._explore`): acceptance 0
# worth PRIOR_WEIGHT observations, so the evidence alone earns it (4 of 4 right reads 0.67, not 1.0: a few
# lucky drafts do not buy a draft model's catch-up); drafting beyond that plan is a probe, bought from the
# exploration budget (exploration.py).
EVIDENCE_ONLY = (0.0, PRIOR_WEIGHT)
# Lookup match lengths are told apart up to this (longer ones share the last bucket).
MATCH_BUCKETS = 4


class Acceptance:
    """Per drafter, per draft position i (1-based), the acceptance of position i given that the
    positions before it were accepted, learned from every step's drafts against the committed tokens.

    Three levels, each the prior of the next: the drafter's pooled acceptance (prior PRIOR_ACCEPTANCE),
    per position (LEVEL_WEIGHT pseudo-observations of the pooled value), per position and match-length
    bucket for drafters that report matches (prompt lookup). A level's prior is read from the level
    above without the level's own counts, which the level above holds too, and is worth at most what
    that holds (its counts and its own prior's weight): so every observation and the prior are read
    once, also where one position holds all the evidence (a fresh pool's first drafts). Then the
    request: its own pooled acceptance with the drafter (LEVEL_WEIGHT pseudo-observations of the
    drafter's), as a factor on the position's (code copies well, open chat does not), raised to the
    part of the pool's evidence that is not the request's: the levels above already hold the
    request's own observations (at batch 1 the pool's recent evidence is mostly the running
    request's), and a full factor would count them twice. Counts decay by SURVIVAL_DECAY per step;
    a request's are dropped once decayed to nothing (it ended)."""

    def __init__(self, num_drafters: int):
        self.pooled = [[0.0, 0.0] for _ in range(num_drafters)]  # [accepted, rejected]
        self.counts: dict[
            tuple[int, int | None, int], list[float]
        ] = {}  # (drafter, match bucket or None, position) -> [accepted, rejected]
        self.rows: dict[tuple[int, int], list[float]] = {}  # (drafter, row id) -> [accepted, rejected]
        # [accepted, rejected] per drafter: a token tree's siblings of its heaviest path where that path failed
        self.alternatives = [[0.0, 0.0] for _ in range(num_drafters)]

    @staticmethod
    def bucket(match: int | None) -> int | None:
        return None if match is None else min(max(match, 1), MATCH_BUCKETS)

    def observe(
        self,
        drafter: int,
        row: int,
        proposed: int,
        matched: int,
        committed: int,
        match: int | None = None,
        seen: int = 0,
    ) -> None:
        """A draft of `proposed` tokens whose first `matched` equal the step's `committed` tokens:
        positions 1..matched were accepted, position matched + 1 rejected if it was checked (within
        the draft and the committed tokens); what lies beyond is unknown. seen: its first positions already
        observed (a draft followed past its step: step/continuations.py), not counted again."""
        accepted = min(matched, proposed, committed)
        rejected_at = accepted + 1 if accepted < min(proposed, committed) else None
        for i in range(seen + 1, accepted + 1):
            self._add(drafter, row, i, match, 0)
        if rejected_at is not None:
            self._add(drafter, row, rejected_at, match, 1)

    def _add(self, drafter: int, row: int, position: int, match: int | None, outcome: int) -> None:
        self.pooled[drafter][outcome] += 1
        self.rows.setdefault((drafter, row), [0.0, 0.0])[outcome] += 1
        for m in {None, self.bucket(match)}:
            self.counts.setdefault((drafter, m, position), [0.0, 0.0])[outcome] += 1

    def observe_alternatives(self, drafter: int, accepted: bool) -> None:
        """Where the drafter's token tree offered siblings beside its heaviest path's failed node: was one accepted."""
        self.alternatives[drafter][0 if accepted else 1] += 1

    def alternative(self, drafter: int, prior: tuple[float, float] = (PRIOR_ACCEPTANCE, PRIOR_WEIGHT)) -> float:
        """P(one of a node's other children is accepted | its heaviest child was rejected)."""
        return acceptance_with_prior(*self.alternatives[drafter], *prior)

    def decay(self) -> None:
        for c in self.pooled + self.alternatives:
            c[0] *= SURVIVAL_DECAY
            c[1] *= SURVIVAL_DECAY
        for c in list(self.counts.values()) + list(self.rows.values()):
            c[0] *= SURVIVAL_DECAY
            c[1] *= SURVIVAL_DECAY
        self.rows = {key: c for key, c in self.rows.items() if c[0] + c[1] > 0.01}

    def evidence(self, drafter: int) -> float:
        """Decayed observations of the drafter (all positions)."""
        return sum(self.pooled[drafter])

    def seen(self, drafter: int, row: int) -> float:
        """Decayed observations of the drafter on request `row` (its own evidence; 0 before any)."""
        return sum(self.rows.get((drafter, row), (0.0, 0.0)))

    def conditionals(
        self,
        drafter: int,
        row: int,
        k: int,
        match: int | None = None,
        optimism: float = 0.0,
        prior: tuple[float, float] = (PRIOR_ACCEPTANCE, PRIOR_WEIGHT),
    ) -> list[float]:
        """[k] P(position i accepted | positions before it accepted) on request `row`, i = 1..k, `optimism` posterior
        sds up; `prior`: (acceptance, pseudo-observations) assumed before evidence (`EVIDENCE_ONLY`: a pessimistic
        one). What does not depend on the position (the pool's mean, the request's own share) is read once."""
        pooled = acceptance_with_prior(*self.pooled[drafter], *prior)
        if pooled == 0:
            return [0.0] * k
        levels = (None, self.bucket(match)) if match is not None else (None,)
        a, r = self.rows.get((drafter, row), (0.0, 0.0))
        share = (a + r) / max(self.evidence(drafter), a + r, 1e-9)  # of the pool's evidence, the request's own
        own = (acceptance_with_prior(a, r, pooled, LEVEL_WEIGHT) / pooled) ** (1.0 - share)
        seen = a + r + LEVEL_WEIGHT + 1  # the request's own evidence, the pool's mean as LEVEL_WEIGHT observations
        out = []
        for position in range(1, k + 1):
            above, mean, level_prior = self.pooled[drafter], pooled, prior
            for m in levels:
                la, lr = self.counts.get((drafter, m, position), (0.0, 0.0))
                # the level's prior: the level above without this level's own counts (else counted twice), worth at
                # most what it holds (those counts and its own prior's weight: where this level holds all the
                # evidence, the prior alone, at its own weight, not LEVEL_WEIGHT)
                rest = (max(above[0] - la, 0.0), max(above[1] - lr, 0.0))
                weight = min(LEVEL_WEIGHT, rest[0] + rest[1] + level_prior[1])
                level_prior = (acceptance_with_prior(*rest, *level_prior), weight)
                mean, above = acceptance_with_prior(la, lr, *level_prior), (la, lr)
            mean = min(mean * own, 0.999)
            if optimism:
                mean += optimism * math.sqrt(mean * (1 - mean) / seen)
            out.append(min(max(mean, 0.0), 0.999))
        return out

    def survival(
        self,
        drafter: int,
        row: int,
        k: int,
        match: int | None = None,
        optimism: float = 0.0,
        prior: tuple[float, float] = (PRIOR_ACCEPTANCE, PRIOR_WEIGHT),
    ) -> list[float]:
        """[k] S(i): the probability that a draft for request `row` survives to position i (1..k)."""
        out, s = [], 1.0
        for c in self.conditionals(drafter, row, k, match, optimism, prior):
            s *= c
            out.append(s)
        return out
