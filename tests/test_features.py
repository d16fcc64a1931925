"""Everything `generate` accepts keeps working with a pool, or is refused with a clear message."""

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

import hf_spin
from hf_spin.drafters import Drafter

from .archs import EOS, ragged_batch, tiny_model
from .speculation import assert_speculated
from .speculation import pool as spin_pool


def spin(model, pool, **kwargs):
    return model.generate(custom_generate=hf_spin.generate, assistant_pool=pool, **kwargs)


def test_return_dict_carries_stats(target, drafter):
    ids, mask = ragged_batch(3, 10)
    pool = spin_pool([drafter, "prompt_lookup"], policy="round_robin")
    out = spin(
        target,
        pool,
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=12,
        do_sample=False,
        return_dict_in_generate=True,
    )
    ref = target.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, return_dict_in_generate=True
    )
    assert isinstance(out, hf_spin.SpinGenerateOutput) and torch.equal(out.sequences, ref.sequences)
    stats = out.stats
    assert stats is pool.last_stats and len(stats.rows) == 3
    assert all(r.new_tokens == 12 for r in stats.rows)
    assert stats.new_tokens == 36 and stats.wall_seconds > 0 and stats.goodput > 0
    assert set(stats.drafters) == set(pool.names)
    for r in stats.rows:
        assert 0 < sum(r.drafters.values()) <= r.target_forwards - 1  # steps with drafts (not the prefill)
        assert r.accepted <= r.drafted and r.mean_accepted_length >= 1.0
    assert set(stats.to_dict()) >= {"goodput", "acceptance_rate", "mean_accepted_length", "rows", "drafters"}
    assert pool.totals[pool.names[0]].drafted == stats.drafters[pool.names[0]].drafted
    assert_speculated(stats)


def test_eos_list_and_rows_leaving_the_batch(target, drafter):
    ids, mask = ragged_batch(4, 10, seed=3)
    ref = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=25, do_sample=False)
    # pick tokens the reference emits mid-way as extra EOS ids: rows then stop at different steps
    eos = [EOS, int(ref[0, 14]), int(ref[2, 18])]
    kwargs = dict(
        input_ids=ids, attention_mask=mask, max_new_tokens=25, do_sample=False, eos_token_id=eos, pad_token_id=0
    )
    ref = target.generate(**kwargs)
    pool = spin_pool([drafter])
    out = spin(target, pool, **kwargs)
    assert torch.equal(out, ref)
    assert (out == 0).any(), "some row should have stopped early and been padded"
    assert_speculated(pool.last_stats)


def test_min_new_tokens_and_repetition_penalty(target, drafter):
    ids, mask = ragged_batch(2, 8)
    kwargs = dict(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=15,
        do_sample=False,
        repetition_penalty=1.3,
        min_new_tokens=10,
    )
    pool = spin_pool([drafter, "prompt_lookup"], policy="round_robin")
    assert torch.equal(spin(target, pool, **kwargs), target.generate(**kwargs))
    assert_speculated(pool.last_stats)


class StopAfter(StoppingCriteria):
    """Stops a row once it holds `n` tokens in total (a user's own criterion)."""

    def __init__(self, n):
        self.n = n

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.n, dtype=torch.bool)


def test_custom_stopping_criteria(target):
    ids = ragged_batch(1, 8, seed=1)[0]
    kwargs = dict(
        input_ids=ids, max_new_tokens=30, do_sample=False, stopping_criteria=StoppingCriteriaList([StopAfter(15)])
    )
    pool = spin_pool([target])
    out = spin(target, pool, **kwargs)
    assert torch.equal(out, target.generate(**kwargs)) and out.shape[1] == 15
    assert_speculated(pool.last_stats, rejected=False)  # the criterion cuts an accepted draft


class Collect:
    """A minimal streamer: records what generate puts."""

    def __init__(self):
        self.chunks, self.ended = [], False

    def put(self, value):
        self.chunks.append(value.flatten().tolist())

    def end(self):
        self.ended = True


def test_enable_streamer_and_plain_path_untouched(target, drafter):
    ids = ragged_batch(1, 8, seed=1)[0]  # a prompt the target continues for all 12 tokens
    ref = target.generate(input_ids=ids, max_new_tokens=12, do_sample=False)
    assert ref.shape[1] == 8 + 12
    hf_spin.enable()
    try:
        streamer, pool = Collect(), spin_pool([drafter])
        out = target.generate(input_ids=ids, max_new_tokens=12, do_sample=False, assistant_pool=pool, streamer=streamer)
        assert torch.equal(out, ref)
        assert streamer.ended and streamer.chunks[0] == ids[0].tolist()
        assert sum(streamer.chunks[1:], []) == out[0, 8:].tolist()
        assert_speculated(pool.last_stats)
        assert len(streamer.chunks) > 3  # the prompt, then the tokens of several steps
        assert torch.equal(target.generate(input_ids=ids, max_new_tokens=12, do_sample=False), ref)  # no pool: plain
    finally:
        hf_spin.disable()


