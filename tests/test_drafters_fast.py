"""Faster drafters: EasySpec fuzzy drafting (drafters/fuzzy.py) and MagicDec streaming drafting (drafters/streaming.py).

Both are lossless by construction, so greedy output must equal plain `generate` whatever they propose;
beyond that each mechanism is checked against a reference:

    fuzzy, N = 1        the layer-parallel forward is the model's forward bit for bit; drafts equal the plain drafter's
    fuzzy, batched      one bmm per set equals calling each layer's own attention module (allclose)
    calibration         after each round the drafter's KV of committed tokens equals a plain drafter's (allclose, fp32);
                        without calibration it does not (negative control)
    streaming           the first draft after the prefill equals a full forward whose last query is masked to
                        sinks + window (true positions); copying the target's prefill equals prefilling itself
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

import hf_spin
from hf_spin.cache import CACHE_ARG, RectangularCache, forward_ragged
from hf_spin.drafters import DraftRequest
from hf_spin.drafters.fuzzy import SUPPORTED_MODEL_TYPES, LayerParallelForward, fuzzy_device_map, layer_sets
from hf_spin.drafters.streaming import StreamingCache

from .archs import VOCAB, ragged_batch, tiny_model
from .speculation import assert_speculated, perturbed
from .speculation import pool as spin_pool

LAYERS = 6  # enough for sets of 2, 3 and 4 between the first and last layer
MAX_NEW_TOKENS = 24
PROMPT_LENGTH = 14
STREAMING_ARCHS = ("llama", "qwen2", "gpt2")  # gpt2: learned absolute positions, so true positions matter too


pytestmark = pytest.mark.usefixtures("one_thread")


@functools.lru_cache(maxsize=None)
def _models(arch: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(target, perturbed target), both LAYERS deep."""
    return tiny_model(arch, seed=0, num_hidden_layers=LAYERS), perturbed(arch, num_hidden_layers=LAYERS)


@functools.lru_cache(maxsize=None)
def _case(arch: str, batch: int) -> tuple[dict, torch.Tensor]:
    """(generate kwargs, plain greedy output) for the first prompt seed whose longest row runs to the end."""
    target = _models(arch)[0]
    for seed in range(16):
        ids, mask = ragged_batch(batch, PROMPT_LENGTH, seed=seed)
        inputs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
        reference = target.generate(**inputs)
        if reference.shape[1] == PROMPT_LENGTH + MAX_NEW_TOKENS:
            return inputs, reference
    raise AssertionError(f"{arch}: every prompt seed stops early")


def _assert_lossless(arch: str, batch: int, drafter, rejected: bool = True) -> hf_spin.GenerationStats:
    """Output equal to plain generate's with 4-token drafts, which were accepted and (`rejected`) rejected."""
    target = _models(arch)[0]
    inputs, reference = _case(arch, batch)
    pool = spin_pool([drafter])
    out = target.generate(**inputs, custom_generate=hf_spin.generate, assistant_pool=pool)
    assert torch.equal(out, reference), f"{drafter.name}: output differs from plain generate\n{out}\n{reference}"
    assert_speculated(pool.last_stats, rejected=rejected)
    return pool.last_stats


# --- greedy output equals plain generate -----------------------------------------------------------

FUZZY_KINDS = {
    "self-N2": lambda target, other: hf_spin.FuzzyDrafter(target, group_size=2),  # accepted drafts, calibration refills
    "self-N4-uncalibrated": lambda target, other: hf_spin.FuzzyDrafter(target, group_size=4, calibrate=False),
    "other-N3": lambda target, other: hf_spin.FuzzyDrafter(other, group_size=3),  # accepted and rejected: rollback
    "self-N2-per-layer": lambda target, other: hf_spin.FuzzyDrafter(target, group_size=2, batched=False),
}
# Kinds whose drafts may all be right (fuzzy N = 2 of the target itself can match it exactly).
MAY_BE_EXACT = {"self-N2", "self-N2-per-layer"}
STREAMING_KINDS = {
    "self": lambda target, other: hf_spin.StreamingDrafter(
        target, sink_tokens=2, window_tokens=6
    ),  # seeded from the target
    "self-window<k": lambda target, other: hf_spin.StreamingDrafter(
        target, sink_tokens=1, window_tokens=2
    ),  # row rebuilds
    "other": lambda target, other: hf_spin.StreamingDrafter(other, sink_tokens=2, window_tokens=6),  # its own prefill
}


