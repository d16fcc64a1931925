"""Running a model on one chunk of new tokens per row, appending them to a `RectangularCache` or a `PackedCache`.

`forward_ragged` runs a model on per-row chunks of new tokens of different lengths (right-padded
with holes on a `RectangularCache`, packed back to back on a `PackedCache`) and returns the logits of every
chunk slot. `CACHE_ARG` is the keyword the installed `transformers` takes the cache under.
"""

from __future__ import annotations

import inspect
import itertools
import sys
import threading
import weakref
from contextlib import contextmanager

import torch
from transformers.masking_utils import create_causal_mask

from ..host_syncs import to_device
from ..kernels.attention import ATTENTION_NAME
from ..kernels.varlen_attention import pack_tree_masks
from .packed import PackedCache
from .rectangular import RectangularCache

# Token fed into hole slots of a right-padded chunk; masked, so any valid id works.
FILLER_TOKEN = 0
# The keyword models, decoder layers, attention modules and mask functions take the KV cache under:
# transformers 5.24 renamed `past_key_values` to `cache` (the old name warns, and both at once raise).
CACHE_NAMES = ("cache", "past_key_values")  # what `generate` may hand a custom loop the cache as, either version
CACHE_ARG = CACHE_NAMES[0] if CACHE_NAMES[0] in inspect.signature(create_causal_mask).parameters else CACHE_NAMES[1]


def forward_ragged(
    model, cache: RectangularCache | PackedCache, chunks: list[list[int]], all_logits: bool = True, forward=None
) -> torch.Tensor:
    """Run `model` on one chunk of new tokens per row, appending them to `cache`.

    chunks: B lists of token ids, any lengths (an empty chunk adds only holes).
    forward: called instead of `model` with the same keyword arguments (e.g. the layer-parallel forward
        of drafters/fuzzy.py); it must return an object with `.logits`.
    Returns logits `[B, T, V]` for every slot of the right-padded chunk (T = longest chunk), or
    `[B, 1, V]` at each row's last chunk token when `all_logits` is False.
    A `PackedCache` goes through `forward_packed` (no padding, no holes).
    """
    if isinstance(cache, PackedCache):
        return forward_packed(model, cache, chunks, all_logits)
    device = model.device
    width = max(len(c) for c in chunks)
    lengths = [len(c) for c in chunks]  # [B]
    input_ids = to_device([c + [FILLER_TOKEN] * (width - len(c)) for c in chunks], device, torch.long)  # [B, T]
    attention_mask, position_ids = cache.add_slots(lengths, width)
    if not cache.has_holes():  # every slot valid (batch 1, rows of one length): with no mask, SDPA keeps its
        attention_mask = None  # causal kernel and grouped KV heads, which a mask trades for its math path
    past = cache.get_seq_length()
    cache_position = torch.arange(past, past + width, device=device)  # [T]
    last = [max(n - 1, 0) for n in lengths]  # [B] each row's last chunk slot (an empty row reads a hole)
    extra = {}
    if not all_logits and model._supports_logits_to_keep():
        # Only the slots some row ends on: a prefill of L tokens computes U <= B rows of logits, not L.
        keep = sorted(set(last))  # [U]
        position = {j: u for u, j in enumerate(keep)}
        last = [position[j] for j in last]  # [B] index into keep
        extra["logits_to_keep"] = to_device(keep, device, torch.long)
    cache.single_token_forward = (
        width == 1 and attention_mask is not None
    )  # no host read of the mask for a one-token query (RectangularCache.is_compileable)
    try:
        with _attention(model):  # the model's own attention, never a packed forward's (another thread's)
            out = (forward or model)(
                **model_inputs(
                    model,
                    cache,
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    position_ids=position_ids,
                    cache_position=cache_position,
                    use_cache=True,
                    return_dict=True,
                    **extra,
                )
            )
    finally:
        cache.single_token_forward = False
    logits = out.logits  # [B, T, V], or [B, U, V] with logits_to_keep
    if all_logits:
        return logits
    rows = torch.arange(len(chunks), device=logits.device)  # logits come out where the LM head is (device_map)
    return logits[rows, to_device(last, logits.device, torch.long)][:, None]  # [B, 1, V]


def model_inputs(model, cache: RectangularCache, **inputs) -> dict:
    """A forward's keyword arguments over a `RectangularCache`: `inputs` and the cache as given for a
    decoder-only model; for an encoder-decoder one (the cache holds its rows' `encoder`), the decoder's
    inputs under their decoder names, the rows' encoder output, and the cache joined with their
    cross-attention K/V (cache/encoder_rows.py)."""
    if cache.encoder is None:
        return {**inputs, CACHE_ARG: cache}
    return {**cache.encoder.decoder_kwargs(model, inputs), CACHE_ARG: cache.encoder.with_cross(cache)}