def test_seeded_sampling_is_deterministic(target, drafter):
    ids, mask = ragged_batch(3, 8)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=15, do_sample=True, temperature=0.8, top_p=0.9)
    outs = []
    for _ in range(2):
        torch.manual_seed(123)
        pool = spin_pool([drafter, "prompt_lookup"], policy="round_robin")
        outs.append(spin(target, pool, **kwargs))
        assert_speculated(pool.last_stats)
    assert torch.equal(outs[0], outs[1])


class Broken(Drafter):
    name = "broken"

    def draft(self, request):
        raise RuntimeError("out of memory (simulated)")


def test_failing_drafter_is_dropped_and_output_stays_exact(target, drafter):
    ids, mask = ragged_batch(2, 8)
    pool = spin_pool([Broken(), drafter], policy="round_robin")
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=15, do_sample=False)
    with pytest.warns(UserWarning, match="broken.*dropped"):
        out = spin(target, pool, **kwargs)
    assert torch.equal(out, target.generate(**kwargs))
    assert pool.last_stats.drafters["broken"].failures == 1
    assert_speculated(pool.last_stats.drafters[pool.names[1]])


# --- refused input, each with a message saying what was given and what is supported ---------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_beams=2), "num_beams=2 is not supported"),
        (dict(return_dict_in_generate=True, output_scores=True), "output_scores=True is not supported"),
        (
            dict(cache_implementation="offloaded"),
            "cache_implementation='offloaded' is not supported with assistant_pool; supported: 'dynamic'",
        ),
        (dict(prefix_allowed_tokens_fn=lambda b, ids: [5]), "PrefixConstrainedLogitsProcessor is not supported"),
    ],
)
def test_refused_generate_arguments(target, kwargs, match):
    with pytest.raises(ValueError, match=match):
        spin(
            target,
            hf_spin.AssistantPool(["prompt_lookup"]),
            input_ids=torch.randint(3, 90, (1, 6)),
            max_new_tokens=4,
            **kwargs,
        )


def test_refused_model_inputs(target):
    ids = torch.randint(3, 90, (1, 6))
    with pytest.raises(ValueError, match=r"model inputs \['token_type_ids'\] are not supported"):
        hf_spin.generate(
            target, ids, assistant_pool=hf_spin.AssistantPool(["prompt_lookup"]), token_type_ids=torch.zeros_like(ids)
        )


def test_refused_pool_arguments(target):
    with pytest.raises(ValueError, match="non-empty list of drafters"):
        hf_spin.AssistantPool([])
    with pytest.raises(ValueError, match="unknown drafter name 'ngram'.*prompt_lookup"):
        hf_spin.AssistantPool(["ngram"])
    with pytest.raises(TypeError, match="cannot use int as a drafter"):
        hf_spin.AssistantPool([3])
    with pytest.raises(ValueError, match="policy='lbss_typo' is not supported.*fixed"):
        hf_spin.AssistantPool(["prompt_lookup"], policy="lbss_typo")
    with pytest.raises(ValueError, match="draft_length must be a positive int.*got 0"):
        hf_spin.AssistantPool(["prompt_lookup"], draft_length=0)


def test_refused_vocab_mismatch_and_missing_tokenizer(target):
    other = tiny_model("llama", seed=2, vocab_size=50)
    ids = torch.randint(3, 40, (1, 6))
    with pytest.raises(ValueError, match="vocab_size 50 but the target has 96.*\\(model, tokenizer\\)"):
        spin(target, hf_spin.AssistantPool([other]), input_ids=ids, max_new_tokens=4)
    with pytest.raises(ValueError, match="needs the target's tokenizer"):
        spin(target, hf_spin.AssistantPool([(other, object())]), input_ids=ids, max_new_tokens=4)


def test_refused_streamer_with_batch_and_missing_pool(target):
    ids, mask = ragged_batch(2, 6)
    with pytest.raises(ValueError, match="streamer supports batch size 1 only, got batch size 2"):
        spin(
            target,
            hf_spin.AssistantPool(["prompt_lookup"]),
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=4,
            spin_streamer=Collect(),
        )
    with pytest.raises(ValueError, match="needs assistant_pool="):
        target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, custom_generate=hf_spin.generate)


def test_refused_stateful_model():
    mamba = tiny_model("llama", seed=0)
    mamba._is_stateful = True  # what transformers sets on recurrent models (mamba, rwkv, ...)
    with pytest.raises(ValueError, match="stateful"):
        hf_spin.AssistantPool([mamba])