@pytest.mark.parametrize("batch", (1, 4))
@pytest.mark.parametrize("kind", FUZZY_KINDS)
@pytest.mark.parametrize("arch", SUPPORTED_MODEL_TYPES)
def test_fuzzy_greedy_equivalence(arch, kind, batch):
    drafter = FUZZY_KINDS[kind](*_models(arch))
    stats = _assert_lossless(arch, batch, drafter, rejected=kind not in MAY_BE_EXACT)
    if kind == "self-N2":  # fuzzy drafts of the target itself, calibrated: still mostly right
        assert stats.acceptance_rate > 0.5, str(stats)


@pytest.mark.parametrize("batch", (1, 4))
@pytest.mark.parametrize("kind", STREAMING_KINDS)
@pytest.mark.parametrize("arch", STREAMING_ARCHS)
def test_streaming_greedy_equivalence(arch, kind, batch):
    drafter = STREAMING_KINDS[kind](*_models(arch))
    _assert_lossless(arch, batch, drafter, rejected=kind == "other")
    assert drafter.seeded == kind.startswith("self")  # the target drafting for itself copies its prefill
    if kind == "self-window<k":  # a draft longer than the window: rollback reaches evicted tokens
        assert drafter.rebuilds > 0


@pytest.mark.parametrize("kind", ("fuzzy", "streaming"))
def test_round_robin_catch_up(kind):
    """Served every other step beside prompt lookup: the catch-up spans several steps' tokens (calibration
    recomputes them; the self-streaming drafter copies them from the target's cache)."""
    target, other = _models("qwen2")
    drafter = hf_spin.FuzzyDrafter(target, group_size=2) if kind == "fuzzy" else hf_spin.StreamingDrafter(target, 2, 6)
    inputs, reference = _case("qwen2", 4)
    pool = spin_pool([drafter, "prompt_lookup"], policy="round_robin")
    out = target.generate(**inputs, custom_generate=hf_spin.generate, assistant_pool=pool)
    assert torch.equal(out, reference)
    stats = pool.last_stats.drafters[pool.names[0]]
    assert_speculated(stats, rejected=False, what=str(pool.last_stats))
    # served on two steps with a lookup step between: the catch-up spans tokens it did not draft
    assert stats.steps >= 2 and pool.last_stats.drafters["prompt_lookup"].steps >= 1, str(pool.last_stats)


@pytest.mark.parametrize("arch", ("llama", "gpt2"))
def test_streaming_without_eviction_is_the_plain_drafter(arch):
    """A budget larger than any row never evicts: acceptance equals the plain self-drafter's (all accepted)."""
    target = _models(arch)[0]
    stats = _assert_lossless(
        arch, 4, hf_spin.StreamingDrafter(target, sink_tokens=4, window_tokens=100), rejected=False
    )
    assert stats.acceptance_rate == 1.0, str(stats)


def test_sampling_runs_with_fuzzy_q():
    """do_sample: the drafters hand back their own q'' (fuzzy / sparse) and decoding goes on without faults."""
    target, other = _models("qwen2")
    ids, mask = ragged_batch(2, PROMPT_LENGTH)
    for drafter in (hf_spin.FuzzyDrafter(target, group_size=2), hf_spin.StreamingDrafter(target, 2, 4)):
        pool = hf_spin.AssistantPool([drafter])
        torch.manual_seed(0)
        out = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=True, top_k=20,
                              custom_generate=hf_spin.generate, assistant_pool=pool)  # fmt: skip
        (d,) = pool.last_stats.drafters.values()
        assert out.shape[0] == 2 and d.failures == 0 and d.drafted > 0


# --- fuzzy forward -----------------------------------------------------------------------------------


def test_layer_sets():
    assert layer_sets(24, 4) == [
        [0],
        [1, 2, 3, 4],
        [5, 6, 7, 8],
        [9, 10, 11, 12],
        [13, 14, 15, 16],
        [17, 18, 19, 20],
        [21, 22],
        [23],
    ]
    assert layer_sets(6, 3) == [[0], [1, 2, 3], [4], [5]]
    assert layer_sets(6, 1) == [[i] for i in range(6)]
    assert layer_sets(2, 4) == [[0], [1]] and layer_sets(1, 4) == [[0]]


