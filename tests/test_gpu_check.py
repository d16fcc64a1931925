"""benchmarks/gpu_check.py runs end to end before a GPU comes: its CPU smoke (tiny shapes, the kernel
under the Triton interpreter) in a subprocess, and every section's JSON says what the GPU run would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    pytest.importorskip("triton")
    out = tmp_path_factory.mktemp("gpu_check")
    env = {**os.environ, "TRITON_INTERPRET": "1", "HF_SPIN_PROFILES": str(out / "profiles")}
    run = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", "--cpu-smoke", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return json.loads((out / "gpu_check.json").read_text())


def test_every_section_ran(report):
    for section in ("environment", "kernel", "identity", "end_to_end", "syncs", "kernel_timing"):
        assert section in report and "error" not in report[section], report.get(section)


def test_kernel_cases_pass_against_the_reference(report):
    cases = report["kernel"]["cases"]
    assert {c["mask"] for c in cases} == {"causal", "window", "tree", "empty_rows", "splits"}
    assert all(c["pass"] for c in cases), [c for c in cases if not c["pass"]]


def test_identity_covers_both_cache_paths_and_drafts_that_get_cut(report):
    runs = report["identity"]["runs"]
    assert report["identity"]["exact_identical"]
    assert {(r["packed"], r["drafter"]) for r in runs} == {
        (p, d) for p in (False, True) for d in ("model", "oracle", "oracle_tree")
    }
    oracle = [r for r in runs if r["drafter"].startswith("oracle")]
    assert all(0 < r["accepted"] < r["drafted"] and r["failures"] == 0 for r in oracle), oracle


def test_oracle_acceptance_follows_alpha(report):
    runs = [r for r in report["end_to_end"]["runs"] if r["profile"] == "off"]
    assert all(r["identical_rows"] == r["batch"] for r in runs)
    assert all(r["accepted_per_step"] == 0 for r in runs if r["alpha"] == 0)
    assert all(r["accepted_per_step"] > 1 for r in runs if r["alpha"] == 0.9)


def test_timings_of_every_method(report):
    for run in report["kernel_timing"]["runs"]:
        assert isinstance(run["ms"]["hf_spin"], float) and isinstance(run["ms"]["padded_sdpa"], float), run


def test_syncs_per_step_within_the_budget(report):
    runs = report["syncs"]["runs"]
    assert {(r["batch"], r["packed"], r["drafter"]) for r in runs} == {
        (b, p, d) for b in (1, 16) for p in (False, True) for d in ("oracle", "model")
    }
    assert all(r["mode"] == "instrumented" and r["steps"] > 0 and r["per_step"] <= r["bound"] for r in runs), runs


def test_host_bound_mode_runs_the_launch_bound_stand_in_on_one_thread(tmp_path, monkeypatch):
    """--cpu-host-bound: the environment on CPU, one thread, the 28-layer stand-in (its end to end is
    a benchmark, too slow for the suite)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    threads = torch.get_num_threads()
    try:
        import gpu_check

        monkeypatch.setitem(gpu_check.HOST_BOUND, "budget_s", 60)
        assert gpu_check.main(["--cpu-host-bound", "--sections", "environment", "--out", str(tmp_path)]) == 0
        report = json.loads((tmp_path / "gpu_check.json").read_text())
        assert report["host_bound"] and report["environment"]["threads"] == 1 and report["environment"]["cuda"] is None
        assert gpu_check.HOST_BOUND["target"]["num_hidden_layers"] == 28 and gpu_check.HOST_BOUND["reps"] > 1
    finally:
        torch.set_num_threads(threads)
        sys.path.remove(str(ROOT / "benchmarks"))


