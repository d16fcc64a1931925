"""Building a pool's `CostProfile`: measured once per model, machine, dtype and thread count, cached.

    profile = build_profile(target, drafters, names, "auto")   # or a path to a JSON file of its own

"auto" keeps one JSON file per model forward cost under `$HF_SPIN_PROFILES` (default
`~/.cache/hf_spin/profiles`), named by a hash of its key: the model's architecture (its config,
parameter count and attention implementation), the device (GPU name, or CPU model and ISA flags),
the dtype, the thread count and the torch / transformers / hf_spin versions. Any of these changing
measures anew. A path instead keeps the whole profile in that one file (read if it matches, else
measured and written), for a machine-specific profile shipped with a deployment.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
import transformers

from ..version import __version__
from .cost_profile import GRID_BUDGET, CostProfile, ForwardCost, measure
from .machine import describe


def cache_dir() -> Path:
    return Path(os.environ.get("HF_SPIN_PROFILES", Path.home() / ".cache" / "hf_spin" / "profiles"))


def model_key(model, dtype: torch.dtype | None = None) -> dict:
    """What a model's forward cost depends on (`dtype`: in place of the model's own)."""
    config = model.config.to_dict()
    for volatile in ("_name_or_path", "transformers_version", "torch_dtype", "dtype"):
        config.pop(volatile, None)
    architecture = json.dumps(config, sort_keys=True, default=str)
    return {
        "architecture": hashlib.sha256(architecture.encode()).hexdigest()[:16],
        "parameters": model.num_parameters(),
        "attention": str(getattr(model.config, "_attn_implementation", None)),
        "device": describe(model.device),
        "dtype": str(dtype or model.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "versions": [torch.__version__, transformers.__version__, __version__],
    }


def key_hash(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]


def complete(model, cost: dict) -> bool:
    """Whether a stored cost has everything measured for this model (an encoder-decoder model's encoder
    seconds came later: a cost stored without them is measured again)."""
    return "encoder" in cost or not getattr(model.config, "is_encoder_decoder", False)


def cached_cost(model, budget: float = GRID_BUDGET, progress=None) -> tuple[ForwardCost, bool]:
    """(the model's ForwardCost, whether it came from the cache): read from `cache_dir()` or measured
    and written there. A cache that cannot be written (read-only home) only costs a re-measure."""
    key = model_key(model)
    path = cache_dir() / f"{key_hash(key)}.json"
    if path.exists():
        try:
            data = json.loads(path.read_text())
            if data.get("key") == key and complete(model, data["cost"]):
                return ForwardCost.from_dict(data["cost"]), True
        except (OSError, ValueError, KeyError):
            pass
    cost = measure(model, budget, progress=progress)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"key": key, "cost": cost.to_dict()}, indent=1))
    except OSError:
        pass
    return cost, False


def other_dtypes(model) -> dict[str, ForwardCost]:
    """The model's forward cost in the other floating dtypes, where the cache has measured it on this
    machine (a run in that dtype did): what the profile's verdict can point to."""
    out = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        if dtype == model.dtype:
            continue
        path = cache_dir() / f"{key_hash(model_key(model, dtype))}.json"
        try:
            out[str(dtype).removeprefix("torch.")] = ForwardCost.from_dict(json.loads(path.read_text())["cost"])
        except (OSError, ValueError, KeyError):
            continue
    return out


def build_profile(target, drafter_models: list, names: list[str], spec: str | os.PathLike = "auto") -> CostProfile:
    """The profile of a target and its drafters (`drafter_models`: [num_drafters] a drafter's model,
    or None for a model-free drafter), with a progress bar while anything is measured.
    spec: "auto" (the per-model cache) or a path (one file for the whole profile)."""
    from tqdm.auto import tqdm

    models = [target] + [m for m in drafter_models if m is not None]
    unique = list({id(m): m for m in models}.values())
    bar = tqdm(total=0, desc="hf_spin cost profile", leave=False, disable=None)

    def progress(what: str) -> None:
        bar.set_postfix_str(what, refresh=True)

    def budget(m) -> float:  # a drafter's forwards are mostly over one token a row: half the target's
        return GRID_BUDGET if m is target else GRID_BUDGET / 2

    costs: dict[int, ForwardCost] = {}
    source = "cached"
    if spec != "auto":
        path = Path(spec)
        stored = json.loads(path.read_text()) if path.exists() else {}
        for m in unique:
            entry = stored.get(key_hash(model_key(m)))
            if entry is not None and complete(m, entry):
                costs[id(m)] = ForwardCost.from_dict(entry)
            else:
                costs[id(m)] = measure(m, budget(m), progress=progress)
                source = "measured"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({key_hash(model_key(m)): costs[id(m)].to_dict() for m in unique}, indent=1))
        source = f"{source}, {path}"
    else:
        for m in unique:
            costs[id(m)], hit = cached_cost(m, budget(m), progress=progress)
            source = source if hit else "measured"
    bar.close()
    # A model serving as target and drafter (self-speculation) gets its own copy: each is refined by its own forwards.
    drafters = [ForwardCost.from_dict(costs[id(m)].to_dict()) if m is not None else None for m in drafter_models]
    return CostProfile(
        target=costs[id(target)],
        drafters=drafters,
        names=list(names),
        machine=describe(target.device),
        dtype=str(target.dtype).removeprefix("torch."),
        threads=torch.get_num_threads(),
        source=source,
        other_dtypes=other_dtypes(target),
    )
