"""Losslessness across architectures: greedy `hf_spin.generate` returns exactly what plain `generate` does.

For every architecture in `archs.ARCHS`, at batch 1 and at batch 4 with ragged left-padded prompts,
`target.generate(..., custom_generate=hf_spin.generate, assistant_pool=pool)` must be `torch.equal` to
`target.generate(...)` with the same arguments, whoever drafts:

    other          the target with noise on its weights (speculation.perturbed): 4-token drafts cut by
                   rejections at every position (holes, rollback of target and drafter caches)
    self           the target drafts for itself: drafts are accepted (long acceptance, bonus token)
    prompt_lookup  n-gram lookup in the row's own tokens
    round_robin    [other, prompt_lookup] alternating: the model drafter catches up on tokens it missed

Every call drafts 4 tokens a step with no confidence stop and asserts that it exercised what it
claims (speculation.assert_speculated): drafts longer than one token, accepted tokens, rejected
tokens wherever the drafter can be wrong.

Token translation (a drafter with another tokenizer) is tokenizer logic, not architecture logic, so it
runs on two architectures with the tokenizers of tiny_tokenizers.py and prompts of real text:

    bpe            a model over a BPE vocabulary of its own (other ids, other segmentation): rejected drafts
    mirror         the perturbed target behind a tokenizer with the same characters under other ids
                   (weights permuted to match): translated drafts, accepted and rejected
    bpe+lookup     round robin between the BPE drafter and prompt lookup (catch-up across tokenizers)
    mirror+lookup  the same with the mirror drafter
"""

from __future__ import annotations

import functools
import importlib
import itertools

import pytest
import torch

import hf_spin
import hf_spin.cache.rectangular
import hf_spin.step.engine
import hf_spin.step.faults
from benchmarks.injected_costs import TIMED_MODULES
from hf_spin.stats import DrafterStats

from .archs import ARCHS, tiny_model
from .speculation import assert_speculated, greedy_case, multi_token, perturbed
from .speculation import pool as spin_pool
from .tiny_tokenizers import PROMPTS, bpe_tokenizer, char_tokenizer

MAX_NEW_TOKENS = 24
PROMPT_LENGTH = 14  # ragged rows at batch 4: 14, 12, 10, 8 real tokens
BATCHES = (1, 4)

# The architectures this file proves lossless; an architecture that fails is removed from archs.ARCHS
# with the reason, not from here.
EQUIVALENT_ARCHS = tuple(ARCHS)
MODEL_DRAFTERS = ("other", "other_chain", "self", "prompt_lookup")  # other: a token tree where the model takes 4D masks
ROUND_ROBIN_ARCHS = ("llama", "gpt2", "gemma2", "opt", "falcon", "bloom", "mixtral", "qwen2_moe")
TRANSLATION_ARCHS = ("llama", "gpt2")
TRANSLATION_DRAFTERS = ("bpe", "mirror", "bpe+lookup", "mirror+lookup")


pytestmark = pytest.mark.usefixtures("one_thread")


