"""FCFS against cache-aware admission (``scheduling_policy``) on one workload, side by side.

Every configuration (no offloading, host tier, host + disk, host + Redis, an unlimited device
cache) runs under both policies, interleaved per repeat (the order rotated each repeat, so drift
hits every run alike), each a fresh engine on the same requests. Prints requests/s median
[min-max], engine steps and tokens computed per run; the median [min-max] of the per-repeat
ratios cache-aware / FCFS per configuration; and each configuration's share of the unlimited
device cache under the same policy (issue 23's targets: host + disk >= 90%, host + Redis >= 80%).
Besides wall-clock requests/s, every run's CPU seconds (this process, all threads, the timed part
only) give requests per CPU second: on a machine shared with other jobs the wall clock swings
with their load, the CPU time much less (it still counts contention's cache misses).

    python benchmarks/admission_order.py issue23 --repeats 3
    python benchmarks/admission_order.py trace --trace ../shared/traces/conversation_trace.jsonl
    python benchmarks/admission_order.py --list

Workloads are presets (``--list``); ``--num-prompts``, ``--num-device-blocks`` and ``--seed``
override theirs; ``--arrival-interval S`` sends request ``i`` at ``i * S`` seconds instead of all at
once (the order can then group only the requests waiting together). ``--configs`` picks configurations (``redis`` starts a local ``redis-server``,
flushed before every run). The machine's load average is printed before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvoffload.benchmark import datasets, traces
from kvoffload.benchmark.datasets import BenchRequest
from kvoffload.benchmark.matrix import unlimited_device_blocks
from kvoffload.benchmark.throughput import run_throughput
from kvoffload.engine.loader import load_model_config

HOST_GIB = 0.0234375  # 96 blocks of the small model (16 tokens): issue 23's host tier
POLICIES = ("fcfs", "cache_aware")
CONFIGS = ("none", "host", "disk", "redis", "unlimited")

#: name -> (description, requests(args, vocab, eos), engine settings)
Workload = tuple[str, Callable[[argparse.Namespace, int, int], list[BenchRequest]], dict[str, Any]]


def _prefix_rep(n: int, prefix_len: int, num_prefixes: int, suffix: int, out: int) -> Callable:
    def make(args: argparse.Namespace, vocab: int, eos: int) -> list[BenchRequest]:
        return datasets.prefix_repetition(
            args.num_prompts or n, prefix_len, suffix, num_prefixes, out, vocab, eos, args.seed
        )

    return make


def _grouped(inner: Callable) -> Callable:
    """The same requests in arrival order grouped by prefix (FCFS's best case)."""

    def make(args: argparse.Namespace, vocab: int, eos: int) -> list[BenchRequest]:
        reqs = inner(args, vocab, eos)
        return sorted(reqs, key=lambda r: tuple(r.prompt[:16]))

    return make


def _random(args: argparse.Namespace, vocab: int, eos: int) -> list[BenchRequest]:
    return datasets.random_prompts(
        args.num_prompts or 32, 384, 16, vocab, eos, args.seed, prefix_len=0, range_ratio=0.25
    )


def _multi_turn(args: argparse.Namespace, vocab: int, eos: int) -> list[BenchRequest]:
    return datasets.multi_turn(args.num_prompts or 48, 8, 128, 96, 8, vocab, eos, args.seed)


def _trace(args: argparse.Namespace, vocab: int, eos: int) -> list[BenchRequest]:
    path = args.trace
    if path in traces.SUITE:  # a generated workload of the suite, written to a temporary file
        records = traces.generate(path, args.seed, args.num_prompts or 64)
        tmp = Path(tempfile.mkdtemp()) / f"{path}.jsonl"
        traces.write(records, tmp)
        path = str(tmp)
    return datasets.trace_prompts(path, args.num_prompts or 64, 16, 8, vocab, eos, args.seed)


WORKLOADS: dict[str, Workload] = {
    "issue23": (
        "issue 23: 8 prefixes of 768 tokens (4x the host tier), 48 requests, 112 device blocks",
        _prefix_rep(48, 768, 8, 32, 8),
        {"num_device_blocks": 112},
    ),
    "issue23_grouped": (
        "issue 23's requests arriving grouped by prefix",
        _grouped(_prefix_rep(48, 768, 8, 32, 8)),
        {"num_device_blocks": 112},
    ),
    "many_prefixes": (
        "24 prefixes of 256 tokens, 96 requests, 64-token suffixes, 160 device blocks",
        _prefix_rep(96, 256, 24, 64, 16),
        {"num_device_blocks": 160},
    ),
    "random": (
        "no shared prefix: 32 requests of ~384 tokens, 128 device blocks (overhead only)",
        _random,
        {"num_device_blocks": 128},
    ),
    "multi_turn": (
        "8 chat sessions, 128-token system prompt, 96-token turns, 48 requests, 160 blocks",
        _multi_turn,
        {"num_device_blocks": 160},
    ),
    "trace": (
        "a Mooncake trace (--trace FILE or a suite name), 16 tokens per hash id, 160 blocks",
        _trace,
        {"num_device_blocks": 160},
    ),
}


def _engine_kwargs(
    args: argparse.Namespace, base: dict[str, Any], config: str, policy: str, unlimited: int
) -> dict[str, Any]:
    kw: dict[str, Any] = {
        "model": args.model,
        "max_num_seqs": 8,
        "scheduling_policy": policy,
        **base,
    }
    if args.num_device_blocks:
        kw["num_device_blocks"] = args.num_device_blocks
    if config == "unlimited":
        kw["num_device_blocks"] = unlimited
    elif config != "none":
        kw["kv_offloading_size"] = args.host_gib
    if config == "disk":
        kw.update(kv_disk_path=tempfile.mkdtemp(prefix="adm-disk-"), kv_disk_size=1.0)
    return kw


def _run_all(args: argparse.Namespace) -> list[dict[str, Any]]:
    description, make, base = WORKLOADS[args.workload]
    model = load_model_config(args.model)
    requests = make(args, model.vocab_size, model.eos_token_id)
    unlimited = unlimited_device_blocks(requests, 16)
    print(f"workload {args.workload}: {description}; {len(requests)} requests", flush=True)
    server = None
    if "redis" in args.configs:
        from kvoffload.benchmark.redis_server import standalone_server

        server_cm = standalone_server()
        server = server_cm.__enter__()
    arrivals = None
    if args.arrival_interval:
        arrivals = [i * args.arrival_interval for i in range(len(requests))]
    runs = [(c, p) for c in args.configs for p in args.policies]
    out: list[dict[str, Any]] = []
    try:
        for repeat in range(args.repeats):
            k = repeat % len(runs)
            for config, policy in runs[k:] + runs[:k]:
                kw = _engine_kwargs(args, base, config, policy, unlimited)
                if config == "redis":
                    assert server is not None
                    server.client().flushall()
                    kw["kv_remote_url"] = server.url
                load = os.getloadavg()[0]
                clock = _CPUClockMaker()
                try:
                    result = run_throughput(
                        requests, f"{config}/{policy}", kw, clock, repeat=repeat, arrivals=arrivals
                    )
                finally:
                    if "kv_disk_path" in kw:
                        shutil.rmtree(kw["kv_disk_path"], ignore_errors=True)
                figures = result.figures()
                row = {
                    "config": config,
                    "policy": policy,
                    "repeat": repeat,
                    "load": load,
                    "requests_per_s": figures["requests_per_s"],
                    "requests_per_cpu_s": result.num_requests / clock.seconds,
                    "steps": result.stats.get("steps", 0),
                    "tokens_computed": figures.get("tokens_computed", 0),
                    "preemptions": figures["preemptions"],
                    "p99_ttft_ms": figures["p99_ttft_ms"],
                    "tier_tokens": {
                        k[len("tokens_") :]: v
                        for k, v in figures.items()
                        if k.startswith("tokens_") and k != "tokens_computed" and v
                    },
                }
                out.append(row)
                print(
                    f"  r{repeat} {config:>9}/{policy:<11} {row['requests_per_s']:7.3f} req/s "
                    f"{row['requests_per_cpu_s']:6.3f} req/cpu-s "
                    f"{row['steps']:5.0f} steps {row['tokens_computed']:7.0f} computed "
                    f"{row['tier_tokens']} p99 TTFT {row['p99_ttft_ms']:.0f} ms (load {load:.1f})",
                    flush=True,
                )
    finally:
        if server is not None:
            server_cm.__exit__(None, None, None)
    return out


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class _CPUClock:
    """A progress "bar" of :func:`run_throughput`: made right before its clock starts and closed
    right after it stops, it measures the CPU seconds of the timed part."""

    def __init__(self) -> None:
        self._start = _cpu_s()
        self.seconds = 0.0

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        self.seconds = _cpu_s() - self._start


class _CPUClockMaker:
    """``progress`` of :func:`run_throughput`: its one bar is a :class:`_CPUClock`."""

    def __init__(self) -> None:
        self._clock: _CPUClock | None = None

    def __call__(self, _total: int, _label: str) -> _CPUClock:
        self._clock = _CPUClock()
        return self._clock

    @property
    def seconds(self) -> float:
        assert self._clock is not None
        return self._clock.seconds


def _spread(values: list[float], fmt: str = "{:.3f}") -> str:
    return f"{fmt.format(statistics.median(values))} [{fmt.format(min(values))}-{fmt.format(max(values))}]"


def _report(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    for metric in ("requests_per_s", "requests_per_cpu_s"):
        _report_metric(rows, args, metric)


def _report_metric(rows: list[dict[str, Any]], args: argparse.Namespace, metric: str) -> None:
    def rate(config: str, policy: str) -> dict[int, float]:
        return {
            r["repeat"]: r[metric] for r in rows if r["config"] == config and r["policy"] == policy
        }

    print(f"\n{args.workload}: {metric} median [min-max] of {args.repeats} interleaved repeats")
    for config in args.configs:
        cells = []
        for policy in args.policies:
            rs = list(rate(config, policy).values())
            steps = [r["steps"] for r in rows if r["config"] == config and r["policy"] == policy]
            cells.append(f"{policy} {_spread(rs)} ({statistics.median(steps):.0f} steps)")
        line = f"  {config:>9}: " + "; ".join(cells)
        if set(POLICIES) <= set(args.policies):
            a, b = rate(config, "fcfs"), rate(config, "cache_aware")
            ratios = [b[k] / a[k] for k in a if k in b]
            line += f"; cache_aware/fcfs {_spread(ratios, '{:.2f}')}x"
        print(line)
    if "unlimited" not in args.configs:
        return
    for policy in args.policies:
        ideal = rate("unlimited", policy)
        for config in args.configs:
            if config == "unlimited":
                continue
            got = rate(config, policy)
            pct = [100 * got[k] / ideal[k] for k in got if k in ideal]
            print(f"  {policy:>11} {config:>5} / unlimited: {_spread(pct, '{:.1f}')}%")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("workload", nargs="?", choices=sorted(WORKLOADS))
    p.add_argument("--list", action="store_true", help="list the workloads")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--configs", default="none,host,disk,unlimited")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--model", default="small")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--num-device-blocks", type=int, default=None)
    p.add_argument("--host-gib", type=float, default=HOST_GIB)
    p.add_argument("--trace", default="mix", help="trace file, or a suite name (workload trace)")
    p.add_argument(
        "--arrival-interval",
        type=float,
        default=0.0,
        help="seconds between request arrivals (default 0: all at once)",
    )
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    if args.list or args.workload is None:
        for name, (description, _, _) in WORKLOADS.items():
            print(f"{name:>16}: {description}")
        return 0
    args.configs = args.configs.split(",")
    args.policies = args.policies.split(",")
    bad = set(args.configs) - set(CONFIGS) or set(args.policies) - set(POLICIES)
    if bad:
        p.error(f"unknown: {sorted(bad)}")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch

    threads = os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(int(threads) if threads else max(1, len(os.sched_getaffinity(0))))
    print(f"load average before: {os.getloadavg()}", flush=True)
    rows = _run_all(args)
    print(f"load average after: {os.getloadavg()}")
    _report(rows, args)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps({"args": vars(args), "runs": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
