"""Record and replay (benchmarks/replay): a trace recorded from tiny random models replays with forced models and
reproduces the recorded hf_spin runs step by step, per drafter, for chains and trees at batch 1 and 4; a forced
target one position off fails the check (the lossy control)."""

from __future__ import annotations

import functools
import json
import time

import pytest
import torch
from transformers import CompileConfig, DynamicCache, StoppingCriteria, StoppingCriteriaList

import hf_spin
from benchmarks.injected_costs import Overrun, pace, table
from benchmarks.replay.__main__ import main
from benchmarks.replay.checks import CheckConfig, generated, left_pad
from benchmarks.replay.costs import FLOOR, run_host, run_structures, shortfalls
from benchmarks.replay.forced import force, match, replay_drafters
from benchmarks.replay.record import continuation, record
from benchmarks.replay.run import TARGET_SHAPES, check
from benchmarks.replay.run import table as markdown
from benchmarks.replay.trace import Request, Trace, compact, load, merge
from hf_spin.cache import RectangularCache
from hf_spin.planning.grid import _context_cache
from hf_spin.step.engine import SpinEngine

from .archs import VOCAB, tiny_model
from .speculation import perturbed

CHECKS = (
    CheckConfig("fixed", False, 1),
    CheckConfig("fixed", True, 4),
    CheckConfig("round_robin", True, 4),
    CheckConfig("vote", False, 4),
    CheckConfig("vote", True, 1),
    CheckConfig("round_robin", True, 4, cache="packed"),
    CheckConfig("vote", False, 1, cache="packed"),
)
NEW_TOKENS, K = 12, 4


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Ragged prompts that repeat a phrase, so prompt lookup and suffix drafting find matches."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        phrase = torch.randint(3, VOCAB, (3 + i % 3,), generator=g).tolist()
        out.append(torch.randint(3, VOCAB, (2 + i,), generator=g).tolist() + phrase * 2)
    return out


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory):
    torch.set_num_threads(1)
    target = tiny_model("llama", seed=0)
    small = tiny_model("llama", seed=1, num_hidden_layers=1)  # another seed and size, the same vocabulary
    requests = [Request(str(i), "w", f"g{i % 2}", p, []) for i, p in enumerate(prompts(6))]
    # EOS: a token request 1 emits mid-way, so rows end on it with drafts running past it (read from the tail)
    target.generation_config.eos_token_id = continuation(target, requests[1].prompt, NEW_TOKENS)[5]
    recorded = record(
        target,
        [perturbed("llama"), small, "prompt_lookup", "suffix"],
        requests,
        NEW_TOKENS,
        K,
        CHECKS,
        min_confidence=0.0,  # tiny random models are never 40% sure of a token
    )
    return recorded.save(tmp_path_factory.mktemp("replay") / "trace.npz")


@pytest.fixture(scope="module")
def trace(trace_file):
    return load(trace_file)


@pytest.fixture(scope="module")
def forced(trace):
    model = tiny_model("llama", seed=5)  # the recorded config, other weights: only the forcing makes its tokens
    force(model, trace)
    return model


def test_trace_round_trip_holds_drafts_and_trees(trace):
    assert [d.kind for d in trace.drafters] == ["model", "model", "prompt_lookup", "suffix"]
    assert trace.drafters[0].trees is not None and trace.drafters[0].chains.shape[1] == K
    assert all(0 < len(r.continuation) <= NEW_TOKENS for r in trace.requests)
    ended = [r for r in trace.requests if r.continuation[-1] in trace.target["eos_token_id"]]
    assert ended and all(len(r.tail) == K for r in ended)
    assert [c["config"] for c in trace.checks] == [vars(c) for c in CHECKS]


def test_recorded_checks_speculated(trace):
    """The check logs are worth replaying: drafts accepted and rejected, by several drafters."""
    steps = [s for log in trace.checks for rows in log["steps"].values() for s in rows]
    assert any(accepted >= 2 for _, accepted, _ in steps)
    assert any(accepted < drafted for drafted, accepted, _ in steps)
    assert {name for *_, drafters in steps for name in drafters} == {d.name for d in trace.drafters}


