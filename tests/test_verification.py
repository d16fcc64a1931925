"""Hand-built accept/reject cases with explicit expected tokens."""

import torch

from hf_spin.verify.chains import RowSampling, verify_greedy, verify_rows, verify_sampling

V = 10


def one_hot_scores(tokens: list[list[int]]) -> torch.Tensor:
    """Scores whose argmax at [b, j] is tokens[b][j]: [B, K + 1, V]."""
    scores = torch.zeros(len(tokens), len(tokens[0]), V)
    for b, row in enumerate(tokens):
        for j, t in enumerate(row):
            scores[b, j, t] = 1.0
    return scores


def test_greedy_accepts_matching_prefix_then_corrects():
    scores = one_hot_scores([[5, 7, 9]])
    v = verify_greedy(scores, torch.tensor([[5, 8]]), torch.tensor([2]))
    assert v.accepted.tolist() == [1] and v.next_token.tolist() == [7]


def test_greedy_all_accepted_gives_bonus_token():
    scores = one_hot_scores([[5, 7, 9]])
    v = verify_greedy(scores, torch.tensor([[5, 7]]), torch.tensor([2]))
    assert v.accepted.tolist() == [2] and v.next_token.tolist() == [9]


def test_greedy_first_draft_rejected():
    scores = one_hot_scores([[3, 7, 9]])
    v = verify_greedy(scores, torch.tensor([[5, 7]]), torch.tensor([2]))
    assert v.accepted.tolist() == [0] and v.next_token.tolist() == [3]


def test_greedy_ragged_rows_ignore_padding_slots():
    # row 0: 2 drafts both right; row 1: 0 drafts (its padded slots happen to match, must not count);
    # row 2: 1 draft right, its padded second slot must not be accepted.
    scores = one_hot_scores([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    drafts = torch.tensor([[1, 2], [4, 5], [7, 8]])
    v = verify_greedy(scores, drafts, torch.tensor([2, 0, 1]))
    assert v.accepted.tolist() == [2, 0, 1]
    assert v.next_token.tolist() == [3, 4, 8]


def test_greedy_no_drafts_at_all():
    v = verify_greedy(one_hot_scores([[4], [6]]), torch.zeros(2, 0, dtype=torch.long), torch.tensor([0, 0]))
    assert v.accepted.tolist() == [0, 0] and v.next_token.tolist() == [4, 6]


def test_a_step_without_drafts_takes_the_argmax_of_greedy_rows_only():
    scores = one_hot_scores([[4], [6]])  # [2, 1, V]: nothing drafted
    greedy = [RowSampling(False, None, 0)] * 2
    v = verify_rows([0, 1], greedy, scores, [[], []], [None, None])
    assert v.accepted.tolist() == [0, 0] and v.next_token.tolist() == [4, 6]
    # a sampled row samples: with p = softmax(scores) every token has mass, so some draw leaves the argmax
    torch.manual_seed(0)
    drawn = {
        verify_rows([0, 1], [RowSampling(True, None, 0)] * 2, scores, [[], []], [None, None]).next_token[0].item()
        for _ in range(20)
    }
    assert drawn - {4}


def dist(*pairs) -> torch.Tensor:
    p = torch.zeros(V)
    for t, w in pairs:
        p[t] = w
    return p


def test_sampling_certain_accept_and_bonus():
    # p puts all mass on the drafts and then on token 9: accept both, bonus 9.
    p = torch.stack([dist((5, 1.0)), dist((7, 1.0)), dist((9, 1.0))])[None]
    v = verify_sampling(p, torch.tensor([[5, 7]]), torch.tensor([2]))
    assert v.accepted.tolist() == [2] and v.next_token.tolist() == [9]


def test_sampling_certain_reject_recovers_from_residual():
    # p_0 has no mass on the draft 5: reject at once; residual max(p - q, 0) = p_0 -> token 3.
    p = torch.stack([dist((3, 1.0)), dist((7, 1.0)), dist((9, 1.0))])[None]
    q = torch.stack([dist((5, 1.0)), dist((7, 1.0))])[None]
    v = verify_sampling(p, torch.tensor([[5, 7]]), torch.tensor([2]), q=q)
    assert v.accepted.tolist() == [0] and v.next_token.tolist() == [3]


def test_sampling_deterministic_proposal_residual_excludes_draft():
    # p_0 = {5: 0.5, 6: 0.5}, draft 5 with one-hot q: if rejected the recovered token must be 6.
    p = torch.stack([dist((5, 0.5), (6, 0.5)), dist((1, 1.0))])[None].repeat(200, 1, 1)
    v = verify_sampling(p, torch.full((200, 1), 5), torch.full((200,), 1), generator=torch.Generator().manual_seed(0))
    rejected = v.accepted == 0
    assert rejected.any() and (~rejected).any()
    assert (v.next_token[rejected] == 6).all()
    assert (v.next_token[~rejected] == 1).all()


def test_sampling_accept_probability_is_p_over_q():
    # p(5) = 0.3, q(5) = 0.6: accept with probability 0.5.
    N = 20000
    p = torch.stack([dist((5, 0.3), (6, 0.7)), dist((1, 1.0))])[None].repeat(N, 1, 1)
    q = dist((5, 0.6), (6, 0.4))[None, None].repeat(N, 1, 1)
    v = verify_sampling(p, torch.full((N, 1), 5), torch.full((N,), 1), q=q, generator=torch.Generator().manual_seed(1))
    rate = v.accepted.float().mean().item()
    assert abs(rate - 0.5) < 0.02  # 4.5 standard deviations at N = 20000


def test_sampling_deterministic_when_seeded():
    p = torch.softmax(torch.randn(8, 4, V, generator=torch.Generator().manual_seed(2)), -1)
    drafts = torch.randint(0, V, (8, 3), generator=torch.Generator().manual_seed(3))
    lengths = torch.tensor([3, 2, 1, 0, 3, 3, 2, 1])
    a = verify_sampling(p, drafts, lengths, generator=torch.Generator().manual_seed(4))
    b = verify_sampling(p, drafts, lengths, generator=torch.Generator().manual_seed(4))
    assert torch.equal(a.accepted, b.accepted) and torch.equal(a.next_token, b.next_token)
    assert (a.accepted <= lengths).all()
