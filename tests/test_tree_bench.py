"""benchmarks/tree_bench.py end to end on tiny random models and the character tokenizer: every method
at each batch size (transformers' at batch 1 only, assisted only with a draft model), greedy output as
plain `generate`'s, and the table's rows per task group."""

from __future__ import annotations

import pytest

from benchmarks import tree_bench

from .archs import tiny_model
from .speculation import perturbed
from .test_server import CHAT_TEMPLATE
from .tiny_tokenizers import char_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

QUESTIONS = [
    {"question_id": 1, "group": "qa", "turns": ["Who wrote the tale of the fox?"]},
    {"question_id": 2, "group": "translation", "turns": ["Translate: the dog runs."]},
]


@pytest.mark.parametrize("drafter", ["prompt_lookup", "model"])
def test_tree_bench_runs_every_method_on_tiny_models(drafter, tmp_path):
    tok = char_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    args = tree_bench.parse_args(
        [
            "--k",
            "4",
            "--max-new-tokens",
            "8",
            "--batch-sizes",
            "1",
            "2",
            "--cache",
            "rectangular",
            "--out",
            str(tmp_path),
        ]
    )
    records = tree_bench.run(
        tiny_model("llama"), tok, perturbed("llama") if drafter == "model" else None, QUESTIONS, args
    )
    for bs in (1, 2):
        methods = {r["method"] for r in records if r["batch_size"] == bs}
        expected = set(tree_bench.METHODS) - ({"transformers_assisted"} if drafter == "prompt_lookup" else set())
        assert methods == (expected if bs == 1 else {m for m in expected if not m.startswith("transformers")})
    assert all(r["identical"] == len(r["groups"]) for r in records)  # float32: every method's output is plain's
    table = tree_bench.summarize(records)
    assert "| qa |" in table and "| translation |" in table and table.count("| ALL |") == 2
    assert (tmp_path / "tree_bench-partial.jsonl").read_text().count("\n") == len(records)