def test_replay_reproduces_every_check(trace, forced):
    """Forced target + replay drafters: every step of every check run as recorded (chains, trees, batch 1 and 4,
    rectangular and packed rows)."""
    assert check(trace, forced, replay_drafters(trace, torch.float32, "cpu")) == {c.name: [] for c in CHECKS}


def test_a_second_turn_is_its_own_request_though_its_prompt_starts_with_the_first_turns(trace):
    """A multi-turn trace: turn 2's prompt is turn 1's prompt, its answer and the next question."""
    first = trace.requests[0]
    second = Request("0/turn2", "w", "g", first.prompt + first.continuation + [7, 8], [9, 10])
    turns = Trace(trace.target, [], [first, second], trace.k_max, trace.max_new_tokens, trace.min_confidence)
    assert turns.request_of(first.prompt + first.continuation[:3]) == 0
    assert turns.request_of(second.prompt + [9]) == 1


def test_check_names_parse():
    for c in CHECKS:
        assert CheckConfig.parse(c.name) == c
    with pytest.raises(ValueError, match="POLICY-chain"):
        CheckConfig.parse("vote-b4")


def test_off_by_one_target_fails_the_check(trace):
    model = tiny_model("llama", seed=5)
    force(model, trace, shift=1)
    results = check(trace, model, replay_drafters(trace, torch.float32, "cpu"))
    assert all(problems for problems in results.values())
    assert any("differs" in p for problems in results.values() for p in problems)  # not only a lost row


def test_forced_target_under_plain_generate_and_prompt_lookup(trace, forced):
    """Plain `generate` (dynamic cache, static cache, static compiled) and transformers' prompt lookup commit the
    recorded continuations."""
    pad, eos = trace.target["pad_token_id"], trace.target["eos_token_id"]
    ids, mask = left_pad([r.prompt for r in trace.requests], pad, "cpu")
    compiled = CompileConfig(backend="eager", mode=None)  # dynamo traces the hook as on a GPU; no inductor here
    compiled._compile_all_devices = True
    for kwargs in (
        {},
        {"cache_implementation": "static"},
        {"cache_implementation": "static", "compile_config": compiled},
    ):
        out = forced.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, **kwargs)
        assert generated(out, ids.shape[1], eos, pad) == [r.continuation for r in trace.requests], kwargs
    for r in trace.requests[:2]:
        ids = torch.tensor([r.prompt])
        out = forced.generate(input_ids=ids, max_new_tokens=NEW_TOKENS, do_sample=False, prompt_lookup_num_tokens=K)
        assert out[0, ids.shape[1] :].tolist() == r.continuation


def test_rows_matched_after_some_retire():
    """Rows keep their order; of the assignments that fit, the one whose retired rows reached their end wins."""
    sequences = [list(range(14)), list(range(40)), list(range(30, 60))]
    # rows 0 and 1 were at position 10 with 4 slots, row 2 at 11: only row 0 could reach its end
    before = [(10, 10, 4), (10, 10, 4), (41, 11, 4)]
    assert match(before, [(12, 12), (42, 12)], [0, 1, 2], sequences) == [1, 2]
    assert match(before, [(12, 12)], [0, 1, 2], sequences) == [1]  # row 2 stopped early (a smaller max_new_tokens)
    with pytest.raises(RuntimeError, match="lost its rows"):  # no row holds 99 at 12
        match(before, [(99, 12)], [0, 1, 2], sequences)


def test_a_probe_on_a_cache_of_its_own_reads_unknown_rows(trace):
    """A cost-profile probe after a batch (fewer rows over a random context in a cache of its own, as the static
    layout's profile measures within a run) is forced to the unknown row's token 0; fewer rows that fit no
    recorded sequence on the batch's own cache still fail."""
    model = tiny_model("llama", seed=5)
    force(model, trace)
    ids, mask = left_pad([r.prompt for r in trace.requests[:3]], trace.target["pad_token_id"], "cpu")
    cache = DynamicCache(config=model.config)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [3, L]
    model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache)  # rows 0, 1, 2 tracked
    with pytest.raises(RuntimeError, match="lost its rows"):  # the batch's cache: a lost row is a fault
        model(input_ids=torch.tensor([[7]]), position_ids=torch.tensor([[10_000]]), past_key_values=cache)
    probe = _context_cache(model, 1, torch.Generator().manual_seed(0))
    at = torch.tensor([[probe.get_seq_length()]])
    logits = model(input_ids=torch.tensor([[7]]), position_ids=at, past_key_values=probe).logits  # [1, 1, V]
    assert logits[0, -1].argmax() == 0


