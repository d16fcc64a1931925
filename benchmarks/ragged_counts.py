"""Padding and cache memory of batched verification, with and without the ragged path: counts, not times.

    python -m benchmarks.ragged_counts --batch-sizes 8 16 --max-new-tokens 128

Prompts are the first turns of the Spec-Bench mix (all 480 questions, seeded shuffle, consecutive batches),
tokenized with the packaged Qwen2.5 tokenizer and chat template; the cache bytes use that model's
dimensions (layers x KV heads x head dim x dtype). Decoding is simulated, not run: each row drafts k
tokens per step and accepts a number drawn from a seeded distribution (per row a per-token acceptance
rate alpha ~ U[alpha_low, alpha_high]; accepted = leading successes of k Bernoulli(alpha) draws, as for a
drafter whose tokens are accepted independently), plus one recovered / bonus token; each row stops at
its own length, drawn U[max_new_tokens / 4, max_new_tokens]. The caches themselves are the real classes
(`RectangularCache`, `PackedCache`) driven without a model: only their bookkeeping runs.

Counted per verification forward and summed over the run (prefill reported apart):
  query tokens   tokens that go through the whole model (right-padded chunks: B x T; packed: sum_b q_b)
  KV tokens      cache slots attention reads for those queries (rectangular: B x S; packed: sum_b L_b;
                 Spin's decomposition: n(w) x w, the planner's blocks)
  cache bytes    bytes held by the target cache, peak over the run, averaged over batches, beside the
                 bytes of the tokens the rows hold (the rest is padding, holes or spare capacity)

Rows: `padded` = a rectangular left-padded cache compacted every step (the best any [B, S] layout does);
`holes` = hf_spin's `RectangularCache` (rejected drafts stay as holes until compaction; the default path);
`decomposed` = Spin's request decomposition without the kernel (planner's block width over the same
lengths; cache as `padded`); `packed` = `PackedCache` + `hf_spin_varlen` (`AssistantPool(cache="packed")`).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch

from benchmarks.common import DEFAULT_QUESTIONS, load_questions
from hf_spin import models
from hf_spin.cache import PackedCache, RectangularCache
from hf_spin.kernels.decomposition import plan_decomposition
from hf_spin.policies import DEFAULT_DRAFT_LENGTH

PATHS = ("padded", "holes", "decomposed", "packed")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--questions", type=Path, default=DEFAULT_QUESTIONS, help="Spec-Bench question.jsonl")
    ap.add_argument(
        "--model", default="qwen2.5-coder-1.5b-instruct", choices=models.NAMES, help="tokenizer and KV dimensions"
    )
    ap.add_argument("--batch-sizes", type=int, nargs="*", default=[8, 16])
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--draft-length", type=int, default=DEFAULT_DRAFT_LENGTH)
    ap.add_argument("--alpha-low", type=float, default=0.3, help="lowest per-row token acceptance rate")
    ap.add_argument("--alpha-high", type=float, default=0.9, help="highest per-row token acceptance rate")
    ap.add_argument("--block-multiple", type=int, default=16, help="decomposition block widths are multiples of this")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    return ap.parse_args()


def load_tokenizer_and_config(name: str):
    """The packaged model's tokenizer and config; reads the cached conversion when there is one
    (loading the weights is not needed to count)."""
    from transformers import AutoConfig, AutoTokenizer

    folder = models.cached_path(name, torch.bfloat16)
    if not folder.is_dir():
        model, tokenizer = models.load(name)
        return tokenizer, model.config
    return AutoTokenizer.from_pretrained(folder), AutoConfig.from_pretrained(folder)


def bytes_per_token(config) -> int:
    c = config.get_text_config()
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    return 2 * c.num_hidden_layers * kv_heads * head_dim * 2  # keys + values, bfloat16


def prompt_lengths(path: Path, tokenizer, seed: int) -> list[tuple[str, int]]:
    records = load_questions(path)  # all of them, in file order
    random.Random(seed).shuffle(records)
    out = []
    for r in records:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": r["turns"][0]}], tokenize=False, add_generation_prompt=True
        )
        out.append((r["category"], len(tokenizer(text)["input_ids"])))
    return out


class _Counts:
    def __init__(self):
        self.query = {p: 0 for p in PATHS}
        self.kv = {p: 0 for p in PATHS}
        self.peak_slots = {p: 0 for p in PATHS}
        self.prefill_query = {p: 0 for p in PATHS}
        self.useful_query = 0
        self.useful_kv = 0
        self.steps = 0


def simulate_batch(lengths: list[int], args, rng: random.Random, counts: _Counts) -> dict[str, int]:
    """One batch decoded to the end; adds its counts; returns its peak cache slots per path."""
    B, k = len(lengths), args.draft_length
    alpha = [rng.uniform(args.alpha_low, args.alpha_high) for _ in range(B)]
    budget = [rng.randint(max(1, args.max_new_tokens // 4), args.max_new_tokens) for _ in range(B)]
    P = max(lengths)
    mask = torch.tensor([[i >= P - n for i in range(P)] for n in lengths])  # left padding
    holes = RectangularCache(mask)
    packed = PackedCache(B)
    packed.begin(lengths)
    packed.commit()
    for p in ("padded", "holes", "decomposed"):
        counts.prefill_query[p] += B * P
    counts.prefill_query["packed"] += sum(lengths)
    cached = list(lengths)  # tokens in the cache per row (committed minus the last)
    done = [0] * B  # new tokens per row; the prefill produced the first
    for b in range(B):
        done[b] = 1
    peak = {p: 0 for p in PATHS}
    active = list(range(B))  # original row of each cache row
    while True:
        keep_rows = [i for i, b in enumerate(active) if done[b] < budget[b]]
        if not keep_rows:
            break
        if len(keep_rows) < len(active):
            holes.select_rows(torch.tensor(keep_rows))
            packed.select_rows(keep_rows)
            active = [active[i] for i in keep_rows]
        q = [1 + min(k, budget[b] - done[b] - 1) for b in active]  # last token + drafts, capped by room
        T = max(q)
        holes.add_slots(torch.tensor(q), T)
        packed.begin(q)
        packed.commit()
        after = [cached[b] + qi for b, qi in zip(active, q)]  # keys each query row attends to (its last query)
        n = len(active)
        counts.steps += 1
        counts.useful_query += sum(q)
        counts.useful_kv += sum(after)
        counts.query["padded"] += n * T
        counts.query["holes"] += n * T
        counts.query["decomposed"] += n * T
        counts.query["packed"] += sum(q)
        counts.kv["padded"] += n * max(after)
        counts.kv["holes"] += n * holes.num_slots
        plan = plan_decomposition(after, multiple_of=args.block_multiple)
        counts.kv["decomposed"] += plan.num_blocks * plan.block_width
        counts.kv["packed"] += sum(after)
        peak["padded"] = max(peak["padded"], n * max(after))
        peak["holes"] = max(peak["holes"], n * holes.num_slots)
        peak["decomposed"] = peak["padded"]
        peak["packed"] = max(peak["packed"], packed.total_slots)
        peak["used"] = max(peak.get("used", 0), sum(after))
        # verify: accepted drafts + one recovered / bonus token; the cache keeps all but the last
        keep = []
        for i, b in enumerate(active):
            drafted = q[i] - 1
            accepted = 0
            while accepted < drafted and rng.random() < alpha[b]:
                accepted += 1
            new = min(accepted + 1, budget[b] - done[b])
            done[b] += new
            cached[b] += new
            keep.append(cached[b])
        holes.rollback(torch.tensor(keep))
        packed.rollback(keep)
    return peak


def main() -> None:
    args = parse_args()
    tokenizer, config = load_tokenizer_and_config(args.model)
    per_token = bytes_per_token(config)
    prompts = prompt_lengths(args.questions, tokenizer, args.seed)
    rows = []
    for B in args.batch_sizes:
        rng = random.Random(args.seed)
        counts = _Counts()
        peaks = {p: [] for p in (*PATHS, "used")}
        batches = [prompts[i : i + B] for i in range(0, len(prompts) - B + 1, B)]
        for batch in batches:
            peak = simulate_batch([n for _, n in batch], args, rng, counts)
            for p in peaks:
                peaks[p].append(peak[p])
        for p in PATHS:
            mean_peak = sum(peaks[p]) / len(peaks[p])
            rows.append(
                dict(
                    batch=B,
                    path=p,
                    batches=len(batches),
                    steps=counts.steps,
                    prefill_padded_tokens=counts.prefill_query[p] - sum(n for b in batches for _, n in b),
                    query_tokens=counts.query[p],
                    padded_query_tokens=counts.query[p] - counts.useful_query,
                    kv_tokens=counts.kv[p],
                    padded_kv_tokens=counts.kv[p] - counts.useful_kv,
                    peak_cache_mib=mean_peak * per_token / 2**20,
                    peak_used_mib=sum(peaks["used"]) / len(peaks["used"]) * per_token / 2**20,
                )
            )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ragged_counts.json").write_text(
        json.dumps(
            dict(args={k: str(v) for k, v in vars(args).items()}, bytes_per_token=per_token, rows=rows), indent=1
        )
    )
    table = markdown(rows, args, per_token)
    (args.out / "ragged_counts.md").write_text(table)
    print(table)


def markdown(rows: list[dict], args, per_token: int) -> str:
    lines = [
        f"Spec-Bench mix (480 first turns, {args.model} tokenizer and KV size {per_token} B/token), "
        f"k = {args.draft_length}, up to {args.max_new_tokens} new tokens per row, "
        f"simulated acceptance alpha ~ U[{args.alpha_low}, {args.alpha_high}], seed {args.seed}. "
        "Counts summed over all verification steps; cache = target KV cache peak per batch, mean over batches.",
        "",
        "| batch | path | steps | prefill padded tokens | query tokens (padded) | KV tokens read (padded) "
        "| peak cache MiB held | of which tokens |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        q_pct = 100 * r["padded_query_tokens"] / max(r["query_tokens"], 1)
        kv_pct = 100 * r["padded_kv_tokens"] / max(r["kv_tokens"], 1)
        lines.append(
            f"| {r['batch']} | {r['path']} | {r['steps']} | {r['prefill_padded_tokens']:,} "
            f"| {r['query_tokens']:,} ({q_pct:.1f}%) | {r['kv_tokens']:,} ({kv_pct:.1f}%) "
            f"| {r['peak_cache_mib']:.1f} | {r['peak_used_mib']:.1f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
