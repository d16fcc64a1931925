"""Continuations: a model-free draft scored against the tokens committed after its step, not only its own.

A step compares every draft (served, cut by `trim`, or a shadow draft) with the tokens it committed: one token
at a plain step, so a draft that was not verified tells the planner about its first position only. A model-free
drafter (prompt lookup, suffix) drafts for nothing, and what its later positions would have got is in the
tokens the next steps commit: a draft that matched all its step committed and holds more is followed
(`Continuation`), and each later step reports the positions it reveals (`follow`), until one is wrong or the
draft is used up. So a request learns, without verifying anything, whether the drafter's continuations hold on it
(a summary copying spans of its text) or stop after a token (a translation repeating a name): position 1 alone
read the two alike (docs/planning.md, "Exploration within a budget").

One continuation a drafter a row at a time: the drafts of the steps it spans continue the same text, and
following each would count that text once a step.
"""

from __future__ import annotations

from dataclasses import dataclass

# (positions observed before, proposed, matched, committed, match): positions seen + 1 .. matched were
# right, matched + 1 wrong where matched < min(proposed, committed) (`Acceptance.observe`)
Observed = tuple[int, int, int, int, int | None]


@dataclass
class Continuation:
    """A draft followed past its step: where its first token sits in the row's sequence, its tokens, how many of
    its positions the planner has been told of, and the match it continued (`Draft.match_lengths`)."""

    origin: int
    tokens: list[int]
    seen: int
    match: int | None


def follow(sequence: list[int], pending: dict[int, Continuation]) -> dict[int, Observed]:
    """drafter -> what the row's committed `sequence` newly reveals of each of its `pending` continuations (those
    with nothing new left out); a continuation found wrong or used up leaves `pending`."""
    out = {}
    for d, c in list(pending.items()):
        committed = min(len(sequence) - c.origin, len(c.tokens))  # its positions the sequence holds
        if committed <= c.seen:
            continue
        matched = next((i for i in range(c.seen, committed) if sequence[c.origin + i] != c.tokens[i]), committed)
        out[d] = (c.seen, len(c.tokens), matched, committed, c.match)
        if matched < committed or committed == len(c.tokens):
            del pending[d]
        else:
            c.seen = committed
    return out


def start(
    pending: dict[int, Continuation],
    drafts: dict[int, list[int]],
    origin: int,
    new: list[int],
    free: list[bool],
    matches: dict[int, int],
) -> None:
    """Follow the drafts of this step (drafter -> tokens, first at `origin` in the row's sequence) of model-free
    drafters (`free`, per drafter) that matched every token the step committed (`new`) and hold more, where the
    drafter has none followed on the row already."""
    for d, tokens in drafts.items():
        if free[d] and d not in pending and len(tokens) > len(new) and tokens[: len(new)] == new:
            pending[d] = Continuation(origin, list(tokens), len(new), matches.get(d))
