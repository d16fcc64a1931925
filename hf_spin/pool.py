"""`AssistantPool`: the drafters a `generate` call may use, the policy that picks among them, and
what they did.

Entries: a causal LM that shares the target's tokenizer; for an encoder-decoder target, a smaller
encoder-decoder model of its family (`EncoderDecoderDrafter`: its own encoder, once per row);
`(model, tokenizer)` for a drafter with another tokenizer (token translation; a shared tokenizer is
detected and translation skipped);
`"prompt_lookup"`; `"suffix"` (a suffix index over the prompt, the output so far and earlier requests'
outputs, kept across calls: `SuffixDrafter(...)` for its knobs); or any `Drafter` object (e.g.
`ModelDrafter(model)` to skip the vocabulary check).
"""

from __future__ import annotations

import copy
import itertools
import os
import threading
import warnings

from .cache import check_packed_support, needs_contiguous_slots
from .cache.encoder_rows import reads_encoder_output, takes_decoder_positions
from .cache.static_forward import StaticOptions
from .drafters import (
    Drafter,
    EncoderDecoderDrafter,
    ModelDrafter,
    PromptLookupDrafter,
    SuffixDrafter,
    TranslatingDrafter,
)
from .planning.cost_profile import CostProfile
from .planning.planner import Planner
from .planning.profiling import build_profile
from .policies import DEFAULT_DRAFT_LENGTH, DrafterInfo, DraftLength, Policy, make_policy
from .stats import DrafterStats, GenerationStats

NAMED_DRAFTERS = {"prompt_lookup": PromptLookupDrafter, "suffix": SuffixDrafter}
# Layer kinds whose state is a KV cache that can be rolled back per row (others: conv, recurrent, ...).
ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention", "chunked_attention"}
# `profile=` when none is given: "auto" unless $HF_SPIN_PROFILE says otherwise (the test suite sets
# "off": its tiny models' timings are noise, and its lossless tests must draft whatever the machine).
PROFILE_ENV = "HF_SPIN_PROFILE"
# `cache=`: the KV cache layout of every model forward (docs/design.md, "Ragged rows").
CACHE_LAYOUTS = ("rectangular", "packed", "static")


def _cache_layout(cache: str | None, ragged_attention: bool | None) -> str:
    """The layout `AssistantPool(cache=..., ragged_attention=...)` asks for; `ragged_attention` is the old spelling."""
    if ragged_attention is not None:
        warnings.warn(
            'AssistantPool(ragged_attention=...) is deprecated; use cache="packed" (packed rows) '
            'or cache="rectangular" (the default)',
            FutureWarning,
            stacklevel=3,
        )
        implied = "packed" if ragged_attention else "rectangular"
        if cache is not None and cache != implied:
            raise ValueError(f"cache={cache!r} and ragged_attention={ragged_attention!r} conflict; give only cache=")
        cache = implied
    if cache is None:
        return "rectangular"
    if cache not in CACHE_LAYOUTS:
        raise ValueError(f"cache={cache!r} is not supported; give one of {', '.join(map(repr, CACHE_LAYOUTS))}")
    return cache


def _static_options(layout: str, compile) -> StaticOptions | None:
    """The static layout's options from `AssistantPool(cache=, compile=)`; None on the other layouts."""
    if layout != "static":
        if compile not in (None, False):
            raise ValueError(
                f"compile={compile!r} needs cache='static' (the fixed-shape forwards); got cache={layout!r}"
            )
        return None
    if isinstance(compile, StaticOptions):
        return compile
    return StaticOptions("auto" if compile is None else compile)


def _is_model(obj) -> bool:
    return hasattr(obj, "config") and callable(obj)


def _same_vocab(tok_a, tok_b) -> bool:
    return tok_a is tok_b or tok_a.get_vocab() == tok_b.get_vocab()


def _encoder_decoder(model) -> bool:
    return bool(getattr(model.config, "is_encoder_decoder", False))


def _check_model(model, role: str) -> None:
    config = model.config
    if getattr(config, "is_encoder_decoder", False) and not (
        takes_decoder_positions(model) or needs_contiguous_slots(config)
    ):
        raise ValueError(
            f"{role} {config.model_type!r} is an encoder-decoder model whose decoder reads its positions from the "
            "cache length (absolute positions, no decoder_position_ids), so rows of different lengths cannot share "
            "a batch; supported: decoder-only causal LMs and encoder-decoder models taking decoder_position_ids "
            "(Whisper) or with relative positions (T5, mT5, UMT5)"
        )
    layer_types = set(getattr(config.get_text_config(), "layer_types", None) or [])
    if getattr(model, "_is_stateful", False) or not layer_types <= ATTENTION_LAYER_TYPES:
        raise ValueError(
            f"{role} {config.model_type!r} is stateful (recurrent state that cannot be rolled back per row); "
            "speculative decoding needs an attention KV cache. Use it without assistant_pool."
        )


