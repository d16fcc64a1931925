"""Replay real acceptance on injected cost structures: the default path's decisions on machines you do not have.

`python -m benchmarks.replay costs TRACE`: for each cost structure of benchmarks/injected_costs.py (flat, AVX-512
bf16-like, AVX2 float32-like, AVX2 bf16-like), each batch size and workload, the trace's requests run on a small
forced target (its logits the recording's: every drafter is accepted exactly as far as in the recording), with
small replay drafters proposing what the real drafters proposed. Every forward advances a `CostClock` by the
structure's t(N) (a model drafter's by its parameter share of the target's: a 0.5B drafter for a 1.5B target pays
about a third of a target step a token), and each pool reads the same costs as an injected profile, so the planner
decides as it would on that machine. Reported per structure: plain `generate`, `transformers`' prompt lookup
(batch 1) and every recorded pool on the same clock. The run exits 1 when a pool falls below `--floor` of plain.

Nothing depends on the machine running it: a few seconds a cell on any CPU. What it does not price: host work
(model-free drafters, the planner, token translation's tokenizers) costs nothing on the clock.
`python -m benchmarks.replay host TRACE` measures that work instead: the same stand-ins by the wall clock, the
pools deciding on one structure's costs (`run_host`), each step's own work in the table's last column.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from transformers import CONFIG_MAPPING, AutoModelForCausalLM

from benchmarks.common import machine, write_results
from benchmarks.injected_costs import STRUCTURES, CostClock, Overrun, pace, profile_of, table

from .forced import build_model, force, replay_drafters
from .run import bench, read_each_draft_token
from .run import table as markdown
from .trace import Trace, compact, load, merge

FLOOR = 0.97  # the never-slower goal: every pool at >= 0.97x plain generate on every structure
STAND_IN = {  # the stand-ins' shape: small, so a run is quick; their cost comes from the clock, not from them
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
}


def stand_in(config: dict, vocab: int | None = None) -> dict:
    """`config` (a `to_dict()`) shrunk to `STAND_IN` (its vocabulary kept, the forced logits index it, or `vocab`
    for a `compact` trace's ids), layer types cut to match."""
    small = {**config, **{k: v for k, v in STAND_IN.items() if k in config or k == "head_dim"}}
    if vocab is not None:  # the special ids live in the trace (`force` sets them), not in the stand-in's config
        small.update(vocab_size=vocab, pad_token_id=None, bos_token_id=None, eos_token_id=None)
    if config.get("layer_types"):
        small["layer_types"] = config["layer_types"][: STAND_IN["num_hidden_layers"]]
    return small


def parameter_share(config: dict, target_config: dict) -> float:
    """A drafter's parameters over the target's, counted on the meta device (no memory): its forward's cost share."""

    def count(cfg: dict) -> int:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(CONFIG_MAPPING[cfg["model_type"]].from_dict(cfg))
        return sum(p.numel() for p in model.parameters())

    return count(config) / count(target_config)


def stand_ins(trace: Trace, vocab: int | None = None) -> tuple:
    """(target, drafters, shares): the forced target's and the replay drafters' stand-ins (of `vocab` tokens where
    given: a `compact` trace's), and each model drafter's cost per forward as a share of the target's (name ->
    share, the real models')."""
    target = build_model(stand_in(trace.target["config"], vocab), torch.float32, "cpu")
    force(target, trace)
    drafters = replay_drafters(trace, torch.float32, "cpu", reshape=lambda config: stand_in(config, vocab))
    shares = {d.name: parameter_share(d.config, trace.target["config"]) for d in trace.drafters if not d.live}
    return target, drafters, shares


def draft_costs(fn, shares: dict[str, float]) -> dict:
    """name -> the model drafter's `ForwardCost` under the target's t(N) = fn(N): its share of it."""
    return {n: table(lambda t, s=s: s * fn(t)) for n, s in shares.items()}


def injected(fn, costs: dict):
    """fn(pool entries) -> the pool's injected `CostProfile`: the target's t(N) = fn(N), model drafters' `costs`."""

    def profile(entries):
        names = [e if isinstance(e, str) else e.name for e in entries]
        return profile_of(table(fn), [costs.get(n) for n in names], names)

    return profile


def run_structures(trace: Trace, structures: list[str], batch_sizes: list[int]) -> list[dict]:
    """Records of `run.bench` for every structure, each tagged with it (`costs`) and with the drafters' shares."""
    target, drafters, shares = stand_ins(trace)
    models = {r.name: d.model for r, d in zip(trace.drafters, drafters) if not r.live}  # name -> stand-in
    records = []
    for name in structures:
        fn = STRUCTURES[name]
        costs = draft_costs(fn, shares)
        clock = CostClock()
        handles = [clock.hook(target, table(fn))] + [clock.hook(models[n], costs[n]) for n in models]
        for rec in bench(trace, target, drafters, batch_sizes, clock=clock, profile=injected(fn, costs)):
            records.append({"costs": name, **rec, "shares": shares})
        for h in handles:
            h.remove()
    return records


def scaled(fn, step_seconds: float):
    """`fn` (a structure's t(N), its plain step 0.1 s) rescaled to a plain step of `step_seconds`."""
    return lambda n: fn(n) * step_seconds / fn(1)


def run_host(
    trace: Trace,
    structure: str,
    batch_sizes: list[int],
    repeat: int = 1,
    step_ms: float | None = None,
    layout: str = "rectangular",
    reads: str = "auto",
) -> list[dict]:
    """Records of `run.bench` on the stand-ins by the wall clock, each pool deciding on `structure`'s injected
    costs (flat: a GPU's): what the engine's own work a step costs (`host_ms`), with the real drafting the trace
    makes (prompt lookup and suffix on the real ids, the model drafters' recorded proposals). repeat: each
    workload's requests that many times over, through one pool (`run.bench`). step_ms: every forward lasts its
    cost on the structure scaled to a plain step of this many milliseconds (`pace`), so the records' times are a
    machine's whose device runs those forwards and whose host is this one (a forward whose stand-in work outlasts
    its cost, a long prefill, is timed at its cost: `Overrun`; None: the stand-ins' own time, the
    pools deciding on the structure's 0.1 s step). layout: the pools' KV cache (`AssistantPool(cache=...)`; static:
    the GPU's layout, its forwards eager here). reads: the model drafters' draft loop there (`run.READS`: auto
    reads each token on this CPU, and grows trees; "no" keeps a chain on the device, a GPU's default)."""
    vocab, fn = None, STRUCTURES[structure]
    if step_ms is not None:  # the stand-ins' own work a position, over ~150k logits, would outlast a device's step
        trace, vocab = compact(trace)
        fn = scaled(fn, step_ms / 1e3)
    target, drafters, shares = stand_ins(trace, vocab)
    read_each_draft_token(drafters, reads)
    costs = draft_costs(fn, shares)
    handles, overrun = [], None
    if step_ms is not None:
        models = {r.name: d.model for r, d in zip(trace.drafters, drafters) if not r.live}
        overrun = Overrun()
        handles = pace(target, table(fn), overrun) + [h for n, m in models.items() for h in pace(m, costs[n], overrun)]
    try:
        return bench(
            trace,
            target,
            drafters,
            batch_sizes,
            profile=injected(fn, costs),
            layout=layout,
            repeat=repeat,
            overrun=overrun,
        )
    finally:
        for h in handles:
            h.remove()


def shortfalls(records: list[dict], floor: float) -> list[str]:
    """The hf_spin cells below `floor` x plain generate on their structure, workload and batch."""
    base = {(r["costs"], r["workload"], r["batch"]): r["seconds"] for r in records if r["method"] == "generate"}
    out = []
    for r in records:
        ratio = base[r["costs"], r["workload"], r["batch"]] / r["seconds"]
        if r["method"].startswith("hf_spin") and ratio < floor:
            out.append(f"{r['costs']} {r['workload']} b{r['batch']} {r['method']}: {ratio:.3f}x")
    return out


def host_main(args) -> int:
    """`python -m benchmarks.replay host TRACE`: the engine's own milliseconds a step, plain and drafting."""
    torch.set_num_threads(args.threads)
    trace = merge([load(path) for path in args.trace])
    records = run_host(
        trace, args.structure, args.batch_sizes, args.repeat, args.step_ms, args.cache, args.read_each_draft_token
    )
    env = {
        **machine(),
        "trace": [str(path) for path in args.trace],
        "structure": args.structure,
        "step_ms": args.step_ms,
        "cache": args.cache,
        "read_each_draft_token": args.read_each_draft_token,
    }
    paced = (
        f"every forward lasting its cost on that structure at a plain step of {args.step_ms:g} ms (a device's, "
        "this machine the host; overrun s: the stand-ins' own work past those costs, taken off the times)"
        if args.step_ms is not None
        else "the forwards the stand-ins' own"
    )
    md = markdown(records) + (
        f"\n\nhost ms / step: the engine's own work beyond the target's forward and the drafters' calls "
        f"(CostProfile.host_seconds), by the wall clock on {env['machine']}, {env['threads']} threads; the pools "
        f"decide on the {args.structure} structure's injected costs, {paced}; each workload's requests "
        f"{args.repeat}x"
    )
    print(md)
    write_results(Path(args.out), "host", {"env": env, "records": records}, md + "\n")
    return 0


def main(args) -> int:
    torch.set_num_threads(args.threads)
    trace = merge([load(path) for path in args.trace])
    records = run_structures(trace, args.structures, args.batch_sizes)
    md = markdown(records)
    below = shortfalls(records, args.floor)
    shares = ", ".join(f"{n} {s:.3f}" for n, s in records[0]["shares"].items()) if records else ""
    print(md)
    print(f"\nmodel drafters' cost per forward, as a share of the target's: {shares or 'none'}")
    print(f"below {args.floor}x plain generate: {'; '.join(below) or 'none'}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    env = {**machine(), "trace": [str(path) for path in args.trace], "recorded_on": trace.env, "floor": args.floor}
    (out / f"costs-{stamp}.json").write_text(json.dumps({"env": env, "records": records}, indent=1))
    (out / f"costs-{stamp}.md").write_text(md + "\n")
    return 1 if below else 0
