"""Check runs: hf_spin configurations whose decisions read no clock, run on the recorded prompts at record time
(real models) and again at replay (forced models); their step logs must agree exactly.

A configuration is a policy over the trace's whole pool (fixed: its first drafter; round robin; vote), chains or
token trees, a batch size and the cache layout (rectangular or packed rows); every one drafts a fixed k (the
trace's k_max, its confidence stop) with profile "off" (no planner, so no measured cost decides anything). Its
log holds, per request and step, what the policy heard (`StepFeedback`): [drafted, accepted, {drafter: [proposed,
matched]}], and whether the output is the recorded continuation.
"""

from __future__ import annotations

import itertools
import re
from collections import defaultdict
from dataclasses import asdict, dataclass

import torch
from tqdm.auto import tqdm

import hf_spin
from hf_spin.policies import FixedLength

from .trace import Request

POLICIES = ("fixed", "round_robin", "vote")
LAYOUTS = ("rectangular", "packed")


@dataclass(frozen=True)
class CheckConfig:
    policy: str  # one of POLICIES, over every drafter of the trace
    tree: bool  # token trees where the target takes them (tree="auto"), else chains
    batch: int  # requests per generate call, in trace order
    cache: str = (
        "rectangular"  # the pool's layout: "rectangular" or "packed" (a model drafter grows trees on the first)
    )

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"check policy {self.policy!r} is not supported; give one of {POLICIES}")
        if self.batch < 1:
            raise ValueError(f"check batch must be at least 1, got {self.batch}")
        if self.cache not in LAYOUTS:
            raise ValueError(f"check cache {self.cache!r} is not supported; give one of {LAYOUTS}")

    @property
    def name(self) -> str:
        name = f"{self.policy}-{'tree' if self.tree else 'chain'}-b{self.batch}"
        return name if self.cache == LAYOUTS[0] else f"{name}-{self.cache}"

    @classmethod
    def parse(cls, name: str) -> CheckConfig:
        """'vote-tree-b4' -> CheckConfig('vote', True, 4); 'vote-tree-b4-packed' on packed rows."""
        match = re.fullmatch(r"(\w+)-(tree|chain)-b(\d+)(?:-(\w+))?", name)
        if match is None:
            raise ValueError(f"check {name!r} is not POLICY-chain|tree-bN[-packed] (e.g. vote-tree-b4)")
        policy, shape, batch, cache = match.groups()
        return cls(policy, shape == "tree", int(batch), cache or LAYOUTS[0])


DEFAULT_CHECKS = tuple(
    CheckConfig(p, t, b)
    for p, t, b in (("fixed", False, 1), ("round_robin", True, 4), ("vote", False, 4), ("vote", True, 1))
)


class StepLog:
    """Per request, what each hf_spin step did to it, read from the feedback the pool's policy hears (row ids
    are set to trace request indices by `run_check`)."""

    def __init__(self, pool: hf_spin.AssistantPool):
        self.steps: dict[int, list] = defaultdict(list)
        names, update = pool.names, pool.policy.update

        def logged(feedback) -> None:
            for b, r in enumerate(feedback.row_ids):
                drafters = {
                    names[d]: [n, feedback.matched[b].get(d, 0)] for d, n in sorted(feedback.proposed[b].items())
                }
                self.steps[r].append([feedback.drafted[b], feedback.accepted[b], drafters])
            update(feedback)

        pool.policy.update = logged


def left_pad(prompts: list[list[int]], pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, W] ids and attention mask of left-padded prompts."""
    W = max(map(len, prompts))
    ids = torch.full((len(prompts), W), pad, dtype=torch.long)
    mask = torch.zeros(len(prompts), W, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, W - len(p) :] = torch.tensor(p)
        mask[b, W - len(p) :] = 1
    return ids.to(device), mask.to(device)


def generated(out: torch.Tensor, width: int, eos: list[int], pad: int) -> list[list[int]]:
    """Each row's new tokens of a `generate` output, up to and with its first EOS (padding after it dropped)."""
    rows = []
    for row in out[:, width:].tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        rows.append(row[:end])
    return rows


def run_check(
    target,
    drafters: list,
    requests: list[Request],
    config: CheckConfig,
    k: int,
    min_confidence: float,
    max_new_tokens: int,
    tokenizer=None,
) -> dict:
    """One check configuration over `requests` (batches of config.batch in order) with these pool entries (and the
    target's tokenizer, for drafters with another); the log {"config", "steps": {request index: [...]}, "differ":
    [request indices whose output is not the recorded continuation]}."""
    pool = hf_spin.AssistantPool(
        list(drafters),
        policy=config.policy,
        draft_length=FixedLength(k, min_confidence),
        profile="off",
        tree="auto" if config.tree else False,
        cache=config.cache,
        tokenizer=tokenizer,
    )
    pool.reset()
    log = StepLog(pool)
    eos, pad = target.generation_config.eos_token_id, target.generation_config.pad_token_id
    eos = eos if isinstance(eos, list) else [eos]
    differ = []
    batches = range(0, len(requests), config.batch)
    for start in tqdm(batches, desc=f"check {config.name}", leave=False):
        chunk = requests[start : start + config.batch]
        ids, mask = left_pad([r.prompt for r in chunk], pad, target.device)
        pool.row_ids = itertools.count(start)  # row ids are the requests' indices in the trace
        out = target.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            custom_generate=hf_spin.generate,
            assistant_pool=pool,
        )
        for i, (r, tokens) in enumerate(zip(chunk, generated(out, ids.shape[1], eos, pad))):
            if tokens != r.continuation:
                differ.append(start + i)
    return {"config": asdict(config), "steps": {str(r): s for r, s in sorted(log.steps.items())}, "differ": differ}


def compare(recorded: dict, replayed: dict) -> list[str]:
    """What differs between a recorded and a replayed check log (empty: they agree exactly)."""
    problems = [f"request {r}: output differs from the recorded continuation" for r in replayed["differ"]]
    for r in sorted(set(recorded["steps"]) | set(replayed["steps"]), key=int):
        a, b = recorded["steps"].get(r, []), replayed["steps"].get(r, [])
        for step, (x, y) in enumerate(itertools.zip_longest(a, b)):
            if x != y:
                problems.append(f"request {r} step {step}: recorded {x}, replayed {y}")
                break
    return problems
