"""How long rows run: a learned expectation of a row's tokens left, for spreading a catch-up's cost.

A catch-up (a drafter reading a prompt, or running its own encoder) pays back over the steps its row has
left. The length limit (`max_new_tokens`, Whisper's 448-token `max_length`) bounds that, but rows
that stop at an end-of-sequence token run far shorter (a transcript of a few seconds of speech: 10-30
tokens), and spreading over the limit makes a catch-up look cheap where it never pays back.
`RowLengths` learns the length of the rows that ended (a decayed mean: the pool's recent requests) and
counts each running row's tokens from the steps it is told of; a row's expected tokens left is the
mean less what it has, capped by its room. A row already past the mean is expected to run the mean
again; before any row ended, the room alone (docs/planning.md, "Exploration").
"""

from __future__ import annotations

from .estimates import DecayedMean

LENGTH_DECAY = 0.9  # the mean follows the last ~10 rows that ended


class RowLengths:
    """Tokens generated per running row (by row id) and the decayed mean length of rows that ended."""

    def __init__(self):
        self.generated: dict[int, int] = {}
        self.steps: dict[int, int] = {}  # steps each running row has committed in
        self.ended = DecayedMean(LENGTH_DECAY)
        self.squares = DecayedMean(LENGTH_DECAY)  # of the ended rows' lengths squared: their spread

    def committed(self, row_ids: list[int], tokens: list[int]) -> None:
        """A step committed `tokens` ([B]) to the rows `row_ids` ([B])."""
        for r, n in zip(row_ids, tokens):
            self.generated[r] = self.generated.get(r, 0) + n
            self.steps[r] = self.steps.get(r, 0) + 1

    def rate(self, row_id: int) -> float:
        """Tokens row `row_id` has committed a step so far (1.0 before its first step)."""
        steps = self.steps.get(row_id, 0)
        return self.generated[row_id] / steps if steps else 1.0

    def end(self, row_ids: list[int], lengths: list[int | None]) -> None:
        """These rows left the batch having generated `lengths` tokens ([B] each; None: a row cut short,
        cancelled or failed, whose length says nothing of how long rows run)."""
        for r, n in zip(row_ids, lengths):
            self.generated.pop(r, None)
            self.steps.pop(r, None)
            if n is not None:
                self.ended.add(float(n))
                self.squares.add(float(n) * n)

    def left(self, row_id: int, room: int | None) -> int | None:
        """Tokens row `row_id` is expected to generate still: at most `room` (None: unknown)."""
        mean = self.ended.mean
        if mean is None:
            return room
        have = self.generated.get(row_id, 0)
        expected = max(round(mean - have), 1) if have < mean else max(round(mean), 1)
        return expected if room is None else min(room, expected)

    def spread(self, left: int | None) -> float | None:
        """How uncertain a row's `left` tokens (`left`) are, as a standard deviation: the spread of the lengths of
        rows that ended, at most `left`; before any ended, `left` itself (a row may stop at any token)."""
        if left is None:
            return None
        mean = self.ended.mean
        if mean is None:
            return float(left)
        return min(max(self.squares.mean - mean * mean, 0.0) ** 0.5, float(left))
