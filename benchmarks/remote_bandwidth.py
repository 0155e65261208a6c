"""Store and load bandwidth of the remote tier against the same client's plain pipelined SET/GET.

For each batch size, interleaved repeats of four timed operations on one ``redis-server``:

* ``tier store``: :meth:`RedisTier.submit_store` of a batch of host slots (header + checksum +
  zero-copy send) until its result is reported;
* ``tier load``: :meth:`RedisTier.submit_load` of those blocks (GET, header and checksum
  verified, copied into the host slots);
* ``plain SET`` / ``plain GET``: one ``redis.Redis().pipeline(transaction=False)`` of the same
  number of values of the same size (header + payload bytes), the limit of this client on this
  server.

Prints medians with the spread (min..max) of each, in GB/s of payload and blocks/s, and the tier's
share of the plain loop. The server is flushed between repeats (outside the timings). With
``--clients`` it also measures the plain loop with each installed client (redis-py, valkey-py,
valkey-glide's sync client): the measurement behind the client choice.

Usage: ``python benchmarks/remote_bandwidth.py [--url redis://host:port] [--block-kib 256]
[--batches 16 64 256] [--repeats 7] [--clients]``. Without ``--url`` it starts a local
``redis-server`` (kvoffload/benchmark/redis_server.py).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from collections.abc import Callable, Iterator

import redis
import torch

from kvoffload.keys import make_offload_key
from kvoffload.tiers.base import KVLayout, TierJob
from kvoffload.tiers.blockformat import header_size
from kvoffload.tiers.remote import VALUE_ALIGN, RedisTier, RemoteTierConfig


@contextlib.contextmanager
def server_url(url: str | None) -> Iterator[str]:
    if url is not None:
        yield url
        return
    from kvoffload.benchmark.redis_server import standalone_server

    with standalone_server() as server:
        yield server.url


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def fmt(seconds: list[float], num_bytes: int, blocks: int) -> str:
    med = statistics.median(seconds)
    return (
        f"{num_bytes / med / 1e9:6.2f} GB/s [{num_bytes / max(seconds) / 1e9:5.2f}.."
        f"{num_bytes / min(seconds) / 1e9:5.2f}] {blocks / med:8.0f} blk/s"
    )


def bench_batch(url: str, block: int, batch: int, repeats: int) -> dict[str, list[float]]:
    """Interleaved repeats of tier store/load and plain SET/GET for one batch size."""
    layout = KVLayout(f"bench-{os.getpid()}", "float32", 16, 8, 4, 64, block)
    pool_tensor = torch.randint(0, 256, (2 * batch, block), dtype=torch.uint8)
    tier = RedisTier(
        memoryview(pool_tensor.numpy()), layout, RemoteTierConfig(url=url, timeout_s=30.0)
    )
    plain = redis.Redis.from_url(url, socket_timeout=30)
    key_len = len(make_offload_key(bytes(32)))
    value = os.urandom(header_size(key_len, VALUE_ALIGN) + block)
    plain_keys = [b"plain:%d" % i for i in range(batch)]
    times: dict[str, list[float]] = {"tier store": [], "tier load": [], "SET": [], "GET": []}
    job_id = 0
    try:
        for rep in range(repeats):
            keys = [
                make_offload_key((rep * 1_000_000 + i).to_bytes(32, "big")) for i in range(batch)
            ]

            def run(is_store: bool, slots: list[int], keys: list[bytes] = keys) -> None:
                nonlocal job_id
                job_id += 1
                job = TierJob(job_id, keys, slots)
                (tier.submit_store if is_store else tier.submit_load)(job)
                tier.drain_jobs()
                (result,) = tier.get_finished_jobs()
                assert result.success, result.failed_keys

            def plain_set() -> None:
                pipe = plain.pipeline(transaction=False)
                for k in plain_keys:
                    pipe.set(k, value)
                pipe.execute()

            def plain_get() -> None:
                pipe = plain.pipeline(transaction=False)
                for k in plain_keys:
                    pipe.get(k)
                assert len(pipe.execute()[-1]) == len(value)

            order = [0, 1, 2, 3] if rep % 2 == 0 else [2, 3, 0, 1]
            for op in order:
                if op == 0:
                    times["tier store"].append(timed(lambda: run(True, list(range(batch)))))
                elif op == 1:
                    slots = list(range(batch, 2 * batch))
                    times["tier load"].append(timed(lambda slots=slots: run(False, slots)))
                elif op == 2:
                    times["SET"].append(timed(plain_set))
                else:
                    times["GET"].append(timed(plain_get))
            assert torch.equal(pool_tensor[batch:], pool_tensor[:batch])
            pool_tensor[batch:].zero_()
            plain.flushall()
    finally:
        tier.close()
        plain.close()
    return times


def client_choice(url: str, block: int, batch: int, repeats: int) -> None:
    """Plain pipelined SET/GET with each installed client, interleaved."""
    host, port = url.split("//")[1].split("/")[0].rsplit("@", 1)[-1].split(":")
    value = os.urandom(block + 64)
    keys = [b"c:%d" % i for i in range(batch)]
    clients: dict[str, tuple[Callable[[], None], Callable[[], None]]] = {}

    def pipelined(client: object) -> tuple[Callable[[], None], Callable[[], None]]:
        def s() -> None:
            p = client.pipeline(transaction=False)  # type: ignore[attr-defined]
            for k in keys:
                p.set(k, value)
            p.execute()

        def g() -> None:
            p = client.pipeline(transaction=False)  # type: ignore[attr-defined]
            for k in keys:
                p.get(k)
            p.execute()

        return s, g

    clients["redis-py"] = pipelined(redis.Redis(host=host, port=int(port)))
    with contextlib.suppress(ImportError):
        import valkey

        clients["valkey-py"] = pipelined(valkey.Valkey(host=host, port=int(port)))
    with contextlib.suppress(ImportError):
        from glide_sync import Batch, GlideClient, GlideClientConfiguration, NodeAddress

        glide = GlideClient.create(
            GlideClientConfiguration([NodeAddress(host, int(port))], request_timeout=30000)
        )

        def gs() -> None:
            b = Batch(is_atomic=False)
            for k in keys:
                b.set(k, value)
            glide.exec(b, raise_on_error=True)

        def gg() -> None:
            b = Batch(is_atomic=False)
            for k in keys:
                b.get(k)
            glide.exec(b, raise_on_error=True)

        clients["valkey-glide (sync)"] = (gs, gg)
    times = {name: ([], []) for name in clients}
    for _ in range(repeats):
        for name, (s, g) in clients.items():
            times[name][0].append(timed(s))
            times[name][1].append(timed(g))
    n = batch * block
    print(f"\nclient choice: plain pipelined SET/GET, {batch} x {block // 1024} KiB")
    for name, (st, gt) in times.items():
        print(f"  {name:20s} SET {fmt(st, n, batch)}   GET {fmt(gt, n, batch)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default=None)
    parser.add_argument("--block-kib", type=int, default=256, help="256 KiB: a small-model block")
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--clients", action="store_true", help="also compare client libraries")
    args = parser.parse_args()
    block = args.block_kib * 1024
    with server_url(args.url) as url:
        print(
            f"remote tier vs plain redis-py pipeline, {args.block_kib} KiB blocks, "
            f"median [min..max] of {args.repeats} interleaved repeats"
        )
        for batch in args.batches:
            t = bench_batch(url, block, batch, args.repeats)
            n = batch * block
            store = statistics.median(t["SET"]) / statistics.median(t["tier store"])
            load = statistics.median(t["GET"]) / statistics.median(t["tier load"])
            print(
                f"batch {batch:4d}  tier store {fmt(t['tier store'], n, batch)} | plain SET "
                f"{fmt(t['SET'], n, batch)} | {100 * store:4.0f}%"
            )
            print(
                f"            tier load  {fmt(t['tier load'], n, batch)} | plain GET "
                f"{fmt(t['GET'], n, batch)} | {100 * load:4.0f}%"
            )
        if args.clients:
            client_choice(url, block, 64, args.repeats)


if __name__ == "__main__":
    main()
