"""``kvoffload bench serve --compare-offloading``: the same workload against one fresh
``kvoffload serve`` (or, with ``--compare-offloading-server vllm``, ``vllm serve`` with our
``KVOffloadSpec``: :mod:`kvoffload.servebench.vllm_offloading`) per offloading configuration (no
offloading / host / host + disk / host + Redis), interleaved over ``--repeats`` (the order
rotated by one each repeat); figures as median [min-max] and as ratios against no offloading.

Every run starts a fresh instance on a free loopback port with ``--num-device-blocks`` and
``--serve-args``, and stops it at the end: a run never finds an earlier run's cache (the disk
tier gets a fresh directory, the Redis server started here for ``host_redis`` is flushed first).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import redis

from kvoffload.cli.front_door_flags import API_KEY_ENV, BACKEND_API_KEY_ENV
from kvoffload.servebench.processes import (
    Server,
    cpu_seconds,
    free_port,
    kvoffload_command,
    running_command,
)
from kvoffload.servebench.routing_configs import repeat_order

__all__ = ["OFFLOADING_CONFIGS", "OFFLOADING_SERVERS", "compare_offloading", "offloading_args"]

#: The configurations, the baseline first.
OFFLOADING_CONFIGS: tuple[str, ...] = ("no_offloading", "host", "host_disk", "host_redis")
BASELINE = OFFLOADING_CONFIGS[0]
#: The servers the comparison can start.
OFFLOADING_SERVERS: tuple[str, ...] = ("kvoffload", "vllm")
#: Keys a server reads from the environment: never inherited by the comparison's vLLM servers
#: (every request would get 401).
_VLLM_KEY_ENVS = frozenset((API_KEY_ENV, BACKEND_API_KEY_ENV, "VLLM_API_KEY"))

#: The figures compared: (result key, label, lower is better); the shares come from the
#: servers' tokens by source.
_FIGURES: tuple[tuple[str, str, bool], ...] = (
    ("round1_mean_ttft_ms", "round 1 TTFT ms", True),
    ("later_rounds_mean_ttft_ms", "rounds 2+ TTFT ms", True),
    ("mean_ttft_ms", "mean TTFT ms", True),
    ("p99_ttft_ms", "P99 TTFT ms", True),
    ("mean_itl_ms", "mean ITL ms", True),
    ("output_throughput", "output tok/s", False),
    ("prefix_hit_rate", "hit rate", False),
    ("share_device", "device", False),
    ("share_host", "host", False),
    ("share_disk", "disk", False),
    ("share_remote", "remote", False),
    ("failed", "failed", True),
    ("context_to_device_cache", "context/device", False),
    ("server_cpu_s", "server CPU s", True),
    ("server_step_s", "engine compute s", True),
    ("server_store_s", "store jobs s", True),
)


def offloading_args(args: argparse.Namespace, name: str, disk: str | None,
                    remote: str | None) -> list[str]:
    """``kvoffload serve``'s flags for configuration ``name`` (no ``--port``)."""
    if name not in OFFLOADING_CONFIGS:
        raise ValueError(f"unknown offloading configuration {name!r}")
    out = ["serve", "--model", args.model, "--num-device-blocks", str(args.num_device_blocks),
           *shlex.split(args.serve_args or "")]
    # no_offloading says so: serve's own default is a host tier sized from the machine
    host = 0.0 if name == BASELINE else args.compare_offloading_host_size
    out += ["--kv-offloading-size", f"{host:g}"]
    if name == "host_disk":
        if disk is None:
            raise ValueError("host_disk needs a disk directory")
        out += ["--kv-disk-path", disk, "--kv-disk-size",
                f"{args.compare_offloading_disk_size:g}"]
    if name == "host_redis":
        if remote is None:
            raise ValueError("host_redis needs a Redis URL")
        out += ["--kv-remote-url", remote]
    return out


def _derived(result: dict[str, Any]) -> dict[str, Any]:
    """``result`` plus the compared figures it does not hold as such: each source's share, the
    server's compute and store seconds (``kvoffload serve``) and, for sessions, the TTFT of
    round 1 and of the later rounds (mean over their turns)."""
    out = dict(result)
    for source, share in result.get("share_by_source", {}).items():
        out[f"share_{source}"] = share
    counters = result.get("server_counters") or {}
    for key in ("step_s", "store_s"):
        if key in counters:
            out[f"server_{key}"] = counters[key]
    rounds = result.get("rounds") or []
    if rounds:
        out["round1_mean_ttft_ms"] = rounds[0]["mean_ttft_ms"] if rounds[0]["completed"] else None
        later = [(r["mean_ttft_ms"], r["completed"]) for r in rounds[1:] if r["completed"]]
        total = sum(n for _, n in later)
        out["later_rounds_mean_ttft_ms"] = (sum(m * n for m, n in later) / total
                                            if total else None)
    return out


