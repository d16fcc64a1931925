"""Token trees (hf_spin/verify/token_tree.py) and their verification (hf_spin/verify/trees.py).

Hand-built cases for the tree's bookkeeping and both walks; then the sampled walk against the exact
distribution of the first two tokens, with branching >= 2 at both levels, for sampled (model
drafter) candidates, deterministic (prompt lookup) candidates, a mix, a suffix drafter's tree and a
model drafter's grown tree, and a lossy control (each candidate tested against p instead of the
residual) that the same check rejects.
"""

from __future__ import annotations

import pytest
import torch

from hf_spin.drafters import DraftRequest
from hf_spin.verify.token_tree import TokenTree
from hf_spin.verify.trees import verify_tree_greedy, verify_tree_sampling, walk_sampling

from .test_sampling import ALPHA, fits

V = 5


def test_chain_is_a_tree_with_one_child_per_node():
    tree = TokenTree.chain([4, 5, 6])
    assert tree.parents == [-1, 0, 1] and tree.depths() == [1, 2, 3] and tree.order == [0, 1, 2]
    assert tree.path(2) == [0, 1, 2] and tree.children(0) == [1]
    assert torch.equal(tree.ancestor_mask(), torch.tril(torch.ones(4, 4, dtype=torch.bool)))


def test_merge_sums_weights_and_keeps_separate_proposals_apart():
    q = torch.full((2, V), 1 / V)
    a = TokenTree.chain([1, 2], drafter=0)
    b = TokenTree.chain([1, 3], drafter=1)
    c = TokenTree.chain([1, 2], q=q, drafter=2)  # sampled: not merged with the deterministic [1, 2]
    tree = TokenTree.merge([a, b, c], weights=[0.5, 0.3, 0.2])
    assert tree.tokens == [1, 2, 3, 1, 2] and tree.parents == [-1, 0, 0, -1, 3]
    assert tree.weights == pytest.approx([0.8, 0.5, 0.3, 0.2, 0.2])
    assert tree.depths() == [1, 2, 2, 1, 2]
    mask = tree.ancestor_mask()  # slot 0 the root, slot i + 1 node i
    assert mask[3].tolist() == [True, True, False, True, False, False]  # node 2 sees the root, node 0, itself
    assert mask[5].tolist() == [True, False, False, False, True, True]


def test_a_token_drawn_twice_is_one_node_and_two_candidates():
    q = torch.full((V,), 1 / V)
    tree = TokenTree()
    first = tree.add(-1, 3, drafter=0, q=q)
    tree.add(-1, 1, drafter=0, q=q)
    assert tree.add(-1, 3, drafter=0, q=q) == first
    assert tree.tokens == [3, 1] and tree.candidates(-1) == [0, 1, 0]
    tree.add(-1, 1, drafter=0)  # deterministic 1: its own node, tried once
    tree.add(-1, 1, drafter=1)
    assert tree.candidates(-1) == [0, 1, 0, 2]
    with pytest.raises(ValueError, match="parent 7 is not a node of a tree of 3 nodes"):
        tree.add(7, 1)


def test_greedy_walk_takes_the_matching_child_and_adds_the_next_argmax():
    tree = TokenTree()
    a = tree.add(-1, 7)
    tree.add(a, 8)
    b = tree.add(a, 9)
    scores = torch.zeros(4, 10)
    for slot, best in enumerate([7, 9, 4, 2]):
        scores[slot, best] = 1.0
    verdict = verify_tree_greedy(scores, tree)
    assert verdict.path == [a, b] and verdict.next_token == 2
    scores[0] = 0
    scores[0, 6] = 1.0  # the root's argmax is no child: nothing accepted, 6 recovered
    assert verify_tree_greedy(scores, tree).path == [] and verify_tree_greedy(scores, tree).next_token == 6


