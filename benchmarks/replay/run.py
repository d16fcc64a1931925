"""Replay a trace on any machine and dtype: forced models of the recorded shapes (forced.py), timed against plain
`generate`; `--check` replays the recorded check runs and fails unless they agree exactly.

Per workload and batch size (requests in trace order, batches never mixing workloads), methods side by side on
the same prompts: plain `generate` (dynamic cache; on CUDA also `cache_implementation="static"`, compiled by
transformers), `transformers`' prompt lookup (batch 1), and hf_spin with each recorded pool (profile "auto": the
planner sizes drafts from costs measured here). Reported: tokens/s, speed-up over plain dynamic `generate`,
tokens per target forward, acceptance per drafter, outputs identical to the recorded continuations.
"""

from __future__ import annotations

import itertools
import json
import time
from collections import defaultdict
from contextlib import nullcontext
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import CompileConfig, StaticCache

import hf_spin
from benchmarks.common import machine
from hf_spin.cache import CACHE_ARG
from hf_spin.cache.static_forward import StaticOptions
from hf_spin.heap import frozen_gc
from hf_spin.planning.cost_profile import DRAFTING, PLAIN

from .checks import CheckConfig, compare, generated, left_pad, run_check
from .forced import ForcedTarget, build_model, force, replay_drafters
from .trace import Trace, load, merge

# Target shapes a replay can stand in for the recorded one (`--target-shape`): config fields over the recorded
# target's (same vocabulary, tokens and acceptance: the recorded pair's, said so in the output).
TARGET_SHAPES = {
    "qwen2.5-7b": dict(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        head_dim=128,
        tie_word_embeddings=False,
    ),
}
# Which token-tree setting each recorded pool runs with (`--trees`): the pool's default ("auto": trees where
# the drafters grow them and the target can verify them), chains only, or both side by side.
TREE_VARIANTS = {"auto": ("auto",), "chains": (False,), "both": ("auto", False)}
# The pools' KV cache layout (`--cache`): "auto" is the static layout, compiled, on CUDA (what beats transformers'
# compiled decode there) and the default rectangular layout elsewhere.
CACHES = ("auto", "rectangular", "static")


def check(trace: Trace, target, drafters: list) -> dict[str, list[str]]:
    """Replay every recorded check run on this target and these pool entries: run name -> what differs (a run
    that raised, e.g. a forced target that lost its rows, differs too)."""
    out = {}
    for recorded in trace.checks:
        config = CheckConfig(**recorded["config"])
        try:
            replayed = run_check(
                target,
                drafters,
                trace.requests,
                config,
                trace.k_max,
                trace.min_confidence,
                trace.max_new_tokens,
            )
        except (RuntimeError, ValueError) as err:
            out[config.name] = [f"raised {type(err).__name__}: {err}"]
            continue
        out[config.name] = compare(recorded, replayed)
    return out


# `--read-each-draft-token`: the model drafters' `ModelDrafter.read_each_draft_token` on the static layout
READS = {"auto": None, "yes": True, "no": False}


