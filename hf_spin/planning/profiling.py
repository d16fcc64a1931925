"""Building a pool's `CostProfile`: measured once per model, machine, dtype and thread count, cached.

    profile = build_profile(target, drafters, names, "auto")   # or a path to a JSON file of its own

"auto" keeps one JSON file per model forward cost under `$HF_SPIN_PROFILES` (default
`~/.cache/hf_spin/profiles`), named by a hash of its key: the model's architecture (its config,
parameter count and attention implementation), the device (GPU name, or CPU model and ISA flags),
the dtype, the thread count, the torch / transformers / hf_spin versions, and how its forwards run
(`forward`: "eager", or "static-compiled:<backend>" on the static layout with compile on, measured
through the compiled fixed-shape forward the engine runs; a drafter's apart). Any of these changing
measures anew. A path instead keeps the whole profile in that one file (read if it matches, else
measured and written), for a machine-specific profile shipped with a deployment. A model whose cost is
read from either runs one forward first (`grid.warm_up`), once per process: its costs are a warm model's.
"""

from __future__ import annotations

import hashlib
import json
import os
import weakref
from pathlib import Path

import torch
import transformers

from ..cache.static import query_bucket
from ..cache.static_forward import StaticOptions, check_static_support, run_static, run_static_draft
from ..drafters.model import COMPILED_CHUNK
from ..version import __version__
from .cost_profile import CostProfile, ForwardCost
from .grid import GRID_BUDGET, GRID_VERSION, measure, warm_up
from .machine import describe

# model -> the (device, dtype) it ran a forward of hf_spin's on in this process (measured, or warmed): a pool built
# per call (as a `generate(assistant_model=...)` user builds one) must not pay a warm-up forward each time (~0.16 s
# on an H200); a model moved or cast since is warmed again
_WARM: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _placement(model) -> tuple[str, str]:
    return str(model.device), str(model.dtype)


def _warmed(model) -> None:
    _WARM.setdefault(model, set()).add(_placement(model))


def cache_dir() -> Path:
    return Path(os.environ.get("HF_SPIN_PROFILES", Path.home() / ".cache" / "hf_spin" / "profiles"))


def static_forwards(model, static: StaticOptions | None, drafter: bool):
    """N -> (the forward the engine runs `model` through for chunks of N tokens a row, its query slots), as
    `measure(static=)` takes it, where the static layout compiles `model`'s forwards: the target's compiled
    `run_static` at `StaticTarget`'s width (one slot for one token, else the bucket of N and `query_slots`; None
    for an N past `query_slots`, which the engine's drafts do not reach: measuring it would compile a graph
    the engine never runs); a drafter's compiled `run_static_draft` for chunks of up to COMPILED_CHUNK tokens,
    `run_static` eagerly beyond (`ModelDrafter._forward`), at the bucket of N. None (measured on the eager
    path) elsewhere, and for a model the layout refuses."""
    if static is None or not static.compiles(model, drafter):
        return None
    try:
        check_static_support(model)
    except ValueError:
        return None
    if not drafter:
        compiled, slots = static.forward_for(model), static.query_slots or 1

        def target(tokens: int):
            if static.query_slots is not None and tokens > static.query_slots:
                return None
            return compiled, 1 if tokens == 1 else query_bucket(max(tokens, slots))

        return target
    compiled = static.forward_for(model, run_static_draft)
    return lambda tokens: (compiled if tokens <= COMPILED_CHUNK else run_static, query_bucket(tokens))


def forward_kind(model, static: StaticOptions | None, drafter: bool = False) -> str:
    """How the profile measures `model` (the key's "forward"): "eager", or "static-compiled:<backend>" (with
    ":drafter" for a drafter, whose chunks past COMPILED_CHUNK run eagerly)."""
    if static_forwards(model, static, drafter) is None:
        return "eager"
    return f"static-compiled:{static.backend_for(drafter)}" + (":drafter" if drafter else "")


def model_key(model, dtype: torch.dtype | None = None, forward: str = "eager") -> dict:
    """What a model's forward cost depends on (`dtype`: in place of the model's own; `forward`: `forward_kind`)."""
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
        "forward": forward,
        "grid": GRID_VERSION,
    }


def key_hash(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]


def complete(model, cost: dict) -> bool:
    """Whether a stored cost has everything measured for this model (an encoder-decoder model's encoder
    seconds came later: a cost stored without them is measured again)."""
    return "encoder" in cost or not getattr(model.config, "is_encoder_decoder", False)


