"""``kvoffload bench serve --compare-routing``: the same workload through one router per policy
over N fresh ``kvoffload serve`` instances, and through one instance with N times their caches (device, host,
disk), interleaved over ``--repeats`` (the order rotated by one each repeat); figures as median [min-max], and the per-block costs the
routers measured.

Every run starts fresh servers (a run never finds the previous run's cache: each instance gets an
empty disk directory of its own, the shared Redis is flushed) on free loopback ports, and stops
them at the end. ``--compare-routing-redis`` adds a shared ``redis-server`` (started here) as
every instance's remote tier; with ``--compare-routing-redis-link MB/S`` each instance reaches it
over a link of its own carrying that many MB per second each way (:mod:`kvoffload.servebench.link`,
a proxy on loopback simulating a network), and the routers are told the instances share it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import Any

import numpy as np
import redis

from kvoffload.errors import ContractError
from kvoffload.servebench.processes import free_port, running
from kvoffload.servebench.routing_configs import (
    CONFIG_NAMES,
    NX_CACHE,
    ROUTER_CONFIGS,
    repeat_order,
)
from kvoffload.servebench.run import run_once

__all__ = ["compare_routing"]

_FIGURES = ("prefix_hit_rate", "mean_ttft_ms", "p99_ttft_ms", "request_throughput")


def _events() -> str:
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                       "endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*",
                       "topic": "kv"})


def _serve_args(args: argparse.Namespace, scale: int, remote: str | None,
                disk: str | None) -> list[str]:
    """One instance's flags; ``scale`` multiplies its device, host and disk sizes."""
    out = ["serve", "--model", args.model, "--num-device-blocks",
           str(args.num_device_blocks * scale), "--kv-offloading-size",
           f"{args.compare_routing_host_size * scale:g}", "--kv-events-config", _events(),
           *shlex.split(args.serve_args or "")]
    if disk is not None:
        out += ["--kv-disk-path", disk, "--kv-disk-size",
                f"{args.compare_routing_disk_size * scale:g}"]
    if remote:
        out += ["--kv-remote-url", remote]
    return out


def _instance(stack: contextlib.ExitStack, args: argparse.Namespace, scale: int,
              remote: str | None) -> str:
    """Start one fresh instance (its own empty disk tier, if any); returns its URL."""
    disk = None
    if args.compare_routing_disk_size:
        disk = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvoffload-disk-"))
    port = free_port()
    return stack.enter_context(running([*_serve_args(args, scale, remote, disk), "--port",
                                         str(port)], port))


def _one_config(args: argparse.Namespace, name: str, remote: str | None,
                links: list[str]) -> dict:
    """One run of ``name``; ``links``: instance i reaches ``remote`` at ``links[i]`` (none:
    directly)."""
    if remote:  # every run starts from empty caches, the shared tier's included
        client = redis.Redis.from_url(remote)
        try:
            client.flushall()
        finally:
            client.close()
    urls: list[str | None] = list(links) or [remote] * args.compare_routing
    with contextlib.ExitStack() as stack:
        if name == NX_CACHE:
            return run_once(args, _instance(stack, args, args.compare_routing, urls[0]), quiet=True)
        backends = [_instance(stack, args, 1, url) for url in urls]
        port = free_port()
        route = ["route", "--model", args.model, "--port", str(port), *ROUTER_CONFIGS[name]]
        for b in backends:  # behind links their remote tiers have different URLs: one group
            route += ["--backend", f"{b},remote_group=shared" if links else b]
        url = stack.enter_context(running(route, port))
        time.sleep(1.0)  # the router subscribes to every backend's events
        result = run_once(args, url, quiet=True)
        with urllib.request.urlopen(f"{url}/router/stats", timeout=10) as resp:
            stats = json.loads(resp.read())
        result["router"] = {k: stats[k] for k in ("decision_us_p50", "decision_us_p99", "counters")}
        result["router"]["measured_costs"] = [b["costs"] for b in stats["backends"]]
        result["router"]["requests_per_backend"] = [b["requests"] for b in stats["backends"]]
        return result


