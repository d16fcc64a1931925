"""Record (CPU, real weights, float32): for every request, the target's greedy continuation, what each model
drafter proposes after every prefix of it, and the check runs (checks.py).

Greedy decoding commits the target's greedy tokens whatever a step verified, so a drafter's proposal depends only
on the committed prefix: recorded once per position (the drafter's own `draft` at batch 1, the k a fixed-length
step asks there, chain and token tree), it is what the drafter proposes there in any run of any policy.

`record` takes model objects (tests pass tiny random ones); `requests_from_workloads` builds the benchmark's
prompts with the target's tokenizer (multi-turn: turn 2 holds the recorded answer to turn 1).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

import hf_spin
from benchmarks import workloads
from benchmarks.common import machine
from hf_spin.cache import CACHE_ARG
from hf_spin.drafters import DraftRequest, ModelDrafter, PromptLookupDrafter, SuffixDrafter, TranslatingDrafter
from hf_spin.models import load
from hf_spin.policies import DEFAULT_MIN_CONFIDENCE

from .checks import DEFAULT_CHECKS, CheckConfig, run_check
from .trace import PAD, DrafterRecord, Request, Trace

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
# the default pool, then the LBSS pool: the 0.5B, SmolLM2 (token translation), prompt lookup, suffix drafting
DEFAULT_POOL = ("qwen2.5-coder-0.5b-instruct",)
LBSS_POOL = ("qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct", "prompt_lookup", "suffix")


def continuation(target, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The target's greedy tokens after `prompt` (batch 1, plain `generate`), up to and with EOS."""
    ids = torch.tensor([prompt], device=target.device)
    out = target.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False
    )
    eos = target.generation_config.eos_token_id
    eos = eos if isinstance(eos, list) else [eos]
    tokens = out[0, len(prompt) :].tolist()
    return tokens[: next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))]


@torch.no_grad()
def tail(target, sequence: list[int], n: int) -> list[int]:
    """The target's n greedy tokens after `sequence`, EOS ignored: what a verification reads past a row's EOS
    (a draft that runs across it is accepted as far as the target would go on)."""
    cache = DynamicCache(config=target.config)
    ids, out = torch.tensor([sequence], device=target.device), []
    for _ in range(n):
        logits = target(input_ids=ids, use_cache=True, **{CACHE_ARG: cache}).logits  # [1, T, V]
        out.append(int(logits[0, -1].argmax()))
        ids = torch.tensor([[out[-1]]], device=target.device)
    return out


def kind_of(drafter) -> str:
    if isinstance(drafter, TranslatingDrafter):
        return "translation"
    if isinstance(drafter, ModelDrafter):
        return "model"
    if isinstance(drafter, (PromptLookupDrafter, SuffixDrafter)):
        return drafter.kind
    raise TypeError(
        f"cannot record drafter {drafter.name!r} ({type(drafter).__name__}); supported: model drafters (same or "
        "another tokenizer), prompt lookup, suffix drafting"
    )


@torch.no_grad()
def record_drafts(drafter, name: str, target, trace: Trace) -> DrafterRecord:
    """What a model drafter proposes after each prefix of each recorded continuation (trace.py's arrays)."""
    kind = kind_of(drafter)
    rec = DrafterRecord(name, kind)
    if rec.live:
        return rec
    rec.config, rec.num_parameters, rec.tree_width = drafter.model.config.to_dict(), drafter.num_parameters, 1
    positions, K = int(trace.offsets[-1]), trace.k_max
    rec.chains = np.full((positions, K), PAD, dtype=np.int32)
    for r, req in enumerate(tqdm(trace.requests, desc=f"drafts of {name}", leave=False)):
        drafter.start(target, [req.prompt])
        if r == 0 and drafter.grows_trees():
            rec.tree_width = drafter.tree_width
            N = drafter.tree_width * K
            rec.trees = {
                "tokens": np.full((positions, N), PAD, dtype=np.int32),
                "parents": np.full((positions, N), PAD, dtype=np.int16),
                "weights": np.zeros((positions, N), dtype=np.float64),
                "chain": np.full((positions, K), PAD, dtype=np.int32),
            }
        for g in range(1, len(req.continuation)):
            k, at = trace.room_k(g), trace.offsets[r] + g
            if k == 0:
                continue
            ask = DraftRequest([0], [req.prompt + req.continuation[:g]], [k], False, None, trace.min_confidence)
            chain = drafter.draft(ask).tokens[0]
            rec.chains[at, : len(chain)] = chain
            if rec.trees is not None:
                ask.trees = True
                draft = drafter.draft(ask)
                rec.trees["chain"][at, : len(draft.tokens[0])] = draft.tokens[0]
                if draft.trees and draft.trees[0] is not None:
                    tree = draft.trees[0]
                    rec.trees["tokens"][at, : len(tree)] = tree.tokens
                    rec.trees["parents"][at, : len(tree)] = tree.parents
                    rec.trees["weights"][at, : len(tree)] = tree.weights
        drafter.finish()
    return rec


