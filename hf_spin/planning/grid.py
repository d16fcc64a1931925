"""The grid: measuring a model's `ForwardCost` on the machine in front of us (docs/planning.md, "The cost profile").

    cost = measure(model, budget=GRID_BUDGET)   # forwards over 1, 8, 2, 32, ... new tokens, timed

Each point is a forward over N new tokens after GRID_CONTEXT positions of random KV (no prefill: on a slow
machine one would overrun the budget), on the path the engine runs: the eager dynamic cache, or the static
layout's fixed-shape forward (compiled or not) at its query width. `profiling.py` caches what this measures;
`cost_profile.py` is what is measured and how it is refined online.
"""

from __future__ import annotations

import statistics
from time import perf_counter
from typing import Callable

import torch
from transformers.modeling_outputs import BaseModelOutput

from ..cache.encoder_rows import reads_encoder_output
from ..cache.forward import CACHE_ARG
from ..cache.static import StaticRowCache
from ..cache.static_forward import forward_static
from ..host_syncs import wait_for
from .cost_profile import ForwardCost

# Context (prompt tokens) the grid is measured at: a short chat prompt.
GRID_CONTEXT = 128
# Forward positions of the grid, in the order measured: the budget may stop it after any of them but the
# first GRID_MIN_POINTS, and (eager) but a point past a grid whose last knots fall. 1, 8 (a draft's usual
# verify width) and 2 come first, so a slow machine's short grid brackets the widths drafting uses and resolves
# the step from one token to two; 32 next, what a batch of 4 verifies. Extrapolating 1 and 2 read an AMD EPYC
# in float32 (M = 1 a GEMV, M >= 2 a GEMM: 431 / 913 / 935 / 897 ms for 1 / 2 / 4 / 8 tokens) as 8 tokens at
# 8.8 plain steps, 2.1 in truth; 1 and 8 alone read a one-token probe (N = 2) at 1.2 steps, 2.1 in truth.
GRID_TOKENS = (1, 8, 2, 32, 4, 16, 64)
GRID_MIN_POINTS = 3
# What the grid measures, in the profile cache's key: raise it when `measure` changes, so a cost measured the
# old way is measured again (2: the point past knots that fall; 3: falls confirmed, `_confirm_falls`).
GRID_VERSION = 3
# Times each knot that takes part in a fall (a wider knot read cheaper than a narrower one) is timed again, in turns.
FALL_REPEATS = 3
# Rows of the per-row overhead point (measured with one new token per row).
GRID_ROWS = 4
# Seconds the grid of the target may take (beyond its first two points, always measured); a drafter
# gets half: its forwards are mostly over one token a row.
GRID_BUDGET = 3.0


def _random_kv(model, rows: int, generator: torch.Generator):
    """Per layer, (keys, values) `[rows, H, GRID_CONTEXT, D]` of random KV in the model's dtype: the context
    the grid's forwards attend to, without the prefill (on a slow machine a prefill alone would overrun the
    budget)."""
    config = model.config.get_text_config()
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    for _ in range(config.num_hidden_layers):
        yield tuple(
            torch.randn(rows, heads, GRID_CONTEXT, head_dim, generator=generator).to(model.device, model.dtype)
            for _ in range(2)
        )


def _context_cache(model, rows: int, generator: torch.Generator):
    """A dynamic cache holding GRID_CONTEXT positions of random KV per layer."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    for layer, (k, v) in enumerate(_random_kv(model, rows, generator)):
        cache.update(k, v, layer)
    return cache


def _encoder_decoder_context(model, rows: int, generator: torch.Generator):
    """(the cache, the encoder output) of the grid of an encoder-decoder model (or a decoder reading an
    encoder's output): GRID_CONTEXT decoder positions prefilled over a random encoder output (Whisper's
    fixed length, else GRID_CONTEXT positions), whose cross-attention K/V the prefill computes once, as
    the engine's steps find them."""
    length = getattr(model.config, "max_source_positions", None) or GRID_CONTEXT
    hidden = torch.randn(rows, length, model.config.d_model, generator=generator).to(model.device, model.dtype)
    encoder = BaseModelOutput(last_hidden_state=hidden)
    context = torch.randint(0, model.config.vocab_size, (rows, GRID_CONTEXT), generator=generator).to(model.device)
    out = model(**{_ids_name(model): context}, encoder_outputs=encoder, use_cache=True, return_dict=True)
    return getattr(out, CACHE_ARG), encoder


def _ids_name(model) -> str:
    """The token ids' keyword: an encoder-decoder model's decoder ids, else (a decoder reading an encoder's
    output, `WhisperForCausalLM`) its input ids."""
    return "decoder_input_ids" if getattr(model.config, "is_encoder_decoder", False) else "input_ids"


