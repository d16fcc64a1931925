"""Suffix drafting: the index (counts equal a rebuild after any extends, removals and evictions, under
threads too), the drafter's proposals on hand-built histories, its memory bound over a long run, and
greedy identity with plain `generate` alone and in a pool, over two calls (the second drafts from
the first's outputs)."""

from __future__ import annotations

import functools
import random
import threading

import pytest
import torch

import hf_spin
from hf_spin.drafters import DraftRequest
from hf_spin.drafters.suffix_index import SequenceIndex, SuffixIndex

from .archs import ARCHS, tiny_model
from .speculation import assert_speculated, greedy_case, perturbed
from .speculation import pool as spin_pool

# --- the index ----------------------------------------------------------------------------------------


def _brute_continuations(sequences: list[list[int]], context: tuple[int, ...]) -> dict[int, int]:
    """token -> how many times it followed `context` in the sequences (the index's children counts)."""
    out: dict[int, int] = {}
    n = len(context)
    for seq in sequences:
        for i in range(len(seq) - n):
            if tuple(seq[i : i + n]) == context:
                out[seq[i + n]] = out.get(seq[i + n], 0) + 1
    return out


def test_counts_equal_a_rebuild_after_random_extends_removals_and_evictions():
    rng = random.Random(0)
    for _ in range(150):
        index = SuffixIndex(max_depth=rng.randint(2, 6))
        for _ in range(12):
            key = rng.randint(0, 4)
            if rng.random() < 0.7:
                index.extend(key, [rng.randint(0, 3) for _ in range(rng.randint(0, 9))])
            else:
                index.remove(key)
            index.check()
        index.evict(2, 12)
        index.check()
        assert len(index) <= 2 and index.tokens <= 12
        for key in index.keys():
            index.remove(key)
        assert (index.nodes, index.tokens, index.root.children or {}) == (0, 0, {})  # nothing left behind


def test_longest_match_and_continuations_agree_with_brute_force():
    rng = random.Random(1)
    for _ in range(100):
        index = SuffixIndex(max_depth=6)
        sequences = [[rng.randint(0, 3) for _ in range(rng.randint(1, 15))] for _ in range(3)]
        for key, seq in enumerate(sequences):
            index.extend(key, seq)
        context = [rng.randint(0, 3) for _ in range(8)]
        match = index.longest_match(context, max_length=5)
        lengths = [n for n in range(1, 6) if _brute_continuations(sequences, tuple(context[-n:]))]
        assert (match.length if match else 0) == max(lengths, default=0)
        if match:
            seen = _brute_continuations(sequences, tuple(context[-match.length :]))
            firsts = {t: p for t, parent, p in index.continuations(match, 99, 1, 0.0) if parent == -1}
            assert firsts == pytest.approx({t: c / sum(seen.values()) for t, c in seen.items()})


def test_a_rows_sequence_index_answers_as_a_suffix_index_of_its_sequence():
    """`SequenceIndex` (a row's own tokens, scanned) gives `SuffixIndex`'s answers over the same one sequence,
    built in pieces as a row grows: the same longest match for every context (the row's own, as the drafter asks,
    and others), the same continuations, nodes, order and probabilities, for trees and chains."""
    rng = random.Random(3)
    for _ in range(300):
        depth = rng.randint(2, 8)
        sequence = [rng.randint(0, rng.choice((2, 4, 9))) for _ in range(rng.randint(0, 40))]
        trie, scanned = SuffixIndex(depth), SequenceIndex(depth)
        cut = rng.randint(0, len(sequence))
        for part in (sequence[:cut], sequence[cut:]):
            trie.extend(0, part)
            scanned.extend(0, part)
        assert scanned.length(0) == trie.length(0) == len(sequence)
        for context in (sequence, sequence[: rng.randint(0, len(sequence))], [rng.randint(0, 4) for _ in range(9)]):
            max_length, min_length = rng.randint(0, 9), rng.randint(1, 3)
            want, got = (i.longest_match(context, max_length, min_length) for i in (trie, scanned))
            assert (got.length if got else None) == (want.length if want else None), (sequence, context)
            if want:
                ask = (rng.randint(1, 12), rng.randint(1, depth), rng.choice((0.0, 0.1, 0.3)), rng.random() < 0.5)
                assert scanned.continuations(got, *ask) == trie.continuations(want, *ask)  # same counts, same sums


