"""Forced models: random weights of the real shapes, run for their real cost, whose decisions are the recording's.

- `force(model, trace)`: a forward hook on a causal LM (any `transformers` model: `generate`, its prompt lookup,
  hf_spin's engine) that replaces its logits, on the device, by a large margin on the recorded next token. The
  logit at position p of a row of request r favours sequence_r[p + 1], so a lossless greedy loop commits exactly
  the recorded continuation, and a drafter's proposal is accepted exactly as far as it was in the recording. A
  position past a rejected draft token gets the same lookup: its logits are never read, as the greedy walk stops
  at the rejection.
- `ReplayDrafter`: a `ModelDrafter` over a random-weight model of the recorded drafter's config that catches up
  and drafts for cost, and proposes what the recording says the real drafter proposed there.

Which request a row is comes from the row's own tokens, never from a counter: a prefill (an empty cache) matches
each row's prompt against the trace's; later forwards keep the rows' order until the batch shrinks (hf_spin
retires finished rows, in order), when the rows left are matched to the earlier ones by their first token and its
position (the last committed token: on the recorded sequence) and by which rows could have finished; rows that fit
none on a cache other than the batch's (a cost-profile probe's random context) are unknown. Prefills back
to back are one batch prefilled in groups (docs/planning.md, "Prefill groups"), its rows put back in row order
before the next forward: each row's first token after its prompt tells whose it is. Past an
EOS the lookup reads the recorded tail (what the real target predicted there). Rows joining
a running batch (the server's continuous batching) are not supported: a prefill starts a new batch.
"""

from __future__ import annotations

import weakref

import torch
from transformers import CONFIG_MAPPING, AutoModelForCausalLM

from hf_spin.cache import CACHE_NAMES, RectangularCache
from hf_spin.cache.forward import FILLER_TOKEN
from hf_spin.drafters import Draft, DraftRequest, ModelDrafter
from hf_spin.verify.token_tree import TokenTree

from .trace import DrafterRecord, Trace

MARGIN = 100.0  # the forced token's logit; every other logit is tanh of the model's own, in (-1, 1)
UNKNOWN = -1  # a row whose prompt is not in the trace (a cost-profile probe): its forced token is 0
ROW_BUFFER = 1024  # rows the device map of rows to requests holds; a forward of more rows reads them all as unknown


def build_model(config: dict, dtype: torch.dtype, device: str | torch.device, seed: int = 0):
    """A random-weight causal LM of `config` (a config's `to_dict()`), in eval mode: the real shape's cost."""
    cfg = CONFIG_MAPPING[config["model_type"]].from_dict(config)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    return model