def test_sampled_walk_on_certain_and_impossible_candidates():
    tree = TokenTree()
    a = tree.add(-1, 0)
    b = tree.add(-1, 1)
    p = torch.tensor([[0.0, 1.0, 0.0], [0.2, 0.3, 0.5], [0.0, 0.0, 1.0]])  # slot 0: the root; 1: node a; 2: node b
    for seed in range(20):
        verdict = verify_tree_sampling(p, tree, torch.Generator().manual_seed(seed))
        assert verdict.path == [b] and verdict.next_token == 2  # 0 impossible, 1 certain; b is a leaf: bonus from p[2]
    p[0] = torch.tensor([0.5, 0.5, 0.0])  # if 0 is rejected the residual is all on 1: 2 never comes out
    outcomes = {tuple(verify_tree_sampling(p, tree, torch.Generator().manual_seed(s)).path) for s in range(60)}
    assert outcomes == {(a,), (b,)}


def test_walk_reads_the_first_accepted_draw_in_order():
    tree = TokenTree()
    q = torch.full((V,), 1 / V)
    tree.add(-1, 2, q=q)
    tree.add(-1, 3, q=q)
    assert walk_sampling([False, True], [4, 0, 0], tree).path == [1]
    assert walk_sampling([True, True], [4, 0, 0], tree).path == [0]
    assert walk_sampling([False, False], [4, 0, 0], tree).next_token == 4


# --- the sampled walk keeps the target's two-token distribution -----------------------------------


def _target(seed: int):
    g = torch.Generator().manual_seed(seed)
    p0 = torch.softmax(2 * torch.randn(V, generator=g), 0)  # [V] the first token
    p1 = torch.softmax(2 * torch.randn(V, V, generator=g), 1)  # [V, V] the second, given the first
    q0 = torch.softmax(2 * torch.randn(V, generator=g), 0)  # a drafter's own guesses
    q1 = torch.softmax(2 * torch.randn(V, V, generator=g), 1)
    return p0, p1, q0, q1


def _tree(kind: str, q0, q1, g) -> TokenTree:
    """Branching 2-3 at the root and 2 under each root child."""
    tree = TokenTree()
    if kind in ("lookup", "mixed"):  # deterministic candidates: fixed tokens (several n-gram matches)
        for first, seconds in ((1, (2, 0)), (3, (3, 4))):
            node = tree.add(-1, first, drafter=0)
            for second in seconds:
                tree.add(node, second, drafter=0)
    if kind == "suffix":  # a suffix drafter's tree: earlier outputs continued the context 1 or 3, then two ways each
        tree = _suffix_tree()
    if kind == "grown":  # a model drafter's grown trees (deterministic top children), one of several prompts
        trees = _grown_trees()
        tree = trees[int(torch.randint(len(trees), (1,), generator=g))]
    if kind in ("model", "mixed"):  # i.i.d. draws from the drafter, 2 under each drawn child
        for first in torch.multinomial(q0, 3 if kind == "model" else 2, replacement=True, generator=g).tolist():
            node = tree.add(-1, first, drafter=1, q=q0)
            if len(tree.candidates(node)) == 0:
                for second in torch.multinomial(q1[first], 2, replacement=True, generator=g).tolist():
                    tree.add(node, second, drafter=1, q=q1[first])
    return tree


_GROWN: list[TokenTree] = []


