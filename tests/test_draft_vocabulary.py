"""A drafter's draft vocabulary (drafters/draft_vocabulary.py): its output layer cut to a subset of ids.

Lossless whatever the subset: greedy output equals plain `generate` on causal LMs and a tiny Whisper, with
the target's greedy tokens outside the subset (so drafts are rejected there by construction); the
drafter never proposes an id outside; the user's model is left as it was. Sampling with q zero outside
the subset keeps the target's distribution: tests/test_sampling.py's "model_draft_vocabulary" case.
"""

from __future__ import annotations

import pytest
import torch

import hf_spin
from hf_spin.drafters.draft_vocabulary import draft_ids, with_draft_vocabulary

from .archs import EOS, VOCAB, encoder_inputs, ragged_batch, tiny_encoder_decoder, tiny_model
from .speculation import assert_speculated, perturbed
from .speculation import pool as spin_pool

MAX_NEW_TOKENS = 20
KEPT = VOCAB // 2  # the draft vocabulary: the lower half of the ids (and EOS)

pytestmark = pytest.mark.usefixtures("one_thread")


class Recording(hf_spin.ModelDrafter):
    """A model drafter that keeps every token it proposes."""

    def draft(self, request):
        out = super().draft(request)
        self.proposed = getattr(self, "proposed", set()) | {t for row in out.tokens for t in row}
        return out


@pytest.mark.parametrize("batch", (1, 4))
@pytest.mark.parametrize("arch", ("llama", "qwen2"))
def test_greedy_output_equals_plain_generate_with_a_draft_vocabulary(arch, batch):
    target, other = tiny_model(arch, seed=0), perturbed(arch)
    ids, mask = ragged_batch(batch, 12, seed=1)
    inputs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
    reference = target.generate(**inputs)
    outside = (reference[:, ids.shape[1] :] >= KEPT) & (reference[:, ids.shape[1] :] != EOS)
    assert outside.any(), "every greedy token lies in the draft vocabulary: the test could not fail there"
    drafter = Recording(other, draft_vocabulary=KEPT)
    pool = spin_pool([drafter])
    out = target.generate(**inputs, custom_generate=hf_spin.generate, assistant_pool=pool)
    assert torch.equal(out, reference)
    assert_speculated(pool.last_stats)
    assert drafter.proposed and max(t for t in drafter.proposed if t != EOS) < KEPT, sorted(drafter.proposed)


@pytest.mark.parametrize("batch", (1, 4))
def test_whisper_drafter_with_a_draft_vocabulary_is_lossless(batch):
    target = tiny_encoder_decoder("whisper", init_std=0.1)
    drafter_model = tiny_encoder_decoder("whisper", seed=1, init_std=0.1)
    kwargs = dict(**encoder_inputs("whisper", batch), language="en", task="transcribe", max_new_tokens=16)
    reference = target.generate(**kwargs)
    pool = spin_pool([hf_spin.EncoderDecoderDrafter(drafter_model, draft_vocabulary=KEPT)])
    out = target.generate(**kwargs, custom_generate=hf_spin.generate, assistant_pool=pool)
    assert torch.equal(out, reference)
    assert_speculated(pool.last_stats, accepted=False, longest=2)


def test_a_draft_vocabulary_holding_every_proposal_drafts_as_the_whole_vocabulary_does():
    """Cut to the ids the drafter proposed with its whole vocabulary, it proposes the same chains (each step's
    argmax lies in the subset), accepted and rejected alike: the cut logits are scored as the ids they are.
    (Chains: a token tree's alternatives are not recorded, and a cut vocabulary would change them.)"""
    target, other = tiny_model("llama", seed=0), perturbed("llama")
    ids, mask = ragged_batch(2, 12, seed=1)
    inputs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
    runs = []
    for vocabulary in (None, "proposed"):
        drafter = Recording(other, draft_vocabulary=sorted(runs[0][0].proposed) if vocabulary else None)
        pool = spin_pool([drafter], tree=False)
        target.generate(**inputs, custom_generate=hf_spin.generate, assistant_pool=pool)
        stats = pool.last_stats.drafters[drafter.name]
        runs.append((drafter, (stats.drafted, stats.accepted, stats.steps)))
    assert len(runs[0][0].proposed) < VOCAB // 2  # a real cut
    assert runs[1][0].proposed == runs[0][0].proposed and runs[1][1] == runs[0][1], runs
    assert_speculated(pool.last_stats)


def test_the_view_cuts_the_output_layer_and_leaves_the_model_alone():
    model = tiny_model("llama", seed=0)
    head = model.get_output_embeddings()
    ids = draft_ids(model, [5, 9, 40])
    assert ids.tolist() == sorted({5, 9, 40, EOS})  # the end-of-sequence id is always in
    view = with_draft_vocabulary(model, ids)
    x = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        full, cut = model(input_ids=x).logits, view(input_ids=x).logits  # [1, 3, V], [1, 3, N]
    assert cut.shape[-1] == len(ids) and full.shape[-1] == VOCAB
    torch.testing.assert_close(cut, full[..., ids])
    assert model.get_output_embeddings() is head and head.weight.shape[0] == VOCAB
    assert view.model is model.model  # everything but the output layer is shared


@pytest.mark.parametrize("vocabulary", (0, VOCAB + 1, [VOCAB], []))
def test_a_draft_vocabulary_outside_the_output_layer_is_refused(vocabulary):
    with pytest.raises(ValueError, match="draft_vocabulary"):
        hf_spin.ModelDrafter(tiny_model("llama", seed=0), draft_vocabulary=vocabulary)