class ForcedTarget:
    """The hook `force` installs (module docstring). shift: look up the token `shift` positions later (a
    deliberately wrong target: the check's lossy control); 0 replays the recording."""

    def __init__(self, model, trace: Trace, shift: int = 0):
        self.trace, self.shift = trace, shift
        self.sequences = [r.sequence for r in trace.requests]
        device = model.device
        width = max(len(r.sequence) + len(r.tail) for r in trace.requests)
        table = torch.zeros(len(self.sequences) + 1, width, dtype=torch.long)  # [R + 1, L]; the last row: UNKNOWN
        lengths = torch.ones(len(self.sequences) + 1, dtype=torch.long)  # [R + 1]
        for r, req in enumerate(trace.requests):  # past an EOS, the recorded tail
            table[r, : len(req.sequence) + len(req.tail)] = torch.tensor(req.sequence + req.tail)
            lengths[r] = len(req.sequence) + len(req.tail)
        # buffers, so a compiled forward (generate's static cache) reads them as graph inputs; the row map is
        # updated in place (`_track`): a captured CUDA graph replays over the addresses it was captured with
        model.register_buffer("replay_table", table.to(device), persistent=False)
        model.register_buffer("replay_lengths", lengths.to(device), persistent=False)
        unknown = torch.full((ROW_BUFFER,), len(self.sequences), dtype=torch.long, device=device)  # [M]
        model.register_buffer("replay_rows", unknown, persistent=False)  # [M] the request of row b, b < count
        model.register_buffer("replay_count", torch.zeros((), dtype=torch.long, device=device), persistent=False)
        self.requests: list[int] = []  # [B] the trace's request of each row of the running batch
        # the latest forward's rows: its (ids, positions, packed metadata or None) on the device, or after a
        # prefill [B] (last prompt token, its position, 1) on the host
        self.last: tuple | list = []
        self.prefills: list[tuple[list[int], list]] = []  # (requests, last) of each prefill back to back so far
        self.buffered: list[int] = []  # what module.replay_rows holds
        self.expected: list[int] | None = None  # the next call's batch, where the caller says (`expect`)
        self.pending: list[int] | None = None  # the batch's map, written after a prefill group's own forward
        self.cache = lambda: None  # a weak reference to the latest forward's cache
        self.handles = (
            model.register_forward_pre_hook(self._before_forward, with_kwargs=True),
            model.register_forward_hook(self._after_forward, with_kwargs=True),
        )

    def expect(self, requests: list[int] | None) -> None:
        """The requests of the next `generate` call's rows, in row order (a benchmark's batch), or None. A batch
        prefilled in groups (docs/planning.md, "Prefill groups") is told apart from separate batches by the first
        forward after its groups; a static layout's forwards replayed from CUDA graphs run no hook, so there the
        map of rows to requests after a prefill group is the expected batch (its slots hold the rows in row order)."""
        self.expected = list(requests) if requests is not None else None

    # -- the logits ---------------------------------------------------------------------------------------
    @staticmethod
    def _inputs(args, kwargs):
        """(ids [B, T] or [1, total] packed, positions of the same shape, packed rows' metadata or None)."""
        ids = kwargs.get("input_ids", args[0] if args else None)
        positions = kwargs.get("position_ids")
        if positions is None:
            positions = kwargs["cache_position"][None]
        return ids, positions.expand(ids.shape[0], -1), kwargs.get("spin_varlen")

    def _before_forward(self, module, args, kwargs) -> None:
        if not torch.compiler.is_compiling():  # a compiled decode step: rows as the eager prefill left them
            self._track(module, *self._inputs(args, kwargs), kwargs)

    def _after_forward(self, module, args, kwargs, output):
        ids, positions, meta = self._inputs(args, kwargs)
        rows = module.replay_rows  # [M] request per row (R: unknown)
        if meta is not None:  # [1, total]: the row of each packed token
            slot = torch.arange(ids.shape[1], device=ids.device)
            rows = rows[torch.searchsorted(meta.cu_seqlens_q[1:].long(), slot, right=True)][None]  # [1, total]
        else:
            B = ids.shape[0]
            unknown = torch.full_like(ids[:, 0], len(self.sequences))  # [B]
            if B <= ROW_BUFFER:  # on the device: rows no pre-hook tracked (a profile probe, compiled) are unknown
                unknown = torch.where(module.replay_count == B, rows[:B], unknown)
            rows = unknown[:, None].expand_as(ids)  # [B, T]
        keep = kwargs.get("logits_to_keep", 0)
        if isinstance(keep, int):
            rows, positions = (rows[:, -keep:], positions[:, -keep:]) if keep else (rows, positions)
        else:
            rows, positions = rows[:, keep], positions[:, keep]
        at = torch.minimum(positions + 1 + self.shift, module.replay_lengths[rows] - 1).clamp(min=0)
        forced = module.replay_table[rows, at]  # [B, T'] the recorded next token
        logits = torch.tanh(output.logits)  # the model's own, bounded: the forward's cost stays in the graph
        output.logits = logits.scatter(-1, forced[..., None], MARGIN)
        if self.pending is not None:  # after a prefill group: the whole batch, for forwards that run no hook
            self._write_rows(module, self.pending)
            self.pending = None
        return output

    # -- which row is which request -----------------------------------------------------------------------
    def _track(self, module, ids, positions, meta, kwargs) -> None:
        """Keep `requests` ([B] the request of each row) right for this forward, and `module.replay_rows` with it."""
        cache = next((kwargs[n] for n in CACHE_NAMES if kwargs.get(n) is not None), None)
        starts = meta.cu_seqlens_q[:-1].long() if meta is not None else None  # [B] each packed row's first token
        first_ids = ids[:, 0] if meta is None else ids[0, starts]  # [B] on the device
        first_positions = positions[:, 0] if meta is None else positions[0, starts]  # [B]
        fillers = 0
        if cache is None or int(cache.get_seq_length()) == 0:
            self._prefill(ids, positions, meta)
            known = self.expected is not None and set(self.requests) <= set(self.expected)
            self.pending = [self._row(r) for r in self.expected] if known else None
        else:
            fillers = self._fillers(first_ids, first_positions) if type(cache) is RectangularCache else 0
            B = len(first_ids) - fillers  # the batch's rows, the fillers after them
            ids, positions, first_ids, first_positions = ids[:B], positions[:B], first_ids[:B], first_positions[:B]
            if len(first_ids) > len(self.requests):
                grouped = self._groups_holding(len(first_ids))
                if grouped is not None and self._expected_batch(grouped[0]):
                    # the caller's batch, in row order: what the forwards since its groups read (`pending`); a
                    # hook may first run steps later (a graph captured mid-call), its rows then past the groups'
                    self.requests = list(self.expected)
                elif grouped is not None:  # one batch prefilled in groups, now in row order
                    self._regroup(*grouped, list(zip(first_ids.tolist(), first_positions.tolist())))
                else:  # rows that no prefill showed (a cost-profile probe)
                    self.requests = [UNKNOWN] * len(first_ids)
            elif len(first_ids) < len(self.requests):
                now = list(zip(first_ids.tolist(), first_positions.tolist()))
                try:
                    self.requests = match(self._before(), now, self.requests, self.sequences)
                except RuntimeError:
                    if self.cache() is cache:
                        raise
                    self.requests = [UNKNOWN] * len(first_ids)  # a cache the rows never ran on (a profile probe)
            self.last = (ids, positions, meta)
            self.prefills = []
        self.cache = weakref.ref(cache) if cache is not None else lambda: None
        self._write_rows(module, [self._row(r) for r in self.requests + [UNKNOWN] * fillers])

    @staticmethod
    def _fillers(first_ids, first_positions) -> int:
        """How many of a rectangular cache's forward's last rows are filler rows (a plain step run beside rows that
        hold nothing, `SpinEngine._filler_rows`, dropped after it): fed one filler token at position 0, where no row
        of a running batch is. Read on the host: not on a layout whose forwards a CUDA graph captures."""
        rows = list(zip(first_ids.tolist(), first_positions.tolist()))
        n = 0
        while n < len(rows) and rows[-1 - n] == (FILLER_TOKEN, 0):
            n += 1
        return n

    def _expected_batch(self, requests: list[int]) -> bool:
        """Whether the caller said which batch this is (`expect`) and `requests`, a batch's groups, are its rows."""
        return self.expected is not None and sorted(requests) == sorted(self.expected)

    def _row(self, request: int) -> int:
        """A request's row of the device table (the last one for UNKNOWN)."""
        return request if request != UNKNOWN else len(self.sequences)

    def _write_rows(self, module, rows: list[int]) -> None:
        """`module.replay_rows` and `replay_count` to hold `rows`, in place (a captured CUDA graph reads these
        addresses), outside any capture: rows change at a prefill or a retirement, in eager forwards."""
        rows = rows[:ROW_BUFFER]
        if rows != self.buffered:
            module.replay_rows[: len(rows)].copy_(torch.tensor(rows))
            module.replay_count.fill_(len(rows))
            self.buffered = rows

    def _prefill(self, ids, positions, meta) -> None:
        """A forward on an empty cache: each row's tokens start with its prompt. Left padding comes first, so a
        row's tokens are its last (last position + 1) ones, whatever the mask's format (2D, 4D, none)."""
        if meta is not None:
            cu = meta.cu_seqlens_q.tolist()
            rows, last = (
                [ids[0, a:b].tolist() for a, b in zip(cu[:-1], cu[1:])],
                positions[0, meta.cu_seqlens_q[1:] - 1],
            )
        else:
            rows, last = ids.tolist(), positions[:, -1]
        prompts = [row[len(row) - n - 1 :] for row, n in zip(rows, last.tolist())]
        # a prompt, or a prompt and drafts (transformers' assisted decoding has no separate prefill)
        requests = [UNKNOWN if (r := self.trace.request_of(p)) is None else r for p in prompts]
        last = [(p[-1] if p else 0, len(p) - 1, 1) for p in prompts]  # the next forward starts after these
        self.requests, self.last = requests, last
        self.prefills.append((requests, last))

    def _groups_holding(self, rows: int) -> tuple[list[int], list] | None:
        """(requests, last) of the latest prefills back to back, in the groups' order, where two or more of them
        hold `rows` rows together (one batch prefilled in groups); None where they do not."""
        taken, total = [], 0
        for group in reversed(self.prefills):
            if total >= rows:
                break
            taken.insert(0, group)
            total += len(group[0])
        if len(taken) < 2 or total != rows:
            return None
        return [r for requests, _ in taken for r in requests], [x for _, last in taken for x in last]

    def _regroup(self, requests: list[int], last: list, now: list[tuple[int, int]]) -> None:
        """Set `requests` and `last` from rows prefilled in groups (theirs, in the groups' order) in the order of the
        forward after them: `now` [B] each row's first token and its position, its first committed one, which the
        recording of the row's request holds right after its prompt."""
        left, order = list(range(len(requests))), []
        for token, pos in now:

            def fits(i: int, token=token, pos=pos) -> bool:
                r = requests[i]
                return (
                    r != UNKNOWN
                    and last[i][1] + 1 == pos
                    and pos < len(self.sequences[r])
                    and self.sequences[r][pos] == token
                )

            i = next((i for i in left if fits(i)), None)
            i = i if i is not None else next((i for i in left if requests[i] == UNKNOWN), left[0])
            left.remove(i)
            order.append(i)
        self.requests, self.last = [requests[i] for i in order], [last[i] for i in order]

    def _before(self) -> list[tuple[int, int, int]]:
        """[B] (first token, its position, reach) of each row in the latest forward (read when rows leave). reach:
        how far past its first position the row can have committed: 1 + the depths d = 1, 2, ... at which some
        slot at position + d holds the recorded token there (a chain's accepted drafts exactly; a tree's accepted
        path, or more where matching nodes lie on different branches), so rows whose recorded texts agree so far
        (repeated-schema requests) are told apart by which of them could have ended."""
        if isinstance(self.last, list):
            return self.last
        ids, positions, meta = self.last
        if meta is None:
            rows, places = ids.tolist(), positions.tolist()
        else:
            cu = meta.cu_seqlens_q.tolist()
            flat, at = ids[0].tolist(), positions[0].tolist()
            rows, places = [flat[a:b] for a, b in zip(cu[:-1], cu[1:])], [at[a:b] for a, b in zip(cu[:-1], cu[1:])]
        out = []
        for r, row, place in zip(self.requests, rows, places):
            p0, reach = place[0], len(row)
            if r != UNKNOWN:
                seq, held, reach = self.sequences[r], set(zip(place, row)), 1
                while p0 + reach < len(seq) and (p0 + reach, seq[p0 + reach]) in held:
                    reach += 1
            out.append((row[0], p0, reach))
        return out


