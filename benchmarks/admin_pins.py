"""Operator pins under pressure, and the cost of an operator's lookup through ``kvoffload route``.

1. **Pinned system prompt** (in-process :class:`~kvoffload.engine.Engine`): ``--sessions``
   conversations, interleaved turn by turn, each turn's prompt a head of ``--system-tokens``
   then the session's history (grows by ``--turn-tokens`` a turn); one session in
   ``--system-every`` has the shared system prompt as its head, the others a head of their own
   (the traffic that churns the host tier between two uses of the system prompt). The host
   tier holds ``--host-blocks`` blocks, far fewer than the sessions' histories, and the device
   cache ``--device-blocks`` (cleared before each turn, as a busy device would have evicted it,
   so what a turn finds comes from the host tier). Run twice, the same prompts: the system
   prompt pinned in the host tier (``Engine.pin``), and not. Reported per run: the share of the
   system prompt's tokens its turns found cached (``system hit``), the share of all prompt
   tokens of all turns (``hit rate``), TTFT p50 / p90 of the turns on the system prompt.
2. **Lookup latency through route**: two ``kvoffload serve`` processes and one ``kvoffload
   route`` (all on loopback), the prompt warmed on one of them; ``--lookups`` sequential
   ``POST /admin/lookup`` (one request at a time) to the router (which asks both backends and
   reads its index) and to one server directly; p50 / p99 of each, in milliseconds.

Usage: ``python benchmarks/admin_pins.py [--model tiny|small] [--sessions 24] [--turns 4]
[--lookups 200] [--skip-route]``. Figures in docs/admin.md come from this script.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import torch

from kvoffload.engine import Engine, SamplingParams


def pinned_run(args: argparse.Namespace, pin: bool) -> dict[str, float]:
    rng = random.Random(args.seed)
    system = [rng.randrange(5, 500) for _ in range(args.system_tokens)]
    # One session in --system-every starts with the shared system prompt; the others with a
    # prompt of their own of the same length (traffic that churns the host tier between uses).
    heads = [system if s % args.system_every == 0 else
             [rng.randrange(5, 500) for _ in range(args.system_tokens)]
             for s in range(args.sessions)]
    histories = [[] for _ in range(args.sessions)]  # type: list[list[int]]
    kv_bytes = {"tiny": 512, "small": 16384}[args.model]  # float32 K and V, per token
    engine = Engine(
        args.model, block_size=16, num_device_blocks=args.device_blocks,
        kv_offloading_size=args.host_blocks * 16 * kv_bytes / 2**30, eviction_policy="lru",
        dtype="float32",
    )
    sampling = SamplingParams(max_tokens=1, ignore_eos=True)
    system_hit: list[float] = []
    ttfts: list[float] = []
    cached = prompt = 0
    with engine:
        if pin:
            engine.pin(system, ["host"], owner="bench")
        for _turn in range(args.turns):
            for s in range(args.sessions):
                histories[s] += [rng.randrange(5, 500) for _ in range(args.turn_tokens)]
                engine.admin.clear(["device"])
                out = engine.generate([heads[s] + histories[s]], sampling)[0]
                engine.drain()
                hit = out.cached_tokens_engine + out.cached_tokens_offload
                if heads[s] is system:  # the turns that use the system prompt
                    system_hit.append(min(hit, len(system)) / len(system))
                    ttfts.append(out.ttft)
                cached += hit
                prompt += out.num_prompt_tokens
    ttfts.sort()
    return {
        "system_hit": statistics.fmean(system_hit),
        "hit_rate": cached / prompt,
        "ttft_p50_ms": ttfts[len(ttfts) // 2] * 1e3,
        "ttft_p90_ms": ttfts[int(len(ttfts) * 0.9)] * 1e3,
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def _process(args: list[str]) -> Iterator[str]:
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "kvoffload.cli.main", *args, "--port",
                             str(port)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            with contextlib.suppress(OSError):
                urllib.request.urlopen(f"{url}/health", timeout=2).close()
                break
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"{args[0]} did not start")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def _post(url: str, body: dict[str, Any]) -> Any:
    request = urllib.request.Request(url, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def _latencies(url: str, body: dict[str, Any], n: int) -> tuple[float, float]:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        _post(url, body)
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2] * 1e3, times[min(len(times) - 1, int(len(times) * 0.99))] * 1e3


def route_lookups(args: argparse.Namespace) -> dict[str, float]:
    flags = ["--model", args.model, "--num-device-blocks", "256", "--kv-offloading-size", "0.01"]
    prompt = "The shared system prompt of the whole fleet. " * 20
    with _process(["serve", *flags]) as a, _process(["serve", *flags]) as b, \
            _process(["route", "--model", args.model, "--backend", a, "--backend", b]) as r:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # both backends in rotation
            with urllib.request.urlopen(f"{r}/router/stats", timeout=5) as response:
                if all(x["healthy"] for x in json.loads(response.read())["backends"]):
                    break
            time.sleep(0.2)
        _post(f"{r}/admin/warm", {"prompt": prompt, "backends": [a]})
        _latencies(f"{r}/admin/lookup", {"prompt": prompt}, 10)  # warm the connections
        route_p50, route_p99 = _latencies(f"{r}/admin/lookup", {"prompt": prompt}, args.lookups)
        serve_p50, serve_p99 = _latencies(f"{a}/admin/lookup", {"prompt": prompt}, args.lookups)
    return {"route_p50_ms": route_p50, "route_p99_ms": route_p99,
            "serve_p50_ms": serve_p50, "serve_p99_ms": serve_p99}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", choices=["tiny", "small"])
    parser.add_argument("--sessions", type=int, default=24)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=512)
    parser.add_argument("--turn-tokens", type=int, default=64)
    parser.add_argument("--system-every", type=int, default=4)
    parser.add_argument("--host-blocks", type=int, default=96)
    parser.add_argument("--device-blocks", type=int, default=128)
    parser.add_argument("--lookups", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-route", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"model {args.model}: {args.sessions} sessions x {args.turns} turns, system prompt "
          f"{args.system_tokens} tokens, host tier {args.host_blocks} blocks of 16 tokens")
    with Engine(args.model, block_size=16, num_device_blocks=64) as warm_up:  # first-run costs
        warm_up.generate([list(range(5, 300))], SamplingParams(max_tokens=2))
    for pin in (True, False):
        r = pinned_run(args, pin)
        print(f"  {'pinned  ' if pin else 'no pin  '} system hit {r['system_hit']:.3f}  "
              f"hit rate {r['hit_rate']:.3f}  TTFT p50 {r['ttft_p50_ms']:.1f} ms  "
              f"p90 {r['ttft_p90_ms']:.1f} ms")
    if not args.skip_route:
        r = route_lookups(args)
        print(f"lookup through route (2 backends): p50 {r['route_p50_ms']:.2f} ms  "
              f"p99 {r['route_p99_ms']:.2f} ms; one server directly: p50 "
              f"{r['serve_p50_ms']:.2f} ms  p99 {r['serve_p99_ms']:.2f} ms")


if __name__ == "__main__":
    main()
