"""Instruments that study the LBSS selection policy rather than report a user-facing claim, run as
modules from the repository root (`python -m benchmarks.research.policy_replay --help`): per-step
traces (`lbss_trace`), noise-free replays of recorded drafts (`policy_replay`), several pool-bench
runs read together (`pool_runs`), and the floor of never-slower decoding (`plain_floor`).
Their tests are in `benchmarks/research/tests/` (`python -m pytest benchmarks/research/tests`).
"""
