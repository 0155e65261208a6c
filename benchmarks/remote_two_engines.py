"""Two engines sharing a Redis tier: the second engine's throughput on the first's prefixes.

Engine A serves the workload once with the remote tier, so its prefixes are on the server. Then,
interleaved for ``--repeats`` rounds, fresh engines B serve the same workload:

* ``recompute``: no offloading (B computes every prefix itself; its device cache reuses what fits);
* ``host only``: B with its own host tier but no remote tier (computes each prefix once);
* ``remote``: B with its host tier and the remote tier (loads A's prefixes from Redis).

Each B is a new engine with empty caches; the Redis blocks stay. Prints the median [min..max]
output tokens/s of each and the ratio to ``recompute``. Workload: the bench CLI's default
(``prefix_repetition``, ``small``, 64 prompts over 8 prefixes of 2048 tokens, 600 device blocks).

Usage: ``python benchmarks/remote_two_engines.py [--url redis://...] [--repeats 3]
[--num-prompts 64]``.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from kvoffload.benchmark import datasets
from kvoffload.benchmark.throughput import run_throughput
from kvoffload.cli.bench import DEFAULTS
from kvoffload.engine.config import preset_config


@contextlib.contextmanager
def server_url(url: str | None) -> Iterator[str]:
    if url is not None:
        yield url
        return
    from redis_servers import standalone_server

    with standalone_server() as server:
        yield server.url


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=DEFAULTS["num_prompts"])
    parser.add_argument("--prefix-len", type=int, default=DEFAULTS["prefix_repetition_prefix_len"])
    args = parser.parse_args()
    model = preset_config(DEFAULTS["model"])
    requests = datasets.prefix_repetition(
        args.num_prompts,
        args.prefix_len,
        DEFAULTS["prefix_repetition_suffix_len"],
        DEFAULTS["prefix_repetition_num_prefixes"],
        DEFAULTS["output_len"],
        vocab_size=model.vocab_size,
        eos_token_id=model.eos_token_id,
        seed=0,
    )
    base: dict[str, Any] = {
        "model": DEFAULTS["model"],
        "num_device_blocks": DEFAULTS["num_device_blocks"],
        "max_num_seqs": DEFAULTS["max_num_seqs"],
    }
    host = {**base, "kv_offloading_size": DEFAULTS["kv_offloading_size"]}
    with server_url(args.url) as url:
        remote = {**host, "kv_remote_url": url}
        a = run_throughput(requests, "engine A", remote)
        print(
            f"engine A: {a.output_tokens / a.elapsed_s:.1f} tok/s, stored "
            f"{a.stats.get('offload_tier_remote_stored_blocks', 0)} blocks in Redis"
        )
        configs = {"recompute": base, "host only": host, "remote": remote}
        rates: dict[str, list[float]] = {name: [] for name in configs}
        loaded: list[int] = []
        for _ in range(args.repeats):
            for name, kwargs in configs.items():
                r = run_throughput(requests, name, kwargs)
                rates[name].append(r.output_tokens / r.elapsed_s)
                if name == "remote":
                    loaded.append(int(r.stats.get("offload_tier_remote_loaded_blocks", 0)))
    ref = statistics.median(rates["recompute"])
    print(f"engine B, median [min..max] of {args.repeats} interleaved repeats (output tok/s):")
    for name, values in rates.items():
        med = statistics.median(values)
        print(
            f"  {name:10s} {med:8.1f} [{min(values):.1f}..{max(values):.1f}]  "
            f"{med / ref:5.2f}x recompute"
        )
    print(f"  blocks loaded from Redis per remote run: {loaded}")


if __name__ == "__main__":
    main()