def test_continuations_are_best_first_bounded_and_cut_by_probability():
    index = SuffixIndex(max_depth=6)
    for key, seq in enumerate([[9, 1, 2, 5], [9, 1, 2, 6], [9, 1, 0, 7], [9, 3, 3, 8]]):
        index.extend(key, seq)
    match = index.longest_match([4, 9], max_length=3)
    assert match.length == 1
    nodes = index.continuations(match, max_nodes=4, max_depth=3, min_probability=0.0)
    # 1 (3/4), 1.2 (1/2), 3 (1/4), 1.0 (1/4): best-first, ties in discovery order
    assert [(t, parent) for t, parent, _ in nodes] == [(1, -1), (2, 0), (3, -1), (0, 0)]
    assert [p for _, _, p in nodes] == pytest.approx([0.75, 0.5, 0.25, 0.25])
    assert [t for t, _, _ in index.continuations(match, 9, 3, min_probability=0.3)] == [1, 2]  # 1.2.5 is 1/4
    assert [t for t, _, _ in index.continuations(match, 9, 3, 0.0, branching=False)] == [
        1,
        2,
        5,
    ]  # the most frequent child each time
    assert max(len(_path(nodes, i)) for i in range(len(nodes))) <= 3


def _path(nodes, i):
    return [] if i < 0 else _path(nodes, nodes[i][1]) + [nodes[i][0]]


