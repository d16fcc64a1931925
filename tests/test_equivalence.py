"""Losslessness across architectures: greedy `hf_spin.generate` returns exactly what plain `generate` does.

For every architecture in `archs.ARCHS`, at batch 1 and at batch 4 with ragged left-padded prompts,
`target.generate(..., custom_generate=hf_spin.generate, assistant_pool=pool)` must be `torch.equal` to
`target.generate(...)` with the same arguments, whoever drafts:

    other          a same-arch model with another seed: drafts are mostly rejected (holes, rollback)
    self           the target drafts for itself: drafts are accepted (long acceptance, bonus token)
    prompt_lookup  n-gram lookup in the row's own tokens
    round_robin    [other, prompt_lookup] alternating: the model drafter catches up on tokens it missed

Token translation (a drafter with another tokenizer) is tokenizer logic, not architecture logic, so it
runs on two architectures with the tokenizers of tiny_tokenizers.py and prompts of real text:

    bpe            a model over a BPE vocabulary of its own (other ids, other segmentation)
    mirror         the target itself behind a tokenizer with the same characters under other ids
                   (weights permuted to match): translated drafts that are accepted
    bpe+lookup     round robin between the BPE drafter and prompt lookup
"""

from __future__ import annotations

import functools

import pytest
import torch

import hf_spin
import hf_spin.cache

from .archs import ARCHS, ragged_batch, tiny_model
from .tiny_tokenizers import PROMPTS, bpe_tokenizer, char_tokenizer

MAX_NEW_TOKENS = 24
PROMPT_LENGTH = 14  # ragged rows at batch 4: 14, 12, 10, 8 real tokens
BATCHES = (1, 4)

# The architectures this file proves lossless; an architecture that fails is removed from archs.ARCHS
# with the reason, not from here.
EQUIVALENT_ARCHS = tuple(ARCHS)
MODEL_DRAFTERS = ("other", "self", "prompt_lookup")
ROUND_ROBIN_ARCHS = ("llama", "gpt2", "gemma2", "opt", "falcon", "bloom", "mixtral", "qwen2_moe")
TRANSLATION_ARCHS = ("llama", "gpt2")
TRANSLATION_DRAFTERS = ("bpe", "mirror", "bpe+lookup")


pytestmark = pytest.mark.usefixtures("one_thread")


