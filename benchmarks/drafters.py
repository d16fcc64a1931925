r"""Faster drafters on the real models: EasySpec fuzzy drafting and MagicDec sparse-KV drafting, one run.

    python -m benchmarks.drafters --threads 2                                   # everything, defaults below
    python -m benchmarks.drafters --sections easyspec fuzzy_cost --per-category 2
    python -m benchmarks.drafters --sections magicdec cost --skip-8k
    python -m benchmarks.drafters --limit 1 --max-new-tokens 8 --lengths 512 --budgets 64 \
        --cost-lengths 512 --cost-batches 1                                     # smoke

Sections (--sections, all by default):
  easyspec    Spec-Bench mix (first turn of --per-category questions per category, batch 1, greedy): plain
              `generate`, the 0.5B drafter as is, and FuzzyDrafter(0.5B, N) for N in --group-sizes with and
              without bonus calibration. Per config: drafting seconds per drafted token, acceptance rate,
              mean accepted length, end-to-end speed-up over plain `generate` (Spec-Bench: mean speed /
              mean plain speed), outputs identical to plain `generate`.
  fuzzy_cost  one draft forward (1 new token per row) of the 0.5B, exact vs fuzzy, on a random KV cache
              of --fuzzy-cost-lengths tokens: drafting cost without acceptance effects (interleaved runs).
  magicdec    long prompts of --lengths tokens (Spec-Bench rag + summarization texts concatenated, then
              "summarize"): self-speculation StreamingDrafter(target, sink, budget - sink) per --budgets, and
              the 0.5B drafter with its full KV and with each budget. Acceptance, speed-up, identical outputs.
  cost        draft / target forward cost vs batch (--cost-batches) and context (--cost-lengths), on random
              KV (no prefill): target verification of k + 1 tokens on the full cache vs one draft token with
              the budget cache (self-speculation) and with the 0.5B (full and budget cache).

CPU caveat (DESIGN.md): on the CPU machines only ratios and counts mean something; every ratio compares
runs made side by side in this process. Writes <out>/drafters-<time>.{json,md}, and appends each
finished record to <out>/drafters-partial.jsonl as it goes.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time
from collections import defaultdict
from pathlib import Path

import torch
import transformers

import hf_spin
from benchmarks.common import DEFAULT_QUESTIONS, load_questions, new_tokens, timed
from hf_spin import models
from hf_spin.cache import RectangularCache, forward_ragged
from hf_spin.drafters.fuzzy import LayerParallelForward
from hf_spin.drafters.streaming import StreamingCache

SECTIONS = ("easyspec", "fuzzy_cost", "magicdec", "cost")
LONG_PROMPT_CATEGORIES = ("rag", "summarization")
LONG_PROMPT_INSTRUCTION = "\n\nSummarize the documents above in a few sentences."
EIGHT_K = 8192
# What the EasySpec paper reports (multi-GPU, abstract): the drafting stage up to 1.62x faster, at most a
# 7% drop in speculation accuracy. MagicDec reports up to 2.51x for Llama-3.1-8B at batch 32-256 on GPUs.
EASYSPEC_PAPER = {"drafting_speedup": 1.62, "max_acceptance_drop": 0.07}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--questions", type=Path, default=DEFAULT_QUESTIONS, help="Spec-Bench question.jsonl")
    ap.add_argument("--per-category", type=int, default=1, help="easyspec: questions taken from each category")
    ap.add_argument("--limit", type=int, default=None, help="easyspec: cap on the number of questions (quick runs)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    ap.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=SECTIONS)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct", choices=models.NAMES)
    ap.add_argument("--drafter", default="qwen2.5-coder-0.5b-instruct", choices=models.NAMES)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--draft-length", type=int, default=hf_spin.policies.DEFAULT_DRAFT_LENGTH, help="k")
    ap.add_argument("--group-sizes", type=int, nargs="+", default=[2, 3, 4], help="easyspec: N, layers per fuzzy set")
    ap.add_argument("--per-layer", action="store_true", help="fuzzy sets call each layer's attention (no stacked bmm)")
    ap.add_argument("--fuzzy-cost-lengths", type=int, nargs="+", default=[256, 1024], help="fuzzy_cost: KV lengths")
    ap.add_argument("--fuzzy-cost-batches", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, EIGHT_K], help="magicdec: prompt tokens")
    ap.add_argument(
        "--skip-8k",
        action="store_true",
        help=f"drop lengths >= {EIGHT_K} from --lengths and --cost-lengths (slow on CPU)",
    )
    ap.add_argument("--long-prompts", type=int, default=1, help="magicdec: prompts per length (different documents)")
    ap.add_argument(
        "--budgets", type=int, nargs="+", default=[128, 256, 512], help="magicdec/cost: KV budgets (sink + window)"
    )
    ap.add_argument(
        "--sink-tokens", type=int, nargs="+", default=[4], help="magicdec: attention sinks (several: one run each)"
    )
    ap.add_argument(
        "--long-task",
        default="summarize",
        choices=["summarize", "continue"],
        help="magicdec: chat prompt asking for a summary, or the raw text to continue (MagicDec's PG-19 style)",
    )
    ap.add_argument("--no-small-streaming", action="store_true", help="magicdec: skip the 0.5B drafter runs")
    ap.add_argument("--cost-batches", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--cost-lengths", type=int, nargs="+", default=[1024, 4096, EIGHT_K])
    ap.add_argument("--reps", type=int, default=7, help="fuzzy_cost/cost: timed forwards per setting (median)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args(argv)
    if args.skip_8k:
        args.lengths = [n for n in args.lengths if n < EIGHT_K]
        args.cost_lengths = [n for n in args.cost_lengths if n < EIGHT_K]
    for b in args.budgets:
        if b <= max(args.sink_tokens):
            ap.error(f"every budget must exceed --sink-tokens ({max(args.sink_tokens)}), got {b}")
    return args


# --- shared helpers ---------------------------------------------------------------------------------


def environment(args) -> dict:
    cpu = ""
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent
        ).stdout.strip()
    except OSError:
        commit = ""
    return {
        "machine": f"{platform.machine()} {cpu or platform.processor()}, {torch.get_num_threads()} torch threads",
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "hf_spin_commit": commit,
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
    }


class Recorder:
    """Keeps every record and appends it to a partial file at once: a run cut short keeps what it measured."""

    def __init__(self, out: Path):
        out.mkdir(parents=True, exist_ok=True)
        self.partial = out / "drafters-partial.jsonl"
        self.records: dict[str, list[dict]] = defaultdict(list)

    def add(self, section: str, record: dict) -> None:
        self.records[section].append(record)
        with open(self.partial, "a") as f:
            f.write(json.dumps({"section": section, **record}) + "\n")


def spin_record(pool: hf_spin.AssistantPool, seconds: float, identical: bool, tokens: int) -> dict:
    stats = pool.last_stats
    d = sum_drafters(stats)
    return {
        "seconds": seconds,
        "new_tokens": tokens,
        "identical": identical,
        **d,
        "verify_seconds": stats.verify_seconds,
    }


def sum_drafters(stats: hf_spin.GenerationStats) -> dict:
    ds = list(stats.drafters.values())
    return {
        "drafted": sum(d.drafted for d in ds),
        "accepted": sum(d.accepted for d in ds),
        "target_forwards": sum(r.target_forwards for r in stats.rows),
        "produced": stats.new_tokens,
        "draft_seconds": sum(d.draft_seconds for d in ds),
        "failures": sum(d.failures for d in ds),
    }


def run_configs(target, tok, batch: dict, configs: dict, max_new_tokens: int, draft_length: int) -> tuple[dict, dict]:
    """Plain greedy `generate`, then each drafter (configs: name -> Drafter, reused across calls) on the same
    inputs; returns (plain, {name: record})."""
    gen = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
    P = batch["input_ids"].shape[1]
    plain, t_plain = timed(lambda: target.generate(**batch, **gen))
    ref = new_tokens(plain, P, tok.pad_token_id)
    out = {}
    for name, drafter in configs.items():
        pool = hf_spin.AssistantPool([drafter], draft_length=draft_length)
        spin, t = timed(lambda: target.generate(**batch, custom_generate=hf_spin.generate, assistant_pool=pool, **gen))
        out[name] = spin_record(pool, t, new_tokens(spin, P, tok.pad_token_id) == ref, sum(len(r) for r in ref))
    return {"seconds": t_plain, "new_tokens": sum(len(r) for r in ref)}, out


def summarize_runs(records: list[dict], key_fields=("config",)) -> dict:
    """Per config: Spec-Bench speed-up (mean speed / mean plain speed) and pooled rates."""
    groups = defaultdict(list)
    for r in records:
        groups[tuple(r[k] for k in key_fields)].append(r)
    table = {}
    for key, rs in groups.items():
        plain_speed = statistics.mean(r["new_tokens"] / r["plain_seconds"] for r in rs)
        speed = statistics.mean(r["new_tokens"] / r["seconds"] for r in rs)
        drafted = sum(r["drafted"] for r in rs)
        table[key] = {
            "n": len(rs),
            "speedup": speed / plain_speed,
            "plain_tok_s": plain_speed,
            "tok_s": speed,
            "draft_s_per_token": sum(r["draft_seconds"] for r in rs) / drafted if drafted else float("nan"),
            "acceptance_rate": sum(r["accepted"] for r in rs) / drafted if drafted else 0.0,
            "mean_accepted_length": sum(r["produced"] for r in rs) / max(1, sum(r["target_forwards"] for r in rs)),
            "draft_share": sum(r["draft_seconds"] for r in rs) / sum(r["seconds"] for r in rs),
            "identical": f"{sum(r['identical'] for r in rs)}/{len(rs)}",
            "failures": sum(r["failures"] for r in rs),
        }
    return table


def random_cache(model, batch: int, length: int, budget: int | None = None, sink: int = 4) -> RectangularCache:
    """A cache of `length` tokens per row filled with random KV (timing only); with `budget`, a
    StreamingCache holding sink + window = budget of those tokens at their true positions."""
    c = model.config.get_text_config()
    heads = c.num_key_value_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    held = min(length, budget) if budget else length
    mask = torch.ones(batch, held, dtype=torch.bool, device=model.device)
    if budget:
        cache = StreamingCache(mask, sink, budget - sink)
        cache.evicted += length - held
    else:
        cache = RectangularCache(mask)
    for i in range(c.num_hidden_layers):
        kv = torch.randn(batch, heads, held, head_dim, dtype=model.dtype, device=model.device)
        cache.update(kv, kv.clone(), i)
    return cache


def time_forwards(settings: dict, reps: int) -> dict[str, float]:
    """settings: name -> (model, cache, chunk length per row, forward or None). Median seconds of one
    forward each, runs interleaved across settings; every cache is rolled back after each forward."""
    times = {name: [] for name in settings}
    with torch.no_grad():
        for rep in range(reps + 1):  # the first round warms up
            for name, (model, cache, width, forward) in settings.items():
                B = cache.slot_mask.shape[0]
                tokens = cache.token_counts if isinstance(cache, StreamingCache) else cache.lengths
                chunks = [[1000 + (rep + j) % 97 for j in range(width)] for _ in range(B)]
                _, t = timed(lambda: forward_ragged(model, cache, chunks, all_logits=width > 1, forward=forward))
                cache.rollback(tokens.clone())
                if rep:
                    times[name].append(t)
    return {name: statistics.median(ts) for name, ts in times.items()}


# --- easyspec ------------------------------------------------------------------------------------


def chat(tok, text: str) -> str:
    return tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)


def easyspec_configs(drafter, args) -> dict:
    configs = {"0.5B exact": hf_spin.ModelDrafter(drafter)}
    for n in args.group_sizes:
        for calibrate in (True, False):
            name = f"fuzzy N={n} " + ("calibrated" if calibrate else "uncalibrated")
            configs[name] = hf_spin.FuzzyDrafter(drafter, group_size=n, calibrate=calibrate, batched=not args.per_layer)
    return configs


def warm_up(target, tok, configs: dict, args) -> None:
    """One short call per drafter: one-off costs (allocations, stacked fuzzy weights) stay out of the timings."""
    batch = tok([chat(tok, "Say hello.")], return_tensors="pt")
    run_configs(target, tok, batch, configs, 4, args.draft_length)


def run_easyspec(target, drafter, tok, args, rec: Recorder) -> None:
    questions = load_questions(args.questions, args.per_category, args.limit)
    configs = easyspec_configs(drafter, args)
    warm_up(target, tok, configs, args)
    for i, q in enumerate(questions):
        batch = tok([chat(tok, q["turns"][0])], return_tensors="pt")
        plain, runs = run_configs(target, tok, batch, configs, args.max_new_tokens, args.draft_length)
        for name, r in runs.items():
            rec.add(
                "easyspec",
                {
                    "config": name,
                    "question_id": q["question_id"],
                    "category": q["category"],
                    "prompt_tokens": batch["input_ids"].shape[1],
                    "plain_seconds": plain["seconds"],
                    **r,
                },
            )
        print(f"  easyspec {i + 1}/{len(questions)} {q['category']}: plain {plain['seconds']:.1f}s, "
              + ", ".join(f"{n} {r['seconds']:.1f}s" for n, r in runs.items()), flush=True)  # fmt: skip


def easyspec_markdown(records: list[dict]) -> list[str]:
    table = summarize_runs(records)
    base = table.get(("0.5B exact",))
    lines = [
        "### EasySpec: fuzzy drafting (Spec-Bench mix, batch 1)",
        "",
        "draft s/token = drafting seconds (catch-up / calibration pass included) per drafted token; drafting x and "
        "acceptance change are relative to the same 0.5B drafter run exactly. EasySpec paper (multi-GPU): drafting up "
        f"to {EASYSPEC_PAPER['drafting_speedup']}x faster with at most "
        f"{EASYSPEC_PAPER['max_acceptance_drop']:.0%} lower acceptance.",
        "",
        "| config | n | draft s/token | drafting x | acceptance | acceptance change | mean accepted len "
        "| speed-up vs plain | draft share of time | identical |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (name,), r in table.items():
        faster = base["draft_s_per_token"] / r["draft_s_per_token"] if base else float("nan")
        change = (
            (r["acceptance_rate"] / base["acceptance_rate"] - 1) if base and base["acceptance_rate"] else float("nan")
        )
        lines.append(
            f"| {name} | {r['n']} | {r['draft_s_per_token'] * 1000:.1f} ms | {faster:.2f} "
            f"| {r['acceptance_rate']:.1%} | {change:+.1%} | {r['mean_accepted_length']:.2f} | {r['speedup']:.2f} "
            f"| {r['draft_share']:.0%} | {r['identical']} |"
        )
    per_cat = summarize_runs(records, ("category", "config"))
    configs = list(dict.fromkeys(r["config"] for r in records))
    cats = sorted({r["category"] for r in records})
    lines += [
        "",
        "Per category: speed-up vs plain / acceptance.",
        "",
        "| category | " + " | ".join(configs) + " |",
        "|---" * (len(configs) + 1) + "|",
    ]
    for cat in cats:
        cells = [f"{per_cat[(cat, c)]['speedup']:.2f} / {per_cat[(cat, c)]['acceptance_rate']:.0%}" for c in configs]
        lines.append(f"| {cat} | " + " | ".join(cells) + " |")
    return lines


# --- fuzzy_cost -------------------------------------------------------------------------------------


def run_fuzzy_cost(drafter, args, rec: Recorder) -> None:
    for B in args.fuzzy_cost_batches:
        for L in args.fuzzy_cost_lengths:
            settings = {"exact": (drafter, random_cache(drafter, B, L), 1, None)}
            for n in args.group_sizes:
                settings[f"N={n}"] = (
                    drafter,
                    random_cache(drafter, B, L),
                    1,
                    LayerParallelForward(drafter, n, batched=not args.per_layer),
                )
            times = time_forwards(settings, args.reps)
            rec.add("fuzzy_cost", {"batch": B, "length": L, "seconds": times})
            print(
                f"  fuzzy_cost B={B} L={L}: " + ", ".join(f"{k} {v * 1000:.1f}ms" for k, v in times.items()), flush=True
            )


def fuzzy_cost_markdown(records: list[dict]) -> list[str]:
    names = list(records[0]["seconds"])
    lines = [
        "### EasySpec: one draft forward (1 token per row, random KV), exact vs fuzzy",
        "",
        "| batch | KV length | " + " | ".join(f"{n} ms (x)" for n in names) + " |",
        "|---|---|" + "---|" * len(names),
    ]
    for r in records:
        s = r["seconds"]
        lines.append(
            f"| {r['batch']} | {r['length']} | "
            + " | ".join(f"{s[n] * 1000:.1f} ({s['exact'] / s[n]:.2f})" for n in names)
            + " |"
        )
    return lines


# --- magicdec ---------------------------------------------------------------------------------------


def long_prompt_ids(tok, texts: list[str], length: int, start: int, task: str = "summarize") -> dict:
    """About `length` tokens of documents from texts[start:] (wrapping): as a chat prompt asking for a
    summary, or (task "continue") as raw text cut mid-document for the model to continue."""
    overhead = len(tok(chat(tok, LONG_PROMPT_INSTRUCTION))["input_ids"]) if task == "summarize" else 0
    docs = "\n\n".join(texts[start:] + texts[:start])
    doc_ids = tok(docs, add_special_tokens=False)["input_ids"]
    while len(doc_ids) < length:  # not enough text: repeat it
        doc_ids = doc_ids + doc_ids
    if task == "continue":
        return {
            "input_ids": torch.tensor([doc_ids[:length]]),
            "attention_mask": torch.ones(1, length, dtype=torch.long),
        }
    content = tok.decode(doc_ids[: length - overhead]) + LONG_PROMPT_INSTRUCTION
    return tok([chat(tok, content)], return_tensors="pt")


def magicdec_configs(target, drafter, args) -> dict:
    configs = {}
    for s in args.sink_tokens:
        for b in args.budgets:
            configs[f"self budget {b} (sink {s})"] = hf_spin.StreamingDrafter(target, s, b - s)
    if not args.no_small_streaming:
        configs["0.5B full KV"] = hf_spin.ModelDrafter(drafter)
        for s in args.sink_tokens:
            for b in args.budgets:
                configs[f"0.5B budget {b} (sink {s})"] = hf_spin.StreamingDrafter(drafter, s, b - s)
    return configs


def run_magicdec(target, drafter, tok, args, rec: Recorder) -> None:
    questions = load_questions(args.questions)  # all of them, in file order
    texts = [q["turns"][0] for q in questions if q["category"] in LONG_PROMPT_CATEGORIES]
    configs = magicdec_configs(target, drafter, args)
    warm_up(target, tok, configs, args)
    for L in args.lengths:
        for j in range(args.long_prompts):
            batch = long_prompt_ids(tok, texts, L, start=7 * j, task=args.long_task)
            plain, runs = run_configs(target, tok, batch, configs, args.max_new_tokens, args.draft_length)
            for name, r in runs.items():
                rec.add(
                    "magicdec",
                    {
                        "config": name,
                        "length": L,
                        "prompt_tokens": batch["input_ids"].shape[1],
                        "prompt": j,
                        "plain_seconds": plain["seconds"],
                        **r,
                    },
                )
            print(
                f"  magicdec L={L} prompt {j}: plain {plain['seconds']:.1f}s, "
                + ", ".join(f"{n} {r['seconds']:.1f}s ({r['accepted']}/{r['drafted']})" for n, r in runs.items()),
                flush=True,
            )


def magicdec_markdown(records: list[dict], task: str) -> list[str]:
    table = summarize_runs(records, ("length", "config"))
    what = {"summarize": "chat prompt: Spec-Bench rag + summarization texts, then 'summarize'",
            "continue": "raw Spec-Bench rag + summarization text, continued"}[task]  # fmt: skip
    lines = [
        f"### MagicDec: acceptance vs KV budget on long prompts (batch 1; {what})",
        "",
        "self = the target drafting for itself with a sink + window cache, a sparse view of its own exact cache "
        "(prefill KV and the KV of committed tokens copied from it); 0.5B = the small drafter with its full KV or the "
        "same budget. draft s/token includes a drafter's own prompt prefill. Speed-up = Spec-Bench speed ratio over "
        "plain `generate`.",
        "",
        "| prompt tokens | drafter | acceptance | mean accepted len | draft s/token | speed-up vs plain | identical |",
        "|---|---|---|---|---|---|---|",
    ]
    for (L, name), r in table.items():
        lines.append(
            f"| {L} | {name} | {r['acceptance_rate']:.1%} | {r['mean_accepted_length']:.2f} "
            f"| {r['draft_s_per_token'] * 1000:.0f} ms | {r['speedup']:.2f} | {r['identical']} |"
        )
    return lines


# --- cost --------------------------------------------------------------------------------------------


def run_cost(target, drafter, args, rec: Recorder) -> None:
    k, sink = args.draft_length, args.sink_tokens[0]  # the sink count does not change the cost
    for L in args.cost_lengths:
        for B in args.cost_batches:
            full = random_cache(target, B, L)  # shared: every timed forward is rolled back
            settings = {
                "target decode (1 token)": (target, full, 1, None),
                f"target verify ({k + 1} tokens)": (target, full, k + 1, None),
                "0.5B draft, full KV": (drafter, random_cache(drafter, B, L), 1, None),
            }
            for b in args.budgets:
                settings[f"self draft, budget {b}"] = (target, random_cache(target, B, L, budget=b, sink=sink), 1, None)
                settings[f"0.5B draft, budget {b}"] = (
                    drafter,
                    random_cache(drafter, B, L, budget=b, sink=sink),
                    1,
                    None,
                )
            times = time_forwards(settings, args.reps)
            rec.add("cost", {"batch": B, "length": L, "seconds": times})
            print(f"  cost L={L} B={B}: " + ", ".join(f"{n} {t * 1000:.0f}ms" for n, t in times.items()), flush=True)
            del settings


def cost_markdown(records: list[dict], k: int) -> list[str]:
    verify = f"target verify ({k + 1} tokens)"
    names = [n for n in records[0]["seconds"] if n != verify]
    lines = [
        "### Draft / target cost ratio vs batch and context length (random KV)",
        "",
        "Each cell: ms of one forward, and in brackets its cost relative to the target verifying "
        f"k + 1 = {k + 1} tokens per row on the full cache. A drafter pays off when k x ratio stays well below the "
        "tokens it gets accepted.",
        "",
        f"| KV length | batch | {verify} ms | " + " | ".join(names) + " |",
        "|---|---|---|" + "---|" * len(names),
    ]
    for r in records:
        s = r["seconds"]
        cells = [f"{s[n] * 1000:.0f} ({s[n] / s[verify]:.2f})" for n in names]
        lines.append(f"| {r['length']} | {r['batch']} | {s[verify] * 1000:.0f} | " + " | ".join(cells) + " |")
    return lines


# --- main --------------------------------------------------------------------------------------------


def markdown(env: dict, records: dict, args) -> str:
    s = env["settings"]
    lines = [
        f"## hf_spin drafters benchmark ({time.strftime('%Y-%m-%d %H:%M')})",
        "",
        f"- machine: {env['machine']}; GPU: {env['gpu']}",
        f"- python {env['python']}, torch {env['torch']}, transformers {env['transformers']}, "
        f"hf_spin commit {env['hf_spin_commit'] or '?'}",
        f"- target {s['target']}, drafter {s['drafter']}, {s['dtype']}, greedy, k = {s['draft_length']}, "
        f"{s['max_new_tokens']} new tokens, {s['threads']} threads",
        "- CPU: only ratios and counts are meaningful (DESIGN.md); runs being compared were made side by side.",
        "",
    ]
    if records.get("easyspec"):
        lines += easyspec_markdown(records["easyspec"]) + [""]
    if records.get("fuzzy_cost"):
        lines += fuzzy_cost_markdown(records["fuzzy_cost"]) + [""]
    if records.get("magicdec"):
        lines += magicdec_markdown(records["magicdec"], args.long_task) + [""]
    if records.get("cost"):
        lines += cost_markdown(records["cost"], args.draft_length) + [""]
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)  # explicit: the default can oversubscribe and collapse ~10x
    dtype = getattr(torch, args.dtype)
    target, tok = models.load(args.target, dtype=dtype)
    drafter, _ = models.load(args.drafter, dtype=dtype)
    env = environment(args)
    rec = Recorder(args.out)
    print(
        f"{env['machine']}; torch {env['torch']}, transformers {env['transformers']}; sections {args.sections}",
        flush=True,
    )
    sections = {
        "easyspec": lambda: run_easyspec(target, drafter, tok, args, rec),
        "fuzzy_cost": lambda: run_fuzzy_cost(drafter, args, rec),
        "magicdec": lambda: run_magicdec(target, drafter, tok, args, rec),
        "cost": lambda: run_cost(target, drafter, args, rec),
    }
    for name in args.sections:
        print(f"[{name}]", flush=True)
        sections[name]()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    table = markdown(env, rec.records, args)
    (args.out / f"drafters-{stamp}.json").write_text(json.dumps({"env": env, "records": rec.records}, indent=1))
    (args.out / f"drafters-{stamp}.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
