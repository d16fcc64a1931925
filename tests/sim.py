"""A simulated engine for policy tests: drafters with known acceptance and costs, no models.

It runs generation.py's steps 3-7 on made-up numbers: plan -> drafts (and shadow drafts) -> verify
-> commit -> catch-up -> `StepFeedback` (built as the engine builds it, so `measured_row_seconds` is the engine's).

- Tokens: the target's next token at sequence position j is `truth(j) = 1000 + j`. A drafter with
  per-token acceptance alpha on a row's type proposes truth with probability alpha at each position,
  else a wrong token drawn from 1..9 (so wrong drafters sometimes agree, as real ones do). Alone, a
  drafter's accepted count is therefore truncated geometric: P(accepted >= i) = alpha^i, i <= k.
  Several drafters: the engine's vote (`heaviest_path`) picks the path.
- Time: draft seconds of drafter d = forward_seconds x (largest k it serves) + token_seconds x
  (sum of k over its rows) + catch_up_seconds x (tokens fed to its cache: the new tail of each row
  it serves, or everything since it last served the row); verify seconds = base + per_token x
  (tokens verified)^power, the tokens packed (B + drafts) or, `padded`, B x (1 + longest draft) as
  on a rectangular cache, x `sustained` on a step no drafter with parameters drafted in (back-to-back
  target forwards). Every time is multiplied by a seeded log-normal noise.
- Caches: per (row, drafter) the number of committed tokens the drafter holds, rolled back to the
  accepted prefix after each draft, as `ModelDrafter._catch_up` does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from hf_spin.planning.estimates import geometric_tokens
from hf_spin.planning.plan import shadow_lengths
from hf_spin.policies import BatchView, DrafterInfo, Plan, Policy, StepFeedback
from hf_spin.verify.vote_tree import heaviest_path

TRUTH_OFFSET = 1000  # truth(j) = 1000 + j; wrong tokens are 1..9


@dataclass(frozen=True)
class SimDrafter:
    name: str
    alpha: dict[str, float]  # row type -> per-token acceptance
    token_seconds: float = 0.0  # per draft token per row served
    forward_seconds: float = 0.0  # per sequential forward (paid once for all rows it serves)
    catch_up_seconds: float = 0.0  # per token fed into its cache
    kind: str = "model"
    num_parameters: int = 1
    # row type -> probability that it drafts at all at a step (all or nothing, as prompt lookup: a match or none);
    # None: always
    matches: dict[str, float] | None = None
    # row type -> ((match length, probability, alpha), ...): at a step it finds a match of that length
    # with that probability (the rest: no draft) and proposes at that per-token acceptance, reporting
    # the length (None: drawn alike, not reported); replaces alpha and matches for that row type
    by_match: dict[str, tuple[tuple[int | None, float, float], ...]] | None = None

    def info(self) -> DrafterInfo:
        return DrafterInfo(self.name, self.kind, self.num_parameters, gives_q=self.kind == "model")

    def seconds(self, drafted: list[int], fed: int) -> float:
        """A step's drafting for the rows it serves: [s] tokens drafted per row, `fed` tokens caught up."""
        return (
            self.forward_seconds * max(drafted, default=0)
            + self.token_seconds * sum(drafted)
            + self.catch_up_seconds * fed
        )


@dataclass(frozen=True)
class SimVerify:
    base: float  # seconds of a verify forward with no tokens
    per_token: float  # seconds per token verified (per token^power)
    power: float = 1.0  # < 1: concave in the tokens verified, as measured on a CPU
    # x on a step where no drafter with parameters ran (plain, prompt lookup): target forwards back to
    # back, which on the bench's CPU cost ~10% more each than between a draft model's forwards
    sustained: float = 1.0

    def seconds(self, n_tokens: float, sustained: bool = False) -> float:
        return (self.base + self.per_token * n_tokens**self.power) * (self.sustained if sustained else 1.0)


@dataclass
class Trace:
    """What a run planned and saw, step by step."""

    plans: list[Plan] = field(default_factory=list)
    feedback: list[StepFeedback] = field(default_factory=list)
    types: list[list[str]] = field(default_factory=list)  # [steps][B] row types of each step's batch


