"""Demo: the packaged Qwen2.5-Coder-1.5B target with the packaged Qwen2.5-Coder-0.5B as drafter.

    python examples/demo.py                 # prompts of its own
    python examples/demo.py --questions ../shared/data/spec_bench/question.jsonl --n 4

Prints each answer, then the speed-up over plain `generate` on the same prompts, whether the
outputs were identical, acceptance and mean accepted length. bf16 on CPU: expect minutes.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import hf_spin
from hf_spin import models

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring.",
    "Explain in three sentences what a hash map is and when to use one.",
    "Refactor this code to use a list comprehension:\nresult = []\nfor x in range(10):\n    if x % 2 == 0:\n        result.append(x * x)",
    "Write a SQL query that returns the five customers with the highest total order value.",
]


def main() -> None:
    ap = argparse.ArgumentParser(description="hf_spin demo on the packaged real models")
    ap.add_argument("--questions", type=Path, help="a Spec-Bench question.jsonl to take prompts from instead")
    ap.add_argument("--n", type=int, default=4, help="number of prompts")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)  # explicit: an oversubscribed CPU collapses ~10x

    prompts = PROMPTS
    if args.questions:
        prompts = [json.loads(line)["turns"][0] for line in args.questions.read_text().splitlines()]
    prompts = prompts[: args.n]

    target, tok = models.load("qwen2.5-coder-1.5b-instruct", dtype=torch.bfloat16)
    drafter, _ = models.load("qwen2.5-coder-0.5b-instruct", dtype=torch.bfloat16)
    pool = hf_spin.AssistantPool([drafter], policy="fixed")  # the 0.5B drafter, k = 8 with the confidence stop
    hf_spin.enable()

    gen = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
    plain_s = spin_s = 0.0
    identical = 0
    for prompt in prompts:
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
        batch = tok(text, return_tensors="pt")
        t = time.perf_counter()
        plain = target.generate(**batch, **gen)
        plain_s += time.perf_counter() - t
        t = time.perf_counter()
        spin = target.generate(**batch, assistant_pool=pool, **gen)
        spin_s += time.perf_counter() - t
        identical += torch.equal(plain, spin)
        answer = tok.decode(spin[0, batch["input_ids"].shape[1]:], skip_special_tokens=True)
        print(f"\n### {prompt}\n{answer}\n--- {pool.last_stats}")

    total = pool.totals[pool.names[0]]
    print(
        f"\n{len(prompts)} prompts: speed-up over plain generate {plain_s / spin_s:.2f}x "
        f"({plain_s:.1f}s -> {spin_s:.1f}s), identical outputs {identical}/{len(prompts)}, "
        f"acceptance {total.acceptance_rate:.1%}, mean accepted length {total.mean_accepted_length:.2f}"
    )


if __name__ == "__main__":
    main()