def _grid_forward(model, cache, encoder, new: torch.Tensor) -> None:
    """One timed forward of the grid: `new` [rows, tokens] after the cache's GRID_CONTEXT positions."""
    position_ids = torch.arange(GRID_CONTEXT, GRID_CONTEXT + new.shape[1], device=new.device).expand(new.shape[0], -1)
    if encoder is None:
        model(input_ids=new, position_ids=position_ids, use_cache=True, **{CACHE_ARG: cache})
    else:
        model(**{_ids_name(model): new}, encoder_outputs=encoder, use_cache=True, **{CACHE_ARG: cache})


def _eager_point(model, rows: int, tokens: int, generator: torch.Generator):
    """(reset, forward) of one grid point on the eager path: `tokens` new tokens `[rows, tokens]` after
    GRID_CONTEXT positions of a dynamic cache (an encoder-decoder model's prefilled one), cropped back by reset."""
    if getattr(model.config, "is_encoder_decoder", False) or reads_encoder_output(model):
        cache, encoder = _encoder_decoder_context(model, rows, generator)
    else:
        cache, encoder = _context_cache(model, rows, generator), None
    vocab = model.config.get_text_config().vocab_size
    new = torch.randint(0, vocab, (rows, tokens), generator=generator).to(model.device)

    def reset() -> None:
        if cache.get_seq_length() > GRID_CONTEXT:
            cache.crop(GRID_CONTEXT - cache.get_seq_length())  # negative: tokens to drop

    return reset, lambda: _grid_forward(model, cache, encoder, new)


def _static_point(model, forward, width: int, rows: int, tokens: int, generator: torch.Generator):
    """(reset, forward) of one grid point on the static layout: `tokens` new tokens a row through
    `forward_static` with `forward` at the engine's query width `width`, on a StaticRowCache of
    `row_bucket(rows)` slots holding GRID_CONTEXT positions of random KV each (capacity: its first bucket), rolled
    back by reset. Runs once here, untimed: a compiled forward compiles its graph for these shapes (or finds one)."""
    cache = StaticRowCache(model.device)
    cache.add_empty_rows(rows)
    cache.reserve(GRID_CONTEXT + width)
    for layer, (k, v) in enumerate(_random_kv(model, cache.num_slots, generator)):
        cache.update(k, v, layer)  # written at positions 0 .. GRID_CONTEXT - 1 of every slot
    cache.advance([GRID_CONTEXT] * rows)
    vocab = model.config.get_text_config().vocab_size
    chunks = torch.randint(0, vocab, (rows, tokens), generator=generator).tolist()  # [rows, tokens]

    def reset() -> None:
        cache.rollback([GRID_CONTEXT] * rows)

    def run() -> None:
        forward_static(model, cache, chunks, forward, width)

    run()
    return reset, run


@torch.no_grad()
def warm_up(model) -> None:
    """One forward over one token after GRID_CONTEXT positions of random KV, on the eager path (the grid's first,
    untimed): a freshly loaded model's first forward reads its weights in (from_pretrained memory-maps safetensors
    on a CPU: a 0.5B model in float32 took 1.2-3.0 s more than its next forward from a cold disk cache, AMD EPYC)
    and makes its first allocations. A cost read from the cache is a warm model's, so each model it prices runs
    this first (`profiling.build_profile`); else a drafter's first probe costs seconds its price never saw."""
    _eager_point(model, 1, 1, torch.Generator().manual_seed(0))[1]()


