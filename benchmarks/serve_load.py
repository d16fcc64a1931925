"""Load test of `hf-spin serve` on loopback: concurrent streaming clients sending Spec-Bench prompts.

For each mode (speculation off, on, on with pipelining) it starts a server (`python -m hf_spin serve`,
127.0.0.1 only), and for each number of concurrent clients (1, 4, 16) sends the same `--requests`
prompts (`--workload`: Spec-Bench first turns, or benchmarks/workloads.py's repeated-schema requests)
through `POST /v1/chat/completions` with `stream: true` (greedy, `--max-new-tokens`), using httpx's
async client. It reports per cell: requests ok / failed / lost, throughput (generated tokens
per second of wall time), p50 / p99 latency and time to first token, and for each mode the server's
resident memory (RSS, sampled every half second) at the start, its peak and at the end. Bounded in
count (`--requests` per cell) and time (`--time-limit` per cell: no new request after it). Exits 1 if
any request failed or was lost.

    python -m benchmarks.serve_load                                          # the full run (long on CPU)
    python -m benchmarks.serve_load --requests 4 --max-new-tokens 8          # a quick check
    python -m benchmarks.serve_load --model smollm2-135m-instruct --drafter prompt_lookup --modes off on
    python -m benchmarks.serve_load --workload schema --drafter suffix --modes off on --concurrency 16

failed = an HTTP error or an error event; lost = a stream that ended without its finish reason (a
dropped connection, a timeout). Greedy outputs of each mode are compared with the speculation-off
mode's for the same prompts (bf16: batching changes rounding, so this is a measured rate, not a
promise; fp32 is exact).

A server whose drafter learns across requests (`--drafter suffix`) keeps what it learned from one cell
to the next, and every cell sends the same prompts: a cell after the first would replay answers it has
seen. Measure such a server with one `--concurrency` value per run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from benchmarks import workloads
from benchmarks.common import DEFAULT_QUESTIONS, load_questions, machine, write_results

REPO = Path(__file__).resolve().parents[1]  # the server subprocess runs here, with this checkout first on PYTHONPATH
MODES = {  # mode -> extra `hf-spin serve` arguments
    "off": ["--no-speculation"],
    "on": [],
    "pipeline": ["--pipeline", "auto"],
}
RSS_INTERVAL_SECONDS = 0.5
REQUEST_TIMEOUT_SECONDS = 900.0  # one request, however long the queue: beyond it the request counts as lost


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


class RssSampler(threading.Thread):
    """Samples a process's RSS (MB) every RSS_INTERVAL_SECONDS, tagged with the current cell."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.cell, self.samples, self.done = pid, "startup", [], threading.Event()

    def run(self):
        while not self.done.wait(RSS_INTERVAL_SECONDS):
            mb = rss_mb(self.pid)
            if mb is not None:
                self.samples.append((time.time(), self.cell, mb))


class Server:
    """`python -m hf_spin serve` in a subprocess on a free loopback port."""

    def __init__(self, mode: str, args):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable,
            "-m",
            "hf_spin",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--model",
            args.model,
            "--policy",
            args.policy,
            "--threads",
            str(args.threads),
            "--max-batch-size",
            str(max(args.concurrency)),
            "--max-queue",
            str(max(args.requests, 1)),
            "--log-level",
            "warning",
            *MODES[mode],
        ]
        for d in args.drafter or []:
            cmd += ["--drafter", d]
        env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        self.log = open(args.out / f"server-{mode}.log", "w")
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self.command = " ".join(cmd)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}; see {self.log.name}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise TimeoutError(f"the server was not healthy within {timeout:.0f}s; see {self.log.name}")

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        return self.proc.returncode