def read_each_draft_token(drafters: list, choice: str) -> None:
    """Set the model drafters' draft loop on the static layout (`READS[choice]`): reading each token (and growing
    trees there) or keeping a chain on the device, read once (a live drafter, named only, has none)."""
    for d in drafters:
        if not isinstance(d, str):
            d.read_each_draft_token = READS[choice]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _graphs() -> int:
    """Graphs torch.compile has built in this process so far."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def methods(
    trace: Trace,
    target,
    drafters: list,
    batch: int,
    cache_len: int,
    compile_config=None,
    profile=None,
    trees: tuple = ("auto",),
    caches: dict | None = None,
    layout: str = "rectangular",
    static: StaticOptions | None = None,
    only=None,
) -> dict:
    """method name -> fn(ids, mask, max_new_tokens) -> (output ids, hf_spin's stats or None), for this batch size.

    cache_len: the static cache's length, one for every batch (the trace's longest prompt + max_new_tokens), so
    transformers compiles its decoding step once per batch size. compile_config: the static method's
    (`--compile-backend eager`: dynamo without inductor, which also runs on CPU); None: transformers' default,
    and the static method on CUDA only. profile: fn(pool entries) -> the pool's `CostProfile` (injected costs),
    or None: each pool measures its own ("auto"). trees: the pools' `tree` settings to run (a variant with
    chains only is named `..._chains`). caches: rows -> the static method's `StaticCache`, kept by the caller
    across workloads (one compiled decoding step per batch size, as transformers reuses its own cache). layout:
    the pools' `cache=` (a static layout's pool is named `..._static`); static: its options (None: the pools'
    default); only: the methods besides plain `generate` (always: every ratio's base), pools not named never
    built; None: all."""
    names = [d.name for d in trace.drafters]

    def plain(ids, mask, n, **kwargs):
        return target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False, **kwargs), None

    out = {"generate": plain}
    if target.device.type == "cuda" or compile_config is not None:
        caches = {} if caches is None else caches

        def plain_static(ids, mask, n):
            if ids.shape[0] not in caches:
                caches[ids.shape[0]] = StaticCache(config=target.config, max_cache_len=cache_len)
            caches[ids.shape[0]].reset()
            return plain(ids, mask, n, compile_config=compile_config, **{CACHE_ARG: caches[ids.shape[0]]})

        out["generate_static"] = plain_static
    if batch == 1:
        out["transformers_lookup"] = lambda ids, mask, n: plain(ids, mask, n, prompt_lookup_num_tokens=trace.k_max)
    for (pool_name, spec), tree in itertools.product(trace.pools.items(), trees):
        chains = "_chains" if tree is False and len(trees) > 1 else ""
        name = f"hf_spin_{pool_name}{chains}" + ("_static" if layout == "static" else "")
        if only is not None and name not in only:
            continue
        entries = [drafters[names.index(n)] for n in spec["drafters"]]
        pool = hf_spin.AssistantPool(
            entries,
            policy=spec["policy"],
            draft_length=trace.k_max,
            profile=profile(entries) if profile is not None else None,
            tree=tree,
            cache=layout,
            compile=static if layout == "static" else None,
        )

        def spin(ids, mask, n, pool=pool):
            out = target.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=n,
                do_sample=False,
                custom_generate=hf_spin.generate,
                assistant_pool=pool,
                return_dict_in_generate=True,
            )
            return out.sequences, out.stats

        spin.pool = pool  # its cost profile holds the engine's own seconds a step (`host_ms`)
        out[name] = spin
    return {n: f for n, f in out.items() if only is None or n == "generate" or n in only}


def bench(
    trace: Trace,
    target,
    drafters: list,
    batch_sizes: list[int],
    compile_config=None,
    clock=None,
    profile=None,
    trees: tuple = ("auto",),
    layout: str = "rectangular",
    deadline: float | None = None,
    on_record=None,
    static: StaticOptions | None = None,
    forced: ForcedTarget | None = None,
    repeat: int = 1,
    overrun=None,
    only: set[str] | None = None,
) -> list[dict]:
    """One record per (workload, batch size, method): tokens, seconds, forwards, per-drafter counts, identical.

    clock: a `CostClock` (benchmarks/injected_costs.py) to time calls by, installed as the engine's clock, with no
    warm-up calls (they change nothing it reads); None: wall time. profile, trees, layout, static: as `methods`
    takes them. deadline: a `time.perf_counter()` by which every method must end (a time budget): a method is
    skipped (recorded as such) when what is left is shorter than the longest method so far, warm-up included (a
    pool's first call compiles its graphs on the static layout: minutes on a GPU with inductor);
    on_record: called with the records so far after each one (a run stopped from outside keeps what it did).
    forced: the target's `ForcedTarget`, told each call's batch (`ForcedTarget.expect`: forwards replayed from
    CUDA graphs run no hook). repeat: each workload's requests that many times over, one method's pool learning
    from them all (a server's steady state rather than a fresh pool's). overrun: the paced forwards' `Overrun`
    (benchmarks/injected_costs.py): seconds are then the wall clock's less the stand-ins' work past their cost,
    the device's time, and each record says how much it took off (`overrun`). only: the methods to run besides
    plain `generate` (always run: every ratio's base); None: all. The methods run with the heap frozen
    (`hf_spin.heap.frozen_gc`), as a server runs."""
    eos, pad = trace.target["eos_token_id"], trace.target["pad_token_id"]
    late = overrun if overrun is not None else lambda: 0.0
    now = clock if clock is not None else lambda: _sync(target.device) or time.perf_counter() - late()
    by_workload = defaultdict(list)
    for r in trace.requests * repeat:
        by_workload[r.workload].append(r)
    records, longest = [], 0.0  # the longest method so far, seconds, warm-up included

    index = {id(r): i for i, r in enumerate(trace.requests)}

    def expect(chunk: list) -> None:
        if forced is not None:
            forced.expect([index[id(r)] for r in chunk])

    # one static cache length for every workload: transformers compiles its decoding step once per batch size
    cache_len, caches = max(len(r.prompt) for r in trace.requests) + trace.max_new_tokens, {}
    with frozen_gc():  # a full collection over the loaded models pauses a method for ~0.2 s (hf_spin/heap.py)
        for bs in batch_sizes:
            for workload, requests in by_workload.items():
                batches = [requests[i : i + bs] for i in range(0, len(requests), bs)]
                fns = methods(
                    trace, target, drafters, bs, cache_len, compile_config, profile, trees, caches, layout, static, only
                )
                for name, fn in fns.items():
                    began = time.perf_counter()
                    if deadline is not None and began + longest > deadline:
                        records.append({"workload": workload, "batch": bs, "method": name, "skipped": "time budget"})
                        continue
                    # a first call per batch shape, untimed, as long as the timed ones: allocations, kernels, and the
                    # graphs of every query width the drafts reach (a timed call that meets a wider one compiles it,
                    # which the record's "graphs" counts)
                    for chunk in {len(c): c for c in batches}.values() if clock is None else ():
                        expect(chunk)
                        fn(*left_pad([r.prompt for r in chunk], pad, target.device), trace.max_new_tokens)
                    rec = {
                        "workload": workload,
                        "batch": bs,
                        "method": name,
                        "tokens": 0,
                        "seconds": 0.0,
                        "identical": 0,
                        "requests": 0,
                        "forwards": 0,
                        "drafters": defaultdict(lambda: [0, 0]),
                        "graphs": 0,  # graphs torch.compile built during the timed calls (0: warm-ups built them all)
                        # hf_spin's own account of its calls (`GenerationStats`): steps, and seconds in prefill, in
                        # the target's forward and verdict, in drafting
                        "steps": 0,
                        "prefill_s": 0.0,
                        "verify_s": 0.0,
                        "draft_s": 0.0,
                    }
                    graphs, late_before = _graphs(), late()
                    for chunk in tqdm(batches, desc=f"{workload} b{bs} {name}", leave=False):
                        ids, mask = left_pad([r.prompt for r in chunk], pad, target.device)
                        expect(chunk)
                        with clock.installed() if clock is not None else nullcontext():
                            start = now()
                            out, stats = fn(ids, mask, trace.max_new_tokens)
                            rec["seconds"] += now() - start
                        rows = generated(out, ids.shape[1], eos, pad)
                        rec["tokens"] += sum(map(len, rows))
                        rec["requests"] += len(chunk)
                        rec["identical"] += sum(row == r.continuation for row, r in zip(rows, chunk))
                        if stats is not None:
                            rec["forwards"] += sum(row.target_forwards for row in stats.rows)
                            rec["steps"] += stats.steps
                            rec["prefill_s"] += stats.prefill_seconds
                            rec["verify_s"] += stats.verify_seconds
                            rec["draft_s"] += sum(d.draft_seconds for d in stats.drafters.values())
                            for d, s in stats.drafters.items():
                                rec["drafters"][d][0] += s.drafted
                                rec["drafters"][d][1] += s.accepted
                    rec["drafters"] = dict(rec["drafters"])
                    rec["graphs"] = _graphs() - graphs
                    rec["overrun"] = late() - late_before
                    rec["host_ms"] = host_ms(getattr(fn, "pool", None), bs)
                    records.append(rec)
                    longest = max(longest, time.perf_counter() - began)
                    if on_record is not None:
                        on_record(records)
    return records


def host_ms(pool, batch: int) -> dict[str, float] | None:
    """A pool's engine's own milliseconds a step at `batch` rows, plain steps and drafting ones
    (`CostProfile.host_seconds`: measured by the wall clock, 0 on a `CostClock`), or None without a planner."""
    profile = getattr(pool, "cost_profile", None)
    if profile is None:
        return None
    return {"plain": 1e3 * profile.host_seconds(batch, PLAIN), "drafting": 1e3 * profile.host_seconds(batch, DRAFTING)}


def _step_cell(r: dict) -> str:
    """A record's milliseconds a step: the target's forward and verdict, drafting, and the rest of its calls' time
    past their prefills (the engine's own work, the forwards run ahead), by the wall clock (paced stand-ins' work past
    their cost counted back in); "-" for a method that is not hf_spin's."""
    if not r.get("steps"):
        return "-"
    rest = r["seconds"] + r.get("overrun", 0.0) - r["prefill_s"] - r["verify_s"] - r["draft_s"]
    return " / ".join(f"{1e3 * v / r['steps']:.2f}" for v in (r["verify_s"], r["draft_s"], rest))


def _host_cell(host: dict[str, float] | None) -> str:
    return f"{host['plain']:.2f} / {host['drafting']:.2f}" if host else "-"


def table(records: list[dict]) -> str:
    """Markdown: one line per (workload, batch, method), and per cost structure where records name one
    (`costs`: benchmarks/replay/costs.py; seconds are then the structure's, not this machine's)."""
    skipped = [r for r in records if "skipped" in r]
    records = [r for r in records if "skipped" not in r]
    structured = any("costs" in r for r in records)
    hosted = any(any((r.get("host_ms") or {}).values()) for r in records)  # the wall clock's (a CostClock reads 0)
    paced = any("overrun" in r for r in records) and hosted  # `bench(overrun=...)`: forwards paced to their cost
    split = not structured  # a call's wall time split by its steps (under a clock's costs: not this machine's)
    lines = [
        ("| costs " if structured else "")
        + "| workload | batch | method | tok/s | x generate | x static | tokens / forward | acceptance per drafter "
        "| identical | graphs |"
        + (" host ms / step, plain / drafting |" if hosted else "")
        + (" overrun s |" if paced else "")
        + (" ms / step: verify / drafting / rest |" if split else ""),
        ("|---" if structured else "")
        + "|---|---|---|---|---|---|---|---|---|---|"
        + ("---|" if hosted else "")
        + ("---|" if paced else "")
        + ("---|" if split else ""),
    ]
    base, static = (
        {(r.get("costs"), r["workload"], r["batch"]): r["tokens"] / r["seconds"] for r in records if r["method"] == m}
        for m in ("generate", "generate_static")
    )
    for r in records:
        rate = r["tokens"] / r["seconds"] if r["seconds"] else 0.0
        key = (r.get("costs"), r["workload"], r["batch"])
        speedup = rate / base[key]
        over_static = f"{rate / static[key]:.2f}" if key in static else "-"
        per_forward = f"{r['tokens'] / r['forwards']:.2f}" if r["forwards"] else "-"
        accept = ", ".join(f"{d} {a / n:.0%} ({a}/{n})" for d, (n, a) in r["drafters"].items() if n) or "-"
        lines.append(
            (f"| {r['costs']} " if structured else "")
            + f"| {r['workload']} | {r['batch']} | {r['method']} | {rate:.1f} | {speedup:.2f} | {over_static} "
            f"| {per_forward} | {accept} | {r['identical']}/{r['requests']} | {r.get('graphs', '-')} |"
            + (f" {_host_cell(r.get('host_ms'))} |" if hosted else "")
            + (f" {r['overrun']:.3f} |" if paced else "")
            + (f" {_step_cell(r)} |" if split else "")
        )
    if skipped:
        lines.append(
            "\nskipped ("
            + skipped[0]["skipped"]
            + "): "
            + ", ".join(f"{r['workload']} b{r['batch']} {r['method']}" for r in skipped)
        )
    return "\n".join(lines)


def main(args) -> int:
    torch.set_num_threads(args.threads)
    trace = merge([load(path) for path in args.trace])
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    shape = TARGET_SHAPES.get(args.target_shape, {})
    target = build_model({**trace.target["config"], **shape}, dtype, device)
    stand_in = (
        f"target: {args.target_shape}'s shape ({target.num_parameters() / 1e9:.1f}B parameters, random weights) "
        f"with the acceptance recorded for {trace.target['name']}\n"
        if shape
        else ""
    )
    forced = force(target, trace)
    drafters = replay_drafters(trace, dtype, device)
    read_each_draft_token(drafters, args.read_each_draft_token)
    if args.check:
        if not trace.checks:
            print(f"{args.trace} holds no check runs (recorded with --checks none)")
            return 1
        results = check(trace, target, drafters)
        for name, problems in results.items():
            print(f"check {name}: {'PASS' if not problems else 'FAIL'}")
            for p in problems[:10]:
                print(f"    {p}")
        return 0 if not any(results.values()) else 1
    compile_config = None
    if args.compile_backend:
        compile_config = CompileConfig(backend=args.compile_backend, mode=None)
        compile_config._compile_all_devices = True  # transformers compiles on CUDA only unless told
    layout = args.cache if args.cache != "auto" else ("static" if device.type == "cuda" else "rectangular")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    env = {
        **machine(),
        "dtype": str(dtype).removeprefix("torch."),
        "compile_backend": args.compile_backend,
        "trace": [str(path) for path in args.trace],
        "target_shape": args.target_shape,
        "recorded_on": trace.env,
        "hf_spin_cache": layout,
        "static_backend": args.static_backend,
        "draft_backend": args.draft_backend or args.static_backend,
        "read_each_draft_token": args.read_each_draft_token,
        "budget_s": args.budget_s,
    }

    def write(records: list[dict]) -> str:
        md = stand_in + table(records)
        (out / f"replay-{stamp}.json").write_text(json.dumps({"env": env, "records": records}, indent=1))
        (out / f"replay-{stamp}.md").write_text(md + "\n")
        return md

    deadline = time.perf_counter() + args.budget_s if args.budget_s else None
    trees = TREE_VARIANTS[args.trees]
    records = bench(
        trace,
        target,
        drafters,
        args.batch_sizes,
        compile_config,
        None,
        None,
        trees,
        layout,
        deadline,
        write,
        static=StaticOptions("auto", backend=args.static_backend, draft_backend=args.draft_backend),
        forced=forced,
        only=set(args.methods) if args.methods else None,
    )
    print(write(records))
    return 0