def _grown_trees() -> list[TokenTree]:
    """Trees a real `ModelDrafter` grows (a tiny random model over the test's V tokens, width 2, two
    levels, cut to its 4 heaviest nodes) for 16 prompts, made once; those that branch at both levels."""
    if not _GROWN:
        from hf_spin.drafters import ModelDrafter

        from .archs import tiny_model

        drafter = ModelDrafter(tiny_model("llama", seed=5, vocab_size=V), tree_width=2)
        prompts = [[3, i // 5, 4, i % 5] for i in range(16)]
        drafter.start(drafter.model, prompts)
        draft = drafter.draft(DraftRequest(list(range(16)), prompts, [2] * 16, True, None, trees=True))
        _GROWN.extend(
            t for t in draft.trees if len(t.children(-1)) == 2 and any(len(t.children(n)) == 2 for n in t.children(-1))
        )
        assert len(_GROWN) >= 3, f"only {len(_GROWN)} of 16 grown trees branch at both levels"
    return _GROWN


def _suffix_tree() -> TokenTree:
    import hf_spin

    drafter = hf_spin.SuffixDrafter()
    for output in ([0, 0, 1, 2], [0, 0, 1, 0], [0, 0, 3, 3], [0, 0, 3, 4]):
        drafter.learn(output)
    drafter.start(None, [[4, 0, 0]])
    draft = drafter.draft(DraftRequest([0], [[4, 0, 0]], [6], True, None, trees=True))
    return draft.trees[0]


def _slots(tree: TokenTree, p0, p1) -> torch.Tensor:
    """[N + 1, V] the target after the root and after each node (depth 1: p1 of its token; deeper slots
    are never needed for the first two tokens)."""
    return torch.stack([p0] + [p1[t] if d == 1 else p0 for t, d in zip(tree.tokens, tree.depths())])


def _first_two(verdict, tree, p1, g) -> tuple[int, int]:
    emitted = [tree.tokens[n] for n in verdict.path] + [verdict.next_token]
    if len(emitted) == 1:  # the next step would draw the second token from the target
        emitted.append(int(torch.multinomial(p1[emitted[0]], 1, generator=g)))
    return emitted[0], emitted[1]


def _lossy(p: torch.Tensor, tree: TokenTree, g):
    """The control: each candidate tested against p itself, no residual, no q (accept x with p(x))."""
    from hf_spin.verify.trees import TreeVerdict

    path, node = [], -1
    while True:
        chosen = next(
            (
                c
                for c in tree.candidates(node)
                if float(torch.rand(1, generator=g)) < float(p[node + 1, tree.tokens[c]])
            ),
            None,
        )
        if chosen is None:
            return TreeVerdict(path, int(torch.multinomial(p[node + 1], 1, generator=g)))
        path.append(chosen)
        node = chosen


def _counts(kind: str, verify, n: int, seed: int):
    p0, p1, q0, q1 = _target(seed)
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V * V)
    for _ in range(n):
        tree = _tree(kind, q0, q1, g)
        a, b = _first_two(verify(_slots(tree, p0, p1), tree, g), tree, p1, g)
        counts[a * V + b] += 1
    return counts, (p0[:, None] * p1).reshape(-1)


@pytest.mark.parametrize("kind", ["model", "lookup", "mixed", "suffix", "grown"])
def test_sampled_tree_keeps_the_two_token_distribution(kind):
    counts, exact = _counts(kind, verify_tree_sampling, 4000, seed=3)
    assert fits(counts, exact) > ALPHA, f"{kind}: {counts.tolist()}"


@pytest.mark.parametrize("kind", ["model", "lookup", "suffix", "grown"])
def test_the_check_rejects_a_verifier_without_residuals(kind):
    counts, exact = _counts(kind, _lossy, 4000, seed=3)
    assert fits(counts, exact) < ALPHA


def test_a_sampled_candidate_is_accepted_as_often_as_speculative_sampling_says():
    """One child drawn from q is accepted with probability sum_x min(p(x), q(x)) (reading it as a
    deterministic proposal would keep the distribution but accept only sum_x p(x) q(x))."""
    from scipy.stats import binomtest

    p0, p1, q0, _ = _target(5)
    g = torch.Generator().manual_seed(5)
    n, accepted = 3000, 0
    for _ in range(n):
        tree = TokenTree()
        tree.add(-1, int(torch.multinomial(q0, 1, generator=g)), q=q0)
        accepted += verify_tree_sampling(_slots(tree, p0, p1), tree, g).accepted
    expected = torch.minimum(p0, q0).sum().item()
    assert abs(expected - (p0 * q0).sum().item()) > 0.1  # the two readings differ enough to tell apart
    assert binomtest(accepted, n, expected).pvalue > ALPHA, (accepted / n, expected)


# --- a tree verified in one forward on packed rows --------------------------------------------------


def _random_tree(g, nodes: int, vocab: int) -> TokenTree:
    tree = TokenTree()
    for _ in range(nodes):
        tree.add(int(torch.randint(-1, len(tree), (1,), generator=g)), int(torch.randint(3, vocab, (1,), generator=g)))
    return tree


@pytest.mark.parametrize("cache_kind", ["packed", "rectangular"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])  # sliding windows and trees: not together (kernels/)
def test_every_tree_slot_scores_its_own_path_and_the_kept_path_decodes_on(arch, cache_kind):
    """Two rows with random trees after ragged prompts: the logits at each slot equal a plain forward
    over prompt + the slot's path; after keep_paths the cache continues exactly like a fresh forward
    (packed rows: the kernel's tree masks; the rectangular cache: a 4D mask, rejected nodes left as holes)."""
    from hf_spin.cache import PackedCache, RectangularCache, forward_ragged, forward_tree

    from .archs import VOCAB, tiny_model

    model = tiny_model(arch)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (9, 5)]
    trees = [_random_tree(g, 7, VOCAB), _random_tree(g, 4, VOCAB)]
    cache = PackedCache(2) if cache_kind == "packed" else RectangularCache(torch.zeros(2, 0, dtype=torch.bool))
    with torch.no_grad():
        forward_ragged(model, cache, [p[:-1] for p in prompts])
        bases = [len(p) - 1 for p in prompts]
        logits = forward_tree(model, cache, [p[-1] for p in prompts], trees)  # [2, 1 + N, V]

        def plain(tokens):
            return model(torch.tensor([tokens])).logits[0, -1]

        for b, (prompt, tree) in enumerate(zip(prompts, trees)):
            assert torch.allclose(logits[b, 0], plain(prompt), atol=1e-5)
            for node in range(len(tree)):
                path = [tree.tokens[n] for n in tree.path(node)]
                assert torch.allclose(logits[b, node + 1], plain(prompt + path), atol=1e-5), (b, node)
        paths = [trees[0].path(len(trees[0]) - 1), []]
        cache.keep_paths(bases, paths)
        nxt = [[5], [6]]
        after = forward_ragged(model, cache, nxt, all_logits=False)  # [2, 1, V]
        for b, (prompt, tree, path) in enumerate(zip(prompts, trees, paths)):
            assert torch.allclose(after[b, 0], plain(prompt + [tree.tokens[n] for n in path] + nxt[b]), atol=1e-5), b


