"""Compressed tiers end to end, in one process on the reference engine (``small``, bf16 KV):

* **disk**: prefixes whose KV is 4x the host tier, behind a disk tier half their size; rounds
  over every prefix in a fresh random order each round (the first fills the tiers). Per codec
  (``none``, ``lossless``): the share of prompt tokens served from cache after the first round
  (``hit_rate``: device and tiers; ``offload_hit_rate``: the tiers alone) and prompt tokens per
  second over those rounds.
* **remote**: a host tier and a Redis tier reached over a simulated link of ``--link-mbps`` MB/s
  each way (:mod:`kvoffload.servebench.link`; 20 by default). Engine A computes every prefix
  (they reach Redis); engine B, fresh, runs the same prefixes one at a time and loads them over
  the link. Per codec: B's load time per block (the tier's ``load_us`` / loaded blocks) and
  mean TTFT. ``auto`` runs too, and once more on loopback without the link (a tier faster than
  the codec: ``auto`` should leave blocks raw).

Medians of ``--repeat`` interleaved repeats (every codec once per repeat). The load average is
printed: on a shared machine compute-bound figures (throughput, TTFT) move with it.

Run: ``PYTHONPATH=. .venv/bin/python benchmarks/compression_e2e.py [--part disk remote]
[--prefixes 24] [--prefix-tokens 256] [--repeat 3]``. Asserts nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Iterator
from typing import Any

import torch

from kvoffload.engine import Engine, SamplingParams

BLOCK = 16
SAMPLING = SamplingParams(max_tokens=1, ignore_eos=True)


def kv_bytes_per_token() -> int:
    """``small`` in bf16: 8 layers x (K, V) x 4 KV heads x 64 x 2 bytes."""
    return 8 * 2 * 4 * 64 * 2


def make_prompts(count: int, prefix_tokens: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(prefix_tokens)] for _ in range(count)]


def with_suffix(prompt: list[int], rng: random.Random) -> list[int]:
    """The prefix and 4 new tokens (a new question after a shared document)."""
    return prompt + [rng.randrange(256) for _ in range(4)]


def engine(tmp: str, prefix_tokens: int, **extra: Any) -> Engine:
    """``small`` in bf16 whose device cache holds two requests' blocks, no more (prefixes are
    found in the offloading tiers, not left on the device)."""
    return Engine(
        "small",
        dtype="bfloat16",
        block_size=BLOCK,
        num_device_blocks=2 * (prefix_tokens // BLOCK + 1) + 2,
        kv_lookup_retry_s=60.0,
        **extra,
    )


def disk_run(args: argparse.Namespace, mode: str, seed: int) -> dict[str, float]:
    prompts = make_prompts(args.prefixes, args.prefix_tokens)
    kv = args.prefixes * args.prefix_tokens * kv_bytes_per_token()
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory() as tmp:
        e = engine(
            tmp,
            args.prefix_tokens,
            kv_offloading_size=kv / 4 / 2**30,
            kv_disk_path=tmp,
            kv_disk_size=kv / 2 / 2**30,
            kv_disk_compression=mode,
        )
        try:
            hits = offload_hits = tokens = 0
            elapsed = 0.0
            for round_no in range(args.rounds):
                order = list(range(args.prefixes))
                rng.shuffle(order)
                start = time.perf_counter()
                for i in order:
                    (out,) = e.generate([with_suffix(prompts[i], rng)], SAMPLING)
                    e.drain()
                    if round_no:
                        hits += out.cached_tokens_offload + out.cached_tokens_engine
                        offload_hits += out.cached_tokens_offload
                        tokens += len(out.prompt_token_ids)
                if round_no:
                    elapsed += time.perf_counter() - start
            stats = e.stats()
        finally:
            e.close()
    raw = stats.get("offload_tier_disk_codec_raw_bytes", 0)
    stored = stats.get("offload_tier_disk_codec_stored_bytes", 0)
    return {
        "hit_rate": hits / tokens,
        "offload_hit_rate": offload_hits / tokens,
        "tokens_per_s": tokens / elapsed,
        "disk_blocks": stats.get("offload_tier_disk_used_blocks", 0),
        "ratio": raw / stored if stored else 1.0,
    }


@contextlib.contextmanager
def redis_link(mbps: float | None) -> Iterator[str]:
    """A fresh ``redis-server``; its URL, through a link of ``mbps`` MB/s when given."""
    from kvoffload.benchmark.redis_server import standalone_server

    with standalone_server() as server:
        if not mbps:
            yield server.url
            return
        port = urllib.parse.urlsplit(server.url).port
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvoffload.servebench.link", str(port), f"{mbps:g}", "1"],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            if proc.stdout is None:
                raise RuntimeError("the link process has no stdout")
            (link_port,) = proc.stdout.readline().split()
            yield server.url.replace(f":{port}", f":{link_port}")
        finally:
            proc.kill()
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()


def remote_run(args: argparse.Namespace, mode: str, mbps: float | None) -> dict[str, float]:
    prompts = make_prompts(args.prefixes, args.prefix_tokens, seed=1)
    kv = args.prefixes * args.prefix_tokens * kv_bytes_per_token()
    rng = random.Random(2)
    suffixed = [with_suffix(p, rng) for p in prompts]
    with redis_link(mbps) as url, tempfile.TemporaryDirectory() as tmp:
        settings = dict(
            kv_offloading_size=kv / 4 / 2**30,
            kv_remote_url=url,
            kv_remote_compression=mode,
            kv_remote_lookup_wait_s=60.0,
        )
        a = engine(tmp, args.prefix_tokens, **settings)
        try:
            for p in suffixed:
                a.generate([p], SAMPLING)
            a.drain()
        finally:
            a.close()
        b = engine(tmp, args.prefix_tokens, **settings)
        try:
            ttfts = []
            for p in suffixed:
                (out,) = b.generate([with_suffix(p[: args.prefix_tokens], rng)], SAMPLING)
                b.drain()
                ttfts.append(out.ttft)
            stats = b.stats()
        finally:
            b.close()
    loaded = stats.get("offload_tier_remote_loaded_blocks", 0)
    raw = stats.get("offload_tier_remote_codec_raw_bytes", 0)
    encoded = stats.get("offload_tier_remote_codec_encoded_blocks", 0)
    return {
        "load_ms_per_block": stats.get("offload_tier_remote_load_us", 0) / 1e3 / max(1, loaded),
        "mean_ttft_ms": statistics.fmean(ttfts) * 1e3,
        "loaded_blocks": loaded,
        "decoded_blocks": stats.get("offload_tier_remote_codec_decoded_blocks", 0),
        "encoded_blocks_b": encoded,
        "ratio": raw / stats["offload_tier_remote_codec_stored_bytes"] if raw else 1.0,
    }


def medians(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def show(title: str, results: dict[str, dict[str, float]]) -> None:
    print(f"\n{title} (load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")
    for name, figures in results.items():
        shown = ", ".join(f"{k} {v:.4g}" for k, v in figures.items())
        print(f"  {name:24s} {shown}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--part", nargs="+", default=["disk", "remote"])
    parser.add_argument("--prefixes", type=int, default=24)
    parser.add_argument("--prefix-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--link-mbps", type=float, default=20.0)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if "disk" in args.part:
        runs: dict[str, list[dict[str, float]]] = {"none": [], "lossless": []}
        for r in range(args.repeat):
            for mode in runs:
                runs[mode].append(disk_run(args, mode, seed=r))
        show(
            f"disk: {args.prefixes} prefixes of {args.prefix_tokens} tokens, host 1/4 and disk "
            f"1/2 of their KV, rounds 2..{args.rounds}",
            {m: medians(v) for m, v in runs.items()},
        )
    if "remote" in args.part:
        configs = {
            f"none @ {args.link_mbps:g} MB/s": ("none", args.link_mbps),
            f"lossless @ {args.link_mbps:g} MB/s": ("lossless", args.link_mbps),
            f"auto @ {args.link_mbps:g} MB/s": ("auto", args.link_mbps),
            "none @ loopback": ("none", None),
            "auto @ loopback": ("auto", None),
        }
        remote: dict[str, list[dict[str, float]]] = {name: [] for name in configs}
        for _ in range(args.repeat):
            for name, (mode, mbps) in configs.items():
                remote[name].append(remote_run(args, mode, mbps))
        show(
            f"remote: engine B loads {args.prefixes} prefixes of {args.prefix_tokens} tokens",
            {m: medians(v) for m, v in remote.items()},
        )


if __name__ == "__main__":
    main()
