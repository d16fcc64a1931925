"""Stopping criteria decided on the host: `generate`'s own criteria without a device read per token.

`generate` stops a row with a `StoppingCriteriaList`, called on the row's ids `[1, L]` after every
token. Calling it per committed token costs a tensor built on the host and a read of the device for
its answer. The criteria `generate` builds for a plain call, `MaxLengthCriteria` and
`EosTokenCriteria`, need neither: the row's length and its last token decide them. `HostStop` is
such a list read once; any other criterion (stop strings, max time, a user's own) leaves the list
to the general path, which calls it exactly as `generate` would.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

# Criteria decided on the host: these exact classes (a subclass may change what __call__ does).
HOST_CRITERIA = (MaxLengthCriteria, EosTokenCriteria)


@dataclass(frozen=True)
class HostStop:
    """A list of max-length and EOS criteria, read once.

    Example: [MaxLengthCriteria(20), EosTokenCriteria([2, 7])] -> HostStop(20, frozenset({2, 7}), None);
    stops(20, 5) is True (length), stops(12, 7) is True (EOS), stops(12, 5) is False.
    """

    max_length: int | None  # stop at this many ids (the smallest MaxLengthCriteria); None: no length criterion
    eos: frozenset[int]  # stop after any of these tokens
    max_positions: int | None  # past this length (and not stopped), `MaxLengthCriteria` warns: call the list then

    @classmethod
    def of(cls, criteria) -> HostStop | None:
        """The list read on the host (its EOS ids read once), or None when a criterion is of another kind."""
        if not all(type(c) in HOST_CRITERIA for c in criteria):
            return None
        lengths = [c.max_length for c in criteria if type(c) is MaxLengthCriteria]
        positions = [
            c.max_position_embeddings
            for c in criteria
            if type(c) is MaxLengthCriteria and c.max_position_embeddings is not None
        ]
        eos = {
            int(t)
            for c in criteria
            if type(c) is EosTokenCriteria
            for t in torch.as_tensor(c.eos_token_id).reshape(-1).tolist()
        }
        return cls(min(lengths, default=None), frozenset(eos), min(positions, default=None))

    def stops(self, length: int, token: int) -> bool | None:
        """What the list answers for ids of `length` (padding included) ending in `token`; None where it
        must be called itself (past max_position_embeddings, where `MaxLengthCriteria` logs a warning)."""
        if (self.max_length is not None and length >= self.max_length) or token in self.eos:
            return True
        if self.max_positions is not None and length > self.max_positions:
            return None
        return False