@pytest.fixture(scope="module")
def compiled_report(tmp_path_factory) -> dict:
    """The compiled section alone on CPU: tiny shapes, dynamo with the eager backend (no code generation)
    for hf_spin's static layout and transformers' static cache; ~20 s on one thread (tiny models: two threads
    on a shared CPU are ~10x slower, conftest.one_thread)."""
    out = tmp_path_factory.mktemp("gpu_check_compiled")
    env = {**os.environ, "HF_SPIN_PROFILES": str(out / "profiles"), "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", "--cpu-smoke", "--sections", "compiled", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return json.loads((out / "gpu_check.json").read_text())["compiled"]


SPIN_FIELDS = (
    "ms_per_token",
    "tok_s",
    "speedup_vs_static",
    "speedup_vs_plain",
    "accepted_per_step",
    "identical_rows",
    "identical_rows_static",
    "host_syncs_per_step",
    "graphs_compiled",
    "ms_per_step",
    "steps",
    "cudagraph_events",  # {} on a CPU: no CUDA graph trees
)


def test_compiled_section_runs_every_method_and_records_every_field(compiled_report):
    report = compiled_report
    assert "error" not in report and report["backend"] == "eager" and "merged into a tree" in report["trees"]
    assert [(c["model"], c["batch"]) for c in report["configs"] if "seconds" in c] == [
        (m, b) for m in ("1.5B", "7B") for b in (1, 4)
    ]
    runs = report["runs"]
    assert not [r for r in runs if "skipped" in r or "error" in r]
    for model, batch in ((m, b) for m in ("1.5B", "7B") for b in (1, 4)):
        mine = [r for r in runs if (r["model"], r["batch"]) == (model, batch)]
        spin = {
            (r["method"], r["drafter"], r["alpha"], r["profile"]) for r in mine if r["method"].startswith("hf_spin")
        }
        variants = [(0.0, "off"), (0.0, "auto"), (0.6, "off"), (0.8, "off"), (0.9, "off")]
        expected = {(m, "oracle", a, p) for m in ("hf_spin_compiled", "hf_spin_eager") for a, p in variants}
        expected.add(("hf_spin_compiled", "oracle tree of 2", 0.6, "off"))
        if model == "1.5B":  # the 0.5B-shape drafter against the 1.5B's compiled plain step
            expected.add(("hf_spin_compiled", "0.5B model", None, "off"))
        assert spin == expected
        assert {r["method"] for r in mine} == {"generate", "generate_static", "hf_spin_compiled", "hf_spin_eager"}
        static = next(r for r in mine if r["method"] == "generate_static")
        assert static["first_call_graphs"] >= 1 and "warmup_s" in static  # transformers compiled it
        first = next(r for r in mine if r["method"] == "hf_spin_compiled")
        assert first["first_call_graphs"] >= 1 and "warmup_s" in first  # so did hf_spin, in its first call
    for r in runs:
        assert r["graphs_compiled"] == 0 and isinstance(r["ms_per_token"], float), r  # no recompilation
        assert isinstance(r["speedup_vs_static"], float), r
    for r in (r for r in runs if r["method"].startswith("hf_spin")):
        assert all(r[field] is not None for field in SPIN_FIELDS), r
        assert r["identical_rows"] == r["identical_rows_static"] == r["batch"], r  # float32: exact, unforced
        assert 0 < r["host_syncs_per_step"] <= report["k"] + 2, r
        if r["drafter"] == "0.5B model":
            assert r["draft_ms_per_token"] > 0 and r["draft_token_vs_static_step"] > 0
        elif r["profile"] == "off":
            assert r["theoretical_accepted_per_step"] is not None
            assert (r["accepted_per_step"] == 0) if r["alpha"] == 0 else (r["accepted_per_step"] > 0), r
    assert report["forced"] is False
    repeats = report["never_slower_repeats"]  # the default pool against static generate, alternating, per config
    assert {(r["model"], r["batch"]) for r in repeats} == {(c["model"], c["batch"]) for c in report["configs"]}
    assert all(len(r["speedups"]) == 2 and r["speedup_median"] > 0 for r in repeats), repeats
    goals = report["goals"]
    assert set(goals) == {
        "never_slower",
        "chain_speedup",
        "trees",
        "draft_cost",
        "no_recompilation",
        "continuous",
        "warmup",
    }
    for c in report["continuous"]:  # one per model, at batch 4: rows joining and leaving, compiled
        assert c["batch"] == 4 and c["identical_rows"] == c["rows"] == 4 and c["graphs_compiled"] == 0, c
    assert [c["model"] for c in report["continuous"]] == ["1.5B", "7B"]
    assert all(g["verdict"] in ("PASS", "FAIL") and g["values"] for g in goals.values()), goals
    assert goals["no_recompilation"]["verdict"] == "PASS" and report["graphs_compiled"] >= 8


def test_a_compiled_run_picks_its_models_batches_and_dtype(tmp_path):
    """`--models`, `--batches`, `--dtype`: a GPU session with little time measures the configs the last one
    skipped, in the dtype users run; an unknown model is refused with the known ones."""
    args = [sys.executable, "benchmarks/gpu_check.py", "--cpu-smoke", "--sections", "compiled", "--out", str(tmp_path)]
    env = {**os.environ, "HF_SPIN_PROFILES": str(tmp_path / "profiles"), "OMP_NUM_THREADS": "1"}
    picked = args + ["--models", "7B", "--batches", "4", "--dtype", "bfloat16"]
    run = subprocess.run(picked, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())["compiled"]
    assert report["dtype"] == "bfloat16" and report["forced"]  # reduced precision: the target follows refs
    spin = [r for r in report["runs"] if r["method"].startswith("hf_spin") and r["drafter"] == "oracle"]
    assert spin and all(r["identical_rows"] == r["identical_rows_static"] == 4 for r in spin), spin
    assert all(r["accepted_per_step"] > 0 for r in spin if r["alpha"]), spin  # the oracle's truth is the target's
    assert [(c["model"], c["batch"]) for c in report["configs"]] == [("7B", 4)]
    assert {(r["model"], r["batch"]) for r in report["runs"]} == {("7B", 4)}
    profiles = report["profiles"]["7B b=4"]  # where a plain step's time goes, transformers' and ours
    assert set(profiles) == {"generate_static", "hf_spin_compiled alpha 0 profile auto"}
    assert all("aten::" in p["cpu_top"] and p["wall_ms_per_token"] > 0 for p in profiles.values())
    run = subprocess.run(args + ["--models", "13B"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "--models 13B: give some of 1.5B 7B" in run.stderr