class AssistantPool:
    """Drafters plus a policy.

    drafters: list of models, `(model, tokenizer)` pairs, `"prompt_lookup"`, `"suffix"` or `Drafter` objects.
    policy: a name from `hf_spin.policies.POLICIES` (`"fixed"`: the first drafter, `"round_robin"`,
        ...) or a `Policy` object.
    draft_length: tokens drafted per step (k) for the built-in policies: an int, a name from
        `hf_spin.policies.DRAFT_LENGTHS`, or a `DraftLength` object.
    tokenizer: the target's tokenizer; needed by drafters with another tokenizer (it may also come
        from `generate(tokenizer=...)`).
    cache: the KV cache layout (docs/design.md, "Ragged rows"): "rectangular" (default) a
        `RectangularCache` per model, rejected slots left as holes; "packed" verifies (and drafts, for
        model drafters) on packed rows: a `PackedCache` per model and `attn_implementation="hf_spin_varlen"`
        for those forwards, so no compute or memory goes to padding or holes. Needs models whose
        attention goes through transformers' AttentionInterface. (`ragged_attention=True` / `False`, the
        old spelling of "packed" / "rectangular", still works with a FutureWarning.) "static": the
        target's KV in a `StaticRowCache` (row slots x capacity allocated once, each row's length on the
        device), every verification one fixed-shape forward (`cache/static_forward.py`) that `compile`
        may compile (token trees run in the same graph as chains), full-attention models taking 4D masks.
        Model drafters draft there too, through static caches of their own (those the layout cannot take
        draft eagerly on a dynamic cache).
    compile: the static layout's fixed-shape forwards (the target's verification, model drafters' draft
        tokens): False (eager), True (`torch.compile(fullgraph=True, dynamic=False)`; CUDA graphs on a
        GPU: inductor's kernels captured by hf_spin), "auto" (default: on for a model on CUDA), or a
        `StaticOptions` (backend, query slots; `backend="cuda_graphs"`: the eager forwards captured as CUDA
        graphs, no torch.compile). Only with cache="static".
    tree: token trees (docs/design.md, "token tree"): "auto" (default) verifies a vote's whole merged
        tree, prompt lookup's several continuations, suffix drafting's likeliest ones and a model
        drafter's grown tree (on a rectangular or static cache) in one forward, False chains only (a vote's
        heaviest path), N at most the tree's N heaviest nodes. Packed rows use the kernel's tree masks,
        the rectangular and static caches a 4D mask (models whose masks come from transformers'
        create_causal_mask, eager or SDPA attention); chains for sliding-window, chunked and
        slot-biased models. A tree may hold more nodes than draft_length (prompt lookup: up to 4
        continuations of k tokens; a model drafter: tree_width x k; a vote: every drafter's): with a
        profile the planner keeps its nodes node by node while the next one pays; tree=N caps it.
    profile: the cost profile the planner sizes drafts with (docs/planning.md): "auto" (measured when
        the pool first meets a model, a few seconds, cached on disk), a path (one JSON file for the
        whole profile), a `CostProfile` (injected costs), or "off": no planner, the policy's k as
        given. With a profile, `draft_length` is each row's upper bound and the planner picks k in
        [0, it] per row and step; a pool that cannot pay on the machine says so once and decodes plainly.
    """

    def __init__(
        self,
        drafters: list,
        policy: str | Policy = "fixed",
        draft_length: int | str | DraftLength = DEFAULT_DRAFT_LENGTH,
        tokenizer=None,
        cache: str | None = None,
        profile: str | os.PathLike | CostProfile | None = None,
        tree: str | bool | int = "auto",
        compile: bool | str | StaticOptions | None = None,
        *,
        ragged_attention: bool | None = None,
    ):
        if not isinstance(drafters, (list, tuple)) or not drafters:
            raise ValueError(f"AssistantPool needs a non-empty list of drafters, got {drafters!r}")
        self.entries = list(drafters)
        self.drafters: list[Drafter] = [self._make(e) for e in self.entries]
        self.policy = make_policy(policy, draft_length)
        self.policy.bind(self.infos)
        self.tokenizer = tokenizer
        self.cache_layout = _cache_layout(cache, ragged_attention)  # one of CACHE_LAYOUTS
        if not (tree in ("auto", False) or (type(tree) is int and tree >= 1)):
            raise ValueError(
                f"tree={tree!r} is not supported; give 'auto', False (chains) or a positive number of nodes"
            )
        self.tree = tree
        self.static = _static_options(self.cache_layout, compile)  # None: not the static layout
        self._vocab_checked: set[int] = (
            set()
        )  # ids of translating drafters already compared with the target's vocabulary
        self.row_ids = itertools.count()  # request ids, unique over every call: the policy remembers past requests
        self.last_stats: GenerationStats | None = None  # statistics of the latest generate call
        self.totals: dict[str, DrafterStats] = {}  # per drafter, summed over all calls
        self.profile = profile if profile is not None else os.environ.get(PROFILE_ENV, "auto")
        named = isinstance(self.profile, str) and (self.profile in ("auto", "off") or self.profile.endswith(".json"))
        if not (named or isinstance(self.profile, (CostProfile, os.PathLike))):
            raise ValueError(
                f"profile={self.profile!r} is not supported; "
                "give 'auto', 'off', a path to a .json file or a CostProfile"
            )
        self.cost_profile: CostProfile | None = self.profile if isinstance(self.profile, CostProfile) else None
        self.planner: Planner | None = None  # made when the pool first meets a target (bind)
        self._profiled: tuple | None = None  # (id of the target, static options) the profile was made for
        self._lock = threading.Lock()  # one profile built at a time (a server binds from several threads)

    @staticmethod
    def _make(entry) -> Drafter:
        if isinstance(entry, Drafter):
            return entry
        if isinstance(entry, str):
            if entry not in NAMED_DRAFTERS:
                raise ValueError(f"unknown drafter name {entry!r}; supported names: {sorted(NAMED_DRAFTERS)}")
            return NAMED_DRAFTERS[entry]()
        if isinstance(entry, tuple) and len(entry) == 2 and _is_model(entry[0]):
            _check_model(entry[0], "drafter")
            return TranslatingDrafter(entry[0], entry[1])
        if _is_model(entry):
            _check_model(entry, "drafter")
            cross = _encoder_decoder(entry) or reads_encoder_output(entry)
            return EncoderDecoderDrafter(entry) if cross else ModelDrafter(entry)
        raise TypeError(
            f"cannot use {type(entry).__name__} as a drafter; give a causal LM, a (model, tokenizer) pair, "
            f"one of {sorted(NAMED_DRAFTERS)}, or a hf_spin.drafters.Drafter"
        )

    @property
    def names(self) -> list[str]:
        """One unique name per drafter (a repeated name gets "#2", "#3"...): the keys of the statistics."""
        names: list[str] = []
        for d in self.drafters:
            n = sum(1 for other in names if other.split("#")[0] == d.name)
            names.append(f"{d.name}#{n + 1}" if n else d.name)
        return names

    @property
    def infos(self) -> list[DrafterInfo]:
        """What the policy may know of each drafter."""
        return [DrafterInfo(n, d.kind, d.num_parameters, d.gives_q) for n, d in zip(self.names, self.drafters)]

    def bind(self, target, tokenizer=None, static: StaticOptions | None = None) -> list[Drafter]:
        """Check every drafter against the target; returns the drafters to use for this call.
        static: the call's static layout where it differs from the pool's (`cache_implementation="static"`)."""
        _check_model(target, "target model")
        if _encoder_decoder(target):
            self._check_encoder_decoder(target)
        for drafter in self.drafters:
            if isinstance(drafter, EncoderDecoderDrafter) and not _encoder_decoder(target):
                raise ValueError(
                    f"drafter {drafter.name!r} is an encoder-decoder model (or reads an encoder's output) and the "
                    f"target {target.config.model_type!r} a causal LM: such a drafter needs an encoder-decoder "
                    "target's encoder input or output"
                )
        if self.cache_layout == "packed":
            check_packed_support(target, "target model")
        tokenizer = tokenizer or self.tokenizer
        target_vocab = target.config.get_text_config().vocab_size
        for i, drafter in enumerate(self.drafters):
            if isinstance(drafter, TranslatingDrafter):
                if tokenizer is None and drafter.target_tokenizer is None:
                    raise ValueError(
                        f"drafter {drafter.name!r} has its own tokenizer, so it needs the target's tokenizer to "
                        "translate tokens: pass tokenizer= to AssistantPool or to generate"
                    )
                drafter.target_tokenizer = drafter.target_tokenizer or tokenizer
                if id(drafter) not in self._vocab_checked:  # once: comparing two vocabularies takes ~0.1 s
                    self._vocab_checked.add(id(drafter))
                    if _same_vocab(drafter.tokenizer, drafter.target_tokenizer):
                        self.drafters[i] = drafter = ModelDrafter(drafter.model, name=drafter.name)
            elif type(drafter) in (ModelDrafter, EncoderDecoderDrafter) and self.entries[i] is drafter.model:
                draft_vocab = drafter.model.config.get_text_config().vocab_size
                if draft_vocab != target_vocab:
                    raise ValueError(
                        f"drafter {drafter.name!r} has vocab_size {draft_vocab} but the target has {target_vocab}. "
                        "If it uses another tokenizer, pass (model, tokenizer) so the pool translates tokens; if it "
                        "shares the target's tokenizer with a padded vocabulary, pass hf_spin.ModelDrafter(model)."
                    )
        for drafter in self.drafters:
            if isinstance(drafter, ModelDrafter):
                if self.cache_layout == "packed":
                    check_packed_support(drafter.model, f"drafter {drafter.name!r}")
                drafter.cache_layout = self.cache_layout
        self._build_planner(target, static or self.static)
        return self.drafters

    def _check_encoder_decoder(self, target) -> None:
        """Refuse what an encoder-decoder target cannot run with (docs/design.md, "Encoder-decoder targets")."""
        if self.cache_layout != "rectangular":
            raise ValueError(
                f"cache={self.cache_layout!r} is not supported for the encoder-decoder target "
                f"{target.config.model_type!r}: its rows' cross-attention K/V follow a rectangular cache; "
                "use cache='rectangular'"
            )
        for drafter in self.drafters:
            if isinstance(drafter, ModelDrafter) and type(drafter) not in (ModelDrafter, EncoderDecoderDrafter):
                raise ValueError(
                    f"drafter {drafter.name!r} ({type(drafter).__name__}) is not supported for the encoder-decoder "
                    f"target {target.config.model_type!r}; supported: an encoder-decoder model of its family, a "
                    "causal LM sharing its tokenizer, 'prompt_lookup', 'suffix'"
                )

    def _build_planner(self, target, static: StaticOptions | None) -> None:
        """The cost profile and planner for this target on this layout (`static`: the static layout's options,
        its compiled forwards measured where they compile): built on first meeting them (or injected)."""
        if self.profile == "off":
            return
        with self._lock:
            if self._profiled == (id(target), static) and self.planner is not None:
                return
            if not isinstance(self.profile, CostProfile):
                models = [d.model if isinstance(d, ModelDrafter) else None for d in self.drafters]
                on_static = [isinstance(d, ModelDrafter) and d.drafts_on_static for d in self.drafters]
                self.cost_profile = build_profile(target, models, self.names, self.profile, static, on_static)
            elif len(self.profile.drafters) != len(self.drafters):
                raise ValueError(
                    f"the CostProfile has {len(self.profile.drafters)} drafters, the pool {len(self.drafters)}"
                )
            self.cost_profile.target.widens = static is None  # the static layout verifies at its query bucket
            self.planner = Planner(self.cost_profile)  # warns once if nothing can pay here
            self.policy.attach_profile(self.cost_profile)
            self._profiled = (id(target), static)

    def snapshot(self) -> dict:
        """A copy of what the pool has learned across calls: the policy's statistics, the planner's
        acceptance estimates and row lengths, the cost profile's refinements. `restore` puts it
        back, e.g. to time several runs of one request from the same learned state. A drafter's own memory
        of earlier outputs (the suffix drafter's index) is not in it: `reset` forgets that."""
        return copy.deepcopy({"policy": self.policy, "planner": self.planner, "cost_profile": self.cost_profile})

    def restore(self, snapshot: dict) -> None:
        """Put back what `snapshot` copied (a copy of it: one snapshot restores any number of times)."""
        state = copy.deepcopy(snapshot)
        self.policy, self.planner, self.cost_profile = state["policy"], state["planner"], state["cost_profile"]

    def reset(self) -> None:
        """Forget what the drafters learned across calls (a suffix drafter's index of earlier outputs)."""
        for drafter in self.drafters:
            drafter.reset()

    def record(self, stats: GenerationStats) -> None:
        self.last_stats = stats
        for name, d in stats.drafters.items():
            self.totals.setdefault(name, DrafterStats()).merge(d)