async def one_request(client: httpx.AsyncClient, messages: list[dict], max_new_tokens: int) -> dict:
    """Stream one chat completion; returns status, latency, TTFT, generated tokens and text."""
    body = {
        "messages": messages,
        "max_tokens": max_new_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    out = {"status": "lost", "latency": None, "ttft": None, "tokens": 0, "text": "", "error": None}
    pieces = []
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                out.update(status="failed", error=f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}")
                return out
            finished = False
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    out.update(status="failed", error=event["error"].get("message"))
                    return out
                if event.get("usage"):
                    out["tokens"] = event["usage"]["completion_tokens"]
                for choice in event.get("choices", []):
                    piece = choice.get("delta", {}).get("content")
                    if (piece or choice.get("finish_reason")) and out["ttft"] is None:
                        out["ttft"] = time.perf_counter() - start
                    if piece:
                        pieces.append(piece)
                    finished = finished or choice.get("finish_reason") is not None
            if finished:
                out.update(status="ok", latency=time.perf_counter() - start, text="".join(pieces))
    except (httpx.HTTPError, asyncio.TimeoutError) as err:
        out["error"] = f"{type(err).__name__}: {err}"
    return out


async def run_cell(
    url: str, prompts: list[list[dict]], clients: int, max_new_tokens: int, time_limit: float
) -> tuple[list[dict], float]:
    """`clients` workers take prompts in order until none is left or the time limit passed."""
    todo = list(enumerate(prompts))
    results: list[dict | None] = [None] * len(prompts)
    start = time.perf_counter()
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT_SECONDS, limits=limits) as client:

        async def worker():
            while todo and time.perf_counter() - start < time_limit:
                i, prompt = todo.pop(0)
                results[i] = await one_request(client, prompt, max_new_tokens)

        await asyncio.gather(*(worker() for _ in range(clients)))
    return [r for r in results if r is not None], time.perf_counter() - start


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def summarize(mode: str, clients: int, results: list[dict], wall: float, skipped: int) -> dict:
    ok = [r for r in results if r["status"] == "ok"]
    tokens = sum(r["tokens"] for r in ok)
    lat = [r["latency"] for r in ok]
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    return {
        "mode": mode,
        "clients": clients,
        "sent": len(results),
        "not_sent_time_limit": skipped,
        "ok": len(ok),
        "failed": sum(r["status"] == "failed" for r in results),
        "lost": sum(r["status"] == "lost" for r in results),
        "tokens": tokens,
        "wall_s": wall,
        "throughput_tok_s": tokens / wall if wall else 0.0,
        "latency_p50_s": percentile(lat, 50),
        "latency_p99_s": percentile(lat, 99),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "errors": sorted({r["error"] for r in results if r["error"]})[:5],
    }


