"""The trace: what a recording with real weights saw, in one compressed .npz small enough to travel to a GPU
machine (no pickles: numpy arrays and one JSON header).

    header                 uint8, UTF-8 JSON: format version, the target and the drafters (name, kind, config,
                           parameter count, tree width), k_max, max_new_tokens, min_confidence, eos / pad ids, the
                           pools, the requests (id, workload, group), the check runs' step logs, the machine
    prompt_ids             int32 [sum P]   every request's prompt ids back to back; prompt_offsets int64 [R + 1]
    continuation_ids       int32 [sum C]   the target's greedy continuation (ending at EOS or max_new_tokens);
                           continuation_offsets int64 [R + 1]
    tail_ids               int32 [sum T]   past an EOS, the target's next k_max greedy tokens (EOS ignored): a draft
                           verified across a row's EOS is accepted by them; tail_offsets int64 [R + 1]
    chain_<d>              int32 [sum C, K]  drafter d's chain after g generated tokens of request r, at row
                           continuation_offsets[r] + g (g = 0 is never asked: the first token comes from the
                           prefill); -1 pads
    tree_tokens_<d>        int32 [sum C, N]  where drafter d grows token trees: its tree there (N = tree width x K),
    tree_parents_<d>       int16 [sum C, N]  parents (-1: the root), weights (path probabilities), and the tree's
    tree_weights_<d>       float64 [sum C, N]  heaviest path (`Draft.tokens` of a tree draft); -1 / 0 pad
    tree_chain_<d>         int32 [sum C, K]

A draft was recorded with k = min(k_max, max_new_tokens - g - 1), the k a step with a fixed draft length asks at
g (the row's room caps it), and the recorded confidence stop. Model-free drafters (prompt lookup, suffix) are not
recorded: they run live on the replayed ids. 48 requests x 128 tokens with a tree-growing drafter take ~2 MiB.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from hf_spin.verify.token_tree import TokenTree

FORMAT = 1  # bumped when the layout above changes; `load` refuses other versions
LIVE_KINDS = ("prompt_lookup", "suffix")  # drafters replayed by running them, not from the recording
PAD = -1  # pads token arrays past a draft's end


@dataclass
class Request:
    id: str
    workload: str  # spec_bench | multi_turn | schema | prompts
    group: str  # Spec-Bench task group, MT-Bench category and turn, record kind, or the prompts file's "group"
    prompt: list[int]
    continuation: list[int]  # the target's greedy tokens after the prompt
    tail: list[int] = field(default_factory=list)  # its greedy tokens after an EOS-ended continuation, EOS ignored

    @property
    def sequence(self) -> list[int]:
        return self.prompt + self.continuation


@dataclass
class DrafterRecord:
    """One drafter of the recording: what the replay needs to build it and, for model drafters, what it proposed.

    kind: "model", "translation" (another tokenizer) or one of LIVE_KINDS. config: the model's config (a dict) for
    the replay's random-weight stand-in, None for live drafters. chains / trees: None for live drafters; trees
    None where the drafter does not grow token trees."""

    name: str
    kind: str
    config: dict | None = None
    num_parameters: int = 0
    tree_width: int = 1
    chains: np.ndarray | None = None  # [sum C, K] int32
    trees: dict[str, np.ndarray] | None = None  # tokens, parents, weights [sum C, N]; chain [sum C, K]

    @property
    def live(self) -> bool:
        return self.kind in LIVE_KINDS

    def header(self) -> dict:
        return {
            "name": self.name,
            "kind": self.kind,
            "config": self.config,
            "num_parameters": self.num_parameters,
            "tree_width": self.tree_width,
            "trees": self.trees is not None,
        }


@dataclass
class Trace:
    target: dict  # name, config (dict), num_parameters, eos_token_id (list), pad_token_id
    drafters: list[DrafterRecord]
    requests: list[Request]
    k_max: int
    max_new_tokens: int
    min_confidence: float
    pools: dict[str, dict] = field(default_factory=dict)  # pool name -> {"drafters": [names], "policy": name}
    checks: list[dict] = field(default_factory=list)  # check runs (checks.py): config and step log
    env: dict = field(default_factory=dict)  # the recording machine, dtype, seconds per phase

    def __post_init__(self):
        self.offsets = np.cumsum([0] + [len(r.continuation) for r in self.requests])  # [R + 1]
        self.by_prompt = {tuple(r.prompt): i for i, r in enumerate(self.requests)}
        self.prompt_lengths = sorted({len(r.prompt) for r in self.requests}, reverse=True)  # longest first

    def drafter(self, name: str) -> DrafterRecord:
        for d in self.drafters:
            if d.name == name:
                return d
        raise KeyError(f"drafter {name!r} is not in the trace; it has {[d.name for d in self.drafters]}")

    def request_of(self, sequence: list[int]) -> int | None:
        """The request whose prompt `sequence` starts with, the longest such (a second turn's prompt starts with
        the first turn's), or None."""
        for n in self.prompt_lengths:
            if n <= len(sequence) and (r := self.by_prompt.get(tuple(sequence[:n]))) is not None:
                return r
        return None

    def room_k(self, g: int) -> int:
        """The k a draft after g generated tokens was recorded with."""
        return max(0, min(self.k_max, self.max_new_tokens - g - 1))

    # -- proposals --------------------------------------------------------------------------------------
    def chain(self, d: DrafterRecord, r: int, g: int) -> list[int]:
        row = d.chains[self.offsets[r] + g]
        return row[row != PAD].tolist()

    def tree(self, d: DrafterRecord, r: int, g: int) -> tuple[list[int], TokenTree | None]:
        """(the tree's heaviest path, the tree) drafter d grew after g generated tokens of request r."""
        at = self.offsets[r] + g
        tokens = d.trees["tokens"][at]
        n = int((tokens != PAD).sum())
        chain = d.trees["chain"][at]
        if n == 0:
            return chain[chain != PAD].tolist(), None
        tree = TokenTree(
            tokens=tokens[:n].tolist(),
            parents=d.trees["parents"][at, :n].tolist(),
            drafters=[0] * n,
            weights=d.trees["weights"][at, :n].tolist(),
            q=[None] * n,
            order=list(range(n)),
        )
        return chain[chain != PAD].tolist(), tree

    # -- file -------------------------------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        header = {
            "format": FORMAT,
            "target": self.target,
            "drafters": [d.header() for d in self.drafters],
            "requests": [{"id": r.id, "workload": r.workload, "group": r.group} for r in self.requests],
            "k_max": self.k_max,
            "max_new_tokens": self.max_new_tokens,
            "min_confidence": self.min_confidence,
            "pools": self.pools,
            "checks": self.checks,
            "env": self.env,
        }
        arrays = {
            "header": np.frombuffer(json.dumps(header).encode(), dtype=np.uint8),
            "prompt_ids": np.array([t for r in self.requests for t in r.prompt], dtype=np.int32),
            "prompt_offsets": np.cumsum([0] + [len(r.prompt) for r in self.requests]).astype(np.int64),
            "continuation_ids": np.array([t for r in self.requests for t in r.continuation], dtype=np.int32),
            "continuation_offsets": self.offsets.astype(np.int64),
            "tail_ids": np.array([t for r in self.requests for t in r.tail], dtype=np.int32),
            "tail_offsets": np.cumsum([0] + [len(r.tail) for r in self.requests]).astype(np.int64),
        }
        for i, d in enumerate(self.drafters):
            if d.chains is not None:
                arrays[f"chain_{i}"] = d.chains
            for key, value in (d.trees or {}).items():
                arrays[f"tree_{key}_{i}"] = value
        with open(path, "wb") as f:  # a file object: numpy would append ".npz" to a name without it
            np.savez_compressed(f, **arrays)
        return path