def match(
    before: list[tuple[int, int, int]], now: list[tuple[int, int]], requests: list[int], sequences: list[list[int]]
) -> list[int]:
    """The requests of the rows left after rows retired: `now` ([B] each row's first token and its position, the
    row's last committed token) against `before` ([B0] the latest forward's rows: first token, position, reach,
    with `requests` [B0]). Rows keep their order; row i may be earlier row j if j's recorded sequence holds i's token
    at i's position, one j's last forward could have reached, short of its end. Of the assignments that fit, the
    one whose retired rows could have reached their recorded end (EOS, or the recording's max_new_tokens) wins;
    a row may also have stopped earlier (a smaller max_new_tokens). Example: sequences [0..13] and [0..39], before
    [(10, 10, 4), (10, 10, 4)], now [(12, 12)]: both fit, but only the first could have reached its end (at 13),
    so the row left is the second.
    """
    B0, B = len(before), len(now)
    if all(r == UNKNOWN for r in requests):
        return [UNKNOWN] * B

    def fits(i: int, j: int) -> bool:
        r, (token, pos), (_, p0, reach) = requests[j], now[i], before[j]
        return r != UNKNOWN and p0 < pos <= p0 + reach and pos < len(sequences[r]) - 1 and sequences[r][pos] == token

    def early(j: int) -> int:
        """1 if row j's retiring needs it to have stopped short of its recorded end, else 0."""
        r, (_, p0, reach) = requests[j], before[j]
        return int(r != UNKNOWN and p0 + reach + 1 < len(sequences[r]))

    # cost[i][j]: the fewest early stops for rows i.. to be earlier rows j.. (in order); B0 + 1: impossible
    impossible = B0 + 1
    cost = [[impossible] * (B0 + 1) for _ in range(B + 1)]
    cost[B][B0] = 0
    for j in range(B0 - 1, -1, -1):
        cost[B][j] = cost[B][j + 1] + early(j)
    for i in range(B - 1, -1, -1):
        for j in range(B0 - 1, -1, -1):
            take = cost[i + 1][j + 1] if fits(i, j) else impossible
            cost[i][j] = min(take, cost[i][j + 1] + early(j), impossible)
    if cost[0][0] >= impossible:
        raise RuntimeError(
            f"the forced target lost its rows: {B0} rows ({requests}) became {B} starting at (token, position) {now}, "
            "and no order-keeping choice of them fits the recorded sequences"
        )
    out, j = [], 0
    for i in range(B):
        while not (fits(i, j) and cost[i + 1][j + 1] == cost[i][j]):
            j += 1  # a row that retired
        out.append(requests[j])
        j += 1
    return out