def test_command_line_runs_the_benchmark_and_the_check(trace_file, trace, tmp_path):
    assert main(["run", str(trace_file), "--check", "--threads", "1"]) == 0
    argv = ["run", str(trace_file), "--batch-sizes", "1", "4", "--compile-backend", "eager", "--threads", "1"]
    assert main(argv + ["--out", str(tmp_path)]) == 0
    (md,) = tmp_path.glob("replay-*.md")
    for method in ("generate", "generate_static", "transformers_lookup", "hf_spin_all"):
        assert f"| w | 1 | {method} |" in md.read_text()
    assert md.read_text().count(f"{len(trace.requests)}/{len(trace.requests)} |") == 7  # identical: every row


def test_traces_replay_as_one_with_chains_and_trees_at_another_target_shape(trace_file, trace, tmp_path, monkeypatch):
    """Several traces recorded alike replay in one run (`run A B`); `--trees both` runs every pool with token trees
    and with chains; `--target-shape` builds the target at another shape, the recorded acceptance standing in."""
    merged = merge([load(trace_file), load(trace_file)])
    assert [r.continuation for r in merged.requests] == [r.continuation for r in trace.requests] * 2
    assert len(merged.drafters[0].chains) == 2 * len(trace.drafters[0].chains)
    other = load(trace_file)
    other.k_max += 1
    with pytest.raises(ValueError, match="k_max"):
        merge([trace, other])
    monkeypatch.setitem(TARGET_SHAPES, "wider", {"intermediate_size": 96})
    argv = ["run", str(trace_file), str(trace_file), "--batch-sizes", "1", "--trees", "both", "--threads", "1"]
    assert main(argv + ["--target-shape", "wider", "--out", str(tmp_path)]) == 0
    (md,) = tmp_path.glob("replay-*.md")
    text, n = md.read_text(), 2 * len(trace.requests)
    assert text.startswith("target: wider's shape")
    for method in ("hf_spin_all", "hf_spin_all_chains"):
        assert f"| w | 1 | {method} |" in text
    assert text.count(f"{n}/{n} |") == 4  # generate, transformers' lookup, the pool with trees and with chains
    argv = ["run", str(trace_file), "--batch-sizes", "1", "--trees", "both", "--methods", "hf_spin_all_chains"]
    assert main(argv + ["--threads", "1", "--out", str(tmp_path / "only")]) == 0  # and plain generate, the base
    (md,) = (tmp_path / "only").glob("replay-*.md")
    methods = [line.split(" | ")[2] for line in md.read_text().splitlines() if line.startswith("| w |")]
    assert methods == ["generate", "hf_spin_all_chains"]


def test_costs_replay_the_recorded_acceptance_on_injected_cost_structures(trace):
    """`costs`: on every structure each method commits the recorded continuations; the clock charges each forward
    the structure's t(N) (flat: a plain decode of n tokens takes n forwards of 0.1 s); a drafter's share is its
    parameters over the target's; and no pool runs below the floor of plain `generate` where the planner reads
    the structure it runs on (the regression gate)."""
    records = run_structures(trace, ["flat", "avx2_bf16"], [1, 4])
    assert {r["costs"] for r in records} == {"flat", "avx2_bf16"}
    assert all(r["identical"] == r["requests"] for r in records)
    plain = next(r for r in records if (r["costs"], r["batch"], r["method"]) == ("flat", 1, "generate"))
    assert plain["seconds"] == pytest.approx(0.1 * plain["tokens"])
    shares = records[0]["shares"]
    assert shares["llama"] == pytest.approx(1.0) and 0 < shares["llama#2"] < 1  # the target's twin, a 1-layer one
    assert shortfalls(records, FLOOR) == []