@functools.lru_cache(maxsize=None)
def _models(arch: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(target, perturbed drafter) of one architecture."""
    return tiny_model(arch, seed=0), perturbed(arch)


@functools.lru_cache(maxsize=None)
def _case(arch: str, batch: int) -> tuple[dict, torch.Tensor]:
    return greedy_case(_models(arch)[0], batch, PROMPT_LENGTH, MAX_NEW_TOKENS)


def _first_difference(out: torch.Tensor, ref: torch.Tensor) -> str:
    if out.shape != ref.shape:
        return f"shape {tuple(out.shape)} != plain generate's {tuple(ref.shape)}"
    row, col = (out != ref).nonzero()[0].tolist()
    return (
        f"row {row} differs first at position {col}: {out[row, col]} != plain generate's {ref[row, col]}\n{out}\n{ref}"
    )


def _assert_lossless(
    target,
    inputs: dict,
    reference: torch.Tensor,
    pool: hf_spin.AssistantPool,
    rejected: bool = True,
    speculated: bool = True,
) -> hf_spin.GenerationStats:
    """Output equal to plain generate's, no drafter failed (a drafter that raises is dropped and the
    output stays right, hiding the bug), and (`speculated`) speculation exercised: multi-token
    drafts, accepted tokens, and rejected ones unless the drafter cannot be wrong (`rejected=False`)."""
    out = target.generate(**inputs, custom_generate=hf_spin.generate, assistant_pool=pool)
    assert torch.equal(out, reference), _first_difference(out, reference)
    stats = pool.last_stats
    for name, d in stats.drafters.items():
        assert d.failures == 0, f"drafter {name!r} raised during the call"
    if speculated:
        assert_speculated(stats, rejected=rejected)
    return stats


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("drafter", MODEL_DRAFTERS)
@pytest.mark.parametrize("arch", EQUIVALENT_ARCHS)
def test_greedy_equivalence(arch, drafter, batch):
    target, other = _models(arch)
    entry = {"other": other, "other_chain": other, "self": target, "prompt_lookup": "prompt_lookup"}[drafter]
    # the target agrees with itself in float32: every draft accepted, a bonus token each step (chains: a
    # tree's other branches are rejected by design)
    pool = spin_pool([entry], tree=False) if drafter in ("self", "other_chain") else spin_pool([entry])
    stats = _assert_lossless(target, *_case(arch, batch), pool, rejected=drafter != "self")
    if drafter == "self":
        assert stats.acceptance_rate == 1.0, str(stats)


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("arch", ROUND_ROBIN_ARCHS)
def test_round_robin_equivalence(arch, batch):
    target, other = _models(arch)
    pool = spin_pool([other, "prompt_lookup"], policy="round_robin")
    stats = _assert_lossless(target, *_case(arch, batch), pool)
    model, lookup = (stats.drafters[name] for name in pool.names)
    # served on two steps with a lookup step between: it caught up on tokens it did not see
    assert model.steps >= 2 and lookup.steps >= 1, str(stats)
    assert_speculated(model, what="the model drafter")


POLICY_ARCHS = ("llama", "gpt2", "qwen2")
RULE_CONFIGS = {  # draft-length rule name -> its config class
    name: next(config for config, cls in hf_spin.policies.DRAFT_LENGTH_CONFIGS.items() if cls is rule)
    for name, rule in hf_spin.policies.DRAFT_LENGTHS.items()
}


@pytest.mark.parametrize("draft_length", [3, *sorted(hf_spin.policies.DRAFT_LENGTHS)])
@pytest.mark.parametrize("policy", sorted(hf_spin.policies.POLICIES))
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("arch", POLICY_ARCHS)
def test_policy_equivalence(arch, batch, policy, draft_length, monkeypatch):
    """Every policy and draft-length rule over a pool of three kinds (another model, the target
    drafting for itself, prompt lookup): whoever a policy picks, and however many tokens, the output
    is plain `generate`'s. The pool is used twice: learned state carries across calls. LBSS may
    rightly decode every row plainly on the second call (on these tiny models no catch-up pays
    for itself), so it runs with never_slower off: its plans, not plain decoding, are checked.

    The engine's clock is a counter (every timed interval lasts one tick), so the rules that size
    drafts from measured seconds see drafting and verification cost the same at any k, and draft
    several tokens on every run instead of whatever this machine's timings say."""
    clock = itertools.count().__next__
    for name in TIMED_MODULES:  # verify and prefill timed in one, drafter calls in the other
        monkeypatch.setattr(importlib.import_module(name), "perf_counter", clock)
    target, other = _models(arch)
    self_drafter = hf_spin.ModelDrafter(target, name="self")
    chosen = hf_spin.policies.LBSSConfig(never_slower=False) if policy == "lbss" else policy
    # a floor of two tokens: a rule may otherwise settle on one-token drafts, which test nothing past
    # the first draft position; within it the rule decides
    rule = multi_token(draft_length) if isinstance(draft_length, int) else RULE_CONFIGS[draft_length](min_k=2)
    pool = hf_spin.AssistantPool([other, self_drafter, "prompt_lookup"], policy=chosen, draft_length=rule)
    inputs, reference = _case(arch, batch)
    for _ in range(2):  # a policy may rightly settle on the drafter that is never wrong (self)
        _assert_lossless(target, inputs, reference, pool, speculated=False)
    assert_speculated(DrafterStats.total(pool.totals.values()), what="both calls")