@functools.lru_cache(maxsize=None)
def _models(arch: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(target, other-seed drafter) of one architecture."""
    return tiny_model(arch, seed=0), tiny_model(arch, seed=1)


def _inputs(batch: int, seed: int) -> dict:
    ids, mask = ragged_batch(batch, PROMPT_LENGTH, seed=seed)
    return dict(input_ids=ids, attention_mask=mask, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)


@functools.lru_cache(maxsize=None)
def _case(arch: str, batch: int) -> tuple[dict, torch.Tensor]:
    """(inputs, plain `generate`'s output) for the first prompt seed on which the longest row runs to
    max_new_tokens. Random tiny models often emit EOS early; a prompt that stops at once would make a
    vacuous test. Rows that stop early are kept (they exercise row retirement)."""
    target = _models(arch)[0]
    for seed in range(16):
        inputs = _inputs(batch, seed)
        reference = target.generate(**inputs)
        if reference.shape[1] == PROMPT_LENGTH + MAX_NEW_TOKENS:
            return inputs, reference
    raise AssertionError(f"{arch}: every prompt seed stops early; pick other seeds")


def _first_difference(out: torch.Tensor, ref: torch.Tensor) -> str:
    if out.shape != ref.shape:
        return f"shape {tuple(out.shape)} != plain generate's {tuple(ref.shape)}"
    row, col = (out != ref).nonzero()[0].tolist()
    return f"row {row} differs first at position {col}: {out[row, col]} != plain generate's {ref[row, col]}\n{out}\n{ref}"


def _assert_lossless(target, inputs: dict, reference: torch.Tensor, pool: hf_spin.AssistantPool) -> hf_spin.GenerationStats:
    out = target.generate(**inputs, custom_generate=hf_spin.generate, assistant_pool=pool)
    assert torch.equal(out, reference), _first_difference(out, reference)
    stats = pool.last_stats
    for name, d in stats.drafters.items():  # a drafter that raised is dropped, and the output stays right
        assert d.failures == 0, f"drafter {name!r} raised during the call"
    assert sum(d.drafted for d in stats.drafters.values()) > 0 or all(
        name == "prompt_lookup" for name in stats.drafters
    ), "no drafter proposed anything: the speculative path was not exercised"
    return stats


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("drafter", MODEL_DRAFTERS)
@pytest.mark.parametrize("arch", EQUIVALENT_ARCHS)
def test_greedy_equivalence(arch, drafter, batch):
    target, other = _models(arch)
    entry = {"other": other, "self": target, "prompt_lookup": "prompt_lookup"}[drafter]
    pool = hf_spin.AssistantPool([entry])
    stats = _assert_lossless(target, *_case(arch, batch), pool)
    if drafter == "self":  # the target agrees with itself: whole drafts accepted, bonus tokens taken
        assert stats.acceptance_rate > 0.5, str(stats)


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("arch", ROUND_ROBIN_ARCHS)
def test_round_robin_equivalence(arch, batch):
    target, other = _models(arch)
    pool = hf_spin.AssistantPool([other, "prompt_lookup"], policy="round_robin")
    stats = _assert_lossless(target, *_case(arch, batch), pool)
    model_name = pool.names[0]
    assert stats.drafters[model_name].target_forwards >= 2, str(stats)  # served again after skipping steps: caught up


POLICY_ARCHS = ("llama", "gpt2", "qwen2")


@pytest.mark.parametrize("draft_length", [3, *sorted(hf_spin.policies.DRAFT_LENGTHS)])
@pytest.mark.parametrize("policy", sorted(hf_spin.policies.POLICIES))
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("arch", POLICY_ARCHS)
def test_policy_equivalence(arch, batch, policy, draft_length):
    """Every policy and draft-length rule over a pool of three kinds (another model, the target
    drafting for itself, prompt lookup): whoever a policy picks, and however many tokens, the output
    is plain `generate`'s. The pool is used twice: learned state carries across calls. LBSS may
    rightly decode every row plainly on the second call (on these tiny models no catch-up pays
    for itself), so it runs with never_slower off: its plans, not plain decoding, are checked."""
    target, other = _models(arch)
    self_drafter = hf_spin.ModelDrafter(target, name="self")
    chosen = hf_spin.policies.LBSSConfig(never_slower=False) if policy == "lbss" else policy
    pool = hf_spin.AssistantPool([other, self_drafter, "prompt_lookup"], policy=chosen, draft_length=draft_length)
    inputs, reference = _case(arch, batch)
    for _ in range(2):
        _assert_lossless(target, inputs, reference, pool)


@pytest.mark.parametrize("arch", EQUIVALENT_ARCHS)
def test_compaction_equivalence(arch, monkeypatch):
    """Compact the target's and the drafter's caches after every step that leaves a hole (rows of
    different lengths always do at batch 4): the KV gather must not change a single token."""
    monkeypatch.setattr(hf_spin.cache, "COMPACT_HOLE_FRACTION", 0.0)
    compactions = []
    real_compact = hf_spin.cache.RaggedCache.compact
    monkeypatch.setattr(hf_spin.cache.RaggedCache, "compact", lambda self: compactions.append(1) or real_compact(self))
    target, other = _models(arch)
    pool = hf_spin.AssistantPool([other, "prompt_lookup"], policy="round_robin")
    _assert_lossless(target, *_case(arch, 4), pool)
    assert len(compactions) >= 2


# --- token translation ---------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _bpe_drafter(arch: str) -> torch.nn.Module:
    return tiny_model(arch, seed=2, vocab_size=len(bpe_tokenizer()))


@functools.lru_cache(maxsize=None)
def _mirror_drafter(arch: str) -> torch.nn.Module:
    """The target with its token ids renamed to `char_tokenizer(reverse=True)`'s: rows of the input and
    output embeddings permuted, so its logits are the target's, permuted."""
    target_tok, mirror_tok = char_tokenizer(), char_tokenizer(reverse=True)
    to_mirror = torch.tensor(mirror_tok.convert_tokens_to_ids(target_tok.convert_ids_to_tokens(list(range(len(target_tok))))))
    model = tiny_model(arch, seed=0)
    with torch.no_grad():
        for layer in (model.get_input_embeddings(), model.get_output_embeddings()):
            for param in (layer.weight, getattr(layer, "bias", None)):
                if param is not None:
                    param[to_mirror] = param.clone()
    return model


def _text_inputs(batch: int) -> dict:
    enc = char_tokenizer()(PROMPTS[:batch], padding=True, return_tensors="pt")
    return dict(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], max_new_tokens=MAX_NEW_TOKENS, do_sample=False)


@functools.lru_cache(maxsize=None)
def _text_reference(arch: str, batch: int) -> torch.Tensor:
    return _models(arch)[0].generate(**_text_inputs(batch))


def test_tokenizers_differ():
    target, mirror, bpe = char_tokenizer(), char_tokenizer(reverse=True), bpe_tokenizer()
    assert len(target) == tiny_model("llama").config.vocab_size
    assert target.get_vocab() != mirror.get_vocab() and target.get_vocab() != bpe.get_vocab()
    for text in PROMPTS:
        assert target.decode(target(text)["input_ids"]) == text
        assert mirror.decode(mirror(text)["input_ids"]) == text
        assert bpe.decode(bpe(text)["input_ids"], skip_special_tokens=True) == text
        assert len(bpe(text)["input_ids"]) < len(target(text)["input_ids"])  # another segmentation


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("drafter", TRANSLATION_DRAFTERS)
@pytest.mark.parametrize("arch", TRANSLATION_ARCHS)
def test_translation_equivalence(arch, drafter, batch):
    target = _models(arch)[0]
    if drafter == "mirror":
        entries, policy = [(_mirror_drafter(arch), char_tokenizer(reverse=True))], "fixed"
    elif drafter == "bpe":
        entries, policy = [(_bpe_drafter(arch), bpe_tokenizer())], "fixed"
    else:
        entries, policy = [(_bpe_drafter(arch), bpe_tokenizer()), "prompt_lookup"], "round_robin"
    pool = hf_spin.AssistantPool(entries, policy=policy, tokenizer=char_tokenizer())
    assert isinstance(pool.bind(target)[0], hf_spin.TranslatingDrafter)  # translated, not shared ids
    stats = _assert_lossless(target, _text_inputs(batch), _text_reference(arch, batch), pool)
    if drafter == "mirror":  # same model, same characters: translated drafts are accepted
        assert stats.acceptance_rate > 0.5, str(stats)


def test_enough_architectures():
    assert len(EQUIVALENT_ARCHS) >= 15, EQUIVALENT_ARCHS
    assert len(set(EQUIVALENT_ARCHS)) == len(EQUIVALENT_ARCHS)
    assert set(ROUND_ROBIN_ARCHS) <= set(EQUIVALENT_ARCHS) and set(TRANSLATION_ARCHS) <= set(EQUIVALENT_ARCHS)