def load(path: str | Path) -> Trace:
    """The trace saved at `path` (`Trace.save`)."""
    with np.load(path, allow_pickle=False) as f:
        header = json.loads(f["header"].tobytes().decode())
        if header.get("format") != FORMAT:
            raise ValueError(f"{path} is a trace of format {header.get('format')!r}; this code reads format {FORMAT}")
        prompts = _split(f["prompt_ids"], f["prompt_offsets"])
        continuations = _split(f["continuation_ids"], f["continuation_offsets"])
        tails = _split(f["tail_ids"], f["tail_offsets"])
        drafters = []
        for i, d in enumerate(header["drafters"]):
            has_trees = d.pop("trees")
            record = DrafterRecord(**d)
            if not record.live:
                record.chains = f[f"chain_{i}"]
            if has_trees:
                record.trees = {key: f[f"tree_{key}_{i}"] for key in ("tokens", "parents", "weights", "chain")}
            drafters.append(record)
    requests = [
        Request(q["id"], q["workload"], q["group"], p, c, t)
        for q, p, c, t in zip(header["requests"], prompts, continuations, tails)
    ]
    return Trace(
        target=header["target"],
        drafters=drafters,
        requests=requests,
        k_max=header["k_max"],
        max_new_tokens=header["max_new_tokens"],
        min_confidence=header["min_confidence"],
        pools=header["pools"],
        checks=header["checks"],
        env=header["env"],
    )


