"""The planner's step log: what each step was expected to cost and commit, beside what it did.

`HF_SPIN_STEP_LOG=steps.jsonl` makes every planner append one JSON line a step: the rows, the
policy's caps, the sizes one sd up (`optimistic`) and those the evidence alone pays for (`exploit`),
what was sized within the exploration budget (`sized`, `probe_seconds` charged, `budget_left`), the
drafts' lengths and what `trim` kept, the seconds the plan was expected to take against a plain
step's, and the step's measured seconds and accepted tokens; and one line per idle catch-up it buys
(`event`). It is how a losing run is taken apart (docs/planning.md, "Exploration").
"""

from __future__ import annotations

import json
import os
from pathlib import Path

ENV = "HF_SPIN_STEP_LOG"


class StepJournal:
    """Collects a step's records from `Planner.size`, `trim` and `update`, keyed by its rows (a
    pipeline plans one micro-batch while another runs), and appends the step once it is learned from."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.pending: dict[tuple[int, ...], dict] = {}

    @classmethod
    def from_env(cls) -> StepJournal | None:
        path = os.environ.get(ENV)
        return cls(path) if path else None

    def note(self, row_ids: list[int], **fields) -> None:
        self.pending.setdefault(tuple(row_ids), {"rows": list(row_ids)}).update(fields)

    def event(self, kind: str, **fields) -> None:
        """A record outside a step's plan, written at once: an idle catch-up the planner bought (`kind`
        "idle_catch_up": the row, the drafter, its lag, the seconds priced, and what paid: "evidence" or
        "budget")."""
        with self.path.open("a") as f:
            f.write(json.dumps({"event": kind, **fields}) + "\n")

    def close(self, row_ids: list[int], **fields) -> None:
        record = self.pending.pop(tuple(row_ids), {"rows": list(row_ids)})
        record.update(fields)
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