@torch.no_grad()
def measure(
    model, budget: float = GRID_BUDGET, clock: Callable[[], float] = perf_counter, progress=None, static=None
) -> ForwardCost:
    """Measure a model's `ForwardCost` on the grid: forwards over N new tokens (in GRID_TOKENS' order:
    1, 8, then the widths between and beyond) after a context of GRID_CONTEXT positions (the cache
    cropped back after each), each timed twice and the faster kept (the first run pays allocations; the knots
    of a fall, a wider knot read cheaper than a narrower one, timed again in turns: `_confirm_falls`),
    skipping a point that would overrun `budget` seconds (a warm-up forward first, outside the budget;
    the first GRID_MIN_POINTS always run, and on the eager path a point past knots that fall: the curve would
    read flat there, a guess; `_past_a_fall`); then GRID_ROWS rows of one token for the per-row overhead.
    static: None (the eager path on a dynamic cache), or on the static layout (the forward, the query slots)
        the engine runs chunks of N tokens a row through (`static(N)`, compiled or not; None: an N the engine
        never runs, not measured): each point then goes through `forward_static` after an untimed run that
        compiles its graph (within the budget: compiling is what a point costs first). The per-row overhead
        is read from eager forwards there: a row bucket's graph would cost a compilation (half a minute for a
        1.5B model on a GPU) that a call at batch 1 never uses.
    `progress`: called with each point's description (a progress bar's update)."""
    device = model.device
    generator = torch.Generator().manual_seed(0)

    def timed(rows: int, tokens: int, eager: bool = False) -> float:
        if static is None or eager:
            reset, forward = _eager_point(model, rows, tokens, generator)
        else:
            reset, forward = _static_point(model, *static(tokens), rows, tokens, generator)
        best = float("inf")
        for _ in range(2):
            reset()
            wait_for(device)
            start = clock()
            forward()
            wait_for(device)
            best = min(best, clock() - start)
        if progress is not None:
            progress(f"{rows} x {tokens} tokens")
        return max(best, 1e-9)

    timed(1, 1)  # untimed warm-up: the first forward of a freshly loaded model pages its weights in
    started = clock()
    table: dict[int, float] = {}
    for n in GRID_TOKENS:
        if static is not None and static(n) is None:
            continue
        if len(table) >= GRID_MIN_POINTS:
            fit = ForwardCost.from_table(dict(sorted(table.items())))  # what is measured
            forced = static is None and _past_a_fall(fit, n)  # compiled, a point costs a graph first
            if clock() - started + 2 * fit.predict(n) > budget and not forced:  # two runs; a cheaper one may fit
                continue
        table[n] = timed(1, n)
    _confirm_falls(table, lambda n: timed(1, n))
    cost = ForwardCost.from_table(dict(sorted(table.items())))
    # always, whatever the budget: every batch > 1 decision reads it (on the static layout from eager forwards)
    if static is None:
        spread = timed(GRID_ROWS, 1) - cost.predict(GRID_ROWS)
    else:
        spread = timed(GRID_ROWS, 1, eager=True) - timed(1, GRID_ROWS, eager=True)
    cost.per_row = max(spread, 0.0) / (GRID_ROWS - 1)
    if getattr(model.config, "is_encoder_decoder", False):
        cost.encoder = _encoder_seconds(model, generator, clock)
    return cost


def _confirm_falls(table: dict[int, float], timed: Callable[[int], float]) -> None:
    """Time every knot that takes part in a fall (a wider knot read cheaper than a narrower one) FALL_REPEATS times
    again, the knots in turns (each time the faster of two runs), and read each at the median of those: a first
    reading taken while the machine was quieter does not decide alone, and the knots it is compared with are read
    over the same stretch of the machine's load. A fall decides widths: a plain step and a draft's
    verification run at a wider knot read cheaper (`ForwardCost.width`). Where the forwards are flat (a GPU, an AMX
    CPU in bf16) the faster of two runs reads a wider knot cheaper by chance: on an AMX Xeon 8 tokens read 198 ms
    against 228 for one, every plain step then ran 8 positions, and on a 709-token prompt their forwards cost 3-5%
    more than one position's. A real fall (an AMD EPYC in bf16: 192 / 172 ms for 1 / 2 tokens, one token a GEMV)
    stays."""
    knots = sorted(table)
    falls = {k for i, n in enumerate(knots) for m in knots[:i] if table[n] < table[m] for k in (m, n)}
    again: dict[int, list[float]] = {n: [] for n in falls}
    for _ in range(FALL_REPEATS):
        for n in sorted(falls):
            again[n].append(timed(n))
    for n, seconds in again.items():
        table[n] = statistics.median(seconds)


def _past_a_fall(fit: ForwardCost, n_tokens: int) -> bool:
    """Whether N lies past the last knot of a grid whose last knots fall, where `predict` reads the curve flat:
    a guess, measured even past the budget. 1, 8 and 2 read a 1.5B in float32 under the AVX2 emulation (AMD
    EPYC: 387 / 842 / 815 ms) flat beyond 8, so 4 rows of 5 tokens at 0.77 s, where they cost 1.23 s (32
    tokens: 1191 ms), and the default pool drafted at batch 4 for 0.91x plain."""
    return n_tokens > fit.knots[-1] and len(fit.knots) > 1 and fit.seconds[-1] <= fit.seconds[-2]


def _encoder_seconds(model, generator: torch.Generator, clock: Callable[[], float]) -> float:
    """Seconds of the model's encoder over one row of random input, the faster of two runs: Whisper's
    fixed-length features, else GRID_CONTEXT token ids."""
    config = model.config
    if model.main_input_name == "input_features":  # [1, mel bins, frames]: twice the encoder's positions
        frames = 2 * config.max_source_positions
        inputs = torch.randn(1, config.num_mel_bins, frames, generator=generator).to(model.device, model.dtype)
    else:  # [1, GRID_CONTEXT] token ids
        inputs = torch.randint(0, config.vocab_size, (1, GRID_CONTEXT), generator=generator).to(model.device)
    best = float("inf")
    for _ in range(2):
        wait_for(model.device)
        start = clock()
        model.get_encoder()(**{model.main_input_name: inputs})
        wait_for(model.device)
        best = min(best, clock() - start)
    return best