def fmt(x, digits=2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def table(cells: list[dict], memory: dict, same: dict) -> str:
    lines = [
        "| mode | clients | ok | failed | lost | tokens | wall s | tok/s | p50 latency s | p99 latency s "
        "| p50 TTFT s | p99 TTFT s | same as off |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        key = f"{c['mode']}/{c['clients']}"
        lines.append(
            f"| {c['mode']} | {c['clients']} | {c['ok']}/{c['sent']} | {c['failed']} | {c['lost']} | {c['tokens']} "
            f"| {fmt(c['wall_s'], 1)} | {fmt(c['throughput_tok_s'])} | {fmt(c['latency_p50_s'])} "
            f"| {fmt(c['latency_p99_s'])} | {fmt(c['ttft_p50_s'])} | {fmt(c['ttft_p99_s'])} | {same.get(key, '-')} |"
        )
    lines += [
        "",
        "| mode | RSS at start MB | peak MB | at end MB | end - first cell's end MB |",
        "|---|---|---|---|---|",
    ]
    for mode, m in memory.items():
        lines.append(
            f"| {mode} | {fmt(m['start_mb'], 0)} | {fmt(m['peak_mb'], 0)} | {fmt(m['end_mb'], 0)} "
            f"| {fmt(m['growth_mb'], 0)} |"
        )
    return "\n".join(lines) + "\n"


def load_prompts(workload: str, questions: Path, requests: int) -> list[list[dict]]:
    """`requests` chat message lists: Spec-Bench first turns round-robin over categories (so a short run
    still mixes tasks), or the schema workload's requests in order (repeated past its 48)."""
    if workload == "schema":
        convs = workloads.schema(min(requests, workloads.SCHEMA_REQUESTS))
        return [convs[i % len(convs)].messages(0, []) for i in range(requests)]
    by_cat: dict[str, list[str]] = {}
    for q in load_questions(questions):
        by_cat.setdefault(q["category"], []).append(q["turns"][0])
    mixed = [p for group in zip(*by_cat.values()) for p in group]
    return [[{"role": "user", "content": mixed[i % len(mixed)]}] for i in range(requests)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--questions", type=Path, default=DEFAULT_QUESTIONS, help="Spec-Bench question.jsonl")
    ap.add_argument(
        "--workload",
        default="spec_bench",
        choices=["spec_bench", "schema"],
        help="the prompts: Spec-Bench first turns mixed over categories, or the repeated-schema requests of "
        "benchmarks/workloads.py",
    )
    ap.add_argument("--requests", type=int, default=32, help="requests per (mode, clients) cell (default 32)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument(
        "--time-limit",
        type=float,
        default=1800.0,
        help="seconds per cell after which no new request is sent (default 1800)",
    )
    ap.add_argument(
        "--concurrency", type=int, nargs="+", default=[1, 4, 16], help="concurrent clients (default 1 4 16)"
    )
    ap.add_argument(
        "--modes", nargs="+", default=list(MODES), choices=list(MODES), help="speculation off / on / on with pipelining"
    )
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument(
        "--drafter", action="append", help="as hf-spin serve --drafter (default: the server's default pool)"
    )
    ap.add_argument("--policy", default="round_robin")
    ap.add_argument(
        "--threads", type=int, default=2, help="torch threads in the server (set it: an oversubscribed CPU collapses)"
    )
    ap.add_argument(
        "--startup-timeout", type=float, default=900.0, help="seconds to wait for the server to load its models"
    )
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = ap.parse_args()
    if args.requests < 1 or args.max_new_tokens < 1 or min(args.concurrency) < 1:
        ap.error("--requests, --max-new-tokens and --concurrency must be >= 1")
    args.out.mkdir(parents=True, exist_ok=True)
    if "suffix" in (args.drafter or []) and len(args.concurrency) > 1 and set(args.modes) - {"off"}:
        print(
            "warning: the suffix drafter learns across requests and every cell sends the same prompts: "
            "the cells after the first replay answers the server has seen; give one --concurrency value per run",
            file=sys.stderr,
            flush=True,
        )

    prompts = load_prompts(args.workload, args.questions, args.requests)

    cells, memory, texts, commands = [], {}, {}, {}
    for mode in args.modes:
        server = Server(mode, args)
        commands[mode] = server.command
        sampler = RssSampler(server.proc.pid)
        sampler.start()
        try:
            t = time.time()
            server.wait_ready(args.startup_timeout)
            print(f"[{mode}] server ready in {time.time() - t:.0f}s: {server.command}", flush=True)
            asyncio.run(run_cell(server.url, prompts[:1], 1, 4, args.time_limit))  # warm-up, not counted
            sampler.cell = "warm"
            cell_ends = []
            for clients in args.concurrency:
                sampler.cell = f"{mode}/{clients}"
                results, wall = asyncio.run(
                    run_cell(server.url, prompts, clients, args.max_new_tokens, args.time_limit)
                )
                cell_ends.append(rss_mb(server.proc.pid))
                summary = summarize(mode, clients, results, wall, len(prompts) - len(results))
                cells.append(summary)
                texts[f"{mode}/{clients}"] = [r["text"] if r["status"] == "ok" else None for r in results]
                print(
                    f"[{mode}] {clients} clients: {summary['ok']}/{summary['sent']} ok, {summary['failed']} failed, "
                    f"{summary['lost']} lost, {fmt(summary['throughput_tok_s'])} tok/s, "
                    f"p50 latency {fmt(summary['latency_p50_s'])}s, p50 TTFT {fmt(summary['ttft_p50_s'])}s",
                    flush=True,
                )
            metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
            leftover = [
                line
                for line in metrics.splitlines()
                if line.startswith(("hf_spin_queue_depth ", "hf_spin_batch_size "))
            ]
        finally:
            sampler.done.set()
            rc = server.stop()
        mb = [s[2] for s in sampler.samples if s[1] not in ("startup",)]
        memory[mode] = {
            "start_mb": mb[0] if mb else None,
            "peak_mb": max(mb) if mb else None,
            "end_mb": mb[-1] if mb else None,
            "growth_mb": (cell_ends[-1] - cell_ends[0]) if len(cell_ends) > 1 and None not in cell_ends else None,
            "after_cells_mb": cell_ends,
            "server_exit_code": rc,
            "leftover_gauges": leftover,
        }
    same = {}
    for key, outs in texts.items():
        mode, clients = key.split("/")
        ref = texts.get(f"off/{clients}")
        if mode != "off" and ref:
            pairs = [(a, b) for a, b in zip(outs, ref) if a is not None and b is not None]
            same[key] = f"{sum(a == b for a, b in pairs)}/{len(pairs)}"
    bad = sum(c["failed"] + c["lost"] for c in cells)
    payload = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "machine": machine(),
        "commands": commands,
        "cells": cells,
        "memory": memory,
        "same_as_off": same,
        "failed_or_lost": bad,
    }
    md = write_results(args.out, "serve_load", payload, table(cells, memory, same))
    print(table(cells, memory, same))
    print(f"results: {md} (and .json); failed or lost requests: {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
