"""Record and replay: real acceptance meets a GPU's costs (issue 46).

Acceptance is a property of the models and the text, cost a property of the machine. Real weights live on CPU
machines; GPU machines have no network and take a few MiB of files. So:

    python -m benchmarks.replay record --out trace.npz        # CPU, real models, float32 (record.py)
    python -m benchmarks.replay run trace.npz --out DIR        # any machine and dtype (run.py)
    python -m benchmarks.replay run trace.npz --check          # the recorded check runs, replayed exactly

The trace (trace.py) holds the prompts, the target's greedy continuations and what every model drafter proposes
after each prefix of them; the replay runs random-weight models of the recorded shapes for their cost, with the
target's logits forced to the recorded tokens and the drafters proposing the recorded drafts (forced.py). The
check runs (checks.py) are hf_spin configurations that read no clock, logged step by step at record time.
"""
