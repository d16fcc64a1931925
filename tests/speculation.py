"""Checks that a lossless test exercised speculation, so that it can fail.

Greedy identity with plain `generate` holds trivially when nothing is drafted (plain decoding), and
says nothing about multi-token acceptance or rollback when every draft is one token long. A lossless
test therefore also asserts, on the call's statistics, what its claim needs: drafts longer than one
token, some accepted, some rejected where a rejection path is claimed.
"""

from __future__ import annotations

import os

import torch

import hf_spin
from hf_spin.drafters import PromptLookupDrafter
from hf_spin.policies import FixedLength
from hf_spin.stats import DrafterStats, GenerationStats

from .archs import EOS, ragged_batch, tiny_model

# Set to a path, every call of assert_speculated appends its test's node id there.
COUNT_FILE = "HF_SPIN_SPECULATED_LOG"
# Draft length of the lossless tests, with no confidence stop: tiny random models are never 40% sure
# of a token, so the default rule (k = 8, stop below 0.4) would draft one token per step.
DRAFT_TOKENS = 4
# Relative noise on the target's weights for a drafter that agrees with it often, not always
# (acceptance 3-91% over archs.ARCHS at k = 4): accepted prefixes cut by rejections at any position.
PERTURBATION = 0.2


def perturbed(arch: str, scale: float = PERTURBATION, seed: int = 1, **overrides) -> torch.nn.Module:
    """The seed-0 tiny model of `arch` with noise on its weights (`perturb`): a drafter close to the
    target (a small model distilled from it, say)."""
    return perturb(tiny_model(arch, seed=0, **overrides), scale, seed)


def perturb(model: torch.nn.Module, scale: float = PERTURBATION, seed: int = 1) -> torch.nn.Module:
    """`model`, changed in place: every weight tensor moved by `scale` times its own std of seeded
    Gaussian noise."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.numel() > 1 and param.std() > 0:
                param.add_(torch.randn(param.shape, generator=g) * param.std() * scale)
    return model


def assert_speculated(
    stats: GenerationStats | DrafterStats,
    *,
    accepted: bool = True,
    rejected: bool = True,
    longest: int = 2,
    what: str = "",
) -> None:
    """The call drafted at least one draft of `longest` tokens and, if `accepted` / `rejected`,
    accepted / rejected some draft tokens (a call's stats: summed over its drafters; or one drafter's)."""
    if COUNT_FILE in os.environ:  # docs/testing.md: how many tests assert that speculation happened
        with open(os.environ[COUNT_FILE], "a") as f:
            f.write(os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0] + "\n")
    d = stats if isinstance(stats, DrafterStats) else DrafterStats.total(stats.drafters.values())
    context = f"{what}\n{stats}" if what else str(stats)
    assert d.failures == 0, f"a drafter raised during the call: {context}"
    assert d.longest_draft >= longest, (
        f"longest draft {d.longest_draft} < {longest}: multi-token drafts not exercised: {context}"
    )
    if accepted:
        assert d.accepted > 0, f"no draft token accepted: the acceptance path was not exercised: {context}"
    if rejected:
        assert d.rejected > 0, f"no draft token rejected: the rejection path was not exercised: {context}"


def multi_token(k: int = DRAFT_TOKENS) -> FixedLength:
    """A draft rule of k tokens a step that never stops a draft early."""
    return FixedLength(k, min_confidence=0.0)


def pool(entries, **kwargs) -> hf_spin.AssistantPool:
    """An AssistantPool drafting DRAFT_TOKENS tokens a step unless draft_length is given."""
    kwargs.setdefault("draft_length", multi_token())
    return hf_spin.AssistantPool(entries, **kwargs)


def lookup_would_speculate(sequence: list[int], prompt_length: int, k: int = DRAFT_TOKENS) -> tuple[bool, bool, bool]:
    """(accepts, rejects, drafts several) of prompt lookup along a greedy sequence, read off the
    sequence alone (no engine, so a bug in the engine cannot change which case a test picks): at each
    generated position, lookup's draft from the tokens before it against the token there."""
    lookup = PromptLookupDrafter()
    accepts = rejects = False
    several = 0  # positions with a draft of several tokens (the engine drafts at only some positions)
    for i in range(prompt_length, len(sequence)):
        draft = lookup.lookup(sequence[:i], k)
        if draft:
            accepts |= draft[0] == sequence[i]
            rejects |= draft[0] != sequence[i]
            several += len(draft) > 1
    return accepts, rejects, several >= 3


def lookup_would_speculate_somewhere(prompts: list[list[int]], outputs: list[list[int]], eos=(EOS,)) -> bool:
    """Whether prompt lookup would draft several tokens, some right, some wrong, over these rows
    (`lookup_would_speculate`): each row's prompt and its generated tokens (cut after its first `eos`)."""
    found = [False, False, False]
    for prompt, generated in zip(prompts, outputs):
        ends = [i for i, token in enumerate(generated) if token in eos]
        generated = generated[: ends[0] + 1] if ends else generated
        found = [x or y for x, y in zip(found, lookup_would_speculate(prompt + generated, len(prompt)))]
    return all(found)


def greedy_case(target, batch: int, prompt_length: int, max_new_tokens: int) -> tuple[dict, torch.Tensor]:
    """(generate kwargs, plain greedy output) of ragged left-padded prompts, for the first prompt seed on
    which the longest row runs to max_new_tokens and prompt lookup would draft several tokens, some
    right, some wrong (`lookup_would_speculate`, over the rows). Random tiny models often emit EOS
    early, and on some prompts never repeat themselves or only loop; either would make a vacuous
    test. Rows that stop early are kept (they exercise row retirement)."""
    for seed in range(256):
        ids, mask = ragged_batch(batch, prompt_length, seed=seed)
        inputs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False)
        reference = target.generate(**inputs)
        if reference.shape[1] < prompt_length + max_new_tokens:
            continue
        prompts = [ids[b][mask[b].bool()].tolist() for b in range(batch)]
        if lookup_would_speculate_somewhere(prompts, [row[prompt_length:].tolist() for row in reference]):
            return inputs, reference
    raise AssertionError(
        f"{target.config.model_type}: no prompt seed runs to the end with prompt lookup drafts right and wrong"
    )
