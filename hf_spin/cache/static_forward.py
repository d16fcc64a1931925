"""Fixed-shape forwards on a `StaticRowCache`, eager or compiled.

`forward_static` feeds every row slot of the cache T query slots (each row's chunk, right-padded with
filler tokens; free slots all filler) at positions length + t under a 4D mask from the device lengths,
so the model forward `run_static` sees the same shapes whatever the lengths, the acceptance and the rows
present: `torch.compile(run_static, fullgraph=True, dynamic=False)` compiles it once per (row slots,
query slots, capacity), and on CUDA can capture it as a CUDA graph.
"""

from __future__ import annotations

import functools
import inspect
import warnings
import weakref
from dataclasses import dataclass

import torch

from ..host_syncs import to_device
from .cuda_graphs import GraphedForward
from .forward import CACHE_ARG, FILLER_TOKEN, _attention, takes_4d_masks
from .rectangular import needs_contiguous_slots
from .static import StaticRowCache, query_bucket


def check_static_support(model, role: str = "model") -> None:
    """Refuse, with the reason, a model whose forward the static cache cannot run exactly."""
    name = f"{role} {model.config.model_type!r} ({type(model).__name__})"
    if not takes_4d_masks(model):
        raise ValueError(
            f"the static cache needs a model that takes a 4D attention mask as given (eager or sdpa attention, masks "
            f"from transformers' create_causal_mask, no ALiBi from the 2D mask); {name} with attention "
            f"{model.config._attn_implementation!r} does not. Use the rectangular or packed cache."
        )
    if needs_contiguous_slots(model.config):
        raise ValueError(
            f"the static cache supports full attention only; {name} has sliding-window, chunked or slot-biased "
            "attention. Use the rectangular or packed cache."
        )
    if "position_ids" not in inspect.signature(model.forward).parameters:
        raise ValueError(f"the static cache passes explicit position_ids; {name} takes none. Use another cache.")
    fixed = [n for n, b in model.named_buffers() if b.dtype == torch.bool and b.dim() == 4]
    if fixed:  # GPT-Neo: `bias[:, :, key_length - query_length : key_length, :key_length]`
        raise ValueError(
            f"the static cache's keys span its capacity, not the positions so far; {name} cuts its own causal mask "
            f"buffer ({fixed[0]!r}) by the key length. Use the rectangular or packed cache."
        )


def run_static(
    model, cache: StaticRowCache, input_ids: torch.Tensor, dtype: torch.dtype, keep: torch.Tensor | None = None
) -> torch.Tensor:
    """The fixed-shape forward: input_ids `[R, T]` (one row per slot) -> logits `[R, T, V]`; each slot's
    T keys and values are written after its length. Reads no host state that changes between steps, so
    it compiles with fullgraph=True. dtype: the model's, for the additive mask. keep: `[U]` the only query
    slots to compute logits at (`logits_to_keep`; eager forwards only): logits `[R, U, V]`."""
    position_ids, mask = cache.query_inputs(input_ids.shape[1], dtype)  # [R, T], [R, 1, T, C]
    out = model(
        input_ids=input_ids,
        attention_mask=mask,
        position_ids=position_ids,
        cache_position=position_ids.max(dim=0).values,  # [T] older transformers want one; this cache ignores it
        use_cache=True,
        return_dict=True,
        **{CACHE_ARG: cache},
        **({} if keep is None else {"logits_to_keep": keep}),
    )
    return out.logits