def record(
    target,
    drafters: list,
    requests: list[Request],
    max_new_tokens: int,
    k_max: int = 8,
    checks: tuple[CheckConfig, ...] = DEFAULT_CHECKS,
    tokenizer=None,
    target_name: str | None = None,
    pools: dict[str, dict] | None = None,
    min_confidence: float = DEFAULT_MIN_CONFIDENCE,
) -> Trace:
    """The trace of `target` and these drafters (pool entries: models, (model, tokenizer) pairs, "prompt_lookup",
    "suffix") over `requests`; a request with an empty continuation gets the target's (plain greedy `generate`).
    pools: name -> {"drafters": [names], "policy": name}, what `run` replays; default one "all" pool, LBSS."""
    seconds = {}
    start = time.perf_counter()
    eos = target.generation_config.eos_token_id
    eos = eos if isinstance(eos, list) else [eos]
    for req in tqdm(requests, desc="continuations", leave=False):
        req.continuation = req.continuation or continuation(target, req.prompt, max_new_tokens)
        if req.continuation[-1] in eos:
            req.tail = tail(target, req.sequence, k_max)
    seconds["continuations"] = time.perf_counter() - start
    pool = hf_spin.AssistantPool(list(drafters), tokenizer=tokenizer, profile="off")
    bound = pool.bind(target, tokenizer)
    trace = Trace(
        target={
            "name": target_name or target.config.name_or_path,
            "config": target.config.to_dict(),
            "num_parameters": target.num_parameters(),
            "eos_token_id": eos,
            "pad_token_id": target.generation_config.pad_token_id,
        },
        drafters=[],
        requests=requests,
        k_max=k_max,
        max_new_tokens=max_new_tokens,
        min_confidence=min_confidence,
        pools=pools or {"all": {"drafters": pool.names, "policy": "lbss"}},
    )
    start = time.perf_counter()
    trace.drafters = [record_drafts(d, name, target, trace) for d, name in zip(bound, pool.names)]
    seconds["drafts"] = time.perf_counter() - start
    for config in tqdm(checks, desc="checks"):
        start = time.perf_counter()
        log = run_check(target, bound, requests, config, k_max, min_confidence, max_new_tokens, tokenizer=tokenizer)
        seconds[f"check {config.name}"] = time.perf_counter() - start
        if log["differ"]:
            raise RuntimeError(
                f"check {config.name}: hf_spin's output differs from plain greedy on requests {log['differ']}"
            )
        trace.checks.append(log)
    trace.env = {**machine(), "dtype": str(target.dtype).removeprefix("torch."), "seconds": seconds}
    return trace


# --- the benchmark's prompts ---------------------------------------------------------------------------


def encode(tokenizer, chat: list[dict]) -> list[int]:
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    return tokenizer(text)["input_ids"]


def requests_from_workloads(args, target, tokenizer) -> list[Request]:
    """The requests of `args.workloads` (spec_bench, multi_turn, schema) and of `args.prompts` (jsonl, one
    {"prompt": ..., optional "id", "group"} a line), in that order; multi-turn conversations get their turn-1
    continuations here, as turn 2's prompt holds the answer."""
    out: list[Request] = []
    for name in args.workloads:
        if name == "spec_bench":
            convs = workloads.spec_bench(args.questions, args.per_group)
        elif name == "multi_turn":
            convs = workloads.multi_turn(args.questions, args.per_group)
        elif name == "schema":
            convs = workloads.schema(args.schema_requests)
        else:
            raise ValueError(f"workload {name!r} is not supported; give some of {workloads.WORKLOADS}")
        for conv in tqdm(convs, desc=name, leave=False):
            answers: list[str] = []
            for turn in range(len(conv.turns)):
                req = Request(
                    conv.id if len(conv.turns) == 1 else f"{conv.id}/turn{turn + 1}",
                    name,
                    conv.group if len(conv.turns) == 1 else f"{conv.group}/turn{turn + 1}",
                    encode(tokenizer, conv.messages(turn, answers)),
                    [],
                )
                if turn + 1 < len(conv.turns):
                    req.continuation = continuation(target, req.prompt, args.max_new_tokens)
                    answers.append(tokenizer.decode(req.continuation, skip_special_tokens=True))
                out.append(req)
    if args.prompts:
        for i, line in enumerate(Path(args.prompts).read_text().splitlines()):
            if line.strip():
                item = json.loads(line)
                if "prompt" not in item:
                    raise ValueError(f"{args.prompts} line {i + 1} has no 'prompt' key: {line[:80]!r}")
                chat = [{"role": "user", "content": item["prompt"]}]
                out.append(
                    Request(
                        str(item.get("id", i)), "prompts", item.get("group", "prompts"), encode(tokenizer, chat), []
                    )
                )
    return out[: args.limit]


def main(args) -> None:
    torch.set_num_threads(args.threads)
    target, tokenizer = load(args.target, dtype=torch.float32, device="cpu")
    entries = []
    for name in args.drafters:
        if name in ("prompt_lookup", "suffix"):
            entries.append(name)
            continue
        model, tok = load(name, dtype=torch.float32, device="cpu")
        entries.append(model if tok.get_vocab() == tokenizer.get_vocab() else (model, tok))
    requests = requests_from_workloads(args, target, tokenizer)
    pools = {
        "default": {"drafters": list(args.drafters[:1]), "policy": "fixed"},
        "lbss": {"drafters": list(args.drafters), "policy": "lbss"},
    }
    checks = () if args.checks == ["none"] else tuple(CheckConfig.parse(c) for c in args.checks)
    start = time.perf_counter()
    trace = record(target, entries, requests, args.max_new_tokens, args.k, checks, tokenizer, args.target, pools)
    path = trace.save(args.out)
    print(
        f"{path}: {len(requests)} requests, {int(trace.offsets[-1])} tokens, {len(trace.checks)} check runs, "
        f"{path.stat().st_size / 2**20:.2f} MiB, recorded in {time.perf_counter() - start:.0f} s"
    )
