"""What a call did: per row and per drafter counts, times and the derived rates.

Glossary: acceptance rate = accepted / drafted; mean accepted length = tokens produced per target
forward (accepted drafts + the recovered-or-bonus token, so 1.0 for plain decoding);
goodput = tokens produced per second of wall time.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0


@dataclass
class Counts:
    drafted: int = 0  # draft tokens the target verified
    accepted: int = 0  # draft tokens the target accepted
    target_forwards: int = 0  # verification forwards (prefill not counted)
    new_tokens: int = 0  # tokens produced (accepted + recovered/bonus, cut at a stop)
    draft_seconds: float = 0.0
    longest_draft: int = (
        0  # most draft tokens verified in one forward (a model drafter's confidence stop keeps it below k)
    )

    def add(self, drafted: int, accepted: int, new_tokens: int) -> None:
        self.drafted += drafted
        self.accepted += accepted
        self.new_tokens += new_tokens
        self.target_forwards += 1
        self.longest_draft = max(self.longest_draft, drafted)

    @property
    def rejected(self) -> int:
        """Draft tokens the target rejected: a step that rejects cuts its draft at the first rejection,
        so rejected > 0 exactly when some step took the rejection path."""
        return self.drafted - self.accepted

    @property
    def acceptance_rate(self) -> float:
        return _ratio(self.accepted, self.drafted)

    @property
    def mean_accepted_length(self) -> float:
        return _ratio(self.new_tokens, self.target_forwards)


@dataclass
class RowStats(Counts):
    drafters: Counter = field(default_factory=Counter)  # drafter name -> steps it served this row
    wall_seconds: float = 0.0  # from the start of the call to the row's last token

    @property
    def goodput(self) -> float:
        return _ratio(self.new_tokens, self.wall_seconds)


@dataclass
class DrafterStats(Counts):
    """A drafter's counts: `drafted` is what the target verified of its drafts; `proposed` every token it drafted,
    those the planner cut before verification (`Planner.trim`: where they would not pay) too."""

    failures: int = 0  # calls in which the drafter raised and was dropped
    steps: int = 0  # verification steps that verified its tokens on at least one row (target_forwards counts rows)
    proposed: int = 0  # draft tokens it made, verified or cut

    @classmethod
    def total(cls, parts) -> DrafterStats:
        """The sum of several drafters' or calls' counts (longest_draft: the longest of them)."""
        out = cls()
        for part in parts:
            out.merge(part)
        return out

    def merge(self, other: DrafterStats) -> None:
        """Add another call's (or lane's) counts to these."""
        for name in (
            "drafted",
            "accepted",
            "target_forwards",
            "new_tokens",
            "draft_seconds",
            "failures",
            "steps",
            "proposed",
        ):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.longest_draft = max(self.longest_draft, other.longest_draft)


@dataclass
class GenerationStats:
    rows: list[RowStats]
    drafters: dict[str, DrafterStats]
    wall_seconds: float = 0.0
    verify_seconds: float = 0.0
    prefill_seconds: float = 0.0
    steps: int = 0  # verification steps of the whole batch

    @property
    def new_tokens(self) -> int:
        return sum(r.new_tokens for r in self.rows)

    @property
    def goodput(self) -> float:
        return _ratio(self.new_tokens, self.wall_seconds)

    @property
    def acceptance_rate(self) -> float:
        return _ratio(sum(r.accepted for r in self.rows), sum(r.drafted for r in self.rows))

    @property
    def mean_accepted_length(self) -> float:
        return _ratio(self.new_tokens, sum(r.target_forwards for r in self.rows))

    def to_dict(self) -> dict:
        """JSON-ready: raw counts plus the derived rates."""
        derived = ("acceptance_rate", "mean_accepted_length", "rejected")

        def counts(c):
            return {**asdict(c), **{k: getattr(c, k) for k in derived}}

        return {
            "wall_seconds": self.wall_seconds,
            "prefill_seconds": self.prefill_seconds,
            "verify_seconds": self.verify_seconds,
            "steps": self.steps,
            "new_tokens": self.new_tokens,
            "goodput": self.goodput,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "rows": [{**counts(r), "drafters": dict(r.drafters), "goodput": r.goodput} for r in self.rows],
            "drafters": {name: counts(d) for name, d in self.drafters.items()},
        }

    def __str__(self) -> str:
        lines = [
            f"{self.new_tokens} tokens in {self.wall_seconds:.2f}s ({self.goodput:.1f} tok/s), "
            f"acceptance {self.acceptance_rate:.1%}, mean accepted length {self.mean_accepted_length:.2f}"
        ]
        for name, d in self.drafters.items():
            lines.append(
                f"  {name}: drafted {d.drafted}"
                + (f" (of {d.proposed} proposed)" if d.proposed != d.drafted else "")
                + f", accepted {d.accepted} ({d.acceptance_rate:.1%}), "
                f"longest draft {d.longest_draft}, {d.steps} steps, {d.draft_seconds:.2f}s drafting"
                + (f", failed {d.failures}x" if d.failures else "")
            )
        return "\n".join(lines)
