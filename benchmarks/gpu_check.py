"""The prepared GPU check: everything hf_spin must show on a GPU, in one run of at most 8 minutes on
one H100/H200, with no network and no real weights (random-init models from the configs of real
shapes: a Qwen2.5-1.5B target and a Qwen2.5-0.5B drafter).

    python benchmarks/gpu_check.py --out DIR              # the full check on CUDA
    python benchmarks/gpu_check.py --cpu-smoke --out DIR  # reduced: tiny shapes, interpreted kernel
    python benchmarks/gpu_check.py --cpu-host-bound --out DIR  # end to end where the host bounds a step, on CPU
    python benchmarks/gpu_check.py --sections environment compiled --out DIR  # the static cache compiled

Sections, each written to DIR/gpu_check.json as soon as it ends (a run cut short keeps what it did):

1. environment: GPU, capability, versions.
2. kernel: the Triton varlen kernel against the float32 reference across dtypes, head dims, GQA
   ratios and masks (causal, sliding window, tree, empty rows, split keys), PASS/FAIL per case.
3. identity: greedy hf_spin against plain `generate` at batch 1, 4, 16 on both cache paths (rectangular
   and packed), with a model drafter, an oracle drafter and an oracle proposing token trees (packed rows
   verify them whole); where they differ, the target's logit margin at the first difference (a
   near-tie flipped by the numerics of a wider forward, or a bug).
4. end_to_end: an oracle drafter that proposes the known greedy continuation with probability alpha
   per token; tokens/s against plain generate in the same run, accepted tokens per step against the
   theoretical sum_{i=1..k} alpha^i, ms per step split into draft / verify / other.
5. syncs: host synchronisations per speculative step at batch 1 and 16 against the budget k + 2
   (`hf_spin.host_syncs`: CUDA's sync debug mode; on CPU the instrumented count).
6. kernel_timing: the kernel against padded SDPA and `torch.nn.attention.varlen.varlen_attn` (where the
   installed torch has it) on ragged verification batches of 1-32 rows, 256-4096 keys.
7. compiled (its own call, not in the default run: `--sections environment compiled`): the static
   cache's compiled verification (`cache="static", compile=True`) beside hf_spin eager, plain `generate`
   and `generate(cache_implementation="static")` compiled by transformers, at the 1.5B and a 7B shape,
   chains and token trees; ms per token, warm-up seconds, recompilations, syncs per step, and the issue's
   goals PASS/FAIL/NA.

docs/benchmarks.md says how to read it; tests/test_gpu_check.py runs the CPU smoke.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import inspect
import itertools
import json
import os
import random
import sys
import time
import traceback
from pathlib import Path

# The smoke runs the Triton kernel in its interpreter, which triton reads when it is first imported.
if "--cpu-smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoModelForCausalLM, CompileConfig, Qwen2Config  # noqa: E402

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hf_spin  # noqa: E402
from benchmarks.replay.forced import ForcedTarget  # noqa: E402
from benchmarks.replay.trace import Request as TraceRequest  # noqa: E402
from benchmarks.replay.trace import Trace  # noqa: E402
from hf_spin.cache.static_forward import (  # noqa: E402
    CUDA_GRAPHS,
    INDUCTOR_GRAPHS,
    StaticOptions,
    run_static,
    run_static_draft,
    shared_compiled,
    shared_graphed,
)
from hf_spin.drafters import Draft, Drafter, DraftRequest  # noqa: E402
from hf_spin.host_syncs import count_syncs  # noqa: E402
from hf_spin.kernels import pack_tree_masks, varlen_attention, varlen_attention_ref  # noqa: E402
from hf_spin.planning import machine  # noqa: E402
from hf_spin.policies import FixedLength  # noqa: E402
from hf_spin.stats import DrafterStats  # noqa: E402
from hf_spin.step.rows import Request  # noqa: E402
from hf_spin.verify.token_tree import TokenTree  # noqa: E402

# Real shapes (Qwen2.5 configs), random weights. The vocabulary is the real one: the lm_head's cost
# and the sampling/argmax over 152k entries are part of what a step costs on a GPU.
QWEN_1_5B = dict(
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    vocab_size=151936,
)
QWEN_0_5B = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
)
QWEN_7B = dict(
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    vocab_size=152064,
)
TINY_TARGET = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
)
TINY_DRAFTER = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
)
TINY_7B = dict(TINY_TARGET, hidden_size=96, intermediate_size=192, num_attention_heads=6, num_key_value_heads=2)
# Deep and narrow: on one CPU thread its forward costs what dispatching its ops costs, as an eager
# decode's costs its launches on a GPU (the 1.5B shape's 28 layers), so the host's work is the step.
LAUNCH_BOUND = dict(TINY_TARGET, num_hidden_layers=28)

# What each run covers: the full check on a GPU, the smoke on CPU (minutes under the interpreter).
FULL = dict(
    target=QWEN_1_5B,
    drafter=QWEN_0_5B,
    dtype=torch.float32,
    batches=(1, 4, 16),
    near_tie_dtype=torch.bfloat16,
    timing_dtype=torch.bfloat16,
    prompt=(64, 512),
    identity_tokens=48,
    e2e_tokens=128,
    alphas=(0.0, 0.6, 0.9),
    k=4,
    kernel_dtypes=(torch.float16, torch.bfloat16, torch.float32),
    head_dims=(64, 128, 256),
    groups=(1, 4, 8),
    context=(0, 700),
    split_context=3000,
    timing_rows=(1, 4, 16, 32),
    timing_keys=(256, 4096),
    # the compiled section: targets in order (a 7B after the 1.5B, skipped where memory or time says no),
    # batches in order of what the budget keeps (1 and 16 first: the two ends), alphas of the oracle
    compiled_targets=(("1.5B", QWEN_1_5B), ("7B", QWEN_7B)),
    compiled_batches=(1, 16, 4),
    compiled_alphas=(0.0, 0.6, 0.8, 0.9),
    compiled_first_guess_s=150,  # what the first (model, batch) is assumed to take: two compilations, the runs
    never_slower_reps=5,  # alternating pairs of the default pool at alpha 0 and the static-cache generate
    budget_s=450,
)
SMOKE = dict(
    target=TINY_TARGET,
    drafter=TINY_DRAFTER,
    dtype=torch.float32,
    batches=(1, 4),
    near_tie_dtype=torch.bfloat16,
    timing_dtype=torch.bfloat16,
    prompt=(6, 20),
    identity_tokens=10,
    e2e_tokens=12,
    alphas=(0.0, 0.9),
    k=4,
    kernel_dtypes=(torch.bfloat16, torch.float32),
    head_dims=(16,),
    groups=(1, 2),
    context=(0, 20),
    split_context=300,
    timing_rows=(1, 2),
    timing_keys=(16, 64),
    compiled_targets=(("1.5B", TINY_TARGET), ("7B", TINY_7B)),
    compiled_batches=(1, 4),
    compiled_alphas=(0.0, 0.6, 0.8, 0.9),
    compiled_first_guess_s=10,
    never_slower_reps=2,
    budget_s=600,
)
HOST_BOUND = dict(
    SMOKE, target=LAUNCH_BOUND, batches=(1, 4), prompt=(32, 96), e2e_tokens=64, alphas=(0.0, 0.6), reps=3, budget_s=900
)
# Kernel tolerance against the float32 reference: max |error| / max(1, max |reference|).
TOLERANCE = {torch.float16: 4e-3, torch.bfloat16: 3e-2, torch.float32: 1e-4}
MASKS = ("causal", "window", "tree", "empty_rows", "splits")
KEY = 6  # prompt tokens that key a row's reference continuation (random prompts: they tell rows apart)


class Oracle(Drafter):
    """Proposes the known greedy continuation of a row, each token right with probability alpha; the
    first wrong token ends the draft. Acceptance is then alpha per token by construction, so a step
    should commit 1 + sum_{i=1..k} alpha^i tokens."""

    name = kind = "oracle"

    def __init__(
        self, references: list[list[int]], alpha: float, vocab: int, seed: int = 0, tree: bool = False, draws: int = 1
    ):
        self.by_prefix = {tuple(r[:KEY]): r for r in references}
        self.alpha, self.vocab, self.rng = alpha, vocab, random.Random(seed)
        self.tree = tree  # where the step takes token trees: the draft, and the truth as a lighter second branch
        self.draws = draws  # > 1: where the step takes trees, `draws` independent drafts merged (no truth branch)

    def _one(self, truth: list[int]) -> list[int]:
        """The truth up to its first wrong token, each right with probability alpha."""
        draft = []
        for token in truth:
            right = self.rng.random() < self.alpha
            draft.append(token if right else (token + 1) % self.vocab)
            if not right:
                break
        return draft

    def draft(self, request: DraftRequest) -> Draft:
        tokens, trees = [], []
        for row, k in zip(request.rows, request.k):
            seq = request.sequences[row]
            truth = self.by_prefix[tuple(seq[:KEY])][len(seq) : len(seq) + k]
            draft = self._one(truth)
            tokens.append(draft)
            if self.draws > 1:  # accepted: the longest right prefix of the draws
                others = [self._one(truth) for _ in range(self.draws - 1)]
                trees.append(TokenTree.merge([TokenTree.chain(d) for d in [draft, *others] if d]) if draft else None)
            else:
                trees.append(
                    TokenTree.merge([TokenTree.chain(draft, weight=2.0), TokenTree.chain(truth)]) if draft else None
                )
        tree = (self.tree or self.draws > 1) and request.trees
        return Draft(tokens=tokens, q=[None] * len(tokens), trees=trees if tree else None)


def theoretical_accepted(alpha: float, k: int, draws: int = 1) -> float:
    """Expected accepted tokens a step: P(the longest right prefix of `draws` independent drafts reaches i),
    summed over i = 1..k."""
    return sum(1 - (1 - alpha**i) ** draws for i in range(1, k + 1))


class Check:
    """The run: its settings, its device, the JSON it keeps writing, the time left."""

    def __init__(self, smoke: bool, out: Path, sections: list[str], host_bound: bool = False):
        self.cfg = HOST_BOUND if host_bound else SMOKE if smoke else FULL
        self.smoke = smoke
        self.device = torch.device("cpu" if smoke or host_bound else "cuda")
        self.out = out
        self.sections = sections
        self.report: dict = {"smoke": smoke, "host_bound": host_bound}
        self.start = time.perf_counter()
        self.models: dict = {}

    def left(self) -> float:
        return self.cfg["budget_s"] - (time.perf_counter() - self.start)

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "gpu_check.json").write_text(json.dumps(self.report, indent=1, default=str))

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def model(self, which: str, dtype: torch.dtype | None = None):
        """The random-init target or drafter in `dtype` (default: the run's exact dtype), made once."""
        dtype = dtype or self.cfg["dtype"]
        if (which, dtype) not in self.models:
            seed = 0 if which == "target" else 1
            self.models[which, dtype] = self.build(self.cfg[which], dtype, seed, tied=which == "drafter")
        return self.models[which, dtype]

    def build(self, shape: dict, dtype: torch.dtype, seed: int, tied: bool = False, device=None):
        """A random-init Qwen2 of `shape` (on `device`, default the run's; "meta" to count parameters)."""
        config = Qwen2Config(
            **shape,
            max_position_embeddings=8192,
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=0,
            tie_word_embeddings=tied,
        )
        torch.manual_seed(seed)
        with torch.device(device or self.device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = 0
        return model

    def prompts(self, batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded random prompts of ragged lengths: [B, L] ids and mask."""
        g = torch.Generator().manual_seed(seed)
        lo, hi = self.cfg["prompt"]
        lengths = torch.randint(lo, hi + 1, (batch,), generator=g).tolist()
        L = max(lengths)
        vocab = self.cfg["target"]["vocab_size"]
        ids = torch.zeros(batch, L, dtype=torch.long)
        mask = torch.zeros(batch, L, dtype=torch.long)
        for b, n in enumerate(lengths):
            ids[b, L - n :] = torch.randint(3, vocab, (n,), generator=g)
            mask[b, L - n :] = 1
        return ids.to(self.device), mask.to(self.device)


def plain(check: Check, ids, mask, tokens: int, dtype=None) -> torch.Tensor:
    return check.model("target", dtype).generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=tokens, do_sample=False
    )


def spin(check: Check, ids, mask, tokens: int, drafter, ragged: bool, dtype=None, profile: str = "off"):
    """hf_spin's greedy generate with one drafter drafting k tokens a step (profile "off": the planner
    would cut drafts it does not expect to pay, and the check wants the k it asked for)."""
    pool = hf_spin.AssistantPool(
        [drafter],
        draft_length=FixedLength(check.cfg["k"], min_confidence=0.0),
        cache="packed" if ragged else "rectangular",
        profile=profile,
    )
    out = check.model("target", dtype).generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=tokens,
        do_sample=False,
        custom_generate=hf_spin.generate,
        assistant_pool=pool,
    )
    return out, pool.last_stats


def references(out: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    """Each row's committed sequence (prompt without padding + generated) of a plain generate."""
    L = mask.shape[1]
    return [out[b, L - int(mask[b].sum()) :].tolist() for b in range(out.shape[0])]


# --- 1. environment -------------------------------------------------------------------------------


def environment(check: Check) -> dict:
    env = {
        "device": machine.describe(check.device),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "hf_spin": hf_spin.__version__,
        "cuda": torch.version.cuda,
        "python": sys.version.split()[0],
        "threads": torch.get_num_threads(),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if check.device.type == "cuda":
        p = torch.cuda.get_device_properties(check.device)
        env.update(
            capability=f"sm{p.major}{p.minor}", sms=p.multi_processor_count, memory_gib=round(p.total_memory / 2**30, 1)
        )
    print("environment: " + ", ".join(f"{k} {v}" for k, v in env.items()))
    return env


# --- 2. kernel against the reference ---------------------------------------------------------------


def kernel_case(check: Check, dtype, D: int, group: int, mask: str, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    H_kv = 2
    H = H_kv * group
    q_lens = [5, 1, 16, 3] if mask != "empty_rows" else [5, 0, 3, 0]
    hi = check.cfg["split_context"] if mask == "splits" else check.cfg["context"][1]
    k_lens = [q + int(torch.randint(0, hi + 1, (1,), generator=g)) for q in q_lens]
    if mask == "empty_rows":
        k_lens[3] = 0
    q = torch.randn(sum(q_lens), H, D, generator=g).to(check.device, dtype)
    k = torch.randn(sum(k_lens), H_kv, D, generator=g).to(check.device, dtype)
    v = torch.randn(sum(k_lens), H_kv, D, generator=g).to(check.device, dtype)
    cu_q = torch.tensor([0] + list(itertools.accumulate(q_lens)), dtype=torch.int32, device=check.device)
    cu_k = torch.tensor([0] + list(itertools.accumulate(k_lens)), dtype=torch.int32, device=check.device)
    kwargs = {}
    if mask == "window":
        kwargs["sliding_window"] = 64 if not check.smoke else 8
    if mask == "tree":
        trees = []
        for n in q_lens:  # random trees: each node's parent is an earlier node
            m = torch.eye(n, dtype=torch.bool)
            for i in range(1, n):
                parent = int(torch.randint(0, i, (1,), generator=g))
                m[i] |= m[parent]
            trees.append(m)
        kwargs["tree_mask"] = pack_tree_masks(trees).to(check.device)
    if mask == "splits":
        kwargs["num_splits"] = 4
    args = (q, k, v, cu_q, cu_k, max(q_lens), max(k_lens))
    ref_kwargs = {key: val for key, val in kwargs.items() if key != "num_splits"}
    out = varlen_attention(*args, **kwargs)
    ref = varlen_attention_ref(*args, **ref_kwargs)
    same = varlen_attention_ref(*args, upcast=False, **ref_kwargs)
    scale = max(1.0, ref.float().abs().max().item())
    err = (out.float() - ref.float()).abs().max().item() / scale
    same_err = (same.float() - ref.float()).abs().max().item() / scale
    ok = bool(torch.isfinite(out.float()).all()) and err <= TOLERANCE[dtype]
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "head_dim": D,
        "group": group,
        "mask": mask,
        "error": err,
        "same_precision_torch_error": same_err,
        "pass": ok,
    }


def kernel(check: Check) -> dict:
    cfg = check.cfg
    cases = [(dt, D, gr, "causal") for dt in cfg["kernel_dtypes"] for D in cfg["head_dims"] for gr in cfg["groups"]]
    mid_D, mid_group = cfg["head_dims"][len(cfg["head_dims"]) // 2], cfg["groups"][-1]
    cases += [(dt, mid_D, mid_group, m) for dt in cfg["kernel_dtypes"] for m in MASKS[1:]]
    results = []
    for i, (dt, D, gr, m) in enumerate(cases):
        if check.left() < 0.6 * cfg["budget_s"]:  # the kernel cases may use the first 40% of the budget
            results.append(
                {"dtype": str(dt), "head_dim": D, "group": gr, "mask": m, "pass": None, "skipped": "time budget"}
            )
            continue
        try:
            r = kernel_case(check, dt, D, gr, m, seed=i)
        except Exception as e:  # a case that cannot run is a FAIL with its error, and the check goes on
            r = {
                "dtype": str(dt),
                "head_dim": D,
                "group": gr,
                "mask": m,
                "pass": False,
                "error": f"{type(e).__name__}: {e}"[:400],
            }
        results.append(r)
        verdict = "PASS" if r["pass"] else ("SKIP" if r["pass"] is None else "FAIL")
        error = r.get("error", "")
        print(
            f"  kernel {r['dtype']:>8} D={D:<3} group={gr} {m:<10} {verdict} "
            + (error if isinstance(error, str) else f"err {error:.2e}")
        )
    passed = sum(1 for r in results if r["pass"])
    print(f"kernel: {passed}/{len(results)} PASS")
    return {"cases": results, "passed": passed, "total": len(results)}


# --- 3. greedy identity ----------------------------------------------------------------------------


def first_difference(check: Check, ref: list[int], got: list[int], prompt_len: int, dtype) -> dict:
    """Where two greedy sequences part: the position, both tokens, and the target's top-2 logit margin there."""
    j = next(i for i, (a, b) in enumerate(zip(ref, got)) if a != b)
    with torch.no_grad():
        logits = check.model("target", dtype)(torch.tensor([ref[:j]], device=check.device)).logits[0, -1].float()
    top = logits.topk(2)
    return {
        "generated_index": j - prompt_len,
        "plain": ref[j],
        "hf_spin": got[j],
        "margin": (top.values[0] - top.values[1]).item(),
        "hf_spin_token_logit_gap": (logits[ref[j]] - logits[got[j]]).item(),
    }


def identity(check: Check) -> dict:
    """Every batch size in the exact dtype (float32: a flip is a bug); batch 4 in the near-tie dtype
    (bfloat16: a 5-token forward rounds differently from a 1-token one, so random weights' near-ties
    flip; the margins say whether each difference was one)."""
    cfg, results = check.cfg, []
    runs = [(batch, cfg["dtype"]) for batch in cfg["batches"]] + [(4, cfg["near_tie_dtype"])]
    for batch, dtype in runs:
        ids, mask = check.prompts(batch, seed=batch)
        refs = references(plain(check, ids, mask, cfg["identity_tokens"], dtype), mask)
        vocab = cfg["target"]["vocab_size"]
        # oracle_tree: token trees whose second branch is the truth, verified in one forward (packed rows:
        # the kernel's tree masks; rectangular cache: a 4D mask), the accepted branch's KV kept
        drafters = {
            "model": check.model("drafter", dtype),
            "oracle": Oracle(refs, 0.7, vocab, seed=batch),
            "oracle_tree": Oracle(refs, 0.5, vocab, seed=batch, tree=True),
        }
        for ragged in (False, True):
            for name, drafter in drafters.items():
                where = {"batch": batch, "dtype": str(dtype).removeprefix("torch."), "packed": ragged, "drafter": name}
                if check.left() < 0.35 * cfg["budget_s"]:
                    results.append({**where, "skipped": "time budget"})
                    continue
                try:
                    r = {**where, **identity_run(check, ids, mask, refs, drafter, ragged, dtype)}
                except Exception as e:
                    r = {**where, "error": f"{type(e).__name__}: {e}"[:600], "trace": traceback.format_exc()[-1500:]}
                results.append(r)
                label = f"  identity {where['dtype']:>8} b={batch:<2} {'packed' if ragged else 'rect  '} {name:<6}"
                if "error" in r:
                    print(f"{label} ERROR {r['error']}")
                else:
                    margins = ", ".join(f"margin {d['margin']:.3f} at {d['generated_index']}" for d in r["differences"])
                    print(
                        f"{label} {r['identical_rows']}/{batch} identical, accepted {r['accepted']}/{r['drafted']}, "
                        f"failures {r['failures']} {margins}"
                    )
    exact = [r for r in results if r.get("dtype") == str(cfg["dtype"]).removeprefix("torch.") and "skipped" not in r]
    return {"runs": results, "exact_identical": all(r.get("identical_rows") == r["batch"] for r in exact)}


def identity_run(check: Check, ids, mask, refs, drafter, ragged: bool, dtype) -> dict:
    out, stats = spin(check, ids, mask, check.cfg["identity_tokens"], drafter, ragged, dtype)
    got = references(out, mask)
    same = [a == b for a, b in zip(refs, got)]
    counts = DrafterStats.total(stats.drafters.values())
    return {
        "identical_rows": sum(same),
        "accepted": counts.accepted,
        "drafted": counts.drafted,
        "failures": counts.failures,
        "differences": [
            first_difference(check, a, b, len(a) - check.cfg["identity_tokens"], dtype)
            for a, b, s in zip(refs, got, same)
            if not s
        ][:4],
    }


# --- 4. end to end with a controlled acceptance ----------------------------------------------------


def alternating(check: Check, fns: dict, reps: int) -> dict[str, list[float]]:
    """Wall seconds of each of `fns` (name -> call), `reps` calls each, in the given order and reversed by turns:
    on a noisy host, what drifts in time falls on both alike."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(reps):
        for name in list(fns) if i % 2 == 0 else list(fns)[::-1]:
            check.sync()
            start = time.perf_counter()
            fns[name]()
            check.sync()
            times[name].append(time.perf_counter() - start)
    return times


def timed(check: Check, fn):
    """(fn's last output, its median wall time over the run's `reps` calls)."""
    times = []
    for _ in range(check.cfg.get("reps", 1)):
        check.sync()
        t = time.perf_counter()
        out = fn()
        check.sync()
        times.append(time.perf_counter() - t)
    return out, sorted(times)[len(times) // 2]


def end_to_end(check: Check) -> dict:
    cfg, results = check.cfg, []
    tokens, k = cfg["e2e_tokens"], cfg["k"]
    for batch in cfg["batches"]:
        ids, mask = check.prompts(batch, seed=100 + batch)
        plain(check, ids, mask, 4)  # warm-up
        ref_out, plain_s = timed(check, lambda: plain(check, ids, mask, tokens))
        refs = references(ref_out, mask)
        # k tokens every step on both paths; the default rectangular pool with the planner sizing drafts
        # from the cost profile it measures here (profile "auto"), at alpha 0.6 and at 0 (never slower:
        # the planner decodes plainly, so this is hf_spin's plain step against generate's); token trees
        # (the alpha chain plus the truth as a second branch: up to 2k nodes verified, k accepted every
        # step) on both paths
        variants = [(ragged, alpha, "off", False) for ragged in (False, True) for alpha in cfg["alphas"]] + [
            (False, 0.6, "auto", False),
            (False, 0.0, "auto", False),
        ]
        variants += [(ragged, 0.6, "off", True) for ragged in (False, True)]
        for ragged, alpha, profile, tree in variants:
            where = {"batch": batch, "packed": ragged, "alpha": alpha, "profile": profile, "tree": tree}
            if check.left() < 0.15 * cfg["budget_s"]:
                results.append({**where, "skipped": "time budget"})
                continue
            oracle = Oracle(refs, alpha, cfg["target"]["vocab_size"], seed=batch, tree=tree)
            try:
                if not check.smoke:  # warm-up: kernel compiles, the profile's measurement
                    spin(check, ids, mask, 4, oracle, ragged, profile=profile)
                (out, stats), spin_s = timed(
                    check, lambda: spin(check, ids, mask, tokens, oracle, ragged, profile=profile)
                )
            except Exception as e:
                results.append({**where, "error": f"{type(e).__name__}: {e}"[:600]})
                print(f"  e2e b={batch} alpha={alpha} profile {profile} ERROR {e}")
                continue
            steps = max(stats.steps, 1)
            draft_s = sum(d.draft_seconds for d in stats.drafters.values())
            other_s = stats.wall_seconds - stats.prefill_seconds - stats.verify_seconds - draft_s
            r = {
                **where,
                "plain_tok_s": batch * tokens / plain_s,
                "hf_spin_tok_s": batch * tokens / spin_s,
                "speedup": plain_s / spin_s,
                "identical_rows": sum(a == b for a, b in zip(refs, references(out, mask))),
                "accepted_per_step": stats.mean_accepted_length - 1,
                "theoretical_accepted_per_step": k if tree else theoretical_accepted(alpha, k),
                "steps": stats.steps,
                "ms_per_step": {
                    "draft": 1e3 * draft_s / steps,
                    "verify": 1e3 * stats.verify_seconds / steps,
                    "other": 1e3 * other_s / steps,
                },
                "plain_ms_per_step": 1e3 * plain_s / tokens,
            }
            results.append(r)
            ms = r["ms_per_step"]
            print(
                f"  e2e b={batch:<2} {'packed' if ragged else 'rect  '} {'tree ' if tree else 'chain'} "
                f"alpha={alpha:.1f} profile {profile:<4}: {r['speedup']:.2f}x plain "
                f"({r['hf_spin_tok_s']:.0f} vs {r['plain_tok_s']:.0f} tok/s), "
                f"accepted/step {r['accepted_per_step']:.2f} (theory {r['theoretical_accepted_per_step']:.2f}), "
                f"ms/step draft {ms['draft']:.1f} verify {ms['verify']:.1f} other {ms['other']:.1f} "
                f"(plain {r['plain_ms_per_step']:.1f}), identical {r['identical_rows']}/{batch}"
            )
    return {"runs": results, "k": k}


# --- 5. synchronisations per step ------------------------------------------------------------------


def syncs(check: Check) -> dict:
    """Syncs per speculative step (`hf_spin.host_syncs`: CUDA's sync debug mode on a GPU, the
    instrumented count on CPU) with the oracle and the model drafter drafting k tokens, against the
    budget k + 2. On CPU the
    packed path runs the kernel's reference, which reads its metadata on the host: left out there."""
    cfg, results = check.cfg, []
    tokens = cfg["identity_tokens"]
    exclude = ("kernels/",) if check.device.type != "cuda" else ()
    for batch in (1, 16):
        ids, mask = check.prompts(batch, seed=200 + batch)
        refs = references(plain(check, ids, mask, tokens), mask)
        drafters = {"oracle": Oracle(refs, 0.6, cfg["target"]["vocab_size"]), "model": check.model("drafter")}
        for ragged, (name, drafter) in itertools.product((False, True), drafters.items()):
            spin(check, ids, mask, 4, drafter, ragged)  # warm-up
            with count_syncs() as counter:
                spin(check, ids, mask, tokens, drafter, ragged)
            r = {
                "batch": batch,
                "packed": ragged,
                "drafter": name,
                "mode": counter.mode,
                "per_step": counter.per_step(exclude),
                "bound": cfg["k"] + 2,
                "steps": counter.entries["step"],
                "phases": dict(counter.phases),
                "top_step_sites": counter.step_sites.most_common(8),
            }
            results.append(r)
            print(
                f"  syncs b={batch:<2} {'packed' if ragged else 'rect  '} {name:<6}: {r['per_step']:.1f} per step "
                f"(budget k + 2 = {r['bound']}, {counter.mode}), "
                f"phases {r['phases']}; top: {counter.step_sites.most_common(3)}"
            )
    return {"runs": results}


# --- 6. kernel timing ------------------------------------------------------------------------------


def bench(check: Check, fn, reps: int) -> float:
    """Median milliseconds of fn."""
    fn()
    times = []
    for _ in range(reps):
        if check.device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t))
    return sorted(times)[len(times) // 2]


def kernel_timing(check: Check) -> dict:
    cfg, results = check.cfg, []
    shape = cfg["target"]
    H, H_kv = shape["num_attention_heads"], shape["num_key_value_heads"]
    D = shape["hidden_size"] // H
    lo, hi = cfg["timing_keys"]
    q_len = cfg["k"] + 1
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        varlen_attn = None
    for rows in cfg["timing_rows"]:
        if check.left() < 0.05 * cfg["budget_s"]:
            break
        g = torch.Generator().manual_seed(rows)
        k_lens = torch.randint(lo, hi + 1, (rows,), generator=g).tolist()
        q = torch.randn(rows * q_len, H, D, generator=g).to(check.device, cfg["timing_dtype"])
        k = torch.randn(sum(k_lens), H_kv, D, generator=g).to(check.device, cfg["timing_dtype"])
        v = torch.randn_like(k)
        cu_q = torch.arange(0, (rows + 1) * q_len, q_len, dtype=torch.int32, device=check.device)
        cu_k = torch.tensor([0] + list(itertools.accumulate(k_lens)), dtype=torch.int32, device=check.device)
        L = max(k_lens)
        kp = torch.zeros(rows, H_kv, L, D, dtype=k.dtype, device=check.device)  # padded, left-aligned
        vp = torch.zeros_like(kp)
        allowed = torch.zeros(rows, 1, q_len, L, dtype=torch.bool, device=check.device)
        for b, n in enumerate(k_lens):
            kp[b, :, :n] = k[cu_k[b] : cu_k[b + 1]].transpose(0, 1)
            vp[b, :, :n] = v[cu_k[b] : cu_k[b + 1]].transpose(0, 1)
            allowed[b, 0] = (
                torch.arange(L, device=check.device)[None, :]
                <= (n - q_len + torch.arange(q_len, device=check.device))[:, None]
            )
        qp = q.view(rows, q_len, H, D).transpose(1, 2)
        methods = {
            "hf_spin": lambda: varlen_attention(q, k, v, cu_q, cu_k, q_len, L),
            "padded_sdpa": lambda: F.scaled_dot_product_attention(qp, kp, vp, attn_mask=allowed, enable_gqa=True),
        }
        if varlen_attn is not None and check.device.type == "cuda":
            # bottom-right causal (window (-1, 0)): queries are each row's last q_len keys. Without
            # enable_gqa (torch < 2.12) the KV heads are repeated beforehand, outside the timing.
            gqa = "enable_gqa" in inspect.signature(varlen_attn).parameters
            kx, vx = (k, v) if gqa else (k.repeat_interleave(H // H_kv, 1), v.repeat_interleave(H // H_kv, 1))
            extra = {"enable_gqa": True} if gqa else {}
            methods["torch_varlen_attn" if gqa else "torch_varlen_attn_repeated_kv"] = lambda: varlen_attn(
                q, kx, vx, cu_q, cu_k, q_len, L, window_size=(-1, 0), **extra
            )
        r = {"rows": rows, "keys": k_lens if rows <= 4 else [min(k_lens), max(k_lens)], "ms": {}}
        for name, fn in methods.items():
            try:
                r["ms"][name] = bench(check, fn, reps=20 if check.device.type == "cuda" else 2)
            except Exception as e:
                r["ms"][name] = f"{type(e).__name__}: {e}"[:200]
        results.append(r)
        print(
            f"  timing rows={rows:<2} keys {lo}-{hi}: "
            + ", ".join(f"{n} {t:.3f} ms" if isinstance(t, float) else f"{n} {t}" for n, t in r["ms"].items())
        )
    return {
        "head_dim": D,
        "heads": H,
        "kv_heads": H_kv,
        "q_len": q_len,
        "dtype": str(cfg["timing_dtype"]),
        "runs": results,
    }


# --- 7. compiled: the static cache's compiled verification -----------------------------------------

# The goals for the compiled static layout, printed PASS / FAIL / NA beside the figures (never asserted)
NEVER_SLOWER = 0.97  # alpha 0, the default pool (profile "auto"): x generate's static cache compiled, every batch
CHAIN_ALPHA, CHAIN_SPEEDUP = 0.8, 2.0  # a chain of k = 4 at batch 1, x generate's static cache compiled
DRAFT_COST = 0.4  # a 0.5B-shape draft token (compiled, its own static cache) / the 1.5B's compiled plain step
WARMUP_RATIO = 1.5  # hf_spin's compilation warm-up / transformers' static-cache warm-up
TREE_ALPHA, TREE_DRAWS, TREE_GAIN = 0.6, 2, 1.2  # trees of 2 oracle drafts at alpha 0.6: x chains, same batch
CONTINUOUS_EVERY = 4  # continuous batching: steps between the groups of rows that join (`continuous`)


def unique_graphs() -> int:
    """Graphs dynamo has compiled in this process so far (a recompilation adds one)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def graph_captures() -> int:
    """CUDA graphs hf_spin has captured for the static layout in this process so far (backends "cuda_graphs" and
    "inductor+cuda_graphs"; a capture per shape and storage)."""
    forwards = [run_static, run_static_draft]
    forwards += [shared_compiled(forward, "inductor", None) for forward in forwards]
    return sum(shared_graphed(forward).captures for forward in forwards)


def cudagraph_skips() -> int:
    """Compiled graphs inductor has run without CUDA graphs so far (mode "reduce-overhead"; its log says why)."""
    return torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]


@contextlib.contextmanager
def cudagraph_events():
    """Counts, over the block, of inductor's CUDA graph trees at work: "record_function" (a graph recorded;
    after a warm-up, a re-record), "run_eager" (a warm-up run), "past_rerecord_limit" (calls that ran their
    kernels one launch at a time, past the re-record limit), "skips" (graphs run without CUDA graphs)."""
    from torch._inductor import cudagraph_trees

    seen, manager, start = collections.Counter(), cudagraph_trees.CUDAGraphTreeManager, cudagraph_skips()
    names = ("record_function", "run_eager", "exceed_rerecord_limit")
    originals = {n: getattr(manager, n) for n in names if hasattr(manager, n)}  # as this torch has them

    def counting(name, fn):
        def wrapper(self, *args, **kwargs):
            out = fn(self, *args, **kwargs)
            if name != "exceed_rerecord_limit":
                seen[name] += 1
            elif out:
                seen["past_rerecord_limit"] += 1
            return out

        return wrapper

    for name, fn in originals.items():
        setattr(manager, name, counting(name, fn))
    try:
        yield seen
    finally:
        for name, fn in originals.items():
            setattr(manager, name, fn)
        seen["skips"] = cudagraph_skips() - start


def compile_backend(check: Check) -> str:
    """On CUDA `--static-backend`: inductor (CUDA graphs through "reduce-overhead"), cuda_graphs (the eager
    forward captured, no torch.compile), or inductor+cuda_graphs (inductor's forward captured by hf_spin); on
    CPU dynamo alone ("eager": no graph break and no recompilation are checked the same, without code
    generation, so the smoke takes seconds)."""
    return check.cfg.get("static_backend", INDUCTOR_GRAPHS) if check.device.type == "cuda" else "eager"


def draft_backend(check: Check) -> str | None:
    """On CUDA `--draft-backend`: the model drafters' own backend (None: the target's); on CPU the target's."""
    return check.cfg.get("draft_backend") if check.device.type == "cuda" else None


def static_generate(check: Check, model, ids, mask, tokens: int) -> torch.Tensor:
    """Plain greedy `generate` on transformers' static cache, its decoding forward compiled by transformers:
    on CUDA its default (inductor, "reduce-overhead"); on CPU, where it compiles only when told, the eager
    backend."""
    kwargs = {}
    if check.device.type != "cuda":
        kwargs["compile_config"] = CompileConfig(backend="eager", mode=None)
        kwargs["compile_config"]._compile_all_devices = True
    return model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=tokens,
        do_sample=False,
        cache_implementation="static",
        **kwargs,
    )


def static_spin(
    check: Check,
    model,
    ids,
    mask,
    tokens: int,
    drafter,
    static: bool,
    profile: str,
    compile=True,
    trees=False,
    run_ahead: bool | str = "auto",
):
    """hf_spin's greedy generate, drafts of k: on the static layout compiled (k + 1 query slots from the
    first verification on, so one graph serves the run; a tree's nodes widen it once; compile=False: the
    same forward eager; plain steps running ahead as `run_ahead` says), or eager on the rectangular cache;
    chains, or the drafter's token trees."""
    k = check.cfg["k"]
    options = StaticOptions(
        compile,
        backend=compile_backend(check),
        query_slots=k + 1,
        run_ahead=run_ahead,
        draft_backend=draft_backend(check),
    )
    layout = dict(cache="static", compile=options) if static else dict(cache="rectangular")
    pool = hf_spin.AssistantPool(
        [drafter], draft_length=FixedLength(k, min_confidence=0.0), profile=profile, tree=trees and "auto", **layout
    )
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=tokens,
        do_sample=False,
        custom_generate=hf_spin.generate,
        assistant_pool=pool,
    )
    return out, pool.last_stats


@contextlib.contextmanager
def forced(check: Check, model, mask: torch.Tensor, refs: list[list[int]]):
    """Yields whether `model` is forced to `refs` inside. In reduced precision a random-weight model's greedy
    path flips at near-ties with a forward's width (bfloat16 on an H100: no compiled run kept dynamic
    `generate`'s 128 tokens), so the oracle's truth would stop being the target's. There the target is
    forced to `refs` (the replay's forced target: a margin on the reference token put on the device over
    the forward's own logits, which still run for their cost), so every method commits `refs` and the
    oracle's acceptance is alpha by construction. float32 (no TF32): the model as it is."""
    if check.cfg["dtype"] == torch.float32:
        yield False
        return
    lengths = mask.sum(dim=1).tolist()  # [B] prompt tokens (refs hold no padding)
    requests = [TraceRequest(str(b), "prompts", "", r[:n], r[n:]) for b, (r, n) in enumerate(zip(refs, lengths))]
    target = {"eos_token_id": [], "pad_token_id": 0}
    trace = Trace(target, [], requests, check.cfg["k"], check.cfg["e2e_tokens"], 0.0)
    hooks = ForcedTarget(model, trace)
    hooks.expect(list(range(len(requests))))  # every call inside runs the batch of refs, in their order
    try:
        yield True
    finally:
        for handle in hooks.handles:
            handle.remove()


def compiled_target(check: Check, shape: dict):
    """(the target of `shape`, None) or (None, why not): the run's own target where the shapes agree, else
    built here where the GPU's free memory holds its weights with room for the caches and graphs."""
    dtype = check.cfg["dtype"]
    if shape == check.cfg["target"]:
        return check.model("target", dtype), None
    if check.device.type == "cuda":
        meta = check.build(shape, dtype, seed=2, device="meta")
        need = sum(p.numel() for p in meta.parameters()) * dtype.itemsize
        free = torch.cuda.mem_get_info(check.device)[0]
        if free < 1.2 * need + 4 * 2**30:
            return None, f"memory: {need / 2**30:.1f} GiB of weights in {dtype}, {free / 2**30:.1f} GiB free"
    try:
        return check.build(shape, dtype, seed=2), None
    except torch.OutOfMemoryError as e:
        return None, f"memory: {e}"[:300]


def config_estimate(check: Check, took: dict, label: str, batch: int) -> float:
    """Seconds a (model, batch) should take: the longest of this model's so far; for a later model with
    none yet, twice the first model's at this batch (larger weights, the same two compilations); else
    the configured guess."""
    mine = [s for (m, _), s in took.items() if m == label]
    same_batch = [s for (_, b), s in took.items() if b == batch]
    if mine:
        return max(mine)
    if same_batch or took:
        return 2 * max(same_batch or took.values())
    return check.cfg["compiled_first_guess_s"]


def compiled(check: Check) -> dict:
    """The static layout's compiled verification against compiled plain decoding, side by side on the
    same prompts: `generate` (dynamic cache, eager; its static cache compiled by transformers), hf_spin
    eager (rectangular cache) and compiled (`cache="static", compile=True`) with the oracle drafter at
    each alpha (alpha 0 with the default profile too: never slower), and a 0.5B-shape model drafter's
    cost. Per (model, batch), in order, while the budget lasts; the JSON is rewritten after each."""
    cfg = check.cfg
    report = {
        "dtype": str(cfg["dtype"]).removeprefix("torch."),
        "k": cfg["k"],
        "tokens": cfg["e2e_tokens"],
        "backend": compile_backend(check),
        "draft_backend": draft_backend(check) or compile_backend(check),
        "trees": f"alpha {TREE_ALPHA}: {TREE_DRAWS} independent oracle drafts merged into a tree, compiled",
        "configs": [],
        "runs": [],
        "continuous": [],  # per model, at its largest batch: rows joining and leaving (`continuous`)
        "never_slower_repeats": [],  # per (model, batch): the default pool at alpha 0 against static generate
    }
    check.report["compiled"] = report  # saved after each (model, batch): a run cut short keeps what it did
    print(
        f"  compiled: chains of k = {cfg['k']}, {report['dtype']}, backend {report['backend']} "
        f"(drafters {report['draft_backend']}); {report['trees']}"
    )
    limit = torch._dynamo.config.recompile_limit
    torch._dynamo.config.recompile_limit = 64  # a graph per (model, batch) and method: counted, not refused
    start, start_skips, took = unique_graphs(), cudagraph_skips(), {}
    try:
        for label, shape in cfg["compiled_targets"]:
            model, later, refused = None, [], None  # refused: why the model could not be built
            for batch in cfg["compiled_batches"]:
                where = {"model": label, "batch": batch}
                need = config_estimate(check, took, label, batch)
                why = refused
                if why is None and check.left() < need:
                    why = f"time budget: ~{need:.0f} s needed, {check.left():.0f} s left"
                elif why is None and model is None:
                    model, refused = compiled_target(check, shape)
                    why = refused
                if why:
                    report["configs"].append({**where, "skipped": why})
                    print(f"  compiled {label} b={batch}: skipped ({why})")
                    continue
                t = time.perf_counter()
                eager = compiled_config(check, report, label, model, batch)
                took[label, batch] = time.perf_counter() - t
                report["configs"].append({**where, "seconds": round(took[label, batch], 1)})
                later += [eager] if eager else []
                check.save()
            for eager in later:  # hf_spin eager after every batch's compiled runs: what the budget drops first
                eager()
                check.save()
            later.clear()  # its runs hold the model: a model built here goes before the next one is
            model = None
            if check.device.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        torch._dynamo.config.recompile_limit = limit
    report["graphs_compiled"] = unique_graphs() - start
    report["cudagraph_skips"] = cudagraph_skips() - start_skips
    report["goals"] = compiled_goals(report)
    return report


def compiled_config(check: Check, report: dict, label: str, model, batch: int):
    """One (model, batch), each run appended to report["runs"] as it ends: the two plain baselines (the
    oracle proposes dynamic generate's greedy output), hf_spin compiled (its first call compiles: warm-up
    = first call - steady call, as for transformers' static cache), the 0.5B-shape drafter (the 1.5B
    only). Returns what runs hf_spin eager at this batch (called once every batch's compiled runs are
    done), or None where the baselines did not fit."""
    cfg, runs = check.cfg, report["runs"]
    tokens, k, budget = cfg["e2e_tokens"], cfg["k"], cfg["budget_s"]
    ids, mask = check.prompts(batch, seed=300 + batch)
    vocab = model.config.vocab_size
    where = {"model": label, "batch": batch}

    def record(r: dict) -> None:
        runs.append(r)
        check.save()  # a run cut short by a timeout keeps every run before it
        head = f"  compiled {label:>4} b={batch:<2} {r['method']:<16}"
        if "skipped" in r or "error" in r:
            print(f"{head} {r.get('skipped') or 'ERROR ' + r['error']}")
            return
        warm = f", warm-up {r['warmup_s']:.1f} s" if "warmup_s" in r else ""
        if r.get("first_call_cudagraph_skips"):
            warm += f" ({r['first_call_cudagraph_skips']} graphs without CUDA graphs: see the log)"
        spin = ""
        if r["method"].startswith("hf_spin"):
            theory = r["theoretical_accepted_per_step"]
            spin = (
                f" {r['drafter']:<10}"
                + (f" alpha={r['alpha']:.1f} profile {r['profile']:<4}" if r["alpha"] is not None else "")
                + (f" ({r['variant']})" if "variant" in r else "")
                + f": accepted/step {r['accepted_per_step']:.2f}"
                + (f" (theory {theory:.2f})" if theory is not None else "")
                + f", syncs/step {r['host_syncs_per_step']:.1f}, identical {r['identical_rows']}/{batch} "
                f"({r['identical_rows_static']}/{batch} vs static),"
            )
        draft = f", draft token {r['draft_ms_per_token']:.2f} ms" if "draft_ms_per_token" in r else ""
        draft += f", CUDA graph trees: {r['cudagraph_events']}" if r.get("cudagraph_events") else ""
        print(
            f"{head}{spin} {r['ms_per_token']:.2f} ms/token, {r['speedup_vs_static']:.2f}x static generate, "
            f"graphs {r['graphs_compiled']}{warm}{draft}"
        )

    # generate, dynamic cache, eager: the reference
    plain_fn = lambda: generate_plain(model, ids, mask, tokens)  # noqa: E731
    generate_plain(model, ids, mask, 4)  # warm-up
    g = unique_graphs()
    out, plain_s = timed(check, plain_fn)
    refs = references(out, mask)
    plain_row = {**where, "method": "generate", "ms_per_token": 1e3 * plain_s / tokens}
    plain_row.update(tok_s=batch * tokens / plain_s, graphs_compiled=unique_graphs() - g)
    # generate, static cache compiled by transformers: its first call compiles
    warmups = [r["warmup_s"] for r in runs if "warmup_s" in r]
    reserve = max(warmups[-1] if warmups else cfg["compiled_first_guess_s"] / 3, 0.03 * budget)
    if check.left() < reserve:
        for method in ("generate", "generate_static"):
            record({**where, "method": method, "skipped": "time budget"})
        return None
    stack = contextlib.ExitStack()  # the target forced to refs in reduced precision, until `continuous`
    report["forced"] = stack.enter_context(forced(check, model, mask, refs))
    g, skips = unique_graphs(), cudagraph_skips()
    first_s, static_out = wall(check, lambda: static_generate(check, model, ids, mask, tokens))
    first_graphs, first_skips = unique_graphs() - g, cudagraph_skips() - skips
    g = unique_graphs()
    static_out, static_s = timed(check, lambda: static_generate(check, model, ids, mask, tokens))
    static_refs = references(static_out, mask)
    plain_row["speedup_vs_static"] = static_s / plain_s
    record(plain_row)
    record(
        {
            **where,
            "method": "generate_static",
            "ms_per_token": 1e3 * static_s / tokens,
            "tok_s": batch * tokens / static_s,
            "speedup_vs_static": 1.0,
            "identical_rows": sum(a == b for a, b in zip(refs, static_refs)),
            "first_call_s": first_s,
            "warmup_s": first_s - static_s,
            "first_call_graphs": first_graphs,
            "first_call_cudagraph_skips": first_skips,
            "graphs_compiled": unique_graphs() - g,
        }
    )

    def spin_run(
        compiled: bool,
        alpha: float | None,
        profile: str,
        first: bool = False,
        warm: bool = False,
        draws: int = 1,
        run_ahead: bool | str = "auto",
    ):
        """One hf_spin run: timed; before it a first call where it compiles (first), measures its cost
        profile or compiles a tree's wider graph (warm); after it the same run again under `count_syncs`.
        alpha None: the model drafter; draws > 1: token trees of that many oracle drafts."""
        method = "hf_spin_compiled" if compiled else "hf_spin_eager"
        r = {**where, "method": method, "alpha": alpha, "profile": profile}
        r["drafter"] = "0.5B model" if alpha is None else "oracle" if draws == 1 else f"oracle tree of {draws}"
        if compiled:  # whether its plain steps ran ahead (docs/design.md, "Run-ahead")
            r["run_ahead"] = StaticOptions(True, backend=compile_backend(check), run_ahead=run_ahead).runs_ahead(model)
        if run_ahead != "auto":  # not the default pool as users get it
            r["variant"] = "run-ahead " + ("on" if r["run_ahead"] else "off")
        if check.left() < (reserve if first else 0.03 * budget):
            return record({**r, "skipped": "time budget"})

        def run(n: int = tokens, compile: bool = True):  # a fresh oracle: every call drafts the same
            oracle = alpha is not None
            drafter = Oracle(refs, alpha, vocab, seed=batch, draws=draws) if oracle else check.model("drafter")
            trees = draws > 1
            return static_spin(check, model, ids, mask, n, drafter, compiled, profile, compile, trees, run_ahead)

        try:
            if first or warm:  # eager: the profile's measurement alone, over 4 tokens
                g, skips, c = unique_graphs(), cudagraph_skips(), graph_captures()
                first_s, _ = wall(check, run if compiled else lambda: run(4))
                first_graphs, first_skips = unique_graphs() - g, cudagraph_skips() - skips
                r["first_call_captures"] = graph_captures() - c
            g, c = unique_graphs(), graph_captures()
            with cudagraph_events() as events:
                (out, stats), s = timed(check, run)
            r["cudagraph_events"] = {k: v for k, v in events.items() if v}  # in the timed run; {}: replays alone
            # the run again, counted (eager: over fewer tokens; compiled: the same, a shorter run could need
            # another capacity, another graph); on CPU the instrumented count's dispatch modes and dynamo do
            # not mix: there the static layout's forward runs eagerly (the host's side of a step is the same)
            eager_count = compiled and check.device.type != "cuda"
            r["sync_tokens"] = tokens if compiled else cfg["identity_tokens"]
            with count_syncs() as counter:
                run(r["sync_tokens"], compile=not eager_count)
            graphs = unique_graphs() - g
            r["captures"] = graph_captures() - c  # backend cuda_graphs: new storage each call, captured again
        except Exception as e:
            return record({**r, "error": f"{type(e).__name__}: {e}"[:600], "trace": traceback.format_exc()[-1500:]})
        steps = max(stats.steps, 1)
        counts = DrafterStats.total(stats.drafters.values())
        other_s = stats.wall_seconds - stats.prefill_seconds - stats.verify_seconds - counts.draft_seconds
        got = references(out, mask)
        r.update(
            ms_per_token=1e3 * s / tokens,
            tok_s=batch * tokens / s,
            speedup_vs_static=static_s / s,
            speedup_vs_plain=plain_s / s,
            accepted_per_step=stats.mean_accepted_length - 1,
            theoretical_accepted_per_step=theoretical_accepted(alpha, k, draws) if alpha is not None else None,
            steps=stats.steps,
            identical_rows=sum(a == b for a, b in zip(refs, got)),
            identical_rows_static=sum(a == b for a, b in zip(static_refs, got)),
            host_syncs_per_step=counter.per_step(),
            sync_mode=counter.mode + (", static layout eager" if eager_count else ""),
            graphs_compiled=graphs,
            ms_per_step={
                "draft": 1e3 * counts.draft_seconds / steps,
                "verify": 1e3 * stats.verify_seconds / steps,
                "other": 1e3 * other_s / steps,
            },
        )
        if first:
            r.update(first_call_s=first_s, warmup_s=first_s - s, first_call_graphs=first_graphs)
            r["first_call_cudagraph_skips"] = first_skips
        if alpha is None:  # per draft token of a row (a batched forward), against the compiled plain step
            r["draft_ms_per_token"] = 1e3 * counts.draft_seconds * batch / max(counts.drafted, 1)
            r["draft_token_vs_static_step"] = r["draft_ms_per_token"] / (1e3 * static_s / tokens)
        record(r)

    def warmups_now() -> list[float]:
        return [r["warmup_s"] for r in runs if "warmup_s" in r]

    alphas = sorted((a for a in cfg["compiled_alphas"] if a), key=lambda a: a != CHAIN_ALPHA)  # the goal's first
    variants = [(0.0, "off"), (0.0, "auto")] + [(a, "off") for a in alphas]
    for i, (alpha, profile) in enumerate(variants[:2]):
        spin_run(True, alpha, profile, first=i == 0, warm=profile == "auto")
    # the default pool's plain decode with run-ahead the other way than its default on this backend
    spin_run(True, 0.0, "auto", run_ahead=not StaticOptions(True, backend=compile_backend(check)).runs_ahead(model))
    if check.left() > 0.1 * budget:  # never slower, beyond one run's noise: the pair again, alternating

        def default_pool():
            return static_spin(check, model, ids, mask, tokens, Oracle(refs, 0.0, vocab), True, "auto", True)

        pair = {"generate_static": lambda: static_generate(check, model, ids, mask, tokens), "hf_spin": default_pool}
        times = alternating(check, pair, cfg["never_slower_reps"])
        medians = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
        report["never_slower_repeats"].append(
            {
                **where,
                "ms_per_token": {name: [round(1e3 * t / tokens, 3) for t in ts] for name, ts in times.items()},
                "speedup_median": medians["generate_static"] / medians["hf_spin"],
                "speedups": [a / b for a, b in zip(times["generate_static"], times["hf_spin"])],
            }
        )
        print(f"  compiled {label:>4} b={batch:<2} never slower, alternating: {report['never_slower_repeats'][-1]}")
    if batch == cfg["compiled_batches"][0] and check.left() > 0.1 * budget:  # where a plain step's time goes

        def never():  # the default pool where nothing is accepted: hf_spin's compiled plain decode
            return static_spin(check, model, ids, mask, tokens, Oracle(refs, 0.0, vocab), True, "auto", True)

        report.setdefault("profiles", {})[f"{label} b={batch}"] = {
            "generate_static": profiled(check, lambda: static_generate(check, model, ids, mask, tokens), tokens),
            "hf_spin_compiled alpha 0 profile auto": profiled(check, never, tokens),
        }
    for alpha, profile in variants[2:]:
        spin_run(True, alpha, profile)
    spin_run(True, TREE_ALPHA, "off", warm=True, draws=TREE_DRAWS)  # its warm call compiles the tree's width
    if model is check.models.get(("target", cfg["dtype"])):  # the drafter shares the 1.5B's vocabulary
        spin_run(True, None, "off", first=True)  # its first call compiles the drafter's graphs (widths 1, 2)
    stack.close()  # rows joining a running batch: the forced target cannot tell them apart
    check.save()
    # its first pass compiles what it meets (unforced: every graph again), as long as a first call
    if batch == max(cfg["compiled_batches"]) and check.left() > max([0.03 * budget] + warmups_now()):
        report["continuous"].append({**where, **continuous(check, model, ids, mask, refs)})
        print(f"  compiled {label:>4} b={batch:<2} continuous: {report['continuous'][-1]}")

    def eager_runs():
        with forced(check, model, mask, refs):
            for alpha, profile in variants:
                spin_run(False, alpha, profile, warm=profile == "auto")

    return eager_runs


def profiled(check: Check, run, tokens: int, rows: int = 12) -> dict:
    """`run` under torch.profiler (CPU, and CUDA on a GPU): per token, the host's time in hf_spin's and
    transformers' Python and in each op, the device's in each kernel; the ops that take most of either,
    as `key_averages` tables. What a compiled plain step pays beyond transformers' own, op by op."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if check.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    start = time.perf_counter()
    with torch.profiler.profile(activities=activities) as prof:
        run()
        if check.device.type == "cuda":
            torch.cuda.synchronize()
    events = prof.key_averages()
    out = {"wall_ms_per_token": 1e3 * (time.perf_counter() - start) / tokens}
    out["cpu_top"] = events.table(sort_by="self_cpu_time_total", row_limit=rows)
    if check.device.type == "cuda":
        out["cuda_top"] = events.table(sort_by="self_device_time_total", row_limit=rows)
        out["kernels_per_token"] = sum(e.count for e in events if e.self_device_time_total > 0) / tokens
    return out


def continuous(check: Check, model, ids, mask, refs: list[list[int]]) -> dict:
    """Continuous batching on the static layout, compiled: the batch's prompts join an engine in three groups
    (a quarter at step 0, half at step CONTINUOUS_EVERY, the rest at 3 CONTINUOUS_EVERY, into slots rows left:
    the row slots grow once, to the batch's bucket, whose graphs the batch's runs compiled), each row for its
    own number of tokens (so rows leave at different steps), the oracle at CHAIN_ALPHA drafting chains of k.
    The schedule runs twice: the first pass compiles what it meets, the second must compile nothing. Returns
    its steps, the graphs each pass compiled, and the rows equal to plain `generate`'s."""
    cfg, k, B = check.cfg, check.cfg["k"], len(refs)
    prompts = [row[m.bool()].tolist() for row, m in zip(ids.cpu(), mask.cpu())]
    tokens = cfg["e2e_tokens"]
    lengths = [max(2, tokens - (7 * i) % (tokens // 2)) for i in range(B)]
    first, second = max(1, B // 4), max(1, B // 4) + B // 2
    joins = {0: range(first), CONTINUOUS_EVERY: range(first, second), 3 * CONTINUOUS_EVERY: range(second, B)}
    options = StaticOptions(True, backend=compile_backend(check), query_slots=k + 1, draft_backend=draft_backend(check))
    passes = {}
    for name in ("warm", "counted"):
        oracle = Oracle(refs, CHAIN_ALPHA, model.config.vocab_size, seed=0)
        pool = hf_spin.AssistantPool(
            [oracle],
            draft_length=FixedLength(k, min_confidence=0.0),
            profile="off",
            tree=False,
            cache="static",
            compile=options,
        )
        engine = hf_spin.SpinEngine(model, pool)
        g, rows, step = unique_graphs(), {}, 0
        while engine.has_work or step <= 3 * CONTINUOUS_EVERY:
            for i in joins.get(step, ()):
                rows[i] = engine.add(Request(prompt=prompts[i], max_new_tokens=lengths[i]))
            if engine.has_work:
                engine.step()
            step += 1
        engine.close()
        passes[name] = (step, unique_graphs() - g)
    same = sum(rows[i].generated == refs[i][len(p) : len(p) + n] for i, (p, n) in enumerate(zip(prompts, lengths)))
    return {
        "steps": passes["counted"][0],
        "graphs_warm": passes["warm"][1],
        "graphs_compiled": passes["counted"][1],
        "identical_rows": same,
        "rows": B,
    }


def generate_plain(model, ids, mask, tokens: int) -> torch.Tensor:
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=tokens, do_sample=False)


def wall(check: Check, fn) -> tuple[float, object]:
    """(fn's wall seconds, its output): one call, the device synchronised around it."""
    check.sync()
    t = time.perf_counter()
    out = fn()
    check.sync()
    return time.perf_counter() - t, out


def compiled_goals(report: dict) -> dict:
    """The issue's goals from the section's runs: PASS where every measured case meets it, FAIL where one
    does not, NA where none was measured; each with its values."""
    runs = [r for r in report["runs"] if "skipped" not in r and "error" not in r]

    def pick(**kw):
        return [r for r in runs if all(r.get(key) == v for key, v in kw.items())]

    def goal(text: str, values: dict, ok) -> dict:
        verdict = "NA" if not values else "PASS" if all(ok(v) for v in values.values()) else "FAIL"
        return {"goal": text, "verdict": verdict, "values": values}

    def at(r):
        return f"{r['model']} b={r['batch']}"

    static_warmup = {at(r): r["warmup_s"] for r in pick(method="generate_static")}
    goals = {
        "never_slower": goal(
            f"alpha 0, default pool (profile auto), compiled: >= {NEVER_SLOWER}x static-cache generate, every batch",
            {  # the alternating repeats' median where they ran, else the one run
                **{
                    at(r): r["speedup_vs_static"]
                    for r in pick(method="hf_spin_compiled", alpha=0.0, profile="auto")
                    if "variant" not in r  # the default pool as users get it
                },
                **{at(r): r["speedup_median"] for r in report["never_slower_repeats"]},
            },
            lambda v: v >= NEVER_SLOWER,
        ),
        "chain_speedup": goal(
            f"alpha {CHAIN_ALPHA}, chain of {report['k']}, batch 1, compiled: "
            f">= {CHAIN_SPEEDUP}x static-cache generate",
            {
                at(r): r["speedup_vs_static"]
                for r in pick(method="hf_spin_compiled", alpha=CHAIN_ALPHA, profile="off", batch=1)
            },
            lambda v: v >= CHAIN_SPEEDUP,
        ),
        "trees": goal(
            f"alpha {TREE_ALPHA}, trees of {TREE_DRAWS} drafts, compiled: >= {TREE_GAIN}x chains, same batch",
            {
                at(r): chain["ms_per_token"] / r["ms_per_token"]
                for r in pick(method="hf_spin_compiled", drafter=f"oracle tree of {TREE_DRAWS}")
                for chain in pick(method="hf_spin_compiled", drafter="oracle", alpha=TREE_ALPHA, profile="off")
                if at(chain) == at(r)
            },
            lambda v: v >= TREE_GAIN,
        ),
        "draft_cost": goal(
            f"a 0.5B-shape draft token <= {DRAFT_COST} of the 1.5B's compiled plain step",
            {at(r): r["draft_token_vs_static_step"] for r in pick(drafter="0.5B model")},
            lambda v: v <= DRAFT_COST,
        ),
        "no_recompilation": goal(
            "no graph compiled by a run after its warm-up (timed and sync-counted runs)",
            {f"{at(r)} {run_name(r)}": r["graphs_compiled"] for r in runs},
            lambda v: v == 0,
        ),
        "continuous": goal(
            "no graph compiled by a second pass of rows joining and leaving (compiled, chains)",
            {at(r): r["graphs_compiled"] for r in report["continuous"]},
            lambda v: v == 0,
        ),
        "warmup": goal(
            f"hf_spin compiled warm-up <= {WARMUP_RATIO}x transformers' static-cache warm-up",
            {
                at(r): r["warmup_s"] / max(static_warmup[at(r)], 1e-9)
                for r in pick(method="hf_spin_compiled", drafter="oracle")  # the model drafter's: its own graphs
                if "warmup_s" in r and at(r) in static_warmup
            },
            lambda v: v <= WARMUP_RATIO,
        ),
    }
    for name, g in goals.items():
        shown = g["values"]
        if name == "no_recompilation":  # one value a run: those that compiled, if any
            shown = {key: v for key, v in shown.items() if v} or {f"{len(shown)} runs": 0}
        values = ", ".join(f"{key} {v:.2f}" if isinstance(v, float) else f"{key} {v}" for key, v in shown.items())
        print(f"  goal {name}: {g['verdict']} ({g['goal']}) {values}")
    return goals


def run_name(r: dict) -> str:
    """A compiled-section run's method, with its drafter, alpha and profile where it is hf_spin's."""
    if not r["method"].startswith("hf_spin"):
        return r["method"]
    alpha = f" alpha {r['alpha']} {r['profile']}" if r["alpha"] is not None else ""
    return f"{r['method']} {r['drafter']}{alpha}" + (f" ({r['variant']})" if "variant" in r else "")


SECTIONS = {
    "environment": environment,
    "kernel": kernel,
    "identity": identity,
    "end_to_end": end_to_end,
    "syncs": syncs,
    "kernel_timing": kernel_timing,
    "compiled": compiled,
}
DEFAULT_SECTIONS = [name for name in SECTIONS if name != "compiled"]  # compiled: its own call (minutes of compiling)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="folder for gpu_check.json")
    parser.add_argument(
        "--cpu-smoke", action="store_true", help="tiny shapes on CPU, the kernel interpreted (TRITON_INTERPRET=1)"
    )
    parser.add_argument(
        "--cpu-host-bound",
        action="store_true",
        help="environment and end to end on CPU, one thread, a 28-layer model of width 64: steps bound by the host's "
        "work, as on a GPU",
    )
    parser.add_argument(
        "--sections", nargs="+", choices=list(SECTIONS), help="default: every section but compiled (its own call)"
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        help="time budget of the whole run (default: 450 s on GPU, 600 s smoke, 900 s host-bound)",
    )
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        help="every section's model dtype (default float32: identity without ties from rounding; bfloat16 "
        "times the compiled section as users run it)",
    )
    parser.add_argument("--models", nargs="+", help="the compiled section's targets, of 1.5B 7B (default: both)")
    parser.add_argument("--batches", nargs="+", type=int, help="the compiled section's batch sizes (default 1 16 4)")
    parser.add_argument(
        "--static-backend",
        choices=("inductor", CUDA_GRAPHS, INDUCTOR_GRAPHS),
        default=INDUCTOR_GRAPHS,
        help="how hf_spin's static layout runs its fixed-shape forwards on CUDA: torch.compile with inductor (torch's "
        "CUDA graph trees), the eager forward captured as CUDA graphs without torch.compile, or inductor's forward "
        "captured as hf_spin's CUDA graphs (default, as StaticOptions)",
    )
    parser.add_argument(
        "--draft-backend",
        choices=("inductor", CUDA_GRAPHS, INDUCTOR_GRAPHS),
        help="the model drafters' backend on CUDA where it differs from --static-backend (a small drafter's captured "
        "eager forward is bound by its kernels' count, which inductor's fusion cuts)",
    )
    args = parser.parse_args(argv)
    if not (args.cpu_smoke or args.cpu_host_bound) and not torch.cuda.is_available():
        parser.error("no CUDA device: run with --cpu-smoke or --cpu-host-bound on a machine without a GPU")
    if args.cpu_host_bound:
        torch.set_num_threads(1)
    args.sections = args.sections or (["environment", "end_to_end"] if args.cpu_host_bound else DEFAULT_SECTIONS)
    check = Check(args.cpu_smoke, args.out, args.sections, host_bound=args.cpu_host_bound)
    if args.budget_s:
        check.cfg = {**check.cfg, "budget_s": args.budget_s}
    if args.dtype:
        check.cfg = {**check.cfg, "dtype": getattr(torch, args.dtype)}
    if args.models:
        known = dict(check.cfg["compiled_targets"])
        if unknown := sorted(set(args.models) - set(known)):
            parser.error(f"--models {' '.join(unknown)}: give some of {' '.join(known)}")
        check.cfg = {**check.cfg, "compiled_targets": tuple((m, known[m]) for m in args.models)}
    if args.batches:
        check.cfg = {**check.cfg, "compiled_batches": tuple(args.batches)}
    check.cfg = {**check.cfg, "static_backend": args.static_backend, "draft_backend": args.draft_backend}
    failed = False
    for name in args.sections:
        t = time.perf_counter()
        print(f"== {name} ({check.left():.0f} s left)", flush=True)
        try:
            check.report[name] = SECTIONS[name](check)
        except Exception as e:
            failed = True
            check.report[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
            print(check.report[name]["trace"])
        check.report.setdefault("seconds", {})[name] = round(time.perf_counter() - t, 1)
        check.save()
    print(f"wrote {args.out / 'gpu_check.json'} in {time.perf_counter() - check.start:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