def _two_forwards(model, forward) -> list[torch.Tensor]:
    """Logits of a ragged prefill (batch 3) then one ragged step, through `forward` (None: the model)."""
    ids, mask = ragged_batch(3, 10)
    cache = RectangularCache(torch.zeros(3, 0, dtype=torch.bool))
    prompts = [row[keep.bool()].tolist() for row, keep in zip(ids, mask)]
    return [
        forward_ragged(model, cache, prompts, forward=forward),
        forward_ragged(model, cache, [[5], [6, 7], [8]], forward=forward),
    ]


@pytest.mark.parametrize("arch", SUPPORTED_MODEL_TYPES)
def test_group_size_one_is_the_model(arch):
    model = _models(arch)[0]
    for got, want in zip(_two_forwards(model, LayerParallelForward(model, group_size=1)), _two_forwards(model, None)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("arch", SUPPORTED_MODEL_TYPES)
def test_batched_sets_equal_per_layer_attention(arch):
    model = _models(arch)[0]
    exact = _two_forwards(model, None)
    for n in (2, 4):
        batched = _two_forwards(model, LayerParallelForward(model, n, batched=True))
        per_layer = _two_forwards(model, LayerParallelForward(model, n, batched=False))
        for b, p, e in zip(batched, per_layer, exact):
            torch.testing.assert_close(b, p, atol=1e-5, rtol=1e-5)
            assert (b - e).abs().max() > 1e-3  # and it is fuzzy: not the exact forward


def test_stacked_weights_follow_the_model():
    """Stacked copies are rebuilt when the model's attention weights change in place."""
    model = copy.deepcopy(_models("llama")[0])
    fuzzy = LayerParallelForward(model, group_size=2)
    before = _two_forwards(model, fuzzy)[1]
    with torch.no_grad():
        model.model.layers[2].self_attn.q_proj.weight.mul_(1.5)
    after = _two_forwards(model, fuzzy)[1]
    fresh = _two_forwards(model, LayerParallelForward(model, group_size=2))[1]
    assert not torch.equal(before, after) and torch.equal(after, fresh)


def test_fuzzy_drafter_leaves_the_model_alone():
    target = _models("qwen2")[0]
    state = {k: v.clone() for k, v in target.state_dict().items()}
    modules = list(target.modules())
    _assert_lossless("qwen2", 4, hf_spin.FuzzyDrafter(target, group_size=3), rejected=False)
    assert list(target.modules()) == modules
    assert all(torch.equal(state[k], v) for k, v in target.state_dict().items())


def test_fuzzy_refuses_other_layouts():
    with pytest.raises(ValueError, match="llama.*gpt2|gpt2.*ModelDrafter"):
        hf_spin.FuzzyDrafter(tiny_model("gpt2"))
    with pytest.raises(ValueError, match="group_size"):
        hf_spin.FuzzyDrafter(_models("llama")[0], group_size=0)


def test_fuzzy_device_map():
    config = _models("llama")[0].config
    device_map = fuzzy_device_map(config, ["cuda:0", "cuda:1"], group_size=2)  # sets [0] [1 2] [3 4] [5]
    layers = {int(k.split(".")[-1]): v for k, v in device_map.items() if k.startswith("model.layers.")}
    assert layers == {0: "cuda:0", 1: "cuda:0", 2: "cuda:1", 3: "cuda:0", 4: "cuda:1", 5: "cuda:0"}
    assert device_map["lm_head"] == device_map["model.embed_tokens"] == "cuda:0"


# --- drafting rounds driven by hand: N = 1 equals the plain drafter; calibration ------------------


def _rounds(drafter, target, sequences, k: int, accept: int, rounds: int, twin=None, check=None, do_sample=False):
    """Play `rounds` draft/verify rounds: each row commits its first `accept` drafts plus a bonus token.
    `twin` (another drafter) is served the same committed sequences; `check(drafter, twin, sequences)`
    runs after each round's drafting. Returns every round's drafts."""
    sequences = [list(s) for s in sequences]
    rows = list(range(len(sequences)))
    for d in (drafter, twin):
        if d is not None:
            d.start(target, sequences)
    history = []
    for r in range(rounds):
        torch.manual_seed(r)
        draft = drafter.draft(DraftRequest(rows, sequences, [k] * len(rows), do_sample, None))
        if twin is not None:
            torch.manual_seed(r)
            twin_draft = twin.draft(DraftRequest(rows, sequences, [k] * len(rows), do_sample, None))
            history.append((draft, twin_draft))
        else:
            history.append(draft)
        if check is not None:
            check(drafter, twin, sequences)
        for b in rows:
            bonus = 3 + (7 * len(sequences[b]) + b) % (VOCAB - 3)  # any committed token will do
            sequences[b] += draft.tokens[b][:accept] + [bonus]
    return history


def _committed_kv(drafter, b: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, (keys, values) [H, n, D] of row b's first n tokens in the drafter's cache."""
    cache = drafter.cache
    valid = cache.slot_mask[b]
    return [(layer.keys[b][:, valid][:, :n], layer.values[b][:, valid][:, :n]) for layer in cache.layers]


def _prompts(batch: int) -> list[list[int]]:
    ids, mask = ragged_batch(batch, PROMPT_LENGTH, seed=1)
    return [row[keep.bool()].tolist() for row, keep in zip(ids, mask)]


@pytest.mark.parametrize("do_sample", (False, True))
def test_fuzzy_group_size_one_drafts_like_the_plain_drafter(do_sample):
    target, other = _models("qwen2")
    rounds = _rounds(hf_spin.FuzzyDrafter(other, group_size=1), target, _prompts(3), k=4, accept=2, rounds=4,
                     twin=hf_spin.ModelDrafter(other), do_sample=do_sample)  # fmt: skip
    for fuzzy, plain in rounds:
        assert fuzzy.tokens == plain.tokens
        if do_sample:
            assert all(torch.equal(a, b) for a, b in zip(fuzzy.q, plain.q))


@pytest.mark.parametrize("calibrate", (True, False))
def test_calibration_restores_the_exact_cache(calibrate):
    """After each round's catch-up the fuzzy drafter's KV of every committed token (accepted drafts
    included) equals that of a plain drafter fed the same tokens sequentially; without calibration the
    accepted drafts keep their fuzzy KV."""
    target = _models("llama")[0]
    diffs = []

    def check(fuzzy, plain, sequences):
        for b, seq in enumerate(sequences):
            for (kf, vf), (kp, vp) in zip(_committed_kv(fuzzy, b, len(seq)), _committed_kv(plain, b, len(seq))):
                diffs.append(max((kf - kp).abs().max().item(), (vf - vp).abs().max().item()))

    drafter = hf_spin.FuzzyDrafter(target, group_size=3, calibrate=calibrate)
    _rounds(drafter, target, _prompts(2), k=4, accept=2, rounds=4, twin=hf_spin.ModelDrafter(target), check=check)
    if calibrate:
        assert max(diffs) < 1e-5, max(diffs)
    else:
        assert max(diffs) > 1e-3, max(diffs)


# --- streaming cache -----------------------------------------------------------------------------


def test_streaming_cache_evicts_the_middle_and_keeps_true_positions():
    mask = torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)  # 7 and 8 tokens
    cache = StreamingCache(mask, sink_tokens=2, window_tokens=3)
    keys = torch.arange(8.0).view(1, 1, 8, 1).expand(2, 1, 8, 1).clone()  # key = slot index
    cache.update(keys, keys.clone(), 0)
    cache.evict()
    assert cache.lengths.tolist() == [5, 5] and cache.evicted.tolist() == [2, 3]
    assert cache.layers[0].keys[:, 0, :, 0].tolist() == [[1, 2, 5, 6, 7], [0, 1, 5, 6, 7]]  # sinks + last window
    _, positions = cache.add_slots(torch.tensor([2, 1]), 2)
    assert positions.tolist() == [[7, 8], [8, 9]]  # true positions, not slot counts
    cache.rollback(torch.tensor([7, 0]))  # row 0 keeps its tokens; row 1 restarts from scratch
    assert cache.token_counts.tolist() == [7, 0] and cache.evicted.tolist() == [2, 0]


def test_streaming_cache_from_target_cache_copies():
    mask = torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    source = RectangularCache(mask.clone())
    keys = torch.randn(1, 2, 8, 4)
    source.update(keys, keys + 1, 0)
    copied = StreamingCache.from_cache(source, sink_tokens=1, window_tokens=2)
    assert copied.evicted.tolist() == [4] and copied.slot_mask.tolist() == [[True, True, True]]
    assert torch.equal(copied.layers[0].keys, keys[:, :, [1, 6, 7]])
    assert torch.equal(source.layers[0].keys, keys) and torch.equal(source.slot_mask, mask)  # untouched
    assert copied.layers[0].keys.data_ptr() != source.layers[0].keys.data_ptr()


@pytest.mark.parametrize("arch", ("llama", "gpt2"))
@pytest.mark.parametrize("seeded", (True, False))
def test_first_streaming_draft_attends_to_sinks_and_window(arch, seeded):
    """q of the first draft = softmax of a full forward in which the last query sees only sinks + window
    (+ itself), at true positions; whether the drafter copied the target's prefill or ran its own."""
    target = _models(arch)[0]
    sink, window = 2, 5
    seq = _prompts(1)[0]  # L tokens; the drafter is fed seq[-1] over seq[:-1]
    L = len(seq)
    target_cache = RectangularCache(torch.ones(1, L - 1, dtype=torch.bool))
    target(input_ids=torch.tensor([seq[:-1]]), use_cache=True, **{CACHE_ARG: target_cache})
    model = target if seeded else copy.deepcopy(target)  # equal weights, another object: prefills itself
    drafter = hf_spin.StreamingDrafter(model, sink_tokens=sink, window_tokens=window)
    drafter.start(target, [seq], target_cache=target_cache)
    assert drafter.seeded == seeded
    q = drafter.draft(DraftRequest([0], [seq], [1], True, None)).q[0][0]  # [V]

    allowed = torch.ones(L, L).tril().bool()  # [L, L] causal
    allowed[-1, sink : L - 1 - window] = False  # the last query: sinks + window + itself
    mask4d = torch.zeros(1, 1, L, L).masked_fill(~allowed, torch.finfo(torch.float32).min)
    logits = target(input_ids=torch.tensor([seq]), attention_mask=mask4d).logits[0, -1]
    torch.testing.assert_close(q, torch.softmax(logits.float(), -1), atol=1e-5, rtol=1e-4)
    assert drafter.cache.lengths.tolist() == [sink + window + 1]


def test_self_streaming_cache_is_a_sparse_view_of_the_target_cache(monkeypatch):
    """Self-speculation: after each catch-up, the KV the drafter holds for committed tokens (but the last,
    which it fed itself) is a copy of the target's exact KV at the same tokens: sinks + window of it."""
    compared = []
    real_draft = hf_spin.StreamingDrafter.draft

    def checked_draft(self, request):
        out = real_draft(self, request)
        cache, target_cache = self.cache, self.target_cache
        for b in request.rows:
            n = self.exact[b]
            held = cache.slot_mask[b].nonzero()[:, 0]  # the drafter's valid slots, in token order
            tokens = torch.arange(len(held))
            tokens = torch.where(tokens < self.sink_tokens, tokens, tokens + cache.evicted[b])  # true token index
            target_slots = target_cache.slot_mask[b].nonzero()[:, 0]
            mine, theirs = held[tokens < n], target_slots[tokens[tokens < n]]
            for layer, target_layer in zip(cache.layers, target_cache.layers):
                assert torch.equal(layer.keys[b][:, mine], target_layer.keys[b][:, theirs])
                assert torch.equal(layer.values[b][:, mine], target_layer.values[b][:, theirs])
            compared.append((n, len(request.sequences[b]), len(mine)))
        return out

    monkeypatch.setattr(hf_spin.StreamingDrafter, "draft", checked_draft)
    target = _models("llama")[0]
    _assert_lossless("llama", 4, hf_spin.StreamingDrafter(target, sink_tokens=2, window_tokens=6))
    assert all(n == length - 1 for n, length, _ in compared)  # everything but the last token copied exactly
    assert max(length for _, length, _ in compared) > PROMPT_LENGTH + 5 and min(held for *_, held in compared) >= 2


def test_streaming_refuses_bad_budgets():
    with pytest.raises(ValueError, match="window_tokens"):
        hf_spin.StreamingDrafter(_models("llama")[0], window_tokens=0)
    with pytest.raises(ValueError, match="sink_tokens"):
        hf_spin.StreamingDrafter(_models("llama")[0], sink_tokens=-1)
