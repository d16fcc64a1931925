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
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from transformers import CONFIG_MAPPING, AutoModelForCausalLM

from benchmarks.common import machine
from benchmarks.injected_costs import STRUCTURES, CostClock, profile_of, table

from .forced import build_model, force, replay_drafters
from .run import bench
from .run import table as markdown
from .trace import Trace, load, merge

FLOOR = 0.97  # the never-slower goal: every pool at >= 0.97x plain generate on every structure
STAND_IN = {  # the stand-ins' shape: small, so a run is quick; their cost comes from the clock, not from them
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
}


def stand_in(config: dict) -> dict:
    """`config` (a `to_dict()`) shrunk to `STAND_IN` (its vocabulary kept: the forced logits index it), layer
    types cut to match."""
    small = {**config, **{k: v for k, v in STAND_IN.items() if k in config or k == "head_dim"}}
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


def run_structures(trace: Trace, structures: list[str], batch_sizes: list[int]) -> list[dict]:
    """Records of `run.bench` for every structure, each tagged with it (`costs`) and with the drafters' shares."""
    target = build_model(stand_in(trace.target["config"]), torch.float32, "cpu")
    force(target, trace)
    drafters = replay_drafters(trace, torch.float32, "cpu", reshape=stand_in)
    shares = {
        d.name: parameter_share(d.config, trace.target["config"]) for d in trace.drafters if not d.live
    }  # model drafter -> its cost per forward over the target's
    records = []
    for name in structures:
        fn = STRUCTURES[name]
        clock = CostClock()
        handles = [clock.hook(target, table(fn))]
        models = {r.name: d.model for r, d in zip(trace.drafters, drafters) if not r.live}  # name -> stand-in
        draft_costs = {n: table(lambda t, s=shares[n]: s * fn(t)) for n in models}
        handles += [clock.hook(models[n], draft_costs[n]) for n in models]

        def profile(entries, fn=fn, draft_costs=draft_costs):
            names = [e if isinstance(e, str) else e.name for e in entries]
            return profile_of(table(fn), [draft_costs.get(n) for n in names], names)

        for rec in bench(trace, target, drafters, batch_sizes, clock=clock, profile=profile):
            records.append({"costs": name, **rec, "shares": shares})
        for h in handles:
            h.remove()
    return records


def shortfalls(records: list[dict], floor: float) -> list[str]:
    """The hf_spin cells below `floor` x plain generate on their structure, workload and batch."""
    base = {(r["costs"], r["workload"], r["batch"]): r["seconds"] for r in records if r["method"] == "generate"}
    out = []
    for r in records:
        ratio = base[r["costs"], r["workload"], r["batch"]] / r["seconds"]
        if r["method"].startswith("hf_spin") and ratio < floor:
            out.append(f"{r['costs']} {r['workload']} b{r['batch']} {r['method']}: {ratio:.3f}x")
    return out


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