def merge(traces: list[Trace]) -> Trace:
    """One trace of several recorded with the same target, drafters, pools and draft settings (the Spec-Bench
    trace and the multi-turn / schema one, replayed in one run): their requests in order. Check runs are kept
    only from a single trace (their step logs index its requests)."""
    first = traces[0]
    if len(traces) == 1:
        return first
    same = ("target", "k_max", "max_new_tokens", "min_confidence", "pools")
    for t in traces[1:]:
        differ = [f for f in same if getattr(t, f) != getattr(first, f)]
        differ += [] if [d.header() for d in t.drafters] == [d.header() for d in first.drafters] else ["drafters"]
        if differ:
            raise ValueError(f"traces recorded differently ({', '.join(differ)}) cannot be replayed as one")
    drafters = []
    for i, d in enumerate(first.drafters):
        parts = [t.drafters[i] for t in traces]
        chains = None if d.chains is None else np.concatenate([x.chains for x in parts])
        trees = None if d.trees is None else {k: np.concatenate([x.trees[k] for x in parts]) for k in d.trees}
        drafters.append(DrafterRecord(d.name, d.kind, d.config, d.num_parameters, d.tree_width, chains, trees))
    return Trace(
        target=first.target,
        drafters=drafters,
        requests=[r for t in traces for r in t.requests],
        k_max=first.k_max,
        max_new_tokens=first.max_new_tokens,
        min_confidence=first.min_confidence,
        pools=first.pools,
        env={"merged": [t.env for t in traces]},
    )


def compact(trace: Trace) -> tuple[Trace, int]:
    """(the trace with every token id renumbered 0..n-1 in id order, n): the same text to every drafter that
    matches ids (prompt lookup, suffix) and to the forced target, over a vocabulary of only the ids it holds, so a
    stand-in's per-position work over its vocabulary (logits, forcing) is a few thousand wide rather than the real
    model's ~150k. The configs are kept (the drafters' cost shares are the real models')."""
    special = [trace.target["pad_token_id"], *_as_list(trace.target["eos_token_id"])]
    tokens = [t for r in trace.requests for t in r.prompt + r.continuation + r.tail]
    drafted = [a for d in trace.drafters for a in [d.chains, *_tree_tokens(d.trees).values()] if a is not None]
    known = np.unique(np.concatenate([np.asarray(special + tokens, dtype=np.int64)] + [a[a != PAD] for a in drafted]))

    def renumber(values):  # ids -> their index in `known`; PAD stays in arrays
        if isinstance(values, np.ndarray):
            return np.where(values != PAD, np.searchsorted(known, values), PAD).astype(values.dtype)
        return np.searchsorted(known, np.asarray(values, dtype=np.int64)).tolist()

    eos = trace.target["eos_token_id"]
    target = {
        **trace.target,
        "eos_token_id": renumber(eos) if isinstance(eos, list) else renumber([eos])[0],
        "pad_token_id": renumber([trace.target["pad_token_id"]])[0],
    }
    drafters = [
        replace(
            d,
            chains=None if d.chains is None else renumber(d.chains),
            trees=None
            if d.trees is None
            else {**d.trees, **{k: renumber(v) for k, v in _tree_tokens(d.trees).items()}},
        )
        for d in trace.drafters
    ]
    requests = [
        replace(r, prompt=renumber(r.prompt), continuation=renumber(r.continuation), tail=renumber(r.tail))
        for r in trace.requests
    ]
    return replace(trace, target=target, drafters=drafters, requests=requests), len(known)


def _tree_tokens(trees: dict | None) -> dict:
    """The arrays of a drafter's recorded trees that hold token ids (parents and weights do not)."""
    return {k: v for k, v in (trees or {}).items() if k in ("tokens", "chain")}


def _as_list(value) -> list[int]:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _split(ids: np.ndarray, offsets: np.ndarray) -> list[list[int]]:
    return [ids[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:])]
