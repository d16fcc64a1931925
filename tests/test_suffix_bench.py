"""benchmarks/workloads.py and benchmarks/suffix_bench.py without the real models or question file: the
workloads from a tiny Spec-Bench-format file (turn 2 carrying turn 1's answer, the schema requests
deterministic), then the whole benchmark end to end on tiny random models and the character tokenizer."""

from __future__ import annotations

import json

import pytest

from benchmarks import suffix_bench, workloads

from .archs import tiny_model
from .speculation import perturbed
from .test_server import CHAT_TEMPLATE
from .tiny_tokenizers import char_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

QUESTIONS = [  # Spec-Bench's format: two MT-Bench categories with two turns, two other task groups with one
    {
        "question_id": 81,
        "category": "writing",
        "turns": ["Write a short poem about the sea.", "Rewrite it so every line starts with A."],
    },
    {"question_id": 82, "category": "writing", "turns": ["Write a note to a friend.", "Make it shorter."]},
    {"question_id": 121, "category": "coding", "turns": ["Write a loop that counts to ten.", "Now count down."]},
    {"question_id": 161, "category": "translation", "turns": ["Translate: the cat sleeps."]},
    {"question_id": 162, "category": "translation", "turns": ["Translate: the dog runs."]},
    {"question_id": 241, "category": "qa", "turns": ["Who wrote the tale of the fox?"]},
]


@pytest.fixture(scope="module")
def questions(tmp_path_factory):
    path = tmp_path_factory.mktemp("spec_bench") / "question.jsonl"
    path.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    return path


@pytest.fixture(scope="module")
def tok():
    t = char_tokenizer()
    t.chat_template = CHAT_TEMPLATE
    return t


def test_spec_bench_takes_first_turns_per_task_group(questions):
    convs = workloads.spec_bench(questions, per_group=1)
    assert [(c.id, c.group, c.turns) for c in convs] == [
        ("81", "mt_bench", [QUESTIONS[0]["turns"][0]]),
        ("161", "translation", [QUESTIONS[3]["turns"][0]]),
        ("241", "qa", [QUESTIONS[5]["turns"][0]]),
    ]


def test_multi_turn_second_prompt_carries_the_first_answer(questions, tok):
    convs = workloads.multi_turn(questions, per_category=1)
    assert [(c.id, c.group) for c in convs] == [("81", "writing"), ("121", "coding")]
    first = convs[0].messages(0, [])
    assert first == [{"role": "user", "content": QUESTIONS[0]["turns"][0]}]
    answer = "Waves roll in, gulls cry over the grey water."
    second = convs[0].messages(1, [answer])
    assert second == first + [
        {"role": "assistant", "content": answer},
        {"role": "user", "content": QUESTIONS[0]["turns"][1]},
    ]
    text = tok.decode(workloads.encode_chats(tok, [first, second])["input_ids"][1], skip_special_tokens=True)
    assert answer in text and text.index(QUESTIONS[0]["turns"][0]) < text.index(answer) < text.index(
        QUESTIONS[0]["turns"][1]
    )
    with pytest.raises(ValueError, match="needs the answers"):
        convs[0].messages(1, [])


def test_schema_workload_is_deterministic_and_repeats_its_shapes():
    a, b = workloads.schema(12), workloads.schema(12)
    assert [(c.id, c.group, c.turns, c.system) for c in a] == [(c.id, c.group, c.turns, c.system) for c in b]
    assert [c.group for c in a[:6]] == ["city", "book", "scientist"] * 2
    assert len({c.turns[0] for c in a}) == 12  # every request about another entity
    assert len({c.system for c in a}) == 3  # one system prompt (schema) per kind, repeated
    assert all(json.loads(c.system.split(":\n", 1)[1]) == workloads.SCHEMAS[c.group][0] for c in a)
    assert len(workloads.schema(48)) == 48
    with pytest.raises(ValueError, match="48 requests"):
        workloads.schema(49)


def test_suffix_bench_end_to_end_on_tiny_models(questions, tok, tmp_path, monkeypatch):
    args = suffix_bench.parse_args(
        [
            "--questions",
            str(questions),
            "--per-group",
            "1",
            "--schema-requests",
            "3",
            "--max-new-tokens",
            "6",
            "--batch-sizes",
            "1",
            "2",
            "--profile",
            "off",
            "--k",
            "4",
            "--out",
            str(tmp_path),
            "--methods",
            *suffix_bench.METHODS[1:],
        ]
    )
    target = tiny_model("llama", seed=0)
    bench = suffix_bench.Bench(target, tok, perturbed("llama"), tok, args)
    chats = []  # every prompt the benchmark encodes, in order
    encode = workloads.encode_chats
    monkeypatch.setattr(workloads, "encode_chats", lambda t, cs: chats.extend(cs) or encode(t, cs))

    records = suffix_bench.run(bench, suffix_bench.build_workloads(args), args)

    # every method on every call; transformers' prompt lookup at batch 1 only
    for workload in workloads.WORKLOADS:
        for bs in (1, 2):
            methods = {r["method"] for r in records if r["workload"] == workload and r["batch_size"] == bs}
            assert methods == set(suffix_bench.METHODS) - ({"transformers_lookup"} if bs > 1 else set()), (workload, bs)
    # float32: every method's greedy output is plain's
    assert all(r["identical"] == len(r["ids"]) for r in records), [
        r for r in records if r["identical"] != len(r["ids"])
    ]
    spin = [r for r in records if r["method"].startswith("hf_spin")]
    assert all(r["target_forwards"] >= 1 and r["stats_new_tokens"] == r["new_tokens"] for r in spin)
    assert all(sum(r["drafted"] for r in spin if r["method"] == m) > 0 for m in suffix_bench.SPIN)  # each drafted
    # turn 2 of a conversation carries plain decoding's answer to turn 1
    turn2 = [c for c in chats if len(c) == 3]
    assert turn2, "no second turn was run"
    for chat in turn2:
        batch = encode(tok, [chat[:1]])
        out = target.generate(**batch, **bench.gen)
        assert chat[1] == {
            "role": "assistant",
            "content": tok.decode(out[0, batch["input_ids"].shape[1] :], skip_special_tokens=True),
        }

    summary, table, md = suffix_bench.report(args, records)
    assert md.exists() and md.with_suffix(".json").exists()
    assert list(summary["spec_bench"][1]) == ["mt_bench", "qa", "translation", "ALL"]
    assert list(summary["multi_turn"][2]) == ["turn 1", "turn 2", "ALL"]
    all_ = summary["schema"][1]["ALL"]
    assert all_["rows"] == 3 and all_["hf_spin_suffix"]["identical"] == "3/3" and "suffix_over_lookup" in all_
    assert "### multi_turn, batch 2" in table and "suffix/lookup speed" in table
    assert (tmp_path / "suffix_bench-partial.jsonl").read_text().count("\n") == len(records)


def test_serve_load_prompts_of_each_workload(questions):
    from benchmarks.serve_load import load_prompts

    schema = load_prompts("schema", questions, 50)
    assert (
        len(schema) == 50
        and schema[:48] == [c.messages(0, []) for c in workloads.schema(48)]
        and schema[48] == schema[0]
    )
    assert schema[0][0]["role"] == "system"
    mixed = load_prompts("spec_bench", questions, 4)
    assert [m[0]["content"] for m in mixed] == [
        QUESTIONS[i]["turns"][0] for i in (0, 2, 3, 5)
    ]  # one per category in turn
