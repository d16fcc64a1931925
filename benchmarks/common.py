"""What every benchmark here shares: the Spec-Bench questions, prompts, timing, partial results, the machine.

Spec-Bench's six task groups: MT-Bench (ids 81-160, in 8 sub-categories), translation,
summarization, qa, math_reasoning and rag. `--group-by task` reports per group, `category` per
raw category.
"""

from __future__ import annotations

import json
import platform
import time
from collections import defaultdict
from pathlib import Path

import torch
import transformers

from hf_spin.planning.machine import cpu, describe, kernels

DEFAULT_QUESTIONS = Path(__file__).resolve().parents[2] / "shared/data/spec_bench/question.jsonl"
MT_BENCH = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}


def task_of(category: str) -> str:
    """Spec-Bench's task group of a raw category (the 8 MT-Bench categories are one task)."""
    return "mt_bench" if category in MT_BENCH else category


def load_questions(
    path: Path, per_group: int | None = None, limit: int | None = None, group_by: str = "category"
) -> list[dict]:
    """The first `per_group` questions of every category (or task group; None: all), in file order, at most `limit`
    (read with `datasets`: the JSON lines' schema and parsing, cached by the file's path and modification time)."""
    if not path.exists():
        raise FileNotFoundError(f"Spec-Bench questions not found at {path}; pass --questions PATH/question.jsonl")
    try:
        from datasets import load_dataset
    except ImportError as err:
        raise ImportError("the benchmarks read Spec-Bench with `datasets`: pip install -e '.[bench]'") from err
    key = task_of if group_by == "task" else (lambda c: c)
    taken: dict[str, int] = defaultdict(int)
    questions = []
    for q in load_dataset("json", data_files=str(path), split="train"):
        group = key(q["category"])
        if per_group is None or taken[group] < per_group:
            taken[group] += 1
            questions.append({**q, "group": group})
    return questions[:limit]


def encode(tokenizer, questions: list[dict]) -> dict:
    """First turns as chat prompts, left-padded into one batch."""
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q["turns"][0]}], tokenize=False, add_generation_prompt=True
        )
        for q in questions
    ]
    return tokenizer(texts, return_tensors="pt", padding=True)


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def new_tokens(sequences: torch.Tensor, prompt_len: int, pad_id: int) -> list[list[int]]:
    return [[t for t in row[prompt_len:].tolist() if t != pad_id] for row in sequences]


def save_partial(path: Path | None, record: dict) -> None:
    """Append one finished record to a jsonl file: a run cut short keeps what it measured."""
    if path is not None:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def machine(num_processes: int = 1) -> dict:
    """Where and with what a run happened (goes into every results file)."""
    import hf_spin

    return {
        "machine": describe("cuda" if torch.cuda.is_available() else "cpu")
        + (f" on {cpu()['cpu']}" if torch.cuda.is_available() else ""),
        **cpu(),
        "kernels": kernels(),
        "threads": torch.get_num_threads(),
        "processes": num_processes,
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "hf_spin": hf_spin.__version__,
    }


def write_results(out: Path, name: str, payload: dict, table: str) -> Path:
    """<out>/<name>-<stamp>.json and .md; returns the markdown path."""
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (out / f"{name}-{stamp}.json").write_text(json.dumps(payload, indent=1))
    md = out / f"{name}-{stamp}.md"
    md.write_text(table)
    return md
