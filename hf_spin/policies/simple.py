"""Policies that do not learn: the baselines."""

from __future__ import annotations

from .base import BatchView, DraftLength, Policy, first_usable


class FixedPolicy(Policy):
    """Every row uses one drafter (falls over to the next usable one if it fails)."""

    def __init__(self, draft_length: DraftLength | None = None, drafter: int = 0):
        super().__init__(draft_length)
        self.drafter = drafter

    def select(self, view: BatchView) -> list[tuple[int, ...]]:
        d = first_usable(view.usable, self.drafter)
        return [(d,) if d is not None else ()] * view.batch_size


class RoundRobinPolicy(Policy):
    """All rows use drafter (step mod n) at each step: every drafter gets its turn."""

    def select(self, view: BatchView) -> list[tuple[int, ...]]:
        d = first_usable(view.usable, view.step % max(len(view.usable), 1))
        return [(d,) if d is not None else ()] * view.batch_size


class ByPromptLengthPolicy(Policy):
    """Spin's greedy-by-prompt-length baseline: longer prompts go to larger drafters.

    When rows start, the rows of the batch are ranked by prompt length (ties: batch order) and cut
    into as many equal-count bins as there are usable drafters; drafters are ranked by
    `num_parameters` (ties: pool order; prompt lookup counts 0). Bin i (shortest prompts first)
    goes to the i-th smallest drafter: rank j of n rows -> drafter j * m // n. A row keeps its
    drafter for the whole request (no switching); if that drafter fails, the row moves to the
    nearest usable drafter by size, larger first.

    Example, drafters [large (1B), lookup (0), small (100M)], prompt lengths [50, 10, 400, 30, 90, 20]:
    ranks by length -> rows 1, 5 to lookup, rows 3, 0 to small, rows 4, 2 to large.
    """

    def __init__(self, draft_length: DraftLength | None = None):
        super().__init__(draft_length)
        self.assigned: dict[int, int] = {}  # row id -> position in the size order

    def by_size(self) -> list[int]:
        """Drafter indices from smallest to largest."""
        return sorted(range(len(self.drafters)), key=lambda d: (self.drafters[d].num_parameters, d))

    def start_rows(self, view: BatchView, rows: list[int]) -> None:
        order = sorted(range(view.batch_size), key=lambda b: (view.prompt_lengths[b], b))
        m, n = max(sum(view.usable), 1), view.batch_size
        usable_sizes = [i for i, d in enumerate(self.by_size()) if view.usable[d]]
        for rank, b in enumerate(order):
            if b in rows and usable_sizes:
                self.assigned[view.row_ids[b]] = usable_sizes[rank * m // n]

    def end_rows(self, row_ids: list[int]) -> None:
        for rid in row_ids:
            self.assigned.pop(rid, None)

    def select(self, view: BatchView) -> list[tuple[int, ...]]:
        missing = [b for b, rid in enumerate(view.row_ids) if rid not in self.assigned]
        if missing:
            self.start_rows(view, missing)
        sizes = self.by_size()
        out = []
        for rid in view.row_ids:
            pos = self.assigned.get(rid)
            if pos is None:
                out.append(())
                continue
            # nearest usable by size: pos, pos + 1, pos - 1, pos + 2, ...
            nearby = sorted(range(len(sizes)), key=lambda i: (abs(i - pos), i < pos))
            d = next((sizes[i] for i in nearby if view.usable[sizes[i]]), None)
            out.append(() if d is None else (d,))
        return out