# --- the engine verifies a vote's whole tree on packed rows ------------------------------------------

# Architectures whose attention goes through AttentionInterface without sliding windows (packed rows
# with tree masks): 16 of the 40 in tests/archs.py that qualify, across families, among the 33 whose
# 40-token greedy run repeats itself enough for prompt lookup to find two continuations of a match
# (gpt_neox, gptj and starcoder2, for one, do not at batch 1 or 4).
TREE_ARCHS = (
    "llama",
    "qwen2",
    "qwen3",
    "gemma",
    "phi",
    "phi3",
    "gpt2",
    "codegen",
    "opt",
    "olmo",
    "olmo2",
    "cohere",
    "granite",
    "mixtral",
    "deepseek_v3",
    "glm4",
)
# (prompt length, new tokens) per kind: prompt lookup needs a longer run to branch
CASE = {"lookup": (24, 40), "vote": (12, 20)}


@pytest.fixture
def verified_trees(monkeypatch):
    """Every tree the engine verifies, recorded."""
    import hf_spin.step.tree_step as tree_step

    seen: list[TokenTree] = []
    real = tree_step.verify

    def verify(engine, trees):
        seen.extend(trees)
        return real(engine, trees)

    monkeypatch.setattr(tree_step, "verify", verify)
    return seen


def _pool(arch: str, kind: str, cache: str = "packed"):
    """ "lookup": prompt lookup alone, every distinct continuation of its matches a branch; "vote": two
    noisy copies of the target and prompt lookup, their drafts merged into one tree (branching where
    they disagree)."""
    import hf_spin

    from .speculation import multi_token, perturbed

    drafters = (
        ["prompt_lookup"]
        if kind == "lookup"
        else [perturbed(arch, seed=1), perturbed(arch, seed=2, scale=0.4), "prompt_lookup"]
    )
    return hf_spin.AssistantPool(
        drafters, policy="vote" if kind == "vote" else "fixed", draft_length=multi_token(), cache=cache
    )