def test_concurrent_writers_and_readers_leave_the_index_consistent():
    """Threads extending, removing, evicting and matching at once (a server's requests sharing one
    drafter): the counts equal a rebuild afterwards, and no reader raised."""
    index, errors = SuffixIndex(max_depth=5), []

    def work(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for i in range(300):
                key = (seed, rng.randint(0, 5))
                roll = rng.random()
                if roll < 0.5:
                    index.extend(key, [rng.randint(0, 4) for _ in range(rng.randint(1, 6))])
                elif roll < 0.7:
                    index.remove(key)
                elif roll < 0.75:
                    index.evict(10, 200)
                else:
                    match = index.longest_match([rng.randint(0, 4) for _ in range(6)], 4)
                    if match:
                        index.continuations(match, 8, 3, 0.0)
        except Exception as err:  # noqa: BLE001
            errors.append(err)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    index.check()


# --- the drafter --------------------------------------------------------------------------------------


def _request(sequences, k, trees=False, rows=None):
    rows = list(range(len(sequences))) if rows is None else rows
    return DraftRequest(rows, sequences, [k] * len(rows), False, None, trees=trees)


def test_drafts_from_the_rows_own_tokens_then_from_earlier_outputs():
    drafter = hf_spin.SuffixDrafter()
    drafter.start(None, [[5, 6, 7, 8, 5, 6]])
    draft = drafter.draft(_request([[5, 6, 7, 8, 5, 6]], 3))
    assert draft.tokens == [[7, 8]] and draft.match_lengths == [2]  # 5 6 -> 7 8 (5 6 ends the row: not proposed)
    drafter.end_rows([0], [[8, 5, 6]])
    drafter.finish()
    assert drafter.index.tokens == 3  # the output only, not the prompt
    drafter.start(None, [[1, 8, 5]])
    assert drafter.draft(_request([[1, 8, 5]], 3)).tokens == [[6]]  # learned: 8 5 -> 6
    drafter.reset()
    assert drafter.draft(_request([[1, 8, 5]], 3)).tokens == [[]]


def test_a_draft_is_as_deep_as_the_match_is_long():
    drafter = hf_spin.SuffixDrafter(spec_factor=1.0)
    history = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    for tail, depth in (([8, 1], 1), ([8, 1, 2], 2), ([8, 1, 2, 3], 3)):
        drafter.start(None, [history + tail])
        assert len(drafter.draft(_request([history + tail], 8)).tokens[0]) == depth
    with pytest.raises(ValueError, match="spec_factor"):
        hf_spin.SuffixDrafter(spec_factor=0)


def test_a_tree_branches_where_earlier_outputs_went_two_ways():
    drafter = hf_spin.SuffixDrafter()
    for name in (11, 12):
        drafter.learn([39, 40, 41, 42, 43, name, 44])  # '{ "name" : X }' twice with two values
    drafter.start(None, [[7, 39, 40, 41]])
    draft = drafter.draft(_request([[7, 39, 40, 41]], 5, trees=True))
    tree = draft.trees[0]
    assert draft.tokens == [[42, 43, 11]]  # the chain: the first of two equally frequent values
    assert tree.tokens == [42, 43, 11, 12] and tree.parents == [-1, 0, 1, 1]
    assert tree.weights == pytest.approx([1.0, 1.0, 0.5, 0.5]) and tree.q == [None] * 4  # deterministic proposals
    assert drafter.draft(_request([[7, 39, 40, 41]], 5, trees=False)).trees is None


def test_memory_stays_within_its_bound_over_a_long_run():
    rng = random.Random(2)
    drafter = hf_spin.SuffixDrafter(max_depth=8, max_requests=50, max_tokens=2000)
    for i in range(600):
        drafter.learn([rng.randint(0, 30) for _ in range(rng.randint(1, 120))])
        assert len(drafter.index) <= 50 and drafter.index.tokens <= 2000
        assert drafter.index.nodes <= drafter.index.tokens * drafter.max_depth
    drafter.index.check()
    drafter.learn(list(range(5000)))  # longer than the budget: its last 2000 tokens
    assert drafter.index.tokens == 2000 and len(drafter.index) == 1


def test_rows_follow_the_batch_as_it_shrinks_and_grows():
    drafter = hf_spin.SuffixDrafter()
    drafter.start(None, [[1, 2, 3, 1, 2], [4, 5, 6, 4, 5]])
    drafter.add_rows([[7, 8, 9, 7, 8]])
    drafter.select_rows(torch.tensor([2, 0]))
    sequences = [[7, 8, 9, 7, 8], [1, 2, 3, 1, 2]]
    assert drafter.draft(_request(sequences, 1)).tokens == [[9], [3]]


# --- through the engine -------------------------------------------------------------------------------

MAX_NEW_TOKENS = 24
SUFFIX_ARCHS = tuple(ARCHS)
POOL_ARCHS = ("llama", "gpt2", "gemma2", "opt", "falcon", "bloom", "mixtral", "qwen2_moe")


@functools.lru_cache(maxsize=None)
def _case(arch: str, batch: int):
    return greedy_case(tiny_model(arch, seed=0), batch, 14, MAX_NEW_TOKENS)


def _two_calls(arch: str, batch: int, pool) -> list[hf_spin.GenerationStats]:
    """Two calls through one pool, each equal to plain generate; the stats of each."""
    target = tiny_model(arch, seed=0)
    inputs, reference = _case(arch, batch)
    stats = []
    for _ in range(2):
        out = target.generate(**inputs, custom_generate=hf_spin.generate, assistant_pool=pool)
        assert torch.equal(out, reference), (out, reference)
        assert all(d.failures == 0 for d in pool.last_stats.drafters.values()), str(pool.last_stats)
        stats.append(pool.last_stats)
    return stats


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("arch", SUFFIX_ARCHS)
def test_suffix_alone_equals_plain_generate(arch, batch, one_thread):
    """The second call drafts from the first's outputs too: more accepted tokens, still identical."""
    pool = spin_pool(["suffix"])
    first, second = _two_calls(arch, batch, pool)
    assert_speculated(second, rejected=False)
    assert second.drafters["suffix"].accepted > first.drafters["suffix"].accepted, (str(first), str(second))


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("arch", POOL_ARCHS)
def test_suffix_in_a_pool_equals_plain_generate(arch, batch, one_thread):
    pool = spin_pool([perturbed(arch), "suffix"], policy="round_robin")
    _, second = _two_calls(arch, batch, pool)
    model, suffix = (second.drafters[name] for name in pool.names)
    assert model.steps >= 1 and suffix.steps >= 1 and suffix.accepted >= 1, str(second)


def test_pool_reset_forgets_earlier_requests():
    pool = spin_pool(["suffix"])
    _two_calls("llama", 1, pool)
    assert pool.drafters[0].index.tokens == 2 * MAX_NEW_TOKENS
    pool.reset()
    assert pool.drafters[0].index.tokens == 0


def test_failed_rows_teach_nothing():
    """Rows that end teach the index their output; a row that failed teaches nothing."""
    from hf_spin.step.engine import SpinEngine
    from hf_spin.step.rows import Request

    target = tiny_model("llama", seed=0)
    pool = spin_pool(["suffix"])
    engine = SpinEngine(target, pool)
    rows = [engine.add(Request(prompt=[5 + i, 9, 9, 7], max_new_tokens=10)) for i in range(3)]
    engine.step()
    rows[1].fail("planted fault")
    while engine.has_work:
        engine.step()
    engine.close()
    assert [r.finish_reason for r in rows] == ["length", "error", "length"]
    assert pool.drafters[0].index.tokens == len(rows[0].generated) + len(rows[2].generated) == 20