class Simulator:
    def __init__(
        self,
        drafters: list[SimDrafter],
        row_types: list[str],
        verify: SimVerify,
        prompt_lengths: list[int] | None = None,
        noise: float = 0.05,
        seed: int = 0,
        max_new_tokens: int | list[int] | None = None,
        padded: bool = False,
    ):
        self.drafters, self.verify, self.noise, self.padded = drafters, verify, noise, padded
        self.rng = np.random.default_rng(seed)
        B = len(row_types)
        self.row_ids = list(range(B))
        self.next_id = B  # id of the next request to join
        self.types = list(row_types)
        self.prompt_lengths = list(prompt_lengths or [32] * B)
        self.lengths = list(self.prompt_lengths)  # committed tokens per row
        self.generated = [0] * B
        limit = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * B
        self.limits = list(limit)
        self.covered = [[0] * len(drafters) for _ in range(B)]  # [B][num_drafters] tokens each cache holds
        self.usable = [True] * len(drafters)
        self.step_index = 0
        self.trace = Trace()

    def add_rows(
        self, policy: Policy, row_types: list[str], prompt_length: int = 32, max_new_tokens: int | None = None
    ) -> None:
        """New requests join the batch between steps (continuous batching), announced to the policy."""
        first = len(self.row_ids)
        self.row_ids += list(range(self.next_id, self.next_id + len(row_types)))
        self.next_id += len(row_types)
        self.types += list(row_types)
        self.prompt_lengths += [prompt_length] * len(row_types)
        self.lengths += [prompt_length] * len(row_types)
        self.generated += [0] * len(row_types)
        self.limits += [max_new_tokens] * len(row_types)
        self.covered += [[0] * len(self.drafters) for _ in row_types]
        policy.start_rows(self.view(), list(range(first, len(self.row_ids))))

    @property
    def infos(self) -> list[DrafterInfo]:
        return [d.info() for d in self.drafters]

    def view(self) -> BatchView:
        room = None if any(m is None for m in self.limits) else [m - g for m, g in zip(self.limits, self.generated)]
        return BatchView(
            list(self.row_ids),
            list(self.prompt_lengths),
            list(self.generated),
            list(self.usable),
            self.step_index,
            room,
        )

    def start(self, policy: Policy) -> Policy:
        policy.bind(self.infos)
        policy.start_rows(self.view(), list(range(len(self.row_ids))))
        return policy

    # --- one step ----------------------------------------------------------------------------

    def _noisy(self, seconds: float) -> float:
        return seconds * float(np.exp(self.noise * self.rng.standard_normal())) if self.noise else seconds

    def _propose(self, b: int, d: int, k: int) -> tuple[list[int], int | None]:
        """Drafter d's draft of k tokens for row b, and the match length it reports (None: none)."""
        sd, kind = self.drafters[d], self.types[b]
        match = None
        if sd.by_match is not None and kind in sd.by_match:
            u, alpha = self.rng.random(), None
            for length, probability, a in sd.by_match[kind]:
                if u < probability:
                    match, alpha = length, a
                    break
                u -= probability
            if alpha is None:
                return [], None
        else:
            alpha = sd.alpha[kind]
            if sd.matches is not None and self.rng.random() >= sd.matches[kind]:
                return [], None
        start = self.lengths[b]
        return [
            self._truth(b, start + i) if self.rng.random() < alpha else int(self.rng.integers(1, 10)) for i in range(k)
        ], match

    def _truth(self, b: int, position: int) -> int:
        """The target's greedy token at sequence `position` of row b."""
        return TRUTH_OFFSET + position

    def step(self, policy: Policy) -> StepFeedback:
        B, n = len(self.row_ids), len(self.drafters)
        # 3. Plan, capped like the engine: unusable drafters removed, k = 0 for plain rows.
        plan = policy.plan(self.view())
        chosen = [tuple(d for d in plan.drafters[b] if self.usable[d]) for b in range(B)]
        ks = [max(0, plan.k[b]) if chosen[b] else 0 for b in range(B)]
        # 4. Draft: each drafter catches up its rows, then proposes; several drafters per row vote.
        #    4a: a preempting drafter (Plan.preempt) first; rows it proposes enough for verify its draft.
        proposals: list[dict[int, list[int]]] = [{} for _ in range(B)]
        shadows: list[dict[int, list[int]]] = [{} for _ in range(B)]
        draft_seconds = [0.0] * n
        match_lengths: list[dict[int, int]] = [{} for _ in range(B)]
        for d, wanted in plan.preempt.items():
            served = [b for b in sorted(wanted) if self.usable[d] and d not in chosen[b] and wanted[b][0] > 0]
            lengths = []
            for b in served:
                k, least, min_match = wanted[b]
                draft, match = self._propose(b, d, k)
                lengths.append(len(draft))
                if match is not None:
                    match_lengths[b][d] = match
                if len(draft) >= least and (match is None or match >= min_match):
                    chosen[b], ks[b], proposals[b][d] = (d,), k, draft
                else:
                    shadows[b][d] = draft
            if served:
                draft_seconds[d] += self._noisy(self.drafters[d].seconds(lengths, 0))
        for d, sd in enumerate(self.drafters):
            served = [b for b in range(B) if d in chosen[b] and ks[b] > 0 and d not in proposals[b]]
            if not served:
                continue
            noise = self._noisy(
                1.0
            )  # drawn before the proposals: the tests' seeded random streams depend on that order
            for b in served:
                proposals[b][d], match = self._propose(b, d, ks[b])
                if match is not None:
                    match_lengths[b][d] = match
            fed = sum(max(1, self.lengths[b] - self.covered[b][d]) for b in served)
            draft_seconds[d] = noise * sd.seconds([len(proposals[b][d]) for b in served], fed)
        # 4b. Shadow drafts (Plan.shadow): proposed for rows the drafter does not serve, never verified.
        for d, wanted in plan.shadow.items():
            served = [
                b for b in wanted if self.usable[d] and d not in chosen[b] and d not in shadows[b] and wanted[b] > 0
            ]
            for b in served:
                shadows[b][d], match = self._propose(b, d, wanted[b])
                if match is not None:
                    match_lengths[b][d] = match
            if served:
                draft_seconds[d] += self._noisy(self.drafters[d].seconds([len(shadows[b][d]) for b in served], 0))
        drafts = []
        for b in range(B):
            if len(proposals[b]) == 1:
                drafts.append(next(iter(proposals[b].values())))
            elif proposals[b]:
                drafts.append(heaviest_path(proposals[b], plan.vote_weights or [1.0] * n)[: ks[b]])
            else:
                drafts.append([])
        # 5. Verify against the truth.
        accepted, new_tokens = [], []
        for b in range(B):
            truth = [self._truth(b, self.lengths[b] + i) for i in range(len(drafts[b]) + 1)]
            a = next((i for i, (x, y) in enumerate(zip(drafts[b], truth)) if x != y), len(drafts[b]))
            accepted.append(a)
            new_tokens.append(drafts[b][:a] + [truth[a]])
        verified = B * (1 + max(map(len, drafts), default=0)) if self.padded else B + sum(map(len, drafts))
        model_drafted = any(draft_seconds[d] > 0 and self.drafters[d].num_parameters > 0 for d in range(n))
        verify_seconds = self._noisy(self.verify.seconds(verified, sustained=not model_drafted))
        # 6. Commit; each serving drafter's cache keeps the prefix its draft shares with the new tokens.
        matched = [{d: _common_prefix(p, new_tokens[b]) for d, p in proposals[b].items()} for b in range(B)]
        for b in range(B):
            old = self.lengths[b]
            self.lengths[b] += len(new_tokens[b])
            self.generated[b] += len(new_tokens[b])
            for d, p in proposals[b].items():
                self.covered[b][d] = old + min(matched[b][d], max(len(p) - 1, 0))
        # 7. Idle drafters named by the plan catch up.
        for d, rows in plan.catch_up.items():
            if self.usable[d] and rows:
                fed = sum(max(0, self.lengths[b] - self.covered[b][d]) for b in rows)
                draft_seconds[d] += self._noisy(self.drafters[d].catch_up_seconds * fed)
                for b in rows:
                    self.covered[b][d] = self.lengths[b]
        executed = Plan(
            list(chosen), ks, plan.min_confidence, plan.vote_weights, plan.catch_up, shadow_lengths(plan, shadows)
        )
        feedback = StepFeedback(
            row_ids=list(self.row_ids),
            plan=executed,
            drafted=[len(x) for x in drafts],
            accepted=accepted,
            proposed=[{d: len(t) for d, t in p.items()} for p in proposals],
            matched=matched,
            shadow_proposed=[{d: len(t) for d, t in sh.items()} for sh in shadows],
            shadow_matched=[{d: _common_prefix(t, new_tokens[b]) for d, t in shadows[b].items()} for b in range(B)],
            match_lengths=match_lengths,
            draft_seconds=draft_seconds,
            verify_seconds=verify_seconds,
            padded=self.padded,
        )
        self.trace.plans.append(plan)
        self.trace.feedback.append(feedback)
        self.trace.types.append(list(self.types))
        policy.update(feedback)
        self.step_index += 1
        self._retire(policy)
        return feedback

    def _retire(self, policy: Policy) -> None:
        """Rows that reached their max_new_tokens leave the batch."""
        done = [
            b for b in range(len(self.row_ids)) if self.limits[b] is not None and self.generated[b] >= self.limits[b]
        ]
        if not done:
            return
        policy.end_rows([self.row_ids[b] for b in done])
        keep = [b for b in range(len(self.row_ids)) if b not in done]
        for name in ("row_ids", "types", "prompt_lengths", "lengths", "generated", "limits", "covered"):
            setattr(self, name, [getattr(self, name)[b] for b in keep])

    def run(self, policy: Policy, steps: int) -> Trace:
        for _ in range(steps):
            if not self.row_ids:
                break
            self.step(policy)
        return self.trace

    # --- ground truth ------------------------------------------------------------------------

    def row_goodput(self, row_type: str, drafter: int | None, k: int, batch_size: int) -> float:
        """Expected goodput of one row (tokens/s) when every row of the batch drafts k tokens with a
        drafter whose cost is per row (token_seconds only); drafter None: every row plain."""
        if drafter is None:
            return batch_size / self.verify.seconds(batch_size)
        sd = self.drafters[drafter]
        per_row = self.verify.seconds(batch_size * (k + 1)) / batch_size + sd.token_seconds * k
        return geometric_tokens(sd.alpha[row_type], k) / per_row

    def best_drafter(self, row_type: str, k: int, batch_size: int) -> int:
        return max(range(len(self.drafters)), key=lambda d: self.row_goodput(row_type, d, k, batch_size))


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)