def cached_cost(
    model, budget: float = GRID_BUDGET, progress=None, static: StaticOptions | None = None, drafter: bool = False
) -> tuple[ForwardCost, bool]:
    """(the model's ForwardCost, whether it came from the cache): read from `cache_dir()` or measured
    and written there, on the path `static` runs it (`static_forwards`). A cache that cannot be written
    (read-only home) only costs a re-measure."""
    key = model_key(model, forward=forward_kind(model, static, drafter))
    path = cache_dir() / f"{key_hash(key)}.json"
    if path.exists():
        try:
            data = json.loads(path.read_text())
            if data.get("key") == key and complete(model, data["cost"]):
                return ForwardCost.from_dict(data["cost"]), True
        except (OSError, ValueError, KeyError):
            pass
    cost = measure(model, budget, progress=progress, static=static_forwards(model, static, drafter))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"key": key, "cost": cost.to_dict()}, indent=1))
    except OSError:
        pass
    return cost, False


def other_dtypes(model, forward: str = "eager") -> dict[str, ForwardCost]:
    """The model's forward cost in the other floating dtypes, where the cache has measured it on this
    machine (a run in that dtype did, its forwards run as `forward` says): what the profile's verdict can
    point to."""
    out = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        if dtype == model.dtype:
            continue
        path = cache_dir() / f"{key_hash(model_key(model, dtype, forward))}.json"
        try:
            out[str(dtype).removeprefix("torch.")] = ForwardCost.from_dict(json.loads(path.read_text())["cost"])
        except (OSError, ValueError, KeyError):
            continue
    return out


def build_profile(
    target,
    drafter_models: list,
    names: list[str],
    spec: str | os.PathLike = "auto",
    static: StaticOptions | None = None,
    static_drafters: list[bool] | None = None,
) -> CostProfile:
    """The profile of a target and its drafters (`drafter_models`: [num_drafters] a drafter's model,
    or None for a model-free drafter), with a progress bar while anything is measured.
    spec: "auto" (the per-model cache) or a path (one file for the whole profile).
    static: the pool's static layout (None: another layout): where it compiles, each model is measured
    through the compiled forward the engine runs, which warms its graphs (`static_forwards`).
    static_drafters: [num_drafters] whether each drafter drafts on that layout (a fuzzy or streaming
    drafter keeps its eager caches: measured eagerly); None: every model drafter does."""
    from tqdm.auto import tqdm

    models = [target] + [m for m in drafter_models if m is not None]
    unique = list({id(m): m for m in models}.values())
    bar = tqdm(total=0, desc="hf_spin cost profile", leave=False, disable=None)

    def progress(what: str) -> None:
        bar.set_postfix_str(what, refresh=True)

    def budget(m) -> float:  # a drafter's forwards are mostly over one token a row: half the target's
        return GRID_BUDGET if m is target else GRID_BUDGET / 2

    eager = {id(m) for m, on in zip(drafter_models, static_drafters or []) if not on}

    def layout(m) -> StaticOptions | None:  # the static layout m's forwards run on, if any
        return None if id(m) in eager and m is not target else static

    def key(m) -> str:
        return key_hash(model_key(m, forward=forward_kind(m, layout(m), m is not target)))

    def measured(m) -> ForwardCost:
        _warmed(m)
        return measure(m, budget(m), progress=progress, static=static_forwards(m, layout(m), m is not target))

    costs: dict[int, ForwardCost] = {}
    read: list = []  # the models whose cost came from the cache: not run yet in this process, maybe
    if spec != "auto":
        path = Path(spec)
        stored = json.loads(path.read_text()) if path.exists() else {}
        for m in unique:
            entry = stored.get(key(m))
            if entry is not None and complete(m, entry):
                costs[id(m)] = ForwardCost.from_dict(entry)
                read.append(m)
            else:
                costs[id(m)] = measured(m)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({key(m): costs[id(m)].to_dict() for m in unique}, indent=1))
    else:
        for m in unique:
            costs[id(m)], hit = cached_cost(m, budget(m), progress, layout(m), drafter=m is not target)
            if hit:
                read.append(m)
            else:
                _warmed(m)  # measured here
    for m in read:  # priced warm: its first forward must not read its weights in mid-call (`warm_up`)
        if _placement(m) not in _WARM.get(m, ()):
            progress(f"warming {type(m).__name__}")
            warm_up(m)
            _warmed(m)
    bar.close()
    source = "cached" if len(read) == len(unique) else "measured"
    source = source if spec == "auto" else f"{source}, {spec}"
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
        other_dtypes=other_dtypes(target, forward_kind(target, static)),
    )
