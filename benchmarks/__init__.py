"""hf_spin's benchmarks, run as modules from the repository root: `python -m benchmarks.spec_bench --help`.

The scripts here report the user-facing claims (docs/benchmarks.md, benchmarks/RESULTS.md); `common`
holds what they share; `research/` holds the instruments that study the LBSS policy itself.
"""
