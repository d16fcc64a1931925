"""Sampled output keeps the target's distribution exactly.

Two levels: the verifier alone on random p and q (the first output token must follow p_0), and the
whole engine on tiny models with an 8-token vocabulary, where the exact joint distribution of the
2nd and 3rd generated tokens (the ones that go through verification) is computed by enumeration.
Each checks a chi-square goodness-of-fit and that the total-variation (TV) distance shrinks as the
sample grows; a negative control shows the same check rejects a wrong distribution.
"""

import pytest
import torch
from scipy.stats import chisquare
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper

import hf_spin
from hf_spin.verification import verify_sampling

from .archs import tiny_model

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
    print(f"verifier, q given={with_q}: " + "; ".join(f"N={n}: TV {r[0]:.4f}, chi-square p {r[1]:.3f}" for n, r in results.items()))
    assert results[64000][1] > ALPHA, results
    assert results[64000][0] < results[4000][0], results  # 16x the samples: TV about 4x smaller
    # negative control: the draft distribution itself is far from p and the check says so
    wrong = torch.bincount(drafts[:, 0], minlength=V).float()
    assert fits(wrong, p_one[0]) < 1e-6


def peaky(seed: int) -> torch.nn.Module:
    model = tiny_model("llama", seed=seed, vocab_size=SMALL_V)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # sharper distributions than a random init gives
    model.generation_config.eos_token_id = None  # rows must not stop: the test counts 3 tokens each
    return model


def exact_joint_2_3(model, prompt: torch.Tensor, processors) -> torch.Tensor:
    """P(t2, t3) [V * V] for the processed distribution, summing over t1, by enumeration."""
    def probs(seqs):  # [N, L] -> next-token distribution [N, V]
        logits = model(input_ids=seqs).logits[:, -1].float()
        return torch.softmax(processors(seqs, logits), -1)

    V = SMALL_V
    with torch.no_grad():
        p1 = probs(prompt)[0]  # [V]
        t1 = torch.arange(V)[:, None]
        p2 = probs(torch.cat([prompt.expand(V, -1), t1], 1))  # [V(t1), V(t2)]
        pairs = torch.cartesian_prod(torch.arange(V), torch.arange(V))  # [V*V, 2] (t1, t2)
        p3 = probs(torch.cat([prompt.expand(V * V, -1), pairs], 1)).view(V, V, V)  # [t1, t2, t3]
    joint = (p1[:, None, None] * p2[:, :, None] * p3).sum(0)  # [t2, t3]
    return joint.flatten()


@pytest.mark.parametrize("drafter", ["model", "prompt_lookup", "self"])
def test_engine_sampling_matches_target_distribution(drafter):
    target = peaky(0)
    entry = {"model": peaky(1), "prompt_lookup": "prompt_lookup", "self": target}[drafter]
    prompt = torch.tensor([[3, 5, 3, 5, 3]])  # repeats, so prompt lookup proposes something
    kwargs = dict(do_sample=True, temperature=0.7, top_k=5, max_new_tokens=3, pad_token_id=0)
    processors = LogitsProcessorList([TemperatureLogitsWarper(0.7), TopKLogitsWarper(5)])
    exact = exact_joint_2_3(target, prompt, processors)
    results = {}
    for n in (1500, 12000):
        torch.manual_seed(n)
        pool = hf_spin.AssistantPool([entry], draft_length=3)
        out = target.generate(input_ids=prompt.expand(n, -1), custom_generate=hf_spin.generate, assistant_pool=pool, **kwargs)
        t2, t3 = out[:, -2], out[:, -1]
        counts = torch.bincount(t2 * SMALL_V + t3, minlength=SMALL_V**2).float()
        results[n] = (tv(counts, exact), fits(counts, exact), pool.last_stats.acceptance_rate)
    print("engine: " + "; ".join(f"N={n}: TV {r[0]:.4f}, chi-square p {r[1]:.3f}, acceptance {r[2]:.2f}" for n, r in results.items()))
    assert results[12000][1] > ALPHA, results
    assert results[12000][0] < results[1500][0], results
    assert results[12000][2] > 0, results  # speculation really happened


def test_engine_sampling_negative_control():
    """The same check rejects the drafter's own distribution (what a broken verifier would emit)."""
    target, draft = peaky(0), peaky(1)
    prompt = torch.tensor([[3, 5, 3, 5, 3]])
    processors = LogitsProcessorList([TemperatureLogitsWarper(0.7), TopKLogitsWarper(5)])
    exact = exact_joint_2_3(target, prompt, processors)
    torch.manual_seed(0)
    out = draft.generate(input_ids=prompt.expand(12000, -1), do_sample=True, temperature=0.7, top_k=5, max_new_tokens=3, pad_token_id=0)
    counts = torch.bincount(out[:, -2] * SMALL_V + out[:, -1], minlength=SMALL_V**2).float()
    assert fits(counts, exact) < 1e-6