@pytest.mark.parametrize("cache_kind", ["packed", "rectangular", "static"])
@pytest.mark.parametrize("kind", ["lookup", "vote"])
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("arch", TREE_ARCHS)
def test_trees_equal_plain_generate(arch, batch, kind, cache_kind, verified_trees, one_thread):
    """Each step verifies every row's tree whole in one forward (packed rows, the rectangular cache with a 4D
    mask, or the static layout's query slots); greedy output as plain `generate`."""
    import hf_spin

    from .archs import tiny_model
    from .speculation import assert_speculated, greedy_case

    target = tiny_model(arch)
    inputs, reference = greedy_case(target, batch, *CASE[kind])
    pool = _pool(arch, kind, cache=cache_kind)
    out = target.generate(custom_generate=hf_spin.generate, assistant_pool=pool, **inputs)
    assert torch.equal(out, reference)
    assert_speculated(pool.last_stats)
    assert any(len(t.children(n)) >= 2 for t in verified_trees for n in range(-1, len(t))), "no tree branched"


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("arch", TREE_ARCHS)
def test_model_drafter_trees_equal_plain_generate(arch, batch, verified_trees, one_thread):
    """A model drafter grows its own tree a depth at a time (drafters/tree_expansion.py) and the target
    verifies it whole on the rectangular cache: greedy output as plain `generate`, trees branch, and
    some step accepts a branch that is not the drafter's heaviest path."""
    import hf_spin
    import hf_spin.step.tree_step as tree_step

    from .archs import tiny_model
    from .speculation import assert_speculated, greedy_case, multi_token, perturbed

    target = tiny_model(arch)
    inputs, reference = greedy_case(target, batch, *CASE["vote"])
    pool = hf_spin.AssistantPool([perturbed(arch, seed=1)], draft_length=multi_token())
    accepted_off_path = []
    real = tree_step.walk_greedy

    def walk(best, tree):
        verdict = real(best, tree)
        heaviest, node = [], -1  # the path down the heaviest children
        while kids := tree.children(node):
            node = max(kids, key=lambda c: tree.weights[c])
            heaviest.append(node)
        accepted_off_path.append(verdict.path != heaviest[: len(verdict.path)])
        return verdict

    with pytest.MonkeyPatch.context() as m:
        m.setattr(tree_step, "walk_greedy", walk)
        out = target.generate(custom_generate=hf_spin.generate, assistant_pool=pool, **inputs)
    assert torch.equal(out, reference)
    assert_speculated(pool.last_stats)
    assert any(len(t.children(n)) >= 2 for t in verified_trees for n in range(-1, len(t))), "no tree branched"
    assert any(accepted_off_path), "no step accepted a branch other than the heaviest"


def test_sampled_vote_trees_run_in_the_engine(verified_trees):
    """Sampling through the engine's tree step: every row gets its tokens, trees branch, nothing fails
    (the distribution itself: the two-token tests above)."""
    import hf_spin

    from .archs import ragged_batch, tiny_model
    from .speculation import multi_token, perturbed

    target = tiny_model("llama")
    ids, mask = ragged_batch(3, 10)
    pool = hf_spin.AssistantPool(
        [perturbed("llama", seed=1), perturbed("llama", seed=2, scale=0.4), "prompt_lookup"],
        policy="vote",
        draft_length=multi_token(),
        cache="packed",
    )
    out = target.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=16,
        do_sample=True,
        top_k=0,
        custom_generate=hf_spin.generate,
        assistant_pool=pool,
    )
    assert out.shape[0] == 3 and 10 < out.shape[1] <= 26
    stats = pool.last_stats
    assert sum(d.failures for d in stats.drafters.values()) == 0 and stats.acceptance_rate > 0
    assert any(len(t.children(n)) >= 2 for t in verified_trees for n in range(-1, len(t)))