def test_a_plain_step_beside_filler_rows_replays_the_recording(trace, monkeypatch):
    """A plain step run beside filler rows (`SpinEngine._filler_rows`: rows fed one filler token at position 0,
    dropped after the forward) leaves every row its request: the rows past the batch's are no request's. Read as a
    new batch of unknown rows, every row was forced to token 0 from there on (3 of 6 outputs were the recording's
    on the small-GEMM structure at batch 4)."""
    monkeypatch.setattr(SpinEngine, "_filler_rows", lambda self: 2 if type(self.cache) is RectangularCache else 0)
    records = [r for r in run_structures(trace, ["avx2_bf16"], [4]) if r["method"] != "generate"]
    assert records and all(r["identical"] == r["requests"] for r in records)


def test_host_times_the_engines_own_work_a_step_by_the_wall_clock(trace):
    """`host`: the same stand-ins by the wall clock, every pool's record holding the engine's own milliseconds a
    step (`CostProfile.host_seconds`), plain and drafting, where on a `CostClock` they read 0; the table shows them.
    Repeated (`--repeat`), each pool decodes every request twice, no replayed drafter failing on a repeat."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        records = run_host(trace, "flat", [1], repeat=2)
    assert not [str(w.message) for w in caught if "raised" in str(w.message)]
    pools = [r for r in records if r["method"].startswith("hf_spin")]
    assert pools and all(r["identical"] == r["requests"] == 2 * len(trace.requests) for r in records)
    assert all(r["host_ms"]["plain"] > 0 and r["host_ms"]["drafting"] > 0 for r in pools), [r["host_ms"] for r in pools]
    assert all(r["host_ms"] is None for r in records if not r["method"].startswith("hf_spin"))
    clocked = run_structures(trace, ["flat"], [1])
    assert all(r["host_ms"] == {"plain": 0.0, "drafting": 0.0} for r in clocked if r["method"].startswith("hf_spin"))
    assert "host ms / step" in markdown(records) and "host ms / step" not in markdown(clocked)


def test_a_compact_trace_renumbers_every_id_one_to_one(trace):
    """`compact`: every id the trace holds (prompts, continuations, tails, model drafters' chains and trees, the
    special ids) renumbered in id order onto 0..n-1, so the text each drafter and the forced target see is the
    same text over a vocabulary of n."""
    small, n = compact(trace)
    back = {}  # new id -> the original it stands for
    for r, c in zip(trace.requests, small.requests):
        for a, b in zip(r.prompt + r.continuation + r.tail, c.prompt + c.continuation + c.tail):
            assert back.setdefault(b, a) == a  # one original a new id
    new = sorted(back)
    assert new[-1] < n and [back[b] for b in new] == sorted(set(back.values()))  # one to one, in id order
    for d, c in zip(trace.drafters, small.drafters):
        if d.chains is not None:
            assert ((d.chains < 0) == (c.chains < 0)).all() and c.chains.max() < n
            assert all(back.get(b, a) == a for a, b in zip(d.chains[d.chains >= 0], c.chains[c.chains >= 0]))
    assert small.target["pad_token_id"] < n and max(small.target["eos_token_id"]) < n


@pytest.mark.parametrize("layout", ["rectangular", "static"])
def test_paced_forwards_last_their_injected_cost_beside_the_hosts_own_work(trace, layout):
    """`host --step-ms`: every forward of the (compact-vocabulary) stand-ins lasts its injected cost in wall time
    (`pace`), so plain `generate` takes at least its forwards' cost and the pools (on either layout, `--cache`)
    still commit the recording."""
    step = 0.004
    records = run_host(trace, "flat", [1], step_ms=step * 1e3, layout=layout)
    pools = [r for r in records if r["method"].startswith("hf_spin")]
    assert pools and all(r["method"].endswith("_static") == (layout == "static") for r in pools)
    assert all(r["identical"] == r["requests"] for r in records)
    plain = next(r for r in records if r["method"] == "generate")
    assert plain["seconds"] >= plain["tokens"] * step  # one forward a token at batch 1, the first the prefill's
    assert all(r["host_ms"]["plain"] > 0 for r in records if r["method"].startswith("hf_spin"))
    assert all(r["overrun"] >= 0 for r in records)  # the stand-ins' work past their cost, taken off `seconds`
    model = tiny_model("llama")
    over = Overrun()
    handles = pace(model, table(lambda n: 0.01 * n), over)
    start = time.perf_counter()
    model(torch.ones(1, 3, dtype=torch.long))
    assert 0.03 <= time.perf_counter() - start < 0.06 and over() == 0  # three positions at 10 ms each
    for h in handles:
        h.remove()
    handles = pace(model, table(lambda n: 1e-9), over)  # a device faster than this CPU runs the stand-in
    start = time.perf_counter()
    model(torch.ones(1, 3, dtype=torch.long))
    assert 0 < over() <= time.perf_counter() - start
    for h in handles:
        h.remove()


def test_pools_replay_on_the_static_layout_and_a_budget_skips_what_starts_late(trace_file, trace, tmp_path):
    """`--cache static`: every pool verifies on the static layout (named `..._static`) and still commits the
    recorded continuations; `--budget-s`: methods that would end past the budget are listed as skipped, and the
    files are written after each record (a run stopped from outside keeps what it did)."""
    argv = ["run", str(trace_file), "--batch-sizes", "1", "4", "--trees", "both", "--cache", "static"]
    argv += ["--compile-backend", "eager"]  # generate_static too: its step beside the pools' static options
    argv += ["--read-each-draft-token", "no"]  # a GPU's default: a model drafter's chain read once, no trees
    assert main(argv + ["--threads", "1", "--out", str(tmp_path / "static")]) == 0
    (md,) = (tmp_path / "static").glob("replay-*.md")
    text, n = md.read_text(), len(trace.requests)
    for method in ("hf_spin_all_static", "hf_spin_all_chains_static"):
        assert f"| w | 1 | {method} |" in text and f"| w | 4 | {method} |" in text
    assert text.count(f"{n}/{n} |") == 2 + 2 + 4 + 1  # generate and its static twice, the pool's variants twice, lookup
    assert "ms / step: verify / drafting / rest |" in text
    (raw,) = (tmp_path / "static").glob("replay-*.json")
    for r in json.loads(raw.read_text())["records"]:  # a call's time past its prefills: verify, drafting, the rest
        spent = r["prefill_s"] + r["verify_s"] + r["draft_s"]
        assert (r["steps"] > 0 and 0 < spent <= r["seconds"]) == r["method"].startswith("hf_spin"), r
    assert main(["run", str(trace_file), "--budget-s", "1e-9", "--threads", "1", "--out", str(tmp_path / "b")]) == 0
    (md,) = (tmp_path / "b").glob("replay-*.md")
    assert "skipped (time budget): w b1 generate, w b1 transformers_lookup, w b1 hf_spin_all, w b4" in md.read_text()


def test_the_static_layouts_captured_graphs_replay_the_recording(trace_file, trace, tmp_path, monkeypatch):
    """`--static-backend cuda_graphs` through a stand-in capture that fails where a CUDA graph would (a host read
    inside it, a replay reading other storage than it captured): the forced target's row map changes in place at
    each prefill (profile probes' unknown rows, then the batch's), so graphs captured before still read it."""
    from hf_spin.cache import cuda_graphs
    from hf_spin.cache.static_forward import StaticOptions

    from .test_cuda_graphs import baked_capture

    monkeypatch.setattr(cuda_graphs, "capture_graph", baked_capture)
    monkeypatch.setattr(StaticOptions, "compiles", lambda self, model, drafter=False: self.compile in (True, "auto"))
    argv = ["run", str(trace_file), "--batch-sizes", "1", "4", "--cache", "static", "--static-backend", "cuda_graphs"]
    assert main(argv + ["--threads", "1", "--out", str(tmp_path)]) == 0
    (md,) = tmp_path.glob("replay-*.md")
    n = len(trace.requests)
    assert "| w | 1 | hf_spin_all_static |" in md.read_text() and md.read_text().count(f"{n}/{n} |") == 2 + 2 + 1


def test_a_batch_prefilled_in_groups_replays_through_graphs_that_run_no_hook(monkeypatch):
    """The forced target's map of rows to requests is kept by its hooks, which a CUDA graph's replay does not run: a
    batch prefilled in groups (`linear` costs: the two short prompts, then the two long ones) on the static layout
    decodes from captured forwards only (the stand-in replays recorded ops, no Python), so the map must hold the
    whole batch after the last group's prefill (`ForcedTarget.expect`); without it every row reads as unknown."""
    from benchmarks.injected_costs import profile_of, table
    from hf_spin.cache import cuda_graphs, static_forward
    from hf_spin.cache.cuda_graphs import GraphedForward
    from hf_spin.cache.static_forward import CUDA_GRAPHS, StaticOptions

    from .archs import EOS
    from .test_cuda_graphs import traced_capture
    from .test_prefill_groups import linear, ragged_prompts

    monkeypatch.setattr(cuda_graphs, "capture_graph", traced_capture)
    monkeypatch.setattr(static_forward, "shared_graphed", functools.cache(GraphedForward))
    monkeypatch.setattr(StaticOptions, "compiles", lambda self, model, drafter=False: self.compile is True)
    ids, mask = ragged_prompts([3, 36, 4, 30])
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    plain = tiny_model("llama", seed=0).generate(ids, eos_token_id=EOS, **kwargs)
    lengths = mask.sum(dim=1).tolist()
    refs = [row[row.shape[0] - n - NEW_TOKENS :].tolist() for row, n in zip(plain, lengths)]
    requests = [Request(str(b), "w", "", r[:n], r[n:]) for b, (r, n) in enumerate(zip(refs, lengths))]
    trace = Trace({"eos_token_id": [], "pad_token_id": 0}, [], requests, K, NEW_TOKENS, 0.0)
    model = tiny_model("llama", seed=5)  # other weights: only the forcing makes plain's tokens
    forced = force(model, trace)
    cost = table(linear)
    options = StaticOptions(True, backend=CUDA_GRAPHS, query_slots=K + 1)
    pool = hf_spin.AssistantPool(
        ["prompt_lookup"], profile=profile_of(cost, [None], ["prompt_lookup"]), cache="static", compile=options
    )
    shapes = []
    model.register_forward_pre_hook(lambda m, a, kw: shapes.append(tuple(kw["input_ids"].shape)), with_kwargs=True)
    run = functools.partial(model.generate, ids, custom_generate=hf_spin.generate, assistant_pool=pool, **kwargs)
    for call, expected in enumerate(([0, 1, 2, 3], None, [0, 1, 2, 3])):  # the first call captures, then replays
        forced.expect(expected)
        shapes.clear()
        out = run()
        assert shapes[0][0] < 4, shapes  # prefilled in groups (as the profile's costs then say)
        assert torch.equal(out, plain) == (expected is not None), out
        assert (max(rows for rows, _ in shapes) == 4) == (call == 0), shapes  # then no forward of 4 rows runs a hook

    class Recapture(StoppingCriteria):  # the graphs dropped mid-call: the next forward captures, its hook runs
        calls = 0

        def __call__(self, input_ids, scores, **kwargs):
            Recapture.calls += 1
            if Recapture.calls == NEW_TOKENS // 2:
                static_forward.shared_graphed(static_forward.run_static).graphs.clear()
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    # a capture steps after the groups' prefill (a wider draft met mid-call, on a GPU): the hook sees the batch
    # long past its prompts, and must keep the expected rows the graphs have read since, not regroup them afresh
    forced.expect([0, 1, 2, 3])
    shapes.clear()
    out = run(stopping_criteria=StoppingCriteriaList([Recapture()]))
    assert Recapture.calls > 3 and max(rows for rows, _ in shapes) == 4, shapes
    assert torch.equal(out, plain), out