def run_static_draft(model, cache: StaticRowCache, input_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`run_static` under a code object of its own: dynamo keeps compiled graphs per code object, so a
    drafter's graphs (one per query width) stay apart from the target's, each set under its own recompile
    limit (past which fullgraph=True raises) and counted on its own."""
    return run_static(model, cache, input_ids, dtype)


# Models dynamo cannot trace whole (a graph break fullgraph=True refuses, as CTRL's positional encoding in torch
# 2.13): their static forwards run eagerly, said once per model (`forward_static`).
_UNTRACEABLE: weakref.WeakSet = weakref.WeakSet()

# Graphs one compiled static forward may hold: one per (row-slot bucket, query width, capacity bucket, model),
# so a server whose batch grows to 64 rows meets 7 row buckets x 2 widths; past dynamo's default (8)
# fullgraph=True raises. A torch.compile that takes a per-call limit (2.13 does) gets this one; on older ones
# (2.11) the process-wide limit is raised to it (never lowered).
RECOMPILE_LIMIT = 64
# StaticOptions' backend for the eager forward captured as CUDA graphs, without torch.compile (cuda_graphs.py);
# "<compiler>+cuda_graphs" (INDUCTOR_GRAPHS) captures the forward torch.compile made with that compiler instead.
CUDA_GRAPHS = "cuda_graphs"
INDUCTOR_GRAPHS = "inductor+" + CUDA_GRAPHS


class FirstRuns:
    """Count the runs of a compiled (or captured) forward at a shape over a storage it has not run before: each
    compiles a graph or captures one, once (an inductor compile takes tens of seconds, a capture a fraction of one,
    on a GPU). A step that ran one spent that time on set-up, not at its forwards' price: the engine marks it
    (`StepFeedback.cold`), and the planner neither learns its costs nor charges its probe for it (docs/planning.md,
    "Set-up is not a price")."""

    def __init__(self):
        self.seen: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {keys}
        self.count = 0

    def note(self, model, forward, cache: StaticRowCache, input_ids: torch.Tensor) -> None:
        """`forward` runs `model` over input_ids `[R, T]` on `cache`: counted if new. The key is
        `cuda_graphs.storage_key`'s with one layer's address for all (a cache reallocates its layers together)."""
        layout = (cache.slot_lengths.data_ptr(), cache.query_depths.data_ptr(), cache.query_visible.data_ptr())
        key = (forward, tuple(input_ids.shape), cache.capacity, layout, cache.layers[0].keys.data_ptr())
        seen = self.seen.setdefault(model, set())
        if key not in seen:
            seen.add(key)
            self.count += 1


FIRST_RUNS = FirstRuns()


def split_backend(backend: str) -> tuple[str | None, bool]:
    """(the torch.compile backend, or None for the eager forward; whether hf_spin captures it as CUDA graphs) of a
    StaticOptions backend: "inductor" (torch's own CUDA graphs, mode "reduce-overhead"), CUDA_GRAPHS, or
    "<compiler>+cuda_graphs"."""
    if backend == CUDA_GRAPHS:
        return None, True
    compiler, plus, graphs = backend.partition("+")
    if not compiler or (plus and graphs != CUDA_GRAPHS):
        raise ValueError(
            f"backend={backend!r} is not supported; give a torch.compile backend ('inductor'), {CUDA_GRAPHS!r}, "
            f"or a torch.compile backend with '+{CUDA_GRAPHS}' ({INDUCTOR_GRAPHS!r})"
        )
    return compiler, bool(plus)


_PER_CALL_LIMIT = "recompile_limit" in inspect.signature(torch.compile).parameters


def compile_static(forward=run_static, backend: str = "inductor", mode: str | None = None):
    """`forward` compiled for fixed shapes with no graph break: one graph per (row slots, query slots,
    capacity, model) in dynamo's cache of the code object, up to RECOMPILE_LIMIT of them."""
    limit = dict(recompile_limit=RECOMPILE_LIMIT) if _PER_CALL_LIMIT else {}
    if not _PER_CALL_LIMIT:
        config = torch._dynamo.config
        config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)
    return torch.compile(forward, fullgraph=True, dynamic=False, backend=backend, mode=mode, **limit)


@functools.cache
def shared_graphed(forward) -> GraphedForward:
    """`GraphedForward(forward)`, one for the process, as `shared_compiled`: profiling's captures serve the
    engine's steps of the same shapes over the same storage, and all share one memory pool."""
    return GraphedForward(forward)


@functools.cache
def shared_compiled(forward, backend: str, mode: str | None):
    """`compile_static(forward, backend, mode)`, one per arguments for the process: the cost profile's
    measuring and every engine after it call the same compiled forward, so the graphs the profile compiled
    (or an earlier call did) serve the engine's steps of the same shapes."""
    return compile_static(forward, backend=backend, mode=mode)


def forward_static(
    model,
    cache: StaticRowCache,
    chunks: list[list[int]],
    forward=run_static,
    width: int | None = None,
    trees: list[tuple[list[int], torch.Tensor] | None] | None = None,
    all_logits: bool = True,
) -> torch.Tensor:
    """Run `model` on one chunk of new tokens per row (B chunks, in the cache's row order), appending them.

    Every slot gets `width` query slots (at least the longest chunk; None: `query_bucket` of it), so
    forwards of one width share one shape; padding and free slots compute but are not counted.
    forward: `run_static`, or a compiled copy of it (`compile_static`); a cache with no storage yet runs
    eagerly.
    trees: [B] a row's chunk as a token tree, (depth of each token `[n]`, which of the chunk each sees
    `[n, n]`), or None for a chain (`StaticRowCache.use_layout`); the same graph runs either.
    Returns logits `[B, T, V]`, T = the longest chunk (the slots after a row's chunk are padding), or `[B, 1, V]`
    at each row's last chunk token when `all_logits` is False: an eager forward (a prompt, a long catch-up) then
    computes logits at those slots alone, as `forward_ragged` does, not `[R, T, V]` (a 0.5B drafter's 4 prompts
    of 700 tokens: 0.9 GB of bf16 logits, and their copy).
    """
    if len(chunks) != len(cache.slot_of):
        raise ValueError(f"{len(chunks)} chunks for a StaticRowCache of {len(cache.slot_of)} rows")
    counts = [len(c) for c in chunks]  # [B]
    longest = max(counts, default=0)
    if longest == 0:
        raise ValueError("forward_static needs at least one token in some chunk")
    width = width or query_bucket(longest)
    assert width >= longest, f"{width} query slots for a chunk of {longest} tokens"
    cache.reserve(width)  # any reallocation happens here, outside the compiled forward
    cache.use_layout(width, {cache.slot_of[b]: t for b, t in enumerate(trees or []) if t is not None})
    ids = [[FILLER_TOKEN] * width for _ in range(cache.num_slots)]  # [R, T]
    for slot, chunk in zip(cache.slot_of, chunks):
        ids[slot][: len(chunk)] = chunk
    return _run(model, cache, to_device(ids, model.device, torch.long), counts, forward, all_logits)


def forward_static_tokens(model, cache: StaticRowCache, tokens: torch.Tensor, fed: list[bool], forward=run_static):
    """`forward_static` of one token per fed row, the tokens already on the device: a draft loop feeds each
    drafted token back without reading it on the host. tokens: `[n]`, one per row where fed (`[B]`) is True,
    in row order. Returns logits `[B, 1, V]` (a row not fed reads padding)."""
    if len(fed) != len(cache.slot_of):
        raise ValueError(f"{len(fed)} rows fed for a StaticRowCache of {len(cache.slot_of)} rows")
    cache.reserve(1)
    cache.use_layout(1, {})
    slots = to_device([slot for slot, f in zip(cache.slot_of, fed) if f], tokens.device, torch.long)  # [n]
    ids = torch.full((cache.num_slots, 1), FILLER_TOKEN, dtype=torch.long, device=tokens.device)  # [R, 1]
    ids[slots, 0] = tokens
    return _run(model, cache, ids, [int(f) for f in fed], forward)


def _run(
    model, cache: StaticRowCache, input_ids: torch.Tensor, counts: list[int], forward, all_logits: bool = True
) -> torch.Tensor:
    """`forward` over input_ids `[R, T]` (eagerly where it cannot run compiled), then each row's length
    advanced by its count; logits `[B, T', V]`, T' = the largest count, rows in the cache's row order (or
    `[B, 1, V]` at each row's last count when not `all_logits`)."""
    if not all(layer.is_initialized for layer in cache.layers) or not cache.layers or model in _UNTRACEABLE:
        forward = run_static  # the first forward allocates the storage: never inside a compiled region
    last = [max(n - 1, 0) for n in counts]  # [B] each row's last query slot (an empty chunk reads padding)
    keep = None
    if not all_logits and forward is run_static and model._supports_logits_to_keep():
        keep = sorted(set(last))  # [U]: the slots some row ends on
        last = [keep.index(j) for j in last]  # [B] index into keep
        keep = to_device(keep, input_ids.device, torch.long)
    args = (model, cache, input_ids, model.dtype) + (() if keep is None else (keep,))  # keep: run_static's alone
    if forward not in (run_static, run_static_draft):  # compiled or captured: a new shape or storage sets one up
        FIRST_RUNS.note(model, forward, cache, input_ids)
    with _attention(model):
        try:
            logits = forward(*args)  # [R, T, V], or [R, U, V] with keep
        except torch._dynamo.exc.Unsupported as e:  # raised while tracing, before anything ran
            if forward in (run_static, run_static_draft):
                raise
            _UNTRACEABLE.add(model)
            warnings.warn(
                f"hf_spin: torch.compile cannot trace {model.config.model_type!r} ({type(model).__name__}) whole: its "
                f"static-layout forwards run eagerly ({str(e).splitlines()[0]})",
                stacklevel=2,
            )
            logits = run_static(*args)
    cache.advance(counts)
    rows = to_device(cache.slot_of, logits.device, torch.long)  # [B]
    if not all_logits:
        return logits[rows, to_device(last, logits.device, torch.long)][:, None]  # [B, 1, V] (a copy)
    return logits[rows, : max(counts)]  # a copy: a CUDA graph's output buffer is reused by its next replay


@dataclass(frozen=True)
class StaticOptions:
    """The static cache layout of a pool's target and model drafters (`AssistantPool(cache="static", compile=...)`).

    compile: False (eager), True, or "auto" (on for a model on CUDA only): `torch.compile` the fixed-shape
        forwards (the target's verification, a model drafter's draft tokens) with fullgraph=True,
        dynamic=False; on CUDA captured as CUDA graphs.
    backend: INDUCTOR_GRAPHS ("inductor+cuda_graphs", the default; any compiler before the "+"): inductor's
        fused kernels captured by hf_spin's graphs, so plain steps run ahead (docs/design.md, "Run-ahead"; on
        an H200 the default pool's plain decode ran 1.2-1.5x `transformers`' static-cache decode, 0.97x with
        run-ahead off); a torch.compile backend alone ("inductor": torch's graph trees, mode
        "reduce-overhead"; "eager" traces with dynamo alone: no graph break and no recompilation are checked
        the same, without code generation); or CUDA_GRAPHS: no torch.compile, the eager forward captured as
        CUDA graphs (cuda_graphs.py: a capture per shape in a fraction of a second, the eager kernels' device
        time; on a CPU the forwards run eagerly).
    draft_backend: the model drafters' backend where it differs from the target's (None: `backend`): a small
        drafter's captured eager forward is bound by its kernels' count, not their work (on an H200 a 0.5B-shape
        draft token cost 0.72 of the 1.5B's step as CUDA graphs, docs/design.md), which inductor's fusion cuts,
        while the target's graphs are captured in seconds.
    query_slots: query slots of every verification from the first on (k + 1 for a draft length cap k);
        None: the longest chunk so far, bucketed, so a longer draft than any before compiles a wider
        forward (once per bucket).
    run_ahead: a step that drafts nothing launches the next one-token forward before the host reads its
        tokens (docs/design.md, "Run-ahead"): True, False, or "auto" (the default): where hf_spin captures the
        target's forwards as CUDA graphs (CUDA_GRAPHS or INDUCTOR_GRAPHS, on CUDA), the host's work then
        overlapping the device's (on an H200 the plain decode 8-50% faster); not under torch's graph trees
        ("inductor" alone), where on an H100 it ran the compiled plain decode 3x slower, for a reason not found.
    """

    compile: bool | str = False
    backend: str = INDUCTOR_GRAPHS
    query_slots: int | None = None
    run_ahead: bool | str = "auto"
    draft_backend: str | None = None

    def __post_init__(self):
        if self.compile not in (False, True, "auto"):
            raise ValueError(f"compile={self.compile!r} is not supported; give False, True or 'auto' (CUDA only)")
        if self.query_slots is not None and not (type(self.query_slots) is int and self.query_slots >= 1):
            raise ValueError(f"query_slots={self.query_slots!r} is not supported; give a positive int or None")
        if self.run_ahead not in (False, True, "auto"):
            raise ValueError(f"run_ahead={self.run_ahead!r} is not supported; give False, True or 'auto'")
        if self.draft_backend is not None and not isinstance(self.draft_backend, str):
            raise ValueError(f"draft_backend={self.draft_backend!r} is not supported; give a backend's name or None")
        for backend in (self.backend, self.draft_backend or self.backend):
            split_backend(backend)

    def backend_for(self, drafter: bool) -> str:
        """The backend of the target's forwards (drafter False) or of a model drafter's."""
        return (self.draft_backend or self.backend) if drafter else self.backend

    def compiles(self, model, drafter: bool = False) -> bool:
        """Whether forwards of `model` (a model drafter's where `drafter`) run compiled (or captured) under these
        options ("auto": on CUDA only; CUDA_GRAPHS: on CUDA only)."""
        on_cuda = model.device.type == "cuda"
        wanted = self.compile is True or (self.compile == "auto" and on_cuda)
        return wanted and (on_cuda or self.backend_for(drafter) != CUDA_GRAPHS)

    def captures(self, model, drafter: bool = False) -> bool:
        """Whether hf_spin captures the forwards of `model` (a model drafter's where `drafter`) as CUDA graphs: a
        CUDA_GRAPHS backend where the forwards compile (CUDA_GRAPHS alone: on CUDA only), after a compiler on
        CUDA only (on a CPU the compiled forward runs as it is)."""
        compiler, graphs = split_backend(self.backend_for(drafter))
        return self.compiles(model, drafter) and graphs and (compiler is None or model.device.type == "cuda")

    def runs_ahead(self, model) -> bool:
        """Whether plain steps of `model` run ahead under these options ("auto": where hf_spin captures the
        target's forwards as CUDA graphs; not under torch's graph trees, "inductor" alone)."""
        captured = self.captures(model) and model.device.type == "cuda"
        return self.run_ahead is True or (self.run_ahead == "auto" and captured)

    def forward_for(self, model, forward=run_static):
        """`forward` (`run_static` or `run_static_draft`) compiled for `model` as these options say, or as
        it is: on CUDA with inductor alone as torch's CUDA graphs (mode "reduce-overhead"); captured by hf_spin
        (`GraphedForward`) under a CUDA_GRAPHS backend, compiled first where it names a compiler. A drafter's
        (`run_static_draft`) under `draft_backend` where given."""
        drafter = forward is run_static_draft
        if not self.compiles(model, drafter):
            return forward
        compiler, _ = split_backend(self.backend_for(drafter))
        captured = self.captures(model, drafter)
        if compiler is not None:
            trees = model.device.type == "cuda" and compiler == "inductor" and not captured
            forward = shared_compiled(forward, compiler, "reduce-overhead" if trees else None)
        return shared_graphed(forward) if captured else forward


class StaticTarget:
    """The target's verification forward on the static layout: `forward_static` with `run_static`, compiled
    when the options say so. Checks the target at construction.

    A step verifies over the sticky `query_width` (k + 1 from `query_slots` on), so steps with shorter
    drafts reuse the widest graph; a step that drafted nothing for any row is the one-token decode, a
    graph of one query slot (the compiled plain step)."""

    def __init__(self, model, options: StaticOptions):
        check_static_support(model, "target model")
        self.compiled = options.compiles(model)
        self.forward = options.forward_for(model)
        self.min_width = options.query_slots or 1

    def __call__(self, model, cache: StaticRowCache, chunks: list[list[int]], trees=None) -> torch.Tensor:
        """Logits `[B, T, V]` of one chunk per row, appended to `cache` (see `forward_static`)."""
        longest = max(len(c) for c in chunks)
        width = 1 if longest == 1 else cache.query_width(max(longest, self.min_width))
        return forward_static(model, cache, chunks, self.forward, width, trees)

    def tree(self, model, cache: StaticRowCache, roots: list[int | None], trees: list) -> torch.Tensor:
        """`forward_tree` on the static layout: [root] + each row's `TokenTree` in its slot's query slots, each
        at position length + depth and seeing its own path, in the graph a chain of that width runs; logits
        `[B, 1 + N_max, V]`. Afterwards the cache holds every slot; its `keep_paths` keeps the accepted ones.
        roots: [B] each row's last committed token, None for a row left out (fault isolation)."""
        chunks = [[root] + tree.tokens if root is not None else [] for root, tree in zip(roots, trees)]
        layouts = [([0] + t.depths(), t.ancestor_mask()) if r is not None else None for r, t in zip(roots, trees)]
        return self(model, cache, chunks, layouts)