class ReplayDrafter(ModelDrafter):
    """A recorded model drafter: proposes what the real one proposed at the row's position of its request (the
    chain, or where the step takes trees and the drafter grew them, its tree), and pays for it by running a
    random-weight model of the real one's config as the real one runs its own: the catch-up forward (rollback of
    rejected drafts included), then one forward a drafted token but the last. A tree's frontier (up to
    tree_width nodes a depth) is fed as its heaviest path, one token a depth; a translating drafter runs on the
    target's ids (mod its vocabulary), without its tokenizers' host work.

    The recording holds each position's draft at the k a fixed-length step asks there (trace.room_k) and the
    recorded confidence stop: exact for those. A shorter k takes the chain's prefix (exact for a same-tokenizer
    chain: a greedy chain's prefix is the shorter chain) and the tree's top depths cut to tree_width x k nodes (a
    translating drafter re-translating a shorter draft, or a shorter tree grown afresh, may differ).
    """

    def __init__(self, model, trace: Trace, record: DrafterRecord):
        super().__init__(model, name=record.name, tree_width=record.tree_width)
        self.trace, self.record = trace, record
        self.kind = record.kind
        self.gives_q = record.kind == "model"  # as the real one tells policies; its replayed drafts are one-hot
        self.num_parameters = record.num_parameters
        self.cost_vocab = model.config.get_text_config().vocab_size
        self.known: dict[int, int] = {}  # id of a row's sequence list -> its request

    def start(self, target, sequences: list[list[int]], target_cache=None) -> None:
        super().start(target, sequences, target_cache)
        self.known = {}

    def to_draft_space(self, sequence: list[int]) -> list[int]:
        return [t % self.cost_vocab for t in sequence]  # the stand-in's ids: as many tokens, any ids cost alike

    @torch.no_grad()
    def draft(self, request: DraftRequest) -> Draft:
        n = len(request.rows)
        if max(request.k, default=0) == 0:
            return Draft(tokens=[[] for _ in range(n)], q=[None] * n)
        self._catch_up(request.rows, request.sequences)
        trees = self.trees(request)
        proposals = [self.proposal(request.sequences[row], k, trees) for row, k in zip(request.rows, request.k)]
        fed = {row: chain[:-1] for row, (chain, _) in zip(request.rows, proposals)}  # what the real drafter fed
        for depth in range(max(map(len, fed.values()))):
            chunks = [[] for _ in self.cached]
            for row, tokens in fed.items():
                if depth < len(tokens):
                    chunks[row] = [tokens[depth] % self.cost_vocab]
                    self.cached[row].append(chunks[row][0])
            self._forward(chunks, None)
        trees = [tree for _, tree in proposals] if trees else None
        return Draft(tokens=[chain for chain, _ in proposals], q=[None] * n, trees=trees)

    def trees(self, request: DraftRequest) -> bool:
        """Whether the real drafter grew a tree here: the step takes them, it recorded trees, and the rule of
        `ModelDrafter.grows_trees` holds on this layout (packed rows: chains)."""
        return request.trees and self.record.trees is not None and self.grows_trees()

    def proposal(self, sequence: list[int], k: int, trees: bool) -> tuple[list[int], TokenTree | None]:
        """(the chain, the tree or None) the recording says this drafter proposed after `sequence`, cut to k."""
        r = self.known.get(id(sequence))
        if r is None or sequence[: len(self.trace.requests[r].prompt)] != self.trace.requests[r].prompt:
            r = self.trace.request_of(sequence)
            if r is None:
                raise ValueError(
                    f"drafter {self.name!r}: a row of {len(sequence)} tokens whose prompt is not in the trace"
                )
            self.known[id(sequence)] = r
        req = self.trace.requests[r]
        g = len(sequence) - len(req.prompt)
        if g >= len(req.continuation) or (g > 0 and sequence[-1] != req.continuation[g - 1]):
            raise ValueError(
                f"drafter {self.name!r}: request {req.id!r} after {g} generated tokens is not on its recorded "
                f"continuation of {len(req.continuation)} (the target is not replaying the trace)"
            )
        if not trees:
            return self.trace.chain(self.record, r, g)[:k], None
        chain, tree = self.trace.tree(self.record, r, g)
        if tree is not None and k < self.trace.room_k(g):
            depths = tree.depths()
            shallow = sum(d <= k for d in depths)
            tree = tree.pruned(
                min(shallow, self.tree_width * k), by=[w if d <= k else -1.0 for w, d in zip(tree.weights, depths)]
            )
        return chain[:k], tree


def force(model, trace: Trace, shift: int = 0) -> ForcedTarget:
    """Make `model`'s greedy decisions the trace's (module docstring); its generation config takes the recorded
    EOS and pad ids. Returns the hooks' owner (removing its `handles` undoes it)."""
    model.generation_config.eos_token_id = trace.target["eos_token_id"]
    model.generation_config.pad_token_id = trace.target["pad_token_id"]
    return ForcedTarget(model, trace, shift)


def replay_drafters(trace: Trace, dtype: torch.dtype, device: str | torch.device, reshape=None) -> list:
    """Pool entries standing in for the trace's drafters, in its order: a `ReplayDrafter` per model drafter (its
    stand-in seeded by its index, of the recorded config or of reshape(config)), the name of each live one (a pool
    makes it afresh)."""
    reshape = reshape or (lambda config: config)
    return [
        d.kind if d.live else ReplayDrafter(build_model(reshape(d.config), dtype, device, seed=i + 1), trace, d)
        for i, d in enumerate(trace.drafters)
    ]
