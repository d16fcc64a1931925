"""Run-ahead on the static layout (`StaticOptions.run_ahead`; docs/design.md, "Run-ahead"): a step that drafts
nothing feeds its tokens, unread, to the next one-token forward; the next step takes those logits as its own
forward (a plain step) or as its first position (a chain step feeding its drafts alone), or drops them (rows
joining, a token tree). Greedy output equals plain `generate` through every one of those paths, sampled output
keeps the target's distribution (with its lossy control). Off by default (measured slower on an H100); "auto"
turns it on where it could pay: compiled on CUDA.
"""

from __future__ import annotations

import collections
import types

import pytest
import torch

import hf_spin
from hf_spin.cache.static_forward import CUDA_GRAPHS, StaticOptions
from hf_spin.drafters import Draft, PromptLookupDrafter
from hf_spin.step.engine import SpinEngine

from .archs import tiny_model
from .speculation import DRAFT_TOKENS, assert_speculated, greedy_case
from .speculation import pool as spin_pool

pytestmark = pytest.mark.usefixtures("one_thread")

MAX_NEW_TOKENS = 24
PROMPT_LENGTH = 14


class EveryOtherStep(PromptLookupDrafter):
    """Prompt lookup on every other call and nothing on the others: plain steps (which run ahead), each
    followed by a chain step where lookup finds a match (which verifies after a forward run ahead)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def draft(self, request) -> Draft:
        self.calls += 1
        draft = super().draft(request)
        if self.calls % 2:
            return Draft(tokens=[[] for _ in draft.tokens], q=[None] * len(draft.tokens))
        return draft


def ran_ahead(monkeypatch) -> collections.Counter:
    """Counts, over the engine's steps: "launched" forwards run ahead, "plain" and "chain" steps that took one,
    "dropped" ones undone."""
    seen = collections.Counter()
    launch, drop, verify = SpinEngine._launch_ahead, SpinEngine._drop_ahead, SpinEngine.verify

    def spy_verify(self, proposal):
        if self._ahead is not None and proposal.trees is None:
            seen["chain" if any(proposal.drafts) else "plain"] += 1
        return verify(self, proposal)

    def spy_drop(self):
        seen["dropped"] += self._ahead is not None
        return drop(self)

    monkeypatch.setattr(
        SpinEngine, "_launch_ahead", lambda self, tokens: seen.update(["launched"]) or launch(self, tokens)
    )
    monkeypatch.setattr(SpinEngine, "_drop_ahead", spy_drop)
    monkeypatch.setattr(SpinEngine, "verify", spy_verify)
    return seen


def static_pool(entries, compile=False, **kwargs) -> hf_spin.AssistantPool:
    options = StaticOptions(compile, backend="eager", query_slots=DRAFT_TOKENS + 1, run_ahead=True)
    return spin_pool(entries, tree=False, cache="static", compile=options, **kwargs)


@pytest.mark.parametrize("batch", (1, 4))
@pytest.mark.parametrize("arch", ("llama", "qwen2", "gemma"))
def test_greedy_output_equals_plain_generate_through_every_run_ahead_path(arch, batch, monkeypatch):
    """Plain steps that run ahead, plain and chain steps that take the forward run ahead, rows that stop (the
    forward's rows cut with the batch): plain `generate`'s tokens."""
    target = tiny_model(arch, seed=0)
    inputs, reference = greedy_case(target, batch, PROMPT_LENGTH, MAX_NEW_TOKENS)
    seen = ran_ahead(monkeypatch)
    pool = static_pool([EveryOtherStep()])
    out = target.generate(**inputs, custom_generate=hf_spin.generate, assistant_pool=pool)
    assert torch.equal(out, reference), f"\n{out}\n{reference}"
    assert_speculated(pool.last_stats)
    assert seen["launched"] > 0 and seen["plain"] > 0 and seen["chain"] > 0, seen


def test_compiled_run_ahead_keeps_greedy_output_in_the_plain_steps_graph(monkeypatch, fresh_dynamo):
    """Compiled (dynamo alone), a forward run ahead is the one-token graph plain steps compile: no other."""
    from hf_spin.cache.static_forward import run_static

    target = tiny_model("llama", seed=0)
    inputs, reference = greedy_case(target, 4, PROMPT_LENGTH, MAX_NEW_TOKENS)
    seen = ran_ahead(monkeypatch)
    pool = static_pool([EveryOtherStep()], compile=True)
    out = target.generate(**inputs, custom_generate=hf_spin.generate, assistant_pool=pool)
    assert torch.equal(out, reference)
    assert seen["plain"] > 0 and seen["chain"] > 0, seen
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert graphs == 2, f"{graphs} graphs of {run_static.__name__}: the one-token and the k + 1 query slots"


def test_rows_joining_drop_the_forward_run_ahead_and_stay_exact(monkeypatch):
    """Continuous batching: a row joining while a forward runs ahead undoes it (its slots have none); every
    row's tokens equal plain generate on its prompt alone."""
    from .test_engine import alone, prompts, request, run

    target = tiny_model("llama", seed=0)
    seen = ran_ahead(monkeypatch)
    engine = SpinEngine(target, static_pool([EveryOtherStep()]))
    ps, lengths = prompts(5), [20, 9, 16, 12, 18]
    schedule = {0: [request(ps[0], 20), request(ps[1], 9)], 3: [request(ps[2], 16)], 6: [request(ps[3], 12)]}
    schedule[7] = [request(ps[4], 18)]  # steps of both parities: some admission comes after a plain step
    rows = run(engine, schedule)
    for row, p, n in zip(rows, ps, lengths):
        assert row.generated == alone(target, p, n), f"row {row.id}"
    assert seen["launched"] > 0 and seen["dropped"] > 0, seen


def test_a_row_stopping_while_a_forward_runs_ahead_leaves_the_others_exact(monkeypatch):
    """The first row stops on a criterion of its own (not its length limit, so its forward ran ahead) while the
    others run on: the forward run ahead loses that row's logits, the others keep theirs."""
    from transformers import EosTokenCriteria, MaxLengthCriteria, StoppingCriteriaList

    from hf_spin.step.rows import Request

    from .archs import EOS
    from .test_engine import alone, prompts, request, run

    target = tiny_model("llama", seed=0)
    seen = ran_ahead(monkeypatch)
    engine = SpinEngine(target, static_pool([EveryOtherStep()]))
    ps = prompts(3)
    criteria = StoppingCriteriaList([EosTokenCriteria(EOS), MaxLengthCriteria(len(ps[0]) + 5)])
    first = Request(prompt=ps[0], max_new_tokens=20, stopping_criteria=criteria)
    rows = run(engine, {0: [first, request(ps[1], 20), request(ps[2], 20)]})
    assert rows[0].generated == alone(target, ps[0], 5) and len(rows[0].generated) == 5
    for row, p in zip(rows[1:], ps[1:]):
        assert row.generated == alone(target, p, 20), f"row {row.id}"
    assert seen["launched"] > 0, seen


def test_run_ahead_by_default_only_where_cuda_graphs_capture_the_forwards():
    cpu = tiny_model("llama")
    assert not StaticOptions("auto").runs_ahead(cpu) and not StaticOptions(True, run_ahead="auto").runs_ahead(cpu)
    assert StaticOptions(True).run_ahead == "auto"
    assert StaticOptions(run_ahead=True).runs_ahead(cpu) and not StaticOptions(True, run_ahead=False).runs_ahead(cpu)
    on_cuda = types.SimpleNamespace(device=torch.device("cuda", 0))  # what runs_ahead reads of a model
    assert StaticOptions(True, backend=CUDA_GRAPHS).runs_ahead(on_cuda)  # the host's work overlaps the graphs'
    assert StaticOptions(True).runs_ahead(on_cuda)  # the default: inductor's kernels, captured by hf_spin
    assert not StaticOptions(True, backend="inductor").runs_ahead(on_cuda)  # graph trees: 3x slower (docs/design.md)
    assert not StaticOptions(True, backend=CUDA_GRAPHS, run_ahead=False).runs_ahead(on_cuda)
    with pytest.raises(ValueError, match="run_ahead="):
        StaticOptions(run_ahead="always")
    pool = static_pool(["prompt_lookup"])
    assert SpinEngine(cpu, pool).run_ahead and not SpinEngine(cpu, pool, run_ahead=False).run_ahead


@pytest.mark.parametrize("lossy", [False, True], ids=["exact", "lossy_control"])
def test_sampled_output_keeps_the_target_distribution_through_run_ahead(lossy, monkeypatch):
    """tests/test_sampling.py's check of the joint distribution of three tokens: t_2 sampled by a plain step
    that runs ahead, t_3 and t_4 at draft positions 0 and 1 of the chain step after it (the first from the
    forward run ahead). Its control, the verifier exact at draft position 0 only, must fail it."""
    from transformers import GenerationMixin

    from .test_sampling import (
        ALPHA,
        LARGE_N,
        MEASURED,
        PROMPT,
        SAMPLED_NEW_TOKENS,
        SMALL_V,
        _exact_measured,
        accept_after_first,
        fits,
        peaky,
    )

    if lossy:
        monkeypatch.setattr(hf_spin.verify.chains, "verify_sampling", accept_after_first)
    seen = ran_ahead(monkeypatch)
    torch.manual_seed(LARGE_N)
    pool = static_pool([EveryOtherStep()], draft_length=hf_spin.FixedLength(MEASURED, min_confidence=0.0))
    kwargs = dict(do_sample=True, temperature=0.7, top_k=5, max_new_tokens=SAMPLED_NEW_TOKENS + 1, pad_token_id=0)
    ids = PROMPT.expand(LARGE_N, -1)
    out = GenerationMixin.generate(
        peaky(0), input_ids=ids, custom_generate=hf_spin.generate, assistant_pool=pool, **kwargs
    )
    cells = torch.zeros(LARGE_N, dtype=torch.long)
    for j in range(MEASURED):
        cells = cells * SMALL_V + out[:, PROMPT.shape[1] + 1 + j]
    counts = torch.bincount(cells, minlength=SMALL_V**MEASURED).float()
    assert_speculated(pool.last_stats)
    assert seen["launched"] > 0 and seen["chain"] > 0, seen
    p = fits(counts, _exact_measured())
    assert p < 1e-6 if lossy else p > ALPHA, p