@pytest.mark.parametrize("arch", ["llama", "gpt2", "phi3"])
def test_trees_under_processors_that_read_the_tokens(arch, verified_trees, one_thread):
    """repetition_penalty and min_new_tokens read the tokens before a slot: each slot of a vote's tree
    is scored after its own path, and the output stays plain `generate`'s."""
    import hf_spin

    from .archs import tiny_model
    from .speculation import greedy_case

    target = tiny_model(arch)
    inputs, _ = greedy_case(target, 4, *CASE["vote"])
    inputs = {**inputs, "repetition_penalty": 3.0, "min_new_tokens": 20}
    reference = target.generate(**inputs)
    pool = _pool(arch, "vote")
    out = target.generate(custom_generate=hf_spin.generate, assistant_pool=pool, **inputs)
    assert torch.equal(out, reference)
    assert any(len(t.children(n)) >= 2 for t in verified_trees for n in range(-1, len(t))), "no tree branched"


def test_seeded_rows_give_the_same_tokens_with_trees_as_with_chains(verified_trees):
    """A seeded row's tokens are a function of its seed (Gumbel-max, noise fixed per position): the tree
    walk over log p + noise at each slot's depth gives exactly the chain's tokens."""
    from transformers import LogitsProcessorList, TemperatureLogitsWarper

    import hf_spin
    from hf_spin.step.engine import SpinEngine
    from hf_spin.step.rows import Request

    from .archs import tiny_model
    from .speculation import multi_token, perturbed

    target = tiny_model("llama")
    drafters = [perturbed("llama", seed=1), perturbed("llama", seed=2, scale=0.4), "prompt_lookup"]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 96, (n,), generator=g).tolist() for n in (9, 6, 11)]

    def generated(tree):
        pool = hf_spin.AssistantPool(drafters, policy="vote", draft_length=multi_token(), cache="packed", tree=tree)
        engine = SpinEngine(target, pool)
        sharp = LogitsProcessorList([TemperatureLogitsWarper(0.3)])  # drafts accepted often, off the first branch too
        rows = [
            engine.add(Request(prompt=p, max_new_tokens=24, do_sample=True, seed=s, processors=sharp))
            for s, p in enumerate(prompts)
        ]
        while engine.has_work:
            engine.step()
        return [r.generated for r in rows]

    chains = generated(False)
    assert not verified_trees
    assert generated("auto") == chains
    assert any(len(t.children(n)) >= 2 for t in verified_trees for n in range(-1, len(t))), "no tree branched"


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("arch", TREE_ARCHS)
def test_suffix_trees_equal_plain_generate(arch, batch, verified_trees, one_thread):
    """Suffix drafting's trees (the likeliest continuations in the row's own tokens and earlier
    outputs) verified whole on packed rows, equal to plain `generate`. The drafter first learns each
    row's true continuation and, for every position, a copy that goes wrong there; its trees, cut
    shallow (a quarter of the match deep), spend their nodes on those wrong siblings."""
    import hf_spin

    from .archs import VOCAB, tiny_model
    from .speculation import assert_speculated, greedy_case, multi_token

    target = tiny_model(arch)
    inputs, reference = greedy_case(target, batch, *CASE["lookup"])
    suffix = hf_spin.SuffixDrafter(spec_factor=0.25, min_probability=0.0)  # shallow, wide trees
    for row in reference[:, inputs["input_ids"].shape[1] :].tolist():
        suffix.learn(row)
        for j in range(len(row)):
            suffix.learn(row[:j] + [(row[j] + 1) % VOCAB])
    pool = hf_spin.AssistantPool([suffix], draft_length=multi_token(), cache="packed")
    out = target.generate(custom_generate=hf_spin.generate, assistant_pool=pool, **inputs)
    assert torch.equal(out, reference)
    assert pool.last_stats.drafters["suffix"].failures == 0
    assert_speculated(pool.last_stats)
    assert any(len(t.children(n)) >= 2 for t in verified_trees for n in range(-1, len(t))), "no tree branched"
