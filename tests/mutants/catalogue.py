"""The mutants: one deliberate bug each, and the tests that must fail on it.

A mutant replaces one exact snippet of one package file (`old`, which must occur there exactly
once, so that a refactor that moves the code makes the mutant fail loudly instead of silently
testing nothing) with `new`. `tests` are pytest node ids, every one of which must fail. Add one per
feature as it lands (docs/testing.md).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    name: str
    why: str  # the bug, as a user would meet it
    path: str  # package file, relative to the repository root
    old: str
    new: str
    tests: tuple[str, ...]  # node ids that must fail


EQ = "tests/test_equivalence.py::"
SAMPLING = "tests/test_sampling.py::"
WIDTHS = "tests/test_widths.py::test_a_widened_verification_commits_what_plain_generate_does_and_pays"
RUN_AHEAD = "tests/test_run_ahead.py::"
STATIC_DRAFTER = "tests/test_static_drafter.py::test_static_drafter_is_lossless_and_drafts_as_on_its_dynamic_cache"
TREE_CHILDREN = "tests/test_tree_expansion.py::test_children_are_the_drafters_likeliest_tokens_after_their_path"

MUTANTS = (
    Mutant(
        "greedy_accepts_every_draft",
        "greedy verification accepts drafts the target would not have produced",
        "hf_spin/verify/chains.py",
        "ok = (drafts == target_tokens[:, :K]) & _draft_mask(draft_lengths, K)",
        "ok = _draft_mask(draft_lengths, K)",
        (
            "tests/test_verification.py::test_greedy_accepts_matching_prefix_then_corrects",
            EQ + "test_greedy_equivalence[llama-other_chain-1]",
            EQ + "test_greedy_equivalence[gpt2-prompt_lookup-4]",
        ),
    ),
    Mutant(
        "sampling_accepts_every_draft",
        "rejection sampling never rejects: the output follows q, not p",
        "hf_spin/verify/chains.py",
        "ok = (r * q_draft < p_draft) & valid",
        "ok = valid",
        (
            SAMPLING + "test_verifier_first_token_follows_p[model_q]",
            SAMPLING + "test_engine_sampling_matches_target_distribution[model]",
        ),
    ),
    Mutant(
        "engine_drops_every_draft",
        "every step decodes plainly: lossless, but no speculation at all",
        "hf_spin/step/engine.py",
        "            plan,\n            chosen,\n            ks,\n            drafts,\n            qs,\n            proposals,\n            draft_seconds,\n            shadows,\n            match_lengths,\n            trees if any(t is not None for t in trees) else None,",
        "            plan, chosen, ks, [[] for _ in drafts], [None] * B, proposals, draft_seconds, shadows, match_lengths, None,",
        (
            EQ + "test_greedy_equivalence[llama-prompt_lookup-1]",
            EQ + "test_greedy_equivalence[llama-self-4]",
            "tests/test_packed_cache.py::test_greedy_output_equals_plain_generate[prompt_lookup-llama-4]",
            "tests/test_server.py::test_pipelined_server_greedy_equals_plain_generate[two_micro_batches]",
        ),
    ),
    Mutant(
        "target_cache_keeps_the_first_rejected_draft",
        "after a rejection the target's cache keeps the rejected token's KV",
        "hf_spin/step/engine.py",
        "                [len(r.sequence) - 1 for r in rows]",
        "                [len(r.sequence) - 1 + (accepted[b] < len(proposal.drafts[b])) for b, r in enumerate(rows)]",
        (
            EQ + "test_greedy_equivalence[llama-other_chain-1]",
            EQ + "test_greedy_equivalence[qwen2-other_chain-4]",
            "tests/test_packed_cache.py::test_greedy_output_equals_plain_generate[other-llama-4]",
        ),
    ),
    Mutant(
        "drafter_cache_never_rolled_back",
        "a model drafter keeps the KV of its rejected drafts: lossless, but its drafts go wrong",
        "hf_spin/drafters/model.py",
        "        self.cache.rollback(keep)\n        return self._forward(chunks, keep), draft_seqs",
        "        return self._forward(chunks, keep), draft_seqs",
        ("tests/test_drafters.py::test_model_drafter_after_rollbacks_drafts_what_a_fresh_one_does[rectangular]",),
    ),
    Mutant(
        "sampling_uses_the_first_positions_q",
        "rejection sampling reads draft position 0's q at every position (lossy past the first draft token)",
        "hf_spin/verify/chains.py",
        "        q = torch.where(deterministic, one_hot, q)\n",
        "        q = torch.where(deterministic, one_hot, q)[:, :1].expand(-1, K, -1)\n",
        (
            SAMPLING + "test_verifier_second_token_follows_p",
            SAMPLING + "test_engine_sampling_matches_target_distribution[model]",
        ),
    ),
    Mutant(
        "streaming_drafter_never_rebuilds",
        "a streaming drafter rolls back into evicted tokens instead of rebuilding the row",
        "hf_spin/drafters/streaming.py",
        "if evicted and keep < self.sink_tokens + evicted:",
        "if False:",
        ("tests/test_drafters_fast.py::test_streaming_greedy_equivalence[llama-self-window<k-1]",),
    ),
    Mutant(
        "recovered_token_from_p",
        "after a rejection the recovered token is drawn from p instead of the residual max(0, p - q)",
        "hf_spin/verify/chains.py",
        "dist = torch.where(rejected[:, None] & residual_ok, residual, p_next)",
        "dist = p_next",
        (
            SAMPLING + "test_verifier_first_token_follows_p[model_q]",
            SAMPLING + "test_engine_sampling_matches_target_distribution[model]",
        ),
    ),
    Mutant(
        "planner_ignores_the_profile",
        "the planner takes every draft slot it is offered whatever the measured costs: slower than plain where verification is expensive",
        "hf_spin/planning/planner.py",
        "        return rate > best\n",
        "        return True\n",
        (
            "tests/test_planning.py::test_plain_when_verification_grows_linearly_at_moderate_acceptance",
            "tests/test_planning.py::test_batch_budget_goes_to_the_rows_whose_tokens_are_worth_most[open]",
        ),
    ),
    Mutant(
        "drafter_reads_each_row",
        "a model drafter reads each row's token off the device on its own: a sync per row and draft position (lossless, slow on a GPU)",
        "hf_spin/drafters/model.py",
        "tokens_host, confidence = tokens.tolist(), None",
        "tokens_host, confidence = [int(t) for t in tokens], None",
        ("tests/test_host_syncs.py::test_greedy_step_within_budget_whatever_the_batch[packed]",),  # chains: packed rows
    ),
    Mutant(
        "drafter_tree_reads_each_node",
        "a model drafter growing a tree reads each frontier node's children off the device on its own: a sync per node and depth (lossless, slow on a GPU)",
        "hf_spin/drafters/tree_expansion.py",
        "values, tokens = torch.stack([top.values.double(), top.indices.double()]).tolist()",
        "values, tokens = [v.tolist() for v in top.values.double()], [i.tolist() for i in top.indices.double()]",
        ("tests/test_host_syncs.py::test_greedy_step_within_budget_whatever_the_batch[rectangular]",),
    ),
    Mutant(
        "tree_keeps_the_first_nodes",
        "after a tree verification the target's cache keeps the tree's first nodes instead of the accepted path: later tokens see a branch that was rejected",
        "hf_spin/step/tree_step.py",
        "target.cache.keep_paths(bases, paths)",
        "target.cache.keep_paths(bases, [list(range(len(p))) for p in paths])",
        (
            "tests/test_token_trees.py::test_trees_equal_plain_generate[glm4-4-vote-packed]",
            "tests/test_token_trees.py::test_trees_equal_plain_generate[phi3-4-lookup-packed]",
            "tests/test_token_trees.py::test_trees_equal_plain_generate[llama-4-vote-rectangular]",
        ),
    ),
    Mutant(
        "tree_slots_scored_as_a_chain",
        "processors that read token ids (repetition penalty) score a tree's slot after the tree's first tokens instead of the slot's own path",
        "hf_spin/step/processors.py",
        "before = paths[b][j] if paths is not None else drafts[b][:j]",
        "before = drafts[b][:j]",
        ("tests/test_token_trees.py::test_trees_under_processors_that_read_the_tokens[gpt2]",),
    ),
    Mutant(
        "tree_noise_by_slot",
        "a seeded row's Gumbel noise on a token tree follows the slot index instead of the slot's depth: its tokens change with what was drafted",
        "hf_spin/step/tree_step.py",
        "+ noise.index_select(0, at)  # [n, V]",
        "+ gumbel_noise(row.request.seed, len(row.generated), len(depths), scores.shape[-1], scores.device)  # [n, V]",
        ("tests/test_token_trees.py::test_seeded_rows_give_the_same_tokens_with_trees_as_with_chains",),
    ),
    Mutant(
        "tree_sampling_skips_the_residual",
        "a token tree's later candidates are tested against p instead of what earlier rejections left: sampled output drifts from the target",
        "hf_spin/verify/trees.py",
        "r = (r - q).clamp(min=0.0)",
        "r = r.clone()",
        (
            "tests/test_token_trees.py::test_sampled_tree_keeps_the_two_token_distribution[model]",
            "tests/test_token_trees.py::test_sampled_tree_keeps_the_two_token_distribution[mixed]",
        ),
    ),
    Mutant(
        "suffix_removal_keeps_deep_counts",
        "evicting an earlier request takes back only its one-token substrings: the index grows past its bound and proposes what it forgot",
        "hf_spin/drafters/suffix_index.py",
        "for token in sequence[start : start + self.max_depth]:",
        "for token in sequence[start : start + 1]:",
        (
            "tests/test_suffix.py::test_counts_equal_a_rebuild_after_random_extends_removals_and_evictions",
            "tests/test_suffix.py::test_memory_stays_within_its_bound_over_a_long_run",
        ),
    ),
    Mutant(
        "row_index_matches_its_own_end",
        "a row's own suffix index counts the context's own occurrence at the sequence's end: every suffix matches "
        "itself, and the longest match has nothing after it",
        "hf_spin/drafters/suffix_index.py",
        "starts, at, end = [], 0, 4 * len(self.tokens) - 4",
        "starts, at, end = [], 0, 4 * len(self.tokens)",
        ("tests/test_suffix.py::test_a_rows_sequence_index_answers_as_a_suffix_index_of_its_sequence",),
    ),
    Mutant(
        "suffix_learns_nothing_across_calls",
        "rows that end never reach the drafters' end_rows: the suffix index stays empty across requests",
        "hf_spin/step/engine.py",
        "ended = [b for b, r in enumerate(self.rows) if r.done and r.finish_reason != ERROR]",
        "ended = []",
        (
            "tests/test_suffix.py::test_suffix_alone_equals_plain_generate[llama-1]",
            "tests/test_suffix.py::test_failed_rows_teach_nothing",
        ),
    ),
    Mutant(
        "drafter_tree_nodes_see_their_cousins",
        "a model drafter growing a tree lets each node attend to every node fed before it, not only its ancestors: its children are drafted after the wrong context",
        "hf_spin/drafters/tree_expansion.py",
        "                allowed[row, t, torch.tensor([column[a] for a in trees[row].path(node)[:-1]], dtype=torch.long)] = True",
        "                allowed[row, t, self.start : S] = True",
        (
            TREE_CHILDREN + "[llama-rectangular]",
            TREE_CHILDREN + "[gpt2-rectangular]",
        ),
    ),
    Mutant(
        "static_tree_nodes_see_every_node_fed",
        "on the static layout a model drafter growing a tree lets each node fed attend to every node of its forward, "
        "not only its ancestors: its children are drafted after the wrong context (lossless, wrong drafts)",
        "hf_spin/drafters/tree_expansion.py",
        "visible = torch.tensor([[m in path for m in fed] for path in paths], dtype=torch.bool)",
        "visible = torch.ones(len(fed), len(fed), dtype=torch.bool)",
        (TREE_CHILDREN + "[llama-static]", STATIC_DRAFTER + "[llama-4-eager-trees]"),
    ),
    Mutant(
        "static_tree_keeps_no_path",
        "on the static layout a model drafter that grew a tree feeds only the last depth's frontier and its ancestors, "
        "not its heaviest path: the cache keeps none of the path, and rows that stopped early lose theirs (lossless, "
        "longer catch-ups)",
        "hf_spin/drafters/tree_expansion.py",
        "nodes_of.get(row, []) + _prefix_in(_heaviest_path(trees[row]), self.ever[row])",
        "nodes_of.get(row, [])",
        (
            "tests/test_tree_expansion.py::test_after_a_tree_the_drafter_drafts_as_a_fresh_one[llama-static]",
            "tests/test_tree_expansion.py::test_width_one_grows_the_chain_and_stops_where_the_chain_does[static]",
        ),
    ),
    Mutant(
        "k_ignores_the_room",
        "a step drafts the policy's k whatever room a row has left before its length limit: drafts verified past max_length, forwards paid for tokens never kept",
        "hf_spin/planning/planner.py",
        "ks = [max(0, min(cap, room)) if ds else 0 for cap, room, ds in zip(caps, rooms, chosen)]",
        "ks = [max(0, cap) if ds else 0 for cap, room, ds in zip(caps, rooms, chosen)]",
        (
            "tests/test_planning.py::test_no_step_drafts_past_the_policys_cap_or_the_rows_room[flat]",
            "tests/test_planning.py::test_no_step_drafts_past_the_policys_cap_or_the_rows_room[off]",
            "tests/test_planning.py::test_plan_k_caps_by_the_policy_and_the_room_with_or_without_a_planner",
        ),
    ),
    Mutant(
        "probes_take_the_optimistic_k",
        "a new request probes a drafter with the k its optimistic bound allows, not one token: on a CPU where 8 tokens cost 6 plain steps, every failed probe costs 5 of them (the README demo ran 0.94x plain)",
        "hf_spin/planning/planner.py",
        "sized, probe = self._probe(row_ids, exploit, wanted, chosen, padded, full)",
        "sized, probe = wanted, 0.0",
        (
            "tests/test_exploration.py::test_a_probe_is_one_token_beyond_what_pays_unless_verification_is_flat[avx2_bf16]",
            "tests/test_exploration.py::test_a_probe_is_one_token_beyond_what_pays_unless_verification_is_flat[avx2_fp32]",
        ),
    ),
    Mutant(
        "probes_pay_catch_ups_spread",
        "a probe is charged its row's catch-up spread over the steps optimism promises, not in full: at batch 4 a pool that rates its draft model at 0.86 reads four new prompts for a 30-token answer (0.79x plain on a Xeon)",
        "hf_spin/planning/planner.py",
        "sized, probe = self._probe(row_ids, exploit, wanted, chosen, padded, full)",
        "sized, probe = self._probe(row_ids, exploit, wanted, chosen, padded, catch_up)",
        ("tests/test_planning.py::test_optimism_buys_a_probe_but_not_a_catch_up_the_mean_cannot_repay",),
    ),
    Mutant(
        "a_new_drafters_first_probe_pays_its_catch_up_spread",
        "a drafter the pool has never seen is tried at its catch-up's spread price: a cold pool's first probe of a 0.5B drafter at batch 4 read four prompts, 4.46 s priced 0.31 s, beyond the exploration budget",
        "hf_spin/planning/planner.py",
        "sized, probe = self._probe(row_ids, exploit, wanted, chosen, padded, full)",
        "sized, probe = self._probe(row_ids, exploit, wanted, chosen, padded, [c if ds and all(self.acceptance.evidence(d) == 0 for d in ds) else f for c, f, ds in zip(catch_up, full, chosen)])",
        (
            "tests/test_planning.py::test_optimism_buys_a_probe_but_not_a_catch_up_the_mean_cannot_repay",
            "tests/test_planning.py::test_a_drafter_reads_a_long_prompt_only_where_the_answer_pays_for_it[150-True]",
        ),
    ),
    Mutant(
        "padded_catch_ups_priced_per_row",
        "a padded drafter cache's catch-up is priced as the row's own tokens, though the forward runs every row at the longest lag: one new 300-token prompt at batch 4 read as 300 positions where it runs 1200",
        "hf_spin/planning/planner.py",
        "rows = len(row_ids) if padded else 1",
        "rows = 1",
        ("tests/test_planning.py::test_batch_4_catch_ups_are_priced_as_the_forward_that_runs_them",),
    ),
    Mutant(
        "rows_catching_up_ranked_with_the_rest",
        "slots are ranked by survival alone: a new prompt's catch-up comes with its first slot and prices its neighbours' drafts out",
        "hf_spin/planning/planner.py",
        "            orders.append(sorted(slots, key=lambda x: late[x[2]]))",
        "            pass",
        ("tests/test_planning.py::test_batch_4_catch_ups_are_priced_as_the_forward_that_runs_them",),
    ),
    Mutant(
        "a_probe_starts_on_every_row",
        "a probe's first rung is a token on every row: at batch 4 a new drafter's first probe reads four prompts, beyond the budget, so it is never tried",
        "hf_spin/planning/planner.py",
        "        if len(wanting) > 1:",
        "        if False:",
        ("tests/test_planning.py::test_batch_4_catch_ups_are_priced_as_the_forward_that_runs_them",),
    ),
    Mutant(
        "exploration_budget_carried_across_calls",
        "the exploration budget carries what earlier calls left unspent into a call: one Spec-Bench request spent what the five before it had saved on probes (LBSS 0.94x plain on a math question, AVX2 float32)",
        "hf_spin/step/engine.py",
        "            self.planner.budget.begin()",
        "            pass",
        (
            "tests/test_exploration.py::test_a_call_spends_only_its_own_budget[avx512_bf16]",
            "tests/test_exploration.py::test_a_call_spends_only_its_own_budget[avx2_fp32]",
        ),
    ),
    Mutant(
        "first_probes_have_no_pool_account",
        "a drafter's first probe may spend only the call's share: a draft model whose catch-up costs more than a short call affords is never tried, and a default pool of one 0.5B drafter decodes plainly on every 32-token request",
        "hf_spin/planning/planner.py",
        "learning = any(self._learning(d) for b in wanting for d in chosen[b])",
        "learning = False",
        ("tests/test_planning.py::test_optimism_buys_a_probe_but_not_a_catch_up_the_mean_cannot_repay",),
    ),
    Mutant(
        "the_pool_account_lends_without_limit",
        "a call's first probes may draw the pool's whole account: once the pool has served enough, one 32-token request on a CPU pays a 0.5B drafter's catch-up of its prompt, 10% of its plain time (Spec-Bench qa 0.90x plain, float32)",
        "hf_spin/planning/exploration.py",
        "return max(min(balance, self.call_share - self.lent), 0.0)",
        "return max(balance, 0.0)",
        ("tests/test_planning.py::test_optimism_buys_a_probe_but_not_a_catch_up_the_mean_cannot_repay",),
    ),
    Mutant(
        "idle_catch_up_ignores_the_planner",
        "idle catch-ups run wherever a policy asks, not only where the evidence says they pay: on an AVX2 CPU the README demo spent 30 s of a 104 s prompt catching two draft models up for nothing",
        "hf_spin/step/engine.py",
        "bs = [b for b, w in zip(bs, worth) if w]",
        "bs = list(bs)",
        (
            "tests/test_exploration.py::test_a_drafter_that_cannot_pay_is_not_caught_up_either",
            "tests/test_exploration.py::test_idle_catch_ups_run_only_where_the_evidence_pays_them[avx2_fp32]",
            "tests/test_exploration.py::test_idle_catch_ups_run_only_where_the_evidence_pays_them[avx2_bf16]",
        ),
    ),
    Mutant(
        "planner_values_siblings_as_the_chain",
        "the planner values a token tree's other children each as the heaviest (the chain's survival times their weight "
        "over the heaviest), not by what siblings have earned where the chain failed: prompt lookup's four equal "
        "continuations of a one-token match each worth the chain, eight nodes verified a step on a RAG prompt for none "
        "accepted (AMD EPYC, bf16, LBSS)",
        "hf_spin/planning/planner.py",
        "                    out[k] = base * (1.0 - c) * sibling * tree.weights[k] / rest",
        "                    out[k] = base * c * tree.weights[k] / tree.weights[top]",
        ("tests/test_planning.py::test_trees_are_sized_node_by_node_by_estimated_acceptance",),
    ),
    Mutant(
        "levels_count_their_own_evidence_twice",
        "a position's counts are shrunk toward the pooled acceptance, which already holds them: where one position holds the pool's evidence (a fresh pool), three rejections read as 0.14 and three acceptances as 0.91",
        "hf_spin/planning/acceptance.py",
        "rest = (max(above[0] - la, 0.0), max(above[1] - lr, 0.0))",
        "rest = (above[0], above[1])",
        ("tests/test_planning.py::test_each_level_reads_its_own_counts_once",),
    ),
    Mutant(
        "level_prior_outweighs_what_it_holds",
        "a position's prior weighs LEVEL_WEIGHT observations even where the level above holds nothing beyond the "
        "position's own counts: the evidence-only read of four acceptances at position 1 is 0.5, not 0.67, and a 0.5B "
        "drafter right 4 of 4 drafts nothing on a new prompt on an AMX CPU's bf16 profile",
        "hf_spin/planning/acceptance.py",
        "weight = min(LEVEL_WEIGHT, rest[0] + rest[1] + level_prior[1])",
        "weight = LEVEL_WEIGHT",
        ("tests/test_planning.py::test_each_level_reads_its_own_counts_once",),
    ),
    Mutant(
        "grid_falls_unconfirmed",
        "the grid trusts a fall it read once: where forwards are flat a wider knot read cheaper by chance widens every "
        "plain step (an AMX Xeon, bf16: 8 tokens read 198 ms against 228 for one; on a 709-token prompt those steps "
        "cost 3-5% more)",
        "hf_spin/planning/grid.py",
        "    _confirm_falls(table, lambda n: timed(1, n))",
        "    table = dict(table)",
        ("tests/test_planning.py::test_a_fall_the_grid_reads_by_chance_is_timed_again",),
    ),
    Mutant(
        "warm_ignores_placement",
        "a model warmed once counts as warm after a move or a cast: its first forward on the new device or dtype (its "
        "allocations there) lands in a call its profile priced warm",
        "hf_spin/planning/profiling.py",
        "    return str(model.device), str(model.dtype)",
        "    return ('', '')",
        ("tests/test_planning.py::test_profile_is_cached_per_model_and_threads",),
    ),
    Mutant(
        "forced_rows_regrouped_after_graphs",
        "the replay's forced target regroups a batch prefilled in groups by the rows' first tokens when its hook first "
        "runs steps later (a graph captured mid-call): the rows are past their prompts, nothing fits, and the map the "
        "graphs read is replaced by the groups' order (an H200 replay: 13/16 identical under LBSS at batch 4)",
        "benchmarks/replay/forced.py",
        "                if grouped is not None and self._expected_batch(grouped[0]):",
        "                if False:",
        ("tests/test_replay.py::test_a_batch_prefilled_in_groups_replays_through_graphs_that_run_no_hook",),
    ),
    Mutant(
        "plain_width_trusts_the_grid",
        "plain steps widen wherever the grid read a wider knot as cheaper, never timing the two widths themselves: a "
        "float32 grid on an AMX Xeon read 355 / 348 ms for one / two positions where they ran 269 / 290, and the "
        "default pool ran 0.91-1.02x plain `generate` with nothing drafted",
        "hf_spin/planning/cost_profile.py",
        "        if wide == rows:\n            return rows\n",
        "        if True:\n            return wide\n",
        ("tests/test_widths.py::test_a_fall_the_grid_read_by_noise_is_checked_by_the_steps_themselves[rectangular]",),
    ),
    Mutant(
        "closed_batch_valued_as_open",
        "a `generate` call's batch values every row's token at an equal share of a step, as a server's: it drafts for "
        "rows that then wait for the slowest (batch 4, bf16, an AMX Xeon: LBSS 0.93x plain `generate` on one batch)",
        "hf_spin/step/engine.py",
        "            closed = self._batch is not None and not self.pending",
        "            closed = False",
        ("tests/test_planning.py::test_a_closed_batch_waiting_for_a_row_that_accepts_nothing_decodes_plainly[closed]",),
    ),
    Mutant(
        "warm_up_every_pool",
        "each pool built warms its models with one forward again, though they ran in this process: a pool built per "
        "call (as `assistant_model=` users build one) paid ~0.16 s a call on an H200 (1.5B shape, 128 tokens: 0.64x "
        "static generate against 0.77x with the profile off)",
        "hf_spin/planning/profiling.py",
        "        if _placement(m) not in _WARM.get(m, ()):",
        "        if True:",
        ("tests/test_planning.py::test_profile_is_cached_per_model_and_threads",),
    ),
    Mutant(
        "cross_attention_rows_stay_when_a_row_retires",
        "an encoder-decoder target's cross-attention K/V do not follow a retired row: the rows after it attend to another row's audio or text",
        "hf_spin/cache/encoder_rows.py",
        "                index = rows.to(layer.keys.device)",
        "                index = torch.arange(len(rows), device=layer.keys.device)",
        (
            "tests/test_encoder_decoder.py::test_greedy_equivalence[whisper-prompt_lookup-4]",
            "tests/test_encoder_decoder.py::test_greedy_equivalence[t5-model-4]",
        ),
    ),
    Mutant(
        "request_counted_twice",
        "a request's own acceptance scales the position's in full, though the pool's evidence it is built on may be the request's own: at batch 1 three early rejections read as 0.14 where the pool's levels say 0.24",
        "hf_spin/planning/acceptance.py",
        "/ pooled) ** (1.0 - share)",
        "/ pooled)",
        ("tests/test_planning.py::test_a_request_that_holds_the_pools_evidence_is_not_counted_twice",),
    ),
    Mutant(
        "whisper_cross_attention_kv_swapped",
        "a packaged Whisper's cross-attention reads keys as values and values as keys: transcripts are garbage, and nothing but the round trip notices before a real model runs",
        "hf_spin/speech_models/ct2.py",
        'out |= split(f"{dst}.encoder_attn", f"{src}/attention/linear_1", ("k_proj", "v_proj"))',
        'out |= split(f"{dst}.encoder_attn", f"{src}/attention/linear_1", ("v_proj", "k_proj"))',
        ("tests/test_speech_models.py::test_ct2_round_trip_rebuilds_the_same_model",),
    ),
    Mutant(
        "ct2_int8_scale_multiplied",
        "int8 CTranslate2 weights are multiplied by their scale instead of divided: a quantized checkpoint loads with weights off by a factor of scale squared",
        "hf_spin/speech_models/ct2.py",
        "variables[weight_name] = weight.astype(np.float32) / scale.reshape(",
        "variables[weight_name] = weight.astype(np.float32) * scale.reshape(",
        ("tests/test_speech_models.py::test_read_ct2_dtypes_alias_and_int8_dequantization",),
    ),
    Mutant(
        "remapped_drafter_keeps_its_own_row_order",
        "the re-indexed drafter copies the drafter's embedding rows in their own order instead of looking them up by token string: it proposes the wrong tokens for every id, and its drafts are all rejected",
        "hf_spin/speech_models/vocabulary.py",
        "rows[mapped] = embed[source[mapped]]",
        "rows[mapped] = embed[: int(mapped.sum())]",
        ("tests/test_speech_models.py::test_remapped_drafter_scores_target_ids_as_the_drafter_scored_its_own",),
    ),
    Mutant(
        "draft_vocabulary_scores_the_wrong_ids",
        "a drafter with a draft vocabulary reads its i-th logit as id i instead of the i-th kept id: it proposes the wrong tokens, lossless but rarely accepted",
        "hf_spin/drafters/draft_vocabulary.py",
        "full[:, ids.to(logits.device)] = logits",
        "full[:, : ids.numel()] = logits",
        (
            "tests/test_draft_vocabulary.py::test_a_draft_vocabulary_holding_every_proposal_drafts_as_the_whole_vocabulary_does",
        ),
    ),
    Mutant(
        "drafter_encodes_every_call",
        "an encoder-decoder drafter runs its encoder when the call starts, even where the planner never drafts with it: a Whisper call that decodes plainly pays a second encoder",
        "hf_spin/drafters/encoder_decoder.py",
        "        self.target_cache = target_cache  # its `encoder` follows the engine's rows; read when first needed",
        "        self.target_cache = target_cache\n        self.cache.encoder = self._encode(target_cache.encoder)",
        ("tests/test_encoder_decoder.py::test_a_drafter_runs_its_encoder_only_when_it_first_drafts",),
    ),
    Mutant(
        "drafters_encoder_unpriced",
        "the planner prices a row's catch-up without the drafter's own encoder pass: on short audio it probes a Whisper drafter whose encoder costs more than the probe can repay, and the call runs slower than plain",
        "hf_spin/planning/planner.py",
        "                seconds += cost.encoder",
        "                seconds += 0.0",
        ("tests/test_planning.py::test_a_drafters_own_encoder_is_measured_and_priced_with_its_first_catch_up",),
    ),
    Mutant(
        "static_drafter_cache_never_rolled_back",
        "on the static layout a model drafter's StaticRowCache keeps its rows' lengths after a rejection: it drafts "
        "after the KV of its rejected drafts (lossless, wrong drafts, fewer accepted)",
        "hf_spin/drafters/model.py",
        "        self.cache.rollback(keep)\n        return self._forward(chunks, keep), draft_seqs",
        "        if not isinstance(self.cache, StaticRowCache):\n            self.cache.rollback(keep)\n"
        "        return self._forward(chunks, keep), draft_seqs",
        (
            "tests/test_drafters.py::test_model_drafter_after_rollbacks_drafts_what_a_fresh_one_does[static]",
            STATIC_DRAFTER + "[llama-4-compiled-chains]",
        ),
    ),
    Mutant(
        "static_drafter_reads_the_first_chunk_token",
        "on the static layout a model drafter drafts from the logits of each row's first fed token, not its last: "
        "after a catch-up of two tokens (a whole draft accepted) it drafts the token it already fed (lossless)",
        "hf_spin/cache/static_forward.py",
        "last = [max(n - 1, 0) for n in counts]",
        "last = [0 for n in counts]",
        (
            "tests/test_drafters.py::test_model_drafter_after_rollbacks_drafts_what_a_fresh_one_does[static]",
            STATIC_DRAFTER + "[qwen2-1-eager-chains]",
        ),
    ),
    Mutant(
        "plain_step_verifies_k_plus_one_slots",
        "on the static layout a step that drafted nothing runs the verification's k + 1 query slots, not the "
        "one-token decode (lossless, k + 1 times the plain step's work)",
        "hf_spin/cache/static_forward.py",
        "width = 1 if longest == 1 else cache.query_width(",
        "width = cache.query_width(",
        ("tests/test_static_engine.py::test_a_step_that_drafts_nothing_is_the_one_token_decode",),
    ),
    Mutant(
        "a_lanes_expectations_overwrite_the_others",
        "each pipeline lane's sizing replaces what the call expects its rows to commit with its own rows' alone: "
        "the call's exploration budget follows whichever lane planned last",
        "hf_spin/planning/exploration.py",
        "        for r, n in zip(row_ids, tokens_left):\n            self.expected_rows[r]",
        "        self.expected_rows = {}\n        for r, n in zip(row_ids, tokens_left):\n            self.expected_rows[r]",
        ("tests/test_exploration.py::test_the_expected_tokens_of_every_lane_count_in_the_calls_budget",),
    ),
    Mutant(
        "run_ahead_rows_not_cut_with_the_batch",
        "a forward run ahead keeps the rows that stopped: the next step verifies each row against another row's "
        "logits (wrong tokens wherever a row of a batch stops before the others)",
        "hf_spin/step/engine.py",
        "            self._ahead = self._ahead[to_device(kept, self._ahead.device, torch.long)]",
        "            self._ahead = self._ahead[: len(kept)]",
        (RUN_AHEAD + "test_a_row_stopping_while_a_forward_runs_ahead_leaves_the_others_exact",),
    ),
    Mutant(
        "run_ahead_dropped_without_rollback",
        "a forward run ahead is dropped (rows joining) but its token stays in the target's cache: the next step "
        "feeds that token again, after itself (wrong tokens)",
        "hf_spin/step/engine.py",
        "            self._ahead = None\n            self.cache.rollback([len(r.sequence) - 1 for r in self.rows])",
        "            self._ahead = None",
        (RUN_AHEAD + "test_rows_joining_drop_the_forward_run_ahead_and_stay_exact",),
    ),
    Mutant(
        "catch_up_spread_over_the_length_limit",
        "the planner spreads a catch-up over the row's length limit, not the steps rows are seen to run: with Whisper's 448-token limit a drafter's encoder and prompt look cheap on 20-token transcripts, and drafting loses",
        "hf_spin/planning/planner.py",
        "left = [self.lengths.left(r, room) for r, room in zip(row_ids, rooms)]",
        "left = list(rooms)",
        ("tests/test_planning.py::test_a_catch_up_is_spread_over_the_steps_rows_are_expected_to_run",),
    ),
    Mutant(
        "transcription_prompt_drops_language",
        "the transcription route prompts Whisper without the language token: every request decodes as if the "
        "model had to guess the language, not as `generate(language=...)` does",
        "hf_spin/serving/audio.py",
        'ids += [self.language_id(language or DEFAULT_LANGUAGE), g.task_to_id["transcribe"]]',
        'ids += [g.task_to_id["transcribe"]]',
        ("tests/test_serving_audio.py::test_transcripts_equal_plain_generate_under_concurrency",),
    ),
    Mutant(
        "transcription_ignores_suppression",
        "the transcription route leaves out Whisper's suppress_tokens: the server transcribes tokens that "
        "`generate` never emits",
        "hf_spin/serving/audio.py",
        "chain.append(SuppressTokensLogitsProcessor(g.suppress_tokens))",
        "pass",
        ("tests/test_serving_audio.py::test_transcripts_equal_plain_generate_under_concurrency",),
    ),
    Mutant(
        "profile_key_ignores_compile",
        "the cost profile's cache key does not say how the forwards run: an eager profile stands in for the compiled one (4-6x a compiled step on a GPU), and the planner compares drafting against the wrong plain step",
        "hf_spin/planning/profiling.py",
        '"forward": forward,',
        '"forward": "eager",',
        ("tests/test_compiled_profile.py::test_compiled_and_eager_costs_are_cached_apart",),
    ),
    Mutant(
        "profile_measures_eagerly_when_compiled",
        "on the static compiled layout the cost profile times the eager dynamic-cache forward instead of the compiled one the engine runs",
        "hf_spin/planning/profiling.py",
        "    if static is None or not static.compiles(model, drafter):\n        return None",
        "    return None",
        (
            "tests/test_compiled_profile.py::test_the_compiled_profile_times_the_compiled_static_forward",
            "tests/test_compiled_profile.py::test_compiled_and_eager_costs_are_cached_apart",
        ),
    ),
    Mutant(
        "verification_not_widened",
        "the planner prices a verification at the cheaper wider width the profile found, and the engine runs it at "
        "the drafts' own (a CPU's slow 2-15 token GEMM): each step costs what the planner never expected",
        "hf_spin/step/engine.py",
        "        wide = profile.plain_width(B) if positions == B else profile.target.width(positions, B)",
        "        wide = positions",
        (WIDTHS + "[1-rectangular]", "tests/test_widths.py::test_a_plain_step_runs_at_a_cheaper_width_too[packed]"),
    ),
    Mutant(
        "verification_priced_unwidened",
        "the planner prices a verification at the drafts' own width though the engine widens it to a cheaper knot: "
        "it drafts little where drafting pays",
        "hf_spin/planning/cost_profile.py",
        "        return self.target.verify(n_tokens, rows)",
        "        return self.target.predict(n_tokens, rows)",
        (WIDTHS + "[1-rectangular]", WIDTHS + "[4-packed]"),
    ),
    Mutant(
        "a_plain_step_never_widens",
        "a plain step runs at one position though two cost less (an AVX-512 bf16 CPU's GEMV against a small GEMM, "
        "AMD EPYC, 1.5B: 192 / 172 ms): 10% of every plain step lost",
        "hf_spin/step/engine.py",
        "        if self.planner is None:\n            return chunks, positions",
        "        if self.planner is None or all(len(c) == 1 for c in chunks):\n            return chunks, positions",
        ("tests/test_widths.py::test_a_plain_step_runs_at_a_cheaper_width_too[rectangular]",),
    ),
    Mutant(
        "the_knots_learn_apart",
        "each knot of the target's cost learns only from forwards at its own width: the plain steps' knot follows a "
        "long prompt's drift (AMD EPYC, bf16, RAG: 0.20 -> 0.26 s) while 8 tokens stay at the grid's 0.23 s, and an "
        "8-token draft looks cheaper than a plain step",
        "hf_spin/planning/cost_profile.py",
        "        if shared:\n            self.shift.add(observed)",
        "        if False:\n            self.shift.add(observed)",
        ("tests/test_planning.py::test_a_drift_seen_on_plain_steps_moves_every_knot_and_a_knot_keeps_its_own_shape",),
    ),
    Mutant(
        "a_catch_up_is_not_timed",
        "an idle catch-up's time is not learned: a drafter's grid flat to 8 positions keeps pricing a 70-token "
        "catch-up at 0.18 s that runs 0.71 s (AMD EPYC, bf16, the 0.5B drafter)",
        "hf_spin/step/engine.py",
        "                        self.planner.observe_catch_up(d_idx, positions, call.seconds)",
        "                        pass",
        ("tests/test_planning.py::test_an_idle_catch_up_teaches_the_drafters_cost_at_its_length",),
    ),
    Mutant(
        "fillers_before_the_drafts",
        "a widened verification puts its filler tokens before a row's real ones: the target scores drafts after "
        "tokens the row never had",
        "hf_spin/step/widths.py",
        "        return [c + [FILLER_TOKEN] * (width - len(c)) for c in chunks]",
        "        return [[FILLER_TOKEN] * (width - len(c)) + c for c in chunks]",
        (
            "tests/test_widths.py::test_widen_fills_each_row_after_its_tokens_within_its_room",
            WIDTHS + "[1-rectangular]",
        ),
    ),
    Mutant(
        "static_layout_widened",
        "the static layout widens a verification to a cheaper knot: its sticky query bucket grows, a wider graph is "
        "compiled (a CUDA graph capture on a GPU) and every later step runs at it",
        "hf_spin/pool.py",
        "            self.cost_profile.target.widens = static is None",
        "            self.cost_profile.target.widens = True",
        ("tests/test_widths.py::test_the_static_layout_verifies_at_its_own_query_bucket_and_prices_it_there",),
    ),
    Mutant(
        "static_tree_path_left_in_place",
        "after a token tree on the static layout the accepted path's KV stays at its nodes' slots, not moved down "
        "behind the root: the next forward reads a rejected branch's keys as the path's",
        "hf_spin/cache/static.py",
        "            moves += [(s, base + 1 + node, base + 1 + j) for j, node in enumerate(path) if node != j]",
        "            moves += []",
        (
            "tests/test_static_cache.py::test_tree_slots_score_their_own_paths_and_the_kept_path_decodes_on[eager]",
            "tests/test_token_trees.py::test_trees_equal_plain_generate[llama-4-vote-static]",
        ),
    ),
    Mutant(
        "grid_stops_before_batch_widths",
        "a slow machine's grid stops at its budget after 1, 8 and 2 tokens though the knots fall from 2 to 8: the "
        "curve reads flat beyond, and a batch of 4 verifying 20 positions is priced a third too cheap",
        "hf_spin/planning/grid.py",
        "            forced = static is None and _past_a_fall(fit, n)",
        "            forced = False",
        ("tests/test_planning.py::test_a_short_grid_reaches_the_positions_a_batch_of_four_verifies",),
    ),
    Mutant(
        "an_idle_catch_up_leaves_no_room_for_its_probe",
        "the exploration budget buys an idle catch-up that leaves it too little for the probe it is the first half of: SmolLM2's catch-up of a Spec-Bench prompt took a 32-token request's whole share and lost 2-3% of it for nothing (AMD EPYC, float32, LBSS)",
        "hf_spin/planning/planner.py",
        "out.append(pays or self.budget.spend(seconds, then=self._first_rung(drafter, padded_rows)))",
        "out.append(pays or self.budget.spend(seconds))",
        ("tests/test_planning.py::test_an_idle_catch_up_on_padded_rows_is_priced_over_every_row_it_pads",),
    ),
    Mutant(
        "idle_catch_up_priced_per_row",
        "an idle catch-up on a rectangular drafter cache is priced at the row's own lag, though its forward runs over "
        "every row of the batch padded to it: the budget buys catch-ups that cost the batch size times their price",
        "hf_spin/planning/planner.py",
        "seconds += cost.bound(rows * lag) - cost.predict(1)",
        "seconds += cost.bound(lag) - cost.predict(1)",
        ("tests/test_planning.py::test_an_idle_catch_up_on_padded_rows_is_priced_over_every_row_it_pads",),
    ),
    Mutant(
        "device_draft_loop_ignores_confidence",
        "the static layout's draft loop on the device keeps every row's draft to its k, not cut after its first token "
        "below min_confidence as the host loop stops it: longer drafts than the rule asks for",
        "hf_spin/drafters/model.py",
        "if j + 1 >= limit[row] or (confidence and confidence[j][i] < request.min_confidence):",
        "if j + 1 >= limit[row]:",
        (
            "tests/test_static_engine.py::test_the_draft_loop_on_the_device_proposes_what_the_host_loop_does[llama-4-eager]",
        ),
    ),
    Mutant(
        "tree_path_scores_indexed_by_list",
        "a tree step gathers each row's accepted path's scores with a Python list as the index: on CUDA a blocking "
        "copy from pageable memory, one a row a step (the instrumented counter must see it)",
        "hf_spin/step/tree_step.py",
        "        return [scores[b, : len(s)] for b, s in enumerate(slots)]",
        "        return [scores[b][s] for b, s in enumerate(slots)]",
        ("tests/test_host_syncs.py::test_a_model_free_drafter_reads_the_device_once_a_step[static]",),
    ),
    Mutant(
        "prefill_groups_out_of_row_order",
        "a ragged batch prefilled in groups keeps its cache in the groups' order while its first tokens come back in "
        "row order: each row decodes on another row's prompt",
        "hf_spin/step/admission.py",
        "    fresh.select_rows(back)\n",
        "",
        (
            "tests/test_prefill_groups.py::test_a_ragged_batch_prefills_in_the_groups_priced_and_commits_what_plain_"
            "generate_does[linear-prefills0-rectangular]",
        ),
    ),
    Mutant(
        "prefill_cost_never_learned",
        "prefill forwards far past the grid are not learned: a grid that reads long forwards at one forward's cost "
        "prefills every later ragged batch in one padded block, however long its prompts",
        "hf_spin/planning/cost_profile.py",
        "        if self.target.learns(positions):\n            self.target.observe(",
        "        if False:\n            self.target.observe(",
        ("tests/test_prefill_groups.py::test_a_prefill_far_past_the_grid_teaches_the_next_calls_groups[rectangular]",),
    ),
    Mutant(
        "learned_knot_takes_the_shift",
        "a knot learned from a long forward takes the shift the steps teach after it, though it was measured as the "
        "machine runs now: a cached grid 1.5x fast reads a 51-token prefill at 1.5x what it took, and similar "
        "prompts are split into two prefills",
        "hf_spin/planning/cost_profile.py",
        "return shift if self.grid[knot] else 0.0",
        "return shift",
        ("tests/test_prefill_groups.py::test_a_prefill_learned_before_the_steps_teach_the_shift_reads_what_it_took",),
    ),
    Mutant(
        "off_grid_widths_stay_interpolated",
        "a width off the grid's knots stays priced by interpolation however its forwards run: an AMD EPYC's float32 "
        "grid of 1, 2 and 8 positions prices 3 at 1.0 s where it takes 1.2 and 8 take 0.84, and a two-token draft is "
        "verified at 3 positions",
        "hf_spin/planning/cost_profile.py",
        "            self._add_knot(int(n_tokens), sorted(runs)[len(runs) // 2])",
        "            pass",
        (
            "tests/test_planning.py::test_a_width_off_the_grid_becomes_a_knot_once_three_runs_agree_the_grid_misprices_it",
        ),
    ),
    Mutant(
        "one_dear_off_grid_run_makes_a_knot",
        "a width off the knots becomes a knot where any of its runs was off its price: a stall in one of three makes "
        "a knot at a cost the width does not have",
        "hf_spin/planning/cost_profile.py",
        "if min(runs) > OFF_GRID_SURPRISE * priced or",
        "if max(runs) > OFF_GRID_SURPRISE * priced or",
        (
            "tests/test_planning.py::test_a_width_off_the_grid_becomes_a_knot_once_three_runs_agree_the_grid_misprices_it",
        ),
    ),
    Mutant(
        "model_free_drafts_planned_on_the_pools_evidence",
        "prompt lookup's first draft on a request that has shown nothing of it is verified on what earlier requests "
        "showed (summaries): in a math question, a rejected verification of 8 where that costs two plain steps",
        "hf_spin/planning/planner.py",
        "        return tuple(d for d in drafters if self.profile.drafters[d] is not None or self.acceptance.seen(d, row) > 0)",
        "        return drafters",
        ("tests/test_exploration.py::test_a_model_free_drafters_first_draft_on_a_request_is_a_probe",),
    ),
    Mutant(
        "model_free_drafts_sized_by_the_budget",
        "a model-free drafter drafts only what the exploration budget affords before drafting: a request with no "
        "evidence of its own and a spent budget never drafts with it, so never learns whether it pays",
        "hf_spin/planning/planner.py",
        "            sized = [k if f else s for k, s, f in zip(ks, sized, free)]",
        "            pass",
        ("tests/test_exploration.py::test_a_model_free_drafters_first_draft_on_a_request_is_a_probe",),
    ),
    Mutant(
        "cut_drafts_taught_only_their_first_position",
        "a model-free draft that was not verified teaches the planner its first position alone: a translation whose "
        "prompt-lookup drafts stop after a name's first token reads as one whose drafts copy whole spans",
        "hf_spin/step/engine.py",
        "            continued.append(follow(row.sequence, row.continuations))",
        "            continued.append({})",
        ("tests/test_exploration.py::test_cut_model_free_drafts_teach_their_later_positions[8]",),
    ),
    Mutant(
        "account_lends_only_unseen_drafters",
        "the pool's account lends only a drafter's first probe: one right on it is left to the calls' own shares, "
        "which on a GPU's 5 ms step cannot buy a 0.5B's probe for a short request, so it is never tried again",
        "hf_spin/planning/planner.py",
        "return accepted + rejected < LEARNED and accepted >= PRIOR_ACCEPTANCE * (accepted + rejected)",
        "return accepted + rejected == 0",
        ("tests/test_exploration.py::test_the_pool_lends_a_drafters_probes_until_it_is_known_or_wrong",),
    ),
    Mutant(
        "set_up_charged_to_probes",
        "a step that compiled or captured a graph charges that set-up to its probe: on a GPU a first wider "
        "verification's compile (30 s) leaves the accounts nothing to lend until 25 minutes of decoding refill them",
        "hf_spin/planning/exploration.py",
        "extra = probe.overrun(verify, drafting, plain_step) if timed else 0.0",
        "extra = probe.overrun(verify, drafting, plain_step)",
        (
            "tests/test_exploration.py::test_a_step_that_sets_up_a_graph_is_charged_to_no_probe_and_teaches_no_cost[True]",
        ),
    ),
    Mutant(
        "no_filler_rows",
        "a batch that lost a row runs its plain steps over the rows left where more rows cost less (float32 on an "
        "AMD EPYC: three rows' steps 1.2 s, four rows' 0.85 s): 0.86x plain generate, which keeps every row",
        "hf_spin/planning/cost_profile.py",
        "                best, cost = more, work.seconds\n",
        "                pass\n",
        (
            "tests/test_widths.py::test_a_batch_that_lost_a_row_runs_beside_a_filler_row_where_fewer_rows_cost_more[0.3]",
        ),
    ),
    Mutant(
        "one_dear_run_settles_a_width",
        "a width settled on one run of it: a stall in the first three-row step would run filler rows for good where "
        "three rows cost less",
        "hf_spin/planning/cost_profile.py",
        "CLEAR_CHECKS = 2\n",
        "CLEAR_CHECKS = 1\n",
        (
            "tests/test_widths.py::test_a_batch_that_lost_a_row_runs_beside_a_filler_row_where_fewer_rows_cost_more[0.3]",
        ),
    ),
    Mutant(
        "any_dearer_run_settles_a_width",
        "two runs a few percent dearer (a stall's worth) settle a width as clearly dearer as two 50% dearer do",
        "hf_spin/planning/cost_profile.py",
        "CLEARLY_DEARER = 1.15\n",
        "CLEARLY_DEARER = 1.0\n",
        (
            "tests/test_widths.py::test_a_batch_that_lost_a_row_runs_beside_a_filler_row_where_fewer_rows_cost_more[0.22]",
        ),
    ),
    Mutant(
        "prefill_groups_priced_pessimistically",
        "prefill groups priced past the grid by its mean slope: a CPU whose one-token step is cheap reads every "
        "position dear and splits similar prompts into several forwards, dearer than one",
        "hf_spin/planning/prefill.py",
        "price = best[i] + cost.predict(rows * longest, rows)",
        "price = best[i] + cost.bound(rows * longest) + cost.per_row * (rows - 1)",
        ("tests/test_prefill_groups.py::test_groups_split_only_where_the_cheapest_reading_past_the_grid_pays",),
    ),
    Mutant(
        "captured_graph_keyed_by_shape_alone",
        "a CUDA graph captured over one cache's storage is replayed over another cache of the same shapes: its kernels "
        "read and write the first cache's freed memory",
        "hf_spin/cache/cuda_graphs.py",
        "    return tuple(input_ids.shape), dtype, cache.capacity, layout, kv\n",
        "    return tuple(input_ids.shape), dtype, cache.capacity\n",
        ("tests/test_cuda_graphs.py::test_new_storage_of_the_same_shapes_is_captured_again",),
    ),
    Mutant(
        "static_storage_not_taken_back",
        "every call allocates a new StaticRowCache: the graphs captured over the last call's storage (inductor's, "
        "cuda_graphs.py's) are recorded again at every call",
        "hf_spin/cache/static.py",
        "    if spare is not None and spare.num_slots == row_bucket(rows):\n",
        "    if False:\n",
        ("tests/test_cuda_graphs.py::test_a_second_call_replays_the_first_calls_graphs",),
    ),
    Mutant(
        "captured_moves_replay_the_capture",
        "keep_paths' captured KV moves replay the moves they were captured with instead of the step's: after a tree "
        "step whose path branched, later tokens read the wrong keys",
        "hf_spin/cache/capture.py",
        "        index.copy_(padded, non_blocking=True)\n",
        "",
        (
            "tests/test_cuda_graphs.py::test_kept_paths_move_the_same_kv_from_a_captured_graph",
            "tests/test_cuda_graphs.py::test_token_trees_through_captured_forwards_and_moves_give_plain_generates_output",
        ),
    ),
    Mutant(
        "host_work_unpriced",
        "the planner prices a drafting step by its forwards alone: on a GPU, where a captured step takes a few "
        "milliseconds, a draft that pays its forwards but not the engine's own work around it runs slower than plain",
        "hf_spin/planning/cost_profile.py",
        "        return self.target.verify(n_tokens, rows) + self.host_seconds(rows, DRAFTING if n_tokens > rows else PLAIN)\n",
        "        return self.target.verify(n_tokens, rows)\n",
        ("tests/test_exploration.py::test_a_drafting_steps_own_host_work_is_priced[0.25]",),
    ),
    Mutant(
        "widening_host_unpriced",
        "a plain step widens by its forward alone: where forwards are flat (a GPU's launch-bound step), a few percent of "
        "noise widens every step, and each pays its fillers' rollback",
        "hf_spin/planning/cost_profile.py",
        "(wide := wide + self.host_seconds(rows, WIDENED))",
        "(wide := wide)",
        (
            "tests/test_widths.py::test_a_plain_step_widens_only_where_its_rollback_leaves_a_saving[rectangular]",
            "tests/test_widths.py::test_a_plain_step_widens_only_where_its_rollback_leaves_a_saving[packed]",
        ),
    ),
    Mutant(
        "nothing_pays_by_the_dearest_drafter",
        "the planner's bound skips ranking where no prefix could pay at the dearest chosen drafter's forwards: a step "
        "whose cheapest drafter pays is planned plain",
        "hf_spin/planning/planner.py",
        "min((profile.least_draft_seconds(d) for d in drafters), default=0.0)",
        "max((profile.least_draft_seconds(d) for d in drafters), default=0.0)",
        ("tests/test_planning.py::test_the_bound_that_skips_ranking_never_changes_a_plan",),
    ),
    Mutant(
        "prompt_lookup_unaligned_hits",
        "prompt lookup takes a byte match that straddles two tokens for an n-gram: it proposes continuations from the "
        "middle of a token, drafts the target rejects (lossless, slower)",
        "hf_spin/drafters/prompt_lookup.py",
        "                if at % 4:\n                    continue\n",
        "",
        ("tests/test_engine.py::test_prompt_lookup_finds_what_a_scan_of_every_ngram_finds",),
    ),
    Mutant(
        "tokens_model_keeps_every_request",
        "LBSS's tokens model never drops ended requests past its history: old requests steer every new one's prior "
        "for good, and each step's fit grows with the whole run",
        "hf_spin/policies/tokens_model.py",
        "        for r in ended[: max(0, len(ended) - self.history)]:\n",
        "        for r in ended[:0]:\n",
        ("tests/test_policies.py::test_tokens_model_drops_requests_past_its_history_and_reuses_their_slots",),
    ),
    Mutant(
        "cached_profile_leaves_models_cold",
        "a cost read from the cache is used without running its model once: a drafter's first probe reads its "
        "memory-mapped weights in mid-call, seconds no price saw",
        "hf_spin/planning/profiling.py",
        "    for m in read:  # priced warm",
        "    for m in read[:0]:  # priced warm",
        ("tests/test_planning.py::test_profile_is_cached_per_model_and_threads",),
    ),
    Mutant(
        "probes_charged_their_price",
        "a probe is charged what it was priced at, never what it cost: where the profile under-reads, the budget keeps "
        "buying probes it has spent",
        "hf_spin/planning/exploration.py",
        "        extra = probe.overrun(verify, drafting, plain_step) if timed else 0.0\n",
        "        extra = 0.0\n",
        (
            "tests/test_exploration.py::test_a_probe_is_charged_what_it_cost_where_the_profile_under_reads[avx2_fp32]",
            "tests/test_exploration.py::test_a_probe_is_charged_what_it_cost_where_the_profile_under_reads[small_gemm_fp32]",
        ),
    ),
    Mutant(
        "a_drafts_catch_up_is_not_learned",
        "a drafter's draft after a step it sat out (a catch-up in its first forward) teaches nothing: a draft model's "
        "catch-ups stay priced from the grid's extrapolation however they run",
        "hf_spin/planning/planner.py",
        "            elif B == 1 and d not in feedback.plan.catch_up:\n",
        "            elif False:\n",
        ("tests/test_planning.py::test_a_drafters_first_draft_on_a_row_teaches_its_catch_up_cost",),
    ),
)
