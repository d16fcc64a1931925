"""Sampled output keeps the target's distribution exactly.

Two levels: the verifier alone on random p and q (the first output token must follow p_0, the second
p_1), and the whole engine on tiny models with an 8-token vocabulary, where the exact joint
distribution of the 2nd, 3rd and 4th generated tokens (verified at draft positions 0, 1 and 2) is
computed by enumeration. Each checks a chi-square goodness-of-fit and that the total-variation (TV)
distance shrinks as the sample grows; lossy controls (the drafter's own distribution, a verifier
exact only at the first draft position, q of the wrong position) show the same check rejects them.
"""

import functools

import pytest
import torch
from scipy.stats import chisquare
from transformers import GenerationMixin, LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper

import hf_spin
import hf_spin.verify.chains
from hf_spin.verify.chains import Verdict, verify_sampling

from .archs import tiny_model
from .speculation import assert_speculated, multi_token

ALPHA = 1e-3  # a correct sampler fails this check once in a thousand seeds; seeds are fixed
SMALL_V = 8


def tv(counts: torch.Tensor, probs: torch.Tensor) -> float:
    return 0.5 * (counts / counts.sum() - probs).abs().sum().item()


def fits(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square p-value of counts against probs, cells with expected count < 5 pooled."""
    expected = probs * counts.sum()
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum(0, keepdim=True)]).double()
    exp = torch.cat([expected[big], expected[~big].sum(0, keepdim=True)]).double()
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    exp = exp * obs.sum() / exp.sum()  # pooled cells make the sums differ by rounding only
    return chisquare(obs.numpy(), exp.numpy()).pvalue


@pytest.mark.parametrize("with_q", [True, False], ids=["model_q", "one_hot_q"])
def test_verifier_first_token_follows_p(with_q):
    g = torch.Generator().manual_seed(0)
    V, K = 12, 3
    p_one = torch.softmax(2 * torch.randn(K + 1, V, generator=g), -1)
    q_one = torch.softmax(2 * torch.randn(K, V, generator=g), -1)
    results = {}
    for n in (4000, 64000):
        p = p_one.expand(n, -1, -1)
        q = q_one.expand(n, -1, -1)
        drafts = torch.multinomial(q.reshape(-1, V), 1, generator=g).view(n, K)
        v = verify_sampling(p, drafts, torch.full((n,), K), q=q if with_q else None, generator=g)
        first = torch.where(v.accepted > 0, drafts[:, 0], v.next_token)  # the first output token
        counts = torch.bincount(first, minlength=V).float()
        results[n] = (tv(counts, p_one[0]), fits(counts, p_one[0]))
    print(
        f"verifier, q given={with_q}: "
        + "; ".join(f"N={n}: TV {r[0]:.4f}, chi-square p {r[1]:.3f}" for n, r in results.items())
    )
    assert results[64000][1] > ALPHA, results
    assert results[64000][0] < results[4000][0], results  # 16x the samples: TV about 4x smaller
    # negative control: the draft distribution itself is far from p and the check says so
    wrong = torch.bincount(drafts[:, 0], minlength=V).float()
    assert fits(wrong, p_one[0]) < 1e-6


def test_verifier_second_token_follows_p():
    """Draft position 1: p and q differ per position and do not depend on the prefix, so among rows that
    accepted the first draft the second output token must follow p_1. The control passes position 0's q
    at every position (a caller's indexing bug) and must be rejected."""
    g = torch.Generator().manual_seed(1)
    V, K, n = 12, 3, 64000
    p_one = torch.softmax(2 * torch.randn(K + 1, V, generator=g), -1)
    q_one = torch.softmax(2 * torch.randn(K, V, generator=g), -1)
    p, q = p_one.expand(n, -1, -1), q_one.expand(n, -1, -1)
    drafts = torch.stack([torch.multinomial(q_one[j], n, replacement=True, generator=g) for j in range(K)], 1)  # [n, K]

    def second_tokens(q_given: torch.Tensor) -> torch.Tensor:
        v = verify_sampling(p, drafts, torch.full((n,), K), q=q_given, generator=g)
        reached = v.accepted >= 1  # the step produced a second token
        second = torch.where(v.accepted > 1, drafts[:, 1], v.next_token)[reached]
        return torch.bincount(second, minlength=V).float()

    counts = second_tokens(q)
    assert counts.sum() > n / 10 and fits(counts, p_one[1]) > ALPHA, (counts.sum(), fits(counts, p_one[1]))
    assert fits(second_tokens(q[:, :1].expand(-1, K, -1)), p_one[1]) < 1e-6


def peaky(seed: int) -> torch.nn.Module:
    model = tiny_model("llama", seed=seed, vocab_size=SMALL_V)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # sharper distributions than a random init gives
    model.generation_config.eos_token_id = None  # rows must not stop: the test counts every token
    return model


def exact_joint(model, prompt: torch.Tensor, processors, n: int, encoder: dict | None = None) -> torch.Tensor:
    """P(t_2, ..., t_{n+1}) [V ** n] of the processed distribution, summing over t_1, by enumeration.
    encoder: an encoder-decoder model's encoder inputs of one row (`prompt` is then the decoder prompt)."""

    def probs(seqs):  # [N, L] -> next-token distribution [N, V]
        if encoder is None:
            logits = model(input_ids=seqs).logits[:, -1].float()
        else:
            rows = {k: v.expand(len(seqs), *v.shape[1:]) for k, v in encoder.items()}
            logits = model(**rows, decoder_input_ids=seqs).logits[:, -1].float()
        return torch.softmax(processors(seqs, logits), -1)

    V = SMALL_V
    joint = torch.ones(1)  # P(t_1 .. t_i) over every prefix, [V ** i]
    prefixes = torch.zeros(1, 0, dtype=torch.long)  # [V ** i, i]
    with torch.no_grad():
        for _ in range(n + 1):
            p = probs(torch.cat([prompt.expand(len(prefixes), -1), prefixes], 1))  # [V ** i, V]
            joint = (joint[:, None] * p).flatten()
            prefixes = torch.cat([prefixes.repeat_interleave(V, 0), torch.arange(V).repeat(len(prefixes))[:, None]], 1)
    return joint.view(V, -1).sum(0)  # sum over t_1


def accept_after_first(p, drafts, draft_lengths, q=None, generator=None) -> Verdict:
    """A lossy verifier (the control): exact at the first draft position, then every later draft token
    accepted unchecked, with a bonus token from p after the last."""
    v = verify_sampling(p, drafts, draft_lengths, q, generator)
    rows = torch.arange(len(draft_lengths))
    bonus = torch.multinomial(p[rows, draft_lengths], 1, generator=generator).squeeze(1)
    whole = v.accepted >= 1
    return Verdict(torch.where(whole, draft_lengths, v.accepted), torch.where(whole, bonus, v.next_token))


SAMPLED_NEW_TOKENS = 4  # t_1 from the prefill, then t_2..t_4 verified at draft positions 0, 1, 2 (k = 3), and t_5
MEASURED = 3  # the joint distribution of t_2, t_3, t_4 is checked
DRAFTERS = {
    "model": lambda target: peaky(1),
    # a draft vocabulary of half the ids: q is 0 on the others, which the target still draws
    "model_draft_vocabulary": lambda target: hf_spin.ModelDrafter(peaky(1), draft_vocabulary=SMALL_V // 2),
    "prompt_lookup": lambda target: "prompt_lookup",
    "suffix": lambda target: "suffix",  # the row's own repeats (and, within a call, nothing learned yet)
    # self-speculation (MagicDec): the target over a 1 + 2 token KV budget, so q != p. (The plain target
    # drafting for itself has q = p: every draft accepted, which tests only the bonus token.)
    "self_streaming": lambda target: hf_spin.StreamingDrafter(target, sink_tokens=1, window_tokens=2),
}


def _sampled_counts(
    target, entry, prompt, n: int, seed: int, encoder: dict | None = None, cache: str = "rectangular"
) -> tuple[torch.Tensor, hf_spin.GenerationStats]:
    """Counts [V ** MEASURED] of (t_2, t_3, t_4) over n sampled rows, drafting 3 tokens a step.
    encoder: an encoder-decoder target's encoder inputs of one row, repeated (`prompt`: the decoder prompt);
    cache: the pool's layout."""
    torch.manual_seed(seed)
    # chains: the control below patches the chain verifier (trees: tests/test_token_trees.py)
    pool = hf_spin.AssistantPool([entry], draft_length=multi_token(MEASURED), tree=False, cache=cache)
    kwargs = dict(do_sample=True, temperature=0.7, top_k=5, max_new_tokens=SAMPLED_NEW_TOKENS + 1, pad_token_id=0)
    if encoder is None:
        inputs = {"input_ids": prompt.expand(n, -1)}
    else:  # generate's own loop: Whisper's generate would add its processors and cut the decoder prompt
        inputs = {k: v.expand(n, *v.shape[1:]) for k, v in encoder.items()} | {
            "decoder_input_ids": prompt.expand(n, -1)
        }
    out = GenerationMixin.generate(target, **inputs, custom_generate=hf_spin.generate, assistant_pool=pool, **kwargs)
    cells = torch.zeros(n, dtype=torch.long)
    for j in range(MEASURED):
        cells = cells * SMALL_V + out[:, prompt.shape[1] + 1 + j]
    return torch.bincount(cells, minlength=SMALL_V**MEASURED).float(), pool.last_stats


@functools.lru_cache(maxsize=None)
def _exact_measured() -> torch.Tensor:
    processors = LogitsProcessorList([TemperatureLogitsWarper(0.7), TopKLogitsWarper(5)])
    return exact_joint(peaky(0), PROMPT, processors, MEASURED)


PROMPT = torch.tensor([[3, 5, 6, 3, 5, 6, 3, 5]])  # repeats with period 3, so prompt lookup proposes up to 3 tokens
SMALL_N, LARGE_N = 1500, 6000  # sampled rows (the engine's per-row bookkeeping makes larger batches slow)


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_engine_sampling_matches_target_distribution(drafter):
    """The joint distribution of three tokens verified at draft positions 0, 1 and 2 is the target's."""
    target = peaky(0)
    exact = _exact_measured()
    results = {}
    for n in (SMALL_N, LARGE_N):
        counts, stats = _sampled_counts(target, DRAFTERS[drafter](target), PROMPT, n, seed=n)
        results[n] = (tv(counts, exact), fits(counts, exact), stats.acceptance_rate)
        assert_speculated(stats, longest=MEASURED)  # drafts reached position 2; accepted and rejected
    print(
        f"engine, {drafter}: "
        + "; ".join(f"N={n}: TV {r[0]:.4f}, chi-square p {r[1]:.3f}, acceptance {r[2]:.2f}" for n, r in results.items())
    )
    assert results[LARGE_N][1] > ALPHA, results
    assert results[LARGE_N][0] < results[SMALL_N][0], results  # 4x the samples: TV about 2x smaller


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_engine_sampling_check_rejects_a_lossy_verifier(drafter, monkeypatch):
    """The control: the same check, with a verifier exact at draft position 0 but not after, must fail,
    so the test above sees the positions past the first."""
    monkeypatch.setattr(hf_spin.verify.chains, "verify_sampling", accept_after_first)
    target = peaky(0)
    counts, _ = _sampled_counts(target, DRAFTERS[drafter](target), PROMPT, LARGE_N, seed=LARGE_N)
    assert fits(counts, _exact_measured()) < 1e-6


@pytest.mark.parametrize("lossy", [False, True], ids=["exact", "lossy_control"])
def test_static_layout_sampling_matches_target_distribution(lossy, monkeypatch):
    """The same check on the static layout (the target and the model drafter on fixed-shape forwards); its
    control, the verifier exact at draft position 0 only, must fail it."""
    if lossy:
        monkeypatch.setattr(hf_spin.verify.chains, "verify_sampling", accept_after_first)
    counts, stats = _sampled_counts(peaky(0), peaky(1), PROMPT, LARGE_N, seed=LARGE_N, cache="static")
    assert_speculated(stats, longest=MEASURED)
    p = fits(counts, _exact_measured())
    assert p < 1e-6 if lossy else p > ALPHA, p


def test_engine_sampling_negative_control():
    """The same check rejects the drafter's own distribution (what a broken verifier would emit)."""
    draft = peaky(1)
    torch.manual_seed(0)
    out = draft.generate(
        input_ids=PROMPT.expand(LARGE_N, -1),
        do_sample=True,
        temperature=0.7,
        top_k=5,
        max_new_tokens=SAMPLED_NEW_TOKENS,
        pad_token_id=0,
    )
    cells = torch.zeros(len(out), dtype=torch.long)
    for j in range(MEASURED):
        cells = cells * SMALL_V + out[:, PROMPT.shape[1] + 1 + j]
    assert fits(torch.bincount(cells, minlength=SMALL_V**MEASURED).float(), _exact_measured()) < 1e-6