class _AttentionSwitch:
    """Which attention implementation one model's forwards in flight run under.

    transformers reads it from `model.config._attn_implementation` at every layer, one value for every
    thread. A packed forward needs `hf_spin_varlen`, any other forward the model's own (its "home"
    implementation), so when a pipeline verifies on packed rows while its drafting thread runs a drafter
    that shares the target's model (self-speculation), a flip for one would change the other mid-forward.
    Forwards that need the implementation in force run together; one that needs the other waits until
    they are done, and the config is flipped only while no forward is in flight.
    """

    def __init__(self, config):
        self.config = config
        self.home = config._attn_implementation  # re-read whenever no forward is in flight
        self.current = self.home  # the implementation the forwards in flight run under
        self.active = 0  # forwards in flight
        self.changed = threading.Condition()

    @contextmanager
    def use(self, name: str | None):
        """Run one forward under attention `name` (None: the model's own)."""
        with self.changed:
            while True:
                if self.active == 0:
                    self.home = self.current = self.config._attn_implementation
                want = name or self.home
                if self.active == 0 or self.current == want:
                    break
                self.changed.wait()
            if self.active == 0 and want != self.home:
                self.config._attn_implementation = self.current = want
            self.active += 1
        try:
            yield
        finally:
            with self.changed:
                self.active -= 1
                if self.active == 0:
                    if self.current != self.home:
                        self.config._attn_implementation = self.home
                    self.current = self.home
                    self.changed.notify_all()


_switches: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its _AttentionSwitch
_switches_lock = threading.Lock()


def _attention(model, name: str | None = None):
    """The context one forward of `model` runs in: attention `name`, or the model's own (None)."""
    with _switches_lock:
        switch = _switches.get(model)
        if switch is None:
            switch = _switches[model] = _AttentionSwitch(model.config)
    return switch.use(name)


def check_packed_support(model, role: str = "model") -> None:
    """Refuse, with the reason, a model the packed path cannot run."""
    if not model._can_set_attn_implementation() or not getattr(model, "_supports_attention_backend", False):
        raise ValueError(
            f"cache='packed' needs a model whose attention goes through transformers' AttentionInterface; "
            f"{role} {model.config.model_type!r} ({type(model).__name__}) has its own attention code. "
            "Use cache='rectangular'."
        )


def takes_4d_masks(model) -> bool:
    """Whether the model reads a 4D attention mask as given (`forward_masked`: token trees on a
    `RectangularCache`): eager or SDPA attention, masks made by transformers' `create_causal_mask` (which
    passes a 4D mask through), and no ALiBi built from the 2D mask (bloom's)."""
    module = sys.modules.get(type(model).__module__)
    return (
        model.config._attn_implementation in ("eager", "sdpa")
        and getattr(module, "create_causal_mask", None) is create_causal_mask
        and not hasattr(module, "build_alibi_tensor")
    )


def forward_tree(model, cache: RectangularCache | PackedCache, roots: list[int], trees: list) -> torch.Tensor:
    """Verify token trees: one forward over [root] + the tree's nodes per row, each slot seeing the
    row's cache and its own path (`TokenTree.ancestor_mask`), at position length + depth. On packed
    rows the kernel's tree masks; on a `RectangularCache` a 4D mask (`_forward_tree_ragged`).

    roots: [B] each row's last committed token (not yet in the cache), None for a row left out of this
    forward (fault isolation); trees: [B] `TokenTree`s. Returns logits `[B, 1 + N_max, V]`: slot 0
    after the root, slot i + 1 after node i (anything past a row's nodes). Afterwards the cache holds
    every slot; its `keep_paths` keeps the accepted ones.
    """
    fed = [root is not None for root in roots]
    chunks = [[root] + tree.tokens if f else [] for root, tree, f in zip(roots, trees, fed)]
    depths = [[0] + tree.depths() if f else [] for tree, f in zip(trees, fed)]
    masks = [tree.ancestor_mask() if f else torch.zeros(0, 0, dtype=torch.bool) for tree, f in zip(trees, fed)]
    if isinstance(cache, RectangularCache):
        return _forward_tree_ragged(model, cache, chunks, depths, masks)
    return forward_packed(model, cache, chunks, depths=depths, tree_masks=masks)


def _forward_tree_ragged(
    model, cache: RectangularCache, chunks: list[list[int]], depths: list[list[int]], masks: list[torch.Tensor]
) -> torch.Tensor:
    """`forward_tree` on a `RectangularCache`: the chunks right-padded as `forward_ragged` pads them; a new
    slot sees the row's valid slots and its own path, a pad slot the row and itself (its logits are unused)."""
    (B, S), T = cache.host_mask.shape, max(len(c) for c in chunks)
    positions = cache.host_mask.sum(dim=1)[:, None].repeat(1, T)  # [B, T] each row's length; + depth below
    allowed = torch.zeros(B, T, S + T, dtype=torch.bool)
    allowed[:, :, :S] = cache.host_mask[:, None, :]
    for b, (mask, depth) in enumerate(zip(masks, depths)):
        n = len(depth)
        allowed[b, :n, S : S + n] = mask
        positions[b, :n] += torch.tensor(depth, dtype=positions.dtype)
    return forward_masked(model, cache, chunks, positions, allowed)


