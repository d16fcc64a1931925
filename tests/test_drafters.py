"""The model drafter's per-row state: after rollbacks its cache is what a fresh drafter would compute."""

from __future__ import annotations

import pytest
import torch

from hf_spin.cache.static import StaticRowCache
from hf_spin.cache.static_forward import StaticOptions
from hf_spin.drafters import DraftRequest, ModelDrafter

from .archs import VOCAB, ragged_batch, tiny_model
from .speculation import perturbed


@pytest.mark.parametrize("layout", ("rectangular", "static"))
def test_model_drafter_after_rollbacks_drafts_what_a_fresh_one_does(layout):
    """Six steps over three rows, each committing a random prefix of the row's draft and then a token
    that differs from the next draft token (a rejection and its recovered token): every draft of the
    drafter that rolled back its cache (its own StaticRowCache on the static layout) equals a fresh
    drafter's on the same sequences (on the default rectangular cache)."""
    target, model = tiny_model("llama"), perturbed("llama")
    ids, mask = ragged_batch(3, 10, seed=0)
    sequences = [row[keep.bool()].tolist() for row, keep in zip(ids, mask)]
    drafter = ModelDrafter(model)
    drafter.static = StaticOptions() if layout == "static" else None
    drafter.start(target, sequences)
    assert isinstance(drafter.cache, StaticRowCache) == (layout == "static")
    g = torch.Generator().manual_seed(0)
    rejected = 0
    for _ in range(6):
        request = DraftRequest(rows=[0, 1, 2], sequences=sequences, k=[4, 4, 4], do_sample=False, score=None)
        fresh = ModelDrafter(model)
        fresh.start(target, sequences)
        drafts = drafter.draft(request).tokens
        assert drafts == fresh.draft(request).tokens
        for b, tokens in enumerate(drafts):
            accepted = int(torch.randint(0, len(tokens) + 1, (1,), generator=g))
            if accepted < len(tokens):  # rejected: the recovered token is another one
                rejected += 1
                sequences[b] = sequences[b] + tokens[:accepted] + [(tokens[accepted] + 1) % VOCAB]
            else:  # all accepted: a bonus token
                sequences[b] = sequences[b] + tokens + [int(torch.randint(3, VOCAB, (1,), generator=g))]
    assert rejected >= 6