@pytest.mark.parametrize("arch", EQUIVALENT_ARCHS)
def test_compaction_equivalence(arch, monkeypatch):
    """Compact the target's and the drafter's caches after every step that leaves a hole (rows of
    different lengths always do at batch 4): the KV gather must not change a single token."""
    monkeypatch.setattr(hf_spin.cache.rectangular, "COMPACT_HOLE_FRACTION", 0.0)  # RectangularCache.rollback reads it
    compactions = []
    real_compact = hf_spin.cache.rectangular.RectangularCache.compact
    monkeypatch.setattr(
        hf_spin.cache.rectangular.RectangularCache, "compact", lambda self: compactions.append(1) or real_compact(self)
    )
    target, other = _models(arch)
    pool = spin_pool([other, "prompt_lookup"], policy="round_robin")
    _assert_lossless(target, *_case(arch, 4), pool)
    assert len(compactions) >= 2


# --- token translation ---------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _bpe_drafter(arch: str) -> torch.nn.Module:
    return tiny_model(arch, seed=2, vocab_size=len(bpe_tokenizer()))


@functools.lru_cache(maxsize=None)
def _mirror_drafter(arch: str) -> torch.nn.Module:
    """The perturbed target (speculation.perturbed) with its token ids renamed to
    `char_tokenizer(reverse=True)`'s: rows of the input and output embeddings permuted, so its logits
    are the perturbed target's, permuted: translated drafts the target often accepts, not always."""
    target_tok, mirror_tok = char_tokenizer(), char_tokenizer(reverse=True)
    to_mirror = torch.tensor(
        mirror_tok.convert_tokens_to_ids(target_tok.convert_ids_to_tokens(list(range(len(target_tok)))))
    )
    model = perturbed(arch)
    with torch.no_grad():
        for layer in (model.get_input_embeddings(), model.get_output_embeddings()):
            for param in (layer.weight, getattr(layer, "bias", None)):
                if param is not None:
                    param[to_mirror] = param.clone()
    return model


def _text_inputs(batch: int) -> dict:
    enc = char_tokenizer()(PROMPTS[:batch], padding=True, return_tensors="pt")
    return dict(
        input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], max_new_tokens=MAX_NEW_TOKENS, do_sample=False
    )


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
    """A random BPE model agrees with the target by chance only: its drafts test the rejection path
    across another segmentation; the perturbed mirror's translated drafts are accepted and rejected."""
    target = _models(arch)[0]
    models = {
        "bpe": (_bpe_drafter(arch), bpe_tokenizer()),
        "mirror": (_mirror_drafter(arch), char_tokenizer(reverse=True)),
    }
    first, *rest = drafter.split("+")
    entries = [models[first], *(["prompt_lookup"] if rest else [])]
    pool = spin_pool(entries, policy="round_robin" if rest else "fixed", tokenizer=char_tokenizer())
    assert isinstance(pool.bind(target)[0], hf_spin.TranslatingDrafter)  # translated, not shared ids
    stats = _assert_lossless(target, _text_inputs(batch), _text_reference(arch, batch), pool, speculated=False)
    translated = stats.drafters[pool.names[0]]
    assert_speculated(translated, accepted=first == "mirror", what="the translated drafter")
    if rest:  # served on two steps with a lookup step between: it caught up across tokenizers
        assert translated.steps >= 2 and stats.drafters["prompt_lookup"].steps >= 1, str(stats)


def test_enough_architectures():
    assert len(EQUIVALENT_ARCHS) >= 15, EQUIVALENT_ARCHS
    assert len(set(EQUIVALENT_ARCHS)) == len(EQUIVALENT_ARCHS)
    assert set(ROUND_ROBIN_ARCHS) <= set(EQUIVALENT_ARCHS) and set(TRANSLATION_ARCHS) <= set(EQUIVALENT_ARCHS)