def forward_masked(
    model, cache: RectangularCache, chunks: list[list[int]], positions: torch.Tensor, allowed: torch.Tensor
) -> torch.Tensor:
    """Run `model` on one chunk of new tokens per row (right-padded), appended to a `RectangularCache`, each new
    slot at its own position and seeing what `allowed` says, through a 4D additive mask (transformers
    takes one as given). Token trees use it: the target verifying one (`forward_tree`), a model drafter
    growing one depth at a time (drafters/tree_expansion.py).

    positions: `[B, T]` host long, each new slot's position; allowed: `[B, T, S + T]` host bool, which of
    the cache's S slots and of the T new ones each new slot sees (every slot is made to see itself).
    Returns logits `[B, T, V]`."""
    device, T = model.device, max(len(c) for c in chunks)
    input_ids = to_device([c + [FILLER_TOKEN] * (T - len(c)) for c in chunks], device, torch.long)  # [B, T]
    S = allowed.shape[-1] - T
    allowed = allowed.clone()
    allowed[:, torch.arange(T), S + torch.arange(T)] = True
    dtype = model.dtype
    additive = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)[
        :, None
    ]  # [B, 1, T, S + T]
    cache.add_slots([len(c) for c in chunks], T)
    past = cache.get_seq_length()
    with _attention(model):
        out = model(
            **model_inputs(
                model,
                cache,
                input_ids=input_ids,
                attention_mask=to_device(additive, device),
                position_ids=to_device(positions, device),
                cache_position=torch.arange(past, past + T, device=device),
                use_cache=True,
                return_dict=True,
            )
        )
    return out.logits  # [B, T, V]


def forward_packed(
    model,
    cache: PackedCache,
    chunks: list[list[int]],
    all_logits: bool = True,
    depths: list[list[int]] | None = None,
    tree_masks: list | None = None,
) -> torch.Tensor:
    """`forward_ragged` on a `PackedCache`: one forward over the packed chunks `[1, total_q]`, no padding.

    Attention runs through `hf_spin_varlen` (switched on for this forward only) with the cache's
    `VarlenMetadata`. Returns logits like `forward_ragged`: `[B, T, V]` right-padded with zeros, or
    `[B, 1, V]` at each row's last chunk token (zeros for an empty chunk) when `all_logits` is False.
    depths / tree_masks: per row, each new token's position after the row's length and the `[q, q]`
    bool mask among its new tokens (`forward_tree`); default: consecutive positions, causal.
    """
    device = model.device
    q_lens = [len(c) for c in chunks]
    total = sum(q_lens)
    if total == 0:
        raise ValueError("forward_packed needs at least one token in some chunk")
    meta, position_ids = cache.begin(q_lens, depths)
    if tree_masks is not None:
        meta.tree_mask = to_device(pack_tree_masks(tree_masks), cache.device, torch.bool)
    input_ids = to_device([t for c in chunks for t in c], device, torch.long)[None]  # [1, total_q]
    fed = [b for b, q in enumerate(q_lens) if q > 0]  # [U] the rows given tokens
    cu = list(itertools.accumulate(q_lens))  # [B] cu_seqlens_q[1:]
    ends = [cu[b] - 1 for b in fed]  # [U] packed index of each fed row's last token
    extra = {CACHE_ARG: cache}
    if not all_logits and model._supports_logits_to_keep():
        extra["logits_to_keep"] = to_device(ends, device, torch.long)  # [U]: one row of logits per non-empty row
    try:
        with _attention(model, ATTENTION_NAME):
            out = model(
                input_ids=input_ids,
                position_ids=position_ids.to(device),
                use_cache=True,
                return_dict=True,
                spin_varlen=meta,
                **extra,
            )
    except BaseException:
        cache.abort()  # the lengths stay as they were
        raise
    cache.commit()
    logits = out.logits[0]  # [total_q, V], or [U, V] with logits_to_keep
    B, V = len(chunks), logits.shape[-1]
    if all_logits:
        row = to_device([b for b, q in enumerate(q_lens) for _ in range(q)], logits.device, torch.long)  # [total_q]
        col = to_device([j for q in q_lens for j in range(q)], logits.device, torch.long)  # [total_q]
        padded = logits.new_zeros(B, max(q_lens), V)
        padded[row, col] = logits
        return padded
    result = logits.new_zeros(B, 1, V)
    fed_rows = to_device(fed, logits.device, torch.long)  # [U]
    result[fed_rows, 0] = logits if "logits_to_keep" in extra else logits[to_device(ends, logits.device, torch.long)]
    return result