def compare_routing(args: argparse.Namespace) -> dict[str, Any]:
    remote_ctx: Any = contextlib.nullcontext(None)
    if args.compare_routing_redis:
        from kvoffload.benchmark.redis_server import standalone_server

        remote_ctx = standalone_server()
    configs = args.compare_routing_configs or CONFIG_NAMES
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in configs}
    with remote_ctx as server, _links(args, server) as links:
        remote = None if server is None else server.url
        for repeat in range(args.repeats):
            order = repeat_order(configs, repeat)
            print(f"repeat {repeat + 1}/{args.repeats}: order {', '.join(order)}", flush=True)
            for name in order:  # every config once per repeat, rotated
                result = _one_config(args, name, remote, links)
                result["loadavg"] = os.getloadavg()
                runs[name].append(result)
                print(f"repeat {repeat + 1}/{args.repeats}: {name}: hit rate "
                      f"{result['prefix_hit_rate'] or 0:.3f}, mean TTFT "
                      f"{result['mean_ttft_ms']:.0f} ms, failed {result['failed']}, load "
                      f"{result['loadavg'][0]:.1f}", flush=True)
    summary = {name: _spread(results) for name, results in runs.items()}
    _print(summary, args)
    _print_costs(runs)
    return {"configs": summary, "runs": runs, "loadavg": os.getloadavg()}


@contextlib.contextmanager
def _links(args: argparse.Namespace, server: Any) -> Iterator[list[str]]:
    """One bandwidth-limited link per instance to ``server`` (Redis URLs), or none."""
    rate = args.compare_routing_redis_link
    if server is None or not rate:
        yield []
        return
    port = urllib.parse.urlsplit(server.url).port
    proc = subprocess.Popen([sys.executable, "-m", "kvoffload.servebench.link", str(port),
                             f"{rate:g}", str(args.compare_routing)], stdout=subprocess.PIPE,
                            text=True)
    try:
        if proc.stdout is None:
            raise ContractError("the link process has no stdout pipe")
        ports = proc.stdout.readline().split()
        if len(ports) != args.compare_routing:
            raise RuntimeError("the link proxy did not start")
        yield [server.url.replace(f":{port}/", f":{p}/") for p in ports]
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def _print_costs(runs: dict[str, list[dict[str, Any]]]) -> None:
    """What the routers measured, per block, over every backend of every run (median)."""
    costs = [c for results in runs.values() for r in results
             for c in r.get("router", {}).get("measured_costs", [])]
    parts = []
    for key, label in (("compute_token_s", "compute per token"), ("load_host_s", "host load"),
                       ("promotion_disk_s", "disk promotion"),
                       ("promotion_remote_s", "remote promotion")):
        values = [c[key] for c in costs if c.get(key) is not None]
        if values:
            parts.append(f"{label} {np.median(values) * 1e3:.3g} ms")
    if parts:
        print("measured per block (median over backends and runs): " + ", ".join(parts))


def _spread(results: list[dict[str, Any]]) -> dict[str, Any]:
    out = {}
    for key in (*_FIGURES, "failed"):
        values = [r[key] for r in results if r.get(key) is not None]
        if values:
            out[key] = {"median": float(np.median(values)), "min": float(min(values)),
                        "max": float(max(values))}
    decisions = [r["router"]["decision_us_p99"] for r in results if "router" in r]
    if decisions:
        out["decision_us_p99"] = {"median": float(np.median(decisions)),
                                  "min": float(min(decisions)), "max": float(max(decisions))}
    return out


def _print(summary: dict[str, Any], args: argparse.Namespace) -> None:
    n = args.compare_routing
    print(f"== {n} instances, median [min-max] of {args.repeats} interleaved repeats; load "
          f"{os.getloadavg()[0]:.1f} ==")
    keys = (*_FIGURES, "decision_us_p99", "failed")
    print(f"{'':<26}" + "".join(f"{k:>24}" for k in keys))
    for name, figures in summary.items():
        cells = []
        for k in keys:
            f = figures.get(k)
            cells.append("-" if f is None else f"{f['median']:.3g} [{f['min']:.3g}-{f['max']:.3g}]")
        print(f"{name.replace('Nx', f'{n}x'):<26}" + "".join(f"{c:>24}" for c in cells))
    base, kv = summary.get("round_robin", {}), summary.get("kv_aware", {})
    if base.get("prefix_hit_rate") and kv.get("prefix_hit_rate") and base["prefix_hit_rate"]["median"]:
        print(f"kv_aware / round_robin: hit rate "
              f"{kv['prefix_hit_rate']['median'] / base['prefix_hit_rate']['median']:.2f}x, "
              f"mean TTFT {base['mean_ttft_ms']['median'] / kv['mean_ttft_ms']['median']:.2f}x lower")