def _spread(results: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    out = {}
    for key, _, _ in _FIGURES:
        values = [r[key] for r in results if r.get(key) is not None]
        if values:
            out[key] = {"median": float(np.median(values)), "min": float(min(values)),
                        "max": float(max(values))}
    return out


def compare_offloading(args: argparse.Namespace,
                       run: Callable[[argparse.Namespace, str], dict[str, Any]]) -> dict[str, Any]:
    """Run ``run(args, url)`` against a fresh instance of every configuration of
    ``args.compare_offloading_configs``, ``args.repeats`` times interleaved; prints the table and
    returns ``{"configs": summary, "runs": results, "loadavg": ...}``."""
    configs = tuple(args.compare_offloading_configs or OFFLOADING_CONFIGS)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in configs}
    remote_ctx: Any = contextlib.nullcontext(None)
    if "host_redis" in configs:
        from kvoffload.benchmark.redis_server import standalone_server

        remote_ctx = standalone_server()
    with remote_ctx as server:
        remote = None if server is None else server.url
        for repeat in range(args.repeats):
            order = repeat_order(configs, repeat)
            print(f"repeat {repeat + 1}/{args.repeats}: order {', '.join(order)}", flush=True)
            for name in order:
                result = _derived(_one(args, name, remote, run))
                result["loadavg"] = os.getloadavg()
                runs[name].append(result)
                ratio = result.get("context_to_device_cache")
                print(f"repeat {repeat + 1}/{args.repeats}: {name}: hit rate "
                      f"{result['prefix_hit_rate'] or 0:.3f}, mean TTFT "
                      f"{result['mean_ttft_ms']:.1f} ms, failed {result['failed']}, "
                      + ("" if ratio is None else f"context {ratio:.1f}x the device cache, ")
                      + f"load {result['loadavg'][0]:.1f}", flush=True)
                if result.get("first_error"):
                    print(f"  first error: {result['first_error']}", flush=True)
    summary = {name: _spread(results) for name, results in runs.items()}
    print_comparison(summary, args.repeats)
    return {"configs": summary, "runs": runs, "loadavg": os.getloadavg()}


def _one(args: argparse.Namespace, name: str, remote: str | None,
         run: Callable[[argparse.Namespace, str], dict[str, Any]]) -> dict[str, Any]:
    if remote is not None and name == "host_redis":  # every run starts from an empty tier
        client = redis.Redis.from_url(remote)
        try:
            client.flushall()
        finally:
            client.close()
    with tempfile.TemporaryDirectory(prefix="kvoffload-offloading-") as tmp:
        disk = None
        if name == "host_disk":
            disk = os.path.join(tmp, "disk")
            os.mkdir(disk)
        port = free_port()
        stats_file = os.path.join(tmp, "kvoffload-stats.json")
        if args.compare_offloading_server == "vllm":
            command, server = _vllm(args, name, disk, remote, port, tmp, stats_file)
        else:
            command, env = kvoffload_command(
                [*offloading_args(args, name, disk, remote), "--port", str(port)])
            server = running_command(command, env, port)
        with server as started:
            cpu_before = cpu_seconds(started.pid)
            result = run(args, started.url)
            cpu_after = cpu_seconds(started.pid)
        result["server_command"] = command
        result["server_cpu_s"] = (None if cpu_before is None or cpu_after is None
                                  else cpu_after - cpu_before)
        if os.path.exists(stats_file):  # the spec's own figures, written when vLLM went idle
            with open(stats_file) as f:
                result["kvoffload_stats"] = json.load(f)
        return result


def _vllm(args: argparse.Namespace, name: str, disk: str | None, remote: str | None, port: int,
          tmp: str, stats_file: str) -> tuple[list[str], contextlib.AbstractContextManager[Server]]:
    """The command of a fresh ``vllm serve`` of configuration ``name`` on ``port`` and the
    context that runs it (its output in ``tmp``, quoted when it fails to start; the spec's
    stats in ``stats_file``)."""
    from kvoffload.servebench.vllm_offloading import (
        needs_chat_template,
        vllm_executable,
        vllm_serve_args,
    )
    from kvoffload.serving.prompts import DEFAULT_CHAT_TEMPLATE

    template = None
    if needs_chat_template(args.model):
        template = os.path.join(tmp, "chat_template.jinja")
        with open(template, "w") as f:
            f.write(DEFAULT_CHAT_TEMPLATE)
    cmd = [vllm_executable(args.compare_offloading_vllm),
           *vllm_serve_args(args, name, disk, remote, template, stats_file), "--port", str(port)]
    env = {k: v for k, v in os.environ.items() if k not in _VLLM_KEY_ENVS}
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    return cmd, running_command(cmd, env, port, log=os.path.join(tmp, "vllm.log"), start_s=600)


def _number(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.3g}"


def _cell(figure: dict[str, float] | None) -> str:
    if figure is None:
        return "-"
    return f"{_number(figure['median'])} [{_number(figure['min'])}-{_number(figure['max'])}]"


def print_comparison(summary: dict[str, dict[str, dict[str, float]]], repeats: int) -> None:
    """The table (a row per figure, a column per configuration: median [min-max]) and each
    configuration's ratios against no offloading where both have the figure."""
    names = list(summary)
    rows = []
    for key, label, _ in _FIGURES:
        if any(key in summary[n] for n in names):
            rows.append([label, *(_cell(summary[n].get(key)) for n in names)])
    width = max(len(c) for row in [["", *names], *rows] for c in row[1:]) + 2
    print(f"== offloading, median [min-max] of {repeats} interleaved repeats; load "
          f"{os.getloadavg()[0]:.1f} ==")
    for row in [["", *names], *rows]:
        print(f"{row[0]:<18}" + "".join(f"{c:>{width}}" for c in row[1:]))
    base = summary.get(BASELINE)
    if not base:
        return
    for n in names:
        if n == BASELINE:
            continue
        parts = []
        for key, label, lower_better in _FIGURES[:6]:
            b, f = base.get(key), summary[n].get(key)
            if b and f and b["median"] and f["median"]:
                ratio = b["median"] / f["median"] if lower_better else f["median"] / b["median"]
                parts.append(f"{label} {ratio:.2f}x")
        if parts:
            print(f"{n} vs {BASELINE} (>1: better): " + ", ".join(parts))
