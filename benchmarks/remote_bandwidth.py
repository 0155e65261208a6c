"""Store and load bandwidth of the remote tier against what the server delivers to its own
client (``redis-benchmark``) and to redis-py, on a standalone server and a 3-master Cluster.

For each batch size ``B`` (blocks per job), interleaved repeats (the order rotates) of:

* ``tier store`` / ``tier load``: :meth:`RedisTier.submit_store` / :meth:`RedisTier.submit_load`
  of ``B`` host slots, waiting for each result (headers, xxh3 checksums and verification
  included), ``rounds`` jobs back to back;
* ``redis-benchmark SET`` / ``GET``: ``redis-benchmark`` (the limit: the server's own C client)
  started here with the same value size (header + block), the same client count (the tier's
  connections: ``--connections`` per master) and the same pipeline depth (``B`` / clients), for
  the same number of requests (``rounds x B``); its own requests per second. Its keys are the
  tier's kind: every ``SET`` a new key (``-r`` over 10^9 keys; by default redis-benchmark
  overwrites one key, whose memory the server reuses, which halves the server's work per
  ``SET``), every ``GET`` one of ``rounds x B`` existing values (written beforehand, untimed;
  by default it reads one key, always hot in cache, or nothing when that key is missing).
  In Cluster mode redis-benchmark's own timing includes a start-up of about 0.25 s (measured:
  256 requests 0.284 s, 1,024 requests 0.334 s), so at small batches it understates the
  Cluster's limit: read the Cluster rows at 256-block batches, or raise ``--rounds``. It times
  a run in whole milliseconds: a run under 1 ms prints ``n/a``, and runs under 20 ms (median)
  are flagged as coarse;
* ``redis-py SET`` / ``GET``: one redis-py pipeline (``RedisCluster`` pipeline on a Cluster) of
  ``B`` values (new keys each round), ``rounds`` times.

Prints GB/s of values as median [min..max], and the tier's share of redis-benchmark as the
median [min..max] of the per-repeat ratios (a repeat's operations run back to back, so they
share the machine's load of that moment). Every operation is checked to count the bytes the
server moved: the servers' ``total_net_input_bytes`` (SET) / ``total_net_output_bytes`` (GET)
grow by the counted value bytes plus the framing (at most 256 bytes per request, 1 MiB in all,
and 2% for redis-benchmark's extra requests in Cluster mode).
The clients' and the servers' CPU seconds per GB are printed too (``cpu s/GB``; redis-benchmark's
from its child rusage, the servers' from ``INFO``): on a loaded machine the wall figure is
decided by who gets the CPUs. Servers are started here (no persistence; the Cluster without
replicas, as redis-benchmark would see it) and stopped at the end. Report the load
(``/proc/loadavg``), printed at the start and the end.

Usage: ``python benchmarks/remote_bandwidth.py [--modes standalone cluster] [--block-kib 256]
[--batches 64 256] [--connections 4] [--repeats 5] [--rounds 4] [--clients]``. ``--clients``
also compares client libraries on plain pipelined GET (redis-py, valkey-py, valkey-glide's sync
client when installed, and this tier's transport receiving into a buffer): the measurement
behind the client choice.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import math
import os
import resource
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import redis
import torch
from redis.cluster import RedisCluster

from kvoffload.benchmark.redis_server import cluster_servers, standalone_server
from kvoffload.keys import OffloadKey, make_offload_key
from kvoffload.tiers.blockformat import header_size
from kvoffload.tiers.contract import KVLayout, TierJob
from kvoffload.tiers.redis.tier import VALUE_ALIGN, RedisTier, RemoteTierConfig

OPS = (
    "tier store",
    "tier load",
    "redis-benchmark SET",
    "redis-benchmark GET",
    "redis-py SET",
    "redis-py GET",
)


@dataclass
class Setup:
    """One server setup: how to reach it, and its masters' ports."""

    mode: str
    url: str
    ports: list[int]


@contextlib.contextmanager
def servers(mode: str) -> Iterator[Setup]:
    if mode == "standalone":
        with standalone_server() as server:
            yield Setup(mode, server.url, [server.port])
    else:
        with cluster_servers(masters=3, replicas=0) as cluster:
            yield Setup(mode, cluster.url, [n.port for n in cluster.masters()])


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


#: ``redis-benchmark -r``: SETs draw their keys from this many (its ``atoi`` takes an int), so
#: every SET of a run writes a new key, as the tier's stores do.
FRESH_KEYSPACE = 1_000_000_000
#: The width of the number redis-benchmark puts in place of ``__rand_int__``.
RAND_INT_DIGITS = 12


def redis_benchmark(
    setup: Setup, test: str, value: int, clients: int, pipe: int, n: int, keyspace: int
) -> float:
    """Seconds ``redis-benchmark`` takes for ``n`` requests (from its requests per second), its
    keys drawn from ``keyspace`` (``-r``)."""
    exe = shutil.which("redis-benchmark")
    assert exe is not None, "redis-benchmark is not installed (Debian's redis-tools)"
    command = [
        exe, "-h", "127.0.0.1", "-p", str(setup.ports[0]), "-t", test, "-d", str(value),
        "-c", str(clients), "-P", str(pipe), "-n", str(n), "-r", str(keyspace), "--csv",
    ]  # fmt: skip
    if setup.mode == "cluster":
        command.append("--cluster")
    out = subprocess.run(command, check=True, capture_output=True, text=True, timeout=600).stdout
    return benchmark_seconds(out, test, n)


#: redis-benchmark times a run in whole milliseconds (its requests per second are the requests
#: over that count): a run shorter than 1 ms reports ``inf``, one of a few ms is coarse.
BENCHMARK_TICK_S = 0.001
#: Below this many ticks (the median run), the report says redis-benchmark's figures are coarse.
COARSE_TICKS = 20


def benchmark_seconds(csv_out: str, test: str, n: int) -> float:
    """Seconds of a redis-benchmark run of ``n`` requests from its ``--csv`` output (``n`` over
    its requests per second); 0.0 for a run shorter than its tick (it reports ``inf``)."""
    rows = [r for r in csv.reader(io.StringIO(csv_out)) if r and r[0].upper() == test.upper()]
    rps = float(rows[-1][1])
    return n / rps if math.isfinite(rps) and rps > 0 else 0.0


def benchmark_key_prefixes(setup: Setup) -> list[tuple[redis.Redis, bytes]]:
    """Where redis-benchmark's keys live: ``key:`` on the one server; in a Cluster each client
    keeps to one master, with keys ``key:{TAG}:`` (a tag of that master's slots), found here by
    a tiny untimed ``SET`` run whose keys are then deleted."""
    if setup.mode == "standalone":
        return [(next(clients_of(setup)), b"key:")]
    redis_benchmark(setup, "set", 1, 4 * len(setup.ports), 1, 16 * len(setup.ports), 1)
    prefixes: list[tuple[redis.Redis, bytes]] = []
    for client in clients_of(setup):
        # The clients answer bytes (made without decode_responses).
        for key in cast("list[bytes]", client.keys("key:*")):
            prefixes.append((client, key[:-RAND_INT_DIGITS]))
            client.delete(key)
    return prefixes


def server_counters(setup: Setup) -> tuple[int, int, float]:
    """The servers' bytes received and sent, and their CPU seconds, summed over the masters."""
    received = sent = 0
    cpu_s = 0.0
    for client in clients_of(setup):
        info = client.info()
        received += info["total_net_input_bytes"]
        sent += info["total_net_output_bytes"]
        cpu_s += info["used_cpu_sys"] + info["used_cpu_user"]
        client.close()
    return received, sent, cpu_s


def cpu_seconds(children: bool) -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN if children else resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@dataclass
class Timed:
    """One timed operation: wall seconds, the client's and the servers' CPU seconds, and the
    bytes the servers received (a SET) or sent (a GET) meanwhile."""

    seconds: float
    client_cpu_s: float
    server_cpu_s: float
    server_bytes: int


def plain_client(setup: Setup) -> Any:
    if setup.mode == "cluster":
        return RedisCluster(host="127.0.0.1", port=setup.ports[0], socket_timeout=60)
    return redis.Redis.from_url(setup.url, socket_timeout=60)


class BatchBench:
    """The six timed operations of one batch size on one setup."""

    def __init__(self, setup: Setup, block: int, batch: int, connections: int, rounds: int):
        self.setup, self.block, self.batch, self.rounds = setup, block, batch, rounds
        layout = KVLayout(f"bench-{os.getpid()}-{batch}", "float32", 16, 8, 4, 64, block)
        self.pool = torch.randint(0, 256, (2 * batch, block), dtype=torch.uint8)
        self.tier = RedisTier(
            self.pool.numpy().data,
            layout,
            RemoteTierConfig(url=setup.url, timeout_s=60.0, connections=connections),
        )
        self.key_len = len(make_offload_key(bytes(32)))
        self.value = header_size(self.key_len, VALUE_ALIGN) + block
        self.clients = connections * len(setup.ports)
        self.pipe = max(1, math.ceil(batch / self.clients))
        self.plain = plain_client(setup)
        self.payload = os.urandom(self.value)
        self.job_id = 0

    def close(self) -> None:
        self.tier.close()
        self.plain.close()

    def keys(self, rep: int, r: int) -> list[OffloadKey]:
        base = (rep * 1000 + r) * 1_000_000
        return [make_offload_key((base + i).to_bytes(32, "big")) for i in range(self.batch)]

    def tier_job(self, store: bool, keys: list[OffloadKey]) -> None:
        self.job_id += 1
        slots = list(range(self.batch)) if store else list(range(self.batch, 2 * self.batch))
        (self.tier.submit_store if store else self.tier.submit_load)(
            TierJob(self.job_id, keys, slots)
        )
        self.tier.drain_jobs()
        (result,) = self.tier.get_finished_jobs()
        assert result.success, result.failed_keys

    def plain_pipeline(self, store: bool, rep: int, r: int) -> None:
        """One redis-py pipeline of the batch: new keys each round, as the tier's."""
        pipe = self.plain.pipeline(transaction=False)
        for k in (b"plain:%d:%d:%d" % (rep, r, i) for i in range(self.batch)):
            if store:
                pipe.set(k, self.payload)
            else:
                pipe.get(k)
        replies = pipe.execute()
        assert store or len(replies[-1]) == self.value

    def populate_benchmark_keys(self) -> int:
        """Write the values redis-benchmark's GETs read (untimed): per master, as many as its
        clients read in all. Returns that keyspace (``-r``)."""
        prefixes = benchmark_key_prefixes(self.setup)
        keyspace = math.ceil(self.rounds * self.batch / len(prefixes))
        for client, prefix in prefixes:
            pipe = client.pipeline(transaction=False)
            for i in range(keyspace):
                pipe.set(b"%s%0*d" % (prefix, RAND_INT_DIGITS, i), self.payload)
            pipe.execute()
        return keyspace

    def run(self, op: str, rep: int) -> Timed:
        """``rounds`` batches of ``op``, timed, with what the servers did meanwhile."""
        keyspace = FRESH_KEYSPACE
        if op == "redis-benchmark GET":
            keyspace = self.populate_benchmark_keys()
        children = op.startswith("redis-benchmark")
        received, sent, server_cpu = server_counters(self.setup)
        cpu = cpu_seconds(children)
        seconds = self.run_op(op, rep, keyspace)
        client_cpu = cpu_seconds(children) - cpu
        received2, sent2, server_cpu2 = server_counters(self.setup)
        moved = received2 - received if op.endswith(("SET", "store")) else sent2 - sent
        return Timed(seconds, client_cpu, server_cpu2 - server_cpu, moved)

    def run_op(self, op: str, rep: int, keyspace: int) -> float:
        """Seconds for ``rounds`` batches of ``op``."""
        if op.startswith("redis-benchmark"):
            test = op.split()[-1].lower()
            n = self.rounds * self.batch
            return redis_benchmark(
                self.setup, test, self.value, self.clients, self.pipe, n, keyspace
            )
        start = time.perf_counter()
        for r in range(self.rounds):
            if op == "tier store":
                self.tier_job(True, self.keys(rep, r))
            elif op == "tier load":
                self.tier_job(False, self.keys(rep, r))
            else:
                self.plain_pipeline(op.endswith("SET"), rep, r)
        elapsed = time.perf_counter() - start
        if op == "tier load":
            assert torch.equal(self.pool[self.batch :], self.pool[: self.batch])
            self.pool[self.batch :].zero_()
        return elapsed


def bench(setup: Setup, block: int, batch: int, args: argparse.Namespace) -> dict[str, list[Timed]]:
    b = BatchBench(setup, block, batch, args.connections, args.rounds)
    times: dict[str, list[Timed]] = {op: [] for op in OPS}
    order = list(OPS)
    try:
        for rep in range(args.repeats):
            # stores before their loads; the pairs rotate so that none always runs first
            pairs = [order[i : i + 2] for i in range(0, len(order), 2)]
            pairs = pairs[rep % 3 :] + pairs[: rep % 3]
            for pair in pairs:
                for op in pair:
                    times[op].append(b.run(op, rep))
            for client in clients_of(setup):
                client.flushall()
    finally:
        b.close()
    return times


def clients_of(setup: Setup) -> Iterator[redis.Redis]:
    for port in setup.ports:
        yield redis.Redis(host="127.0.0.1", port=port, socket_timeout=60)


def gbps(seconds: list[float], num_bytes: int) -> str:
    """GB/s as median [min-max]; ``n/a`` when a run was too short to time (0 s)."""
    if min(seconds) <= 0:
        return "  n/a (a run under the timer's tick)"
    med = statistics.median(seconds)
    return (
        f"{num_bytes / med / 1e9:5.2f} [{num_bytes / max(seconds) / 1e9:4.2f}-"
        f"{num_bytes / min(seconds) / 1e9:4.2f}]"
    )


def share(tier: list[float], limit: list[float]) -> str:
    """The tier's share of ``limit``'s rate per repeat, median [min-max]; ``n/a`` as :func:`gbps`."""
    if min(tier + limit) <= 0:
        return " n/a"
    ratios = [b / a for a, b in zip(tier, limit, strict=True)]
    return f"{100 * statistics.median(ratios):4.0f}% [{100 * min(ratios):.0f}-{100 * max(ratios):.0f}%]"


def per_gb(values: list[float], num_bytes: int) -> str:
    return f"{statistics.median(values) / num_bytes * 1e9:.2f}"


#: Bytes a request may add to its value: the command or reply framing and the key.
FRAMING_BYTES = 256
#: Bytes an operation may add in all (start-up commands, the tier's INFO refreshes).
SLACK_BYTES = 1 << 20
#: Share of extra requests allowed: redis-benchmark in Cluster mode sends up to about 1% more
#: than ``-n`` (pipelines in flight when it stops; measured 1.008-1.010x), uncounted.
OVERSHOOT = 0.02


def check_bytes(op: str, runs: list[Timed], num_bytes: int, requests: int) -> str:
    """The servers moved what the figure counts: the values, plus framing per request and a
    little slack; returns the median ratio."""
    moved = statistics.median(r.server_bytes for r in runs)
    bound = (1 + OVERSHOOT) * (num_bytes + FRAMING_BYTES * requests) + SLACK_BYTES
    assert num_bytes <= moved <= bound, (
        f"{op}: the servers moved {moved:.0f} B, {num_bytes} counted"
    )
    return f"{moved / num_bytes:.3f}"


def report(setup: Setup, batch: int, b_value: int, rounds: int, t: dict[str, list[Timed]]) -> None:
    n = rounds * batch * b_value
    for kind, ops in (
        ("store", ("tier store", "redis-benchmark SET", "redis-py SET")),
        ("load ", ("tier load", "redis-benchmark GET", "redis-py GET")),
    ):
        secs = {op: [r.seconds for r in t[op]] for op in ops}
        tier_op, limit_op, py_op = ops
        print(
            f"{setup.mode:10s} batch {batch:4d} {kind}  tier {gbps(secs[tier_op], n)} | "
            f"redis-benchmark {gbps(secs[limit_op], n)} | redis-py {gbps(secs[py_op], n)} GB/s | "
            f"tier/redis-benchmark {share(secs[tier_op], secs[limit_op])}",
            flush=True,
        )
        median_ms = 1e3 * statistics.median(secs[limit_op])
        if median_ms < COARSE_TICKS * BENCHMARK_TICK_S * 1e3:
            took = f"{median_ms:.0f} ms" if median_ms else "under 1 ms"
            print(
                f"    {limit_op} runs took {took} (median): it times in whole ms (n/a: a run "
                f"under 1 ms), so its figures are coarse; "
                f"raise --rounds for runs of {COARSE_TICKS} ms or more",
                flush=True,
            )
        for op in ops:
            print(
                f"    {op:20s} cpu s/GB: client {per_gb([r.client_cpu_s for r in t[op]], n)}, "
                f"server {per_gb([r.server_cpu_s for r in t[op]], n)}; "
                f"server bytes / counted {check_bytes(op, t[op], n, rounds * batch)}",
                flush=True,
            )


def client_getters(port: int, keys: list[bytes], block: int) -> dict[str, Callable[[], object]]:
    """One pipelined GET of ``keys`` per installed client library, and this tier's transport
    receiving into buffers (1 and 4 connections)."""
    from kvoffload.tiers.redis.transport import RedisTransport
    from kvoffload.tiers.redis.url import parse_redis_url

    def pipelined(client: Any) -> Callable[[], object]:
        def get() -> object:
            p = client.pipeline(transaction=False)
            for k in keys:
                p.get(k)
            return p.execute()

        return get

    getters = {"redis-py (hiredis)": pipelined(redis.Redis(host="127.0.0.1", port=port))}
    with contextlib.suppress(ImportError):
        import valkey

        getters["valkey-py"] = pipelined(valkey.Valkey(host="127.0.0.1", port=port))
    with contextlib.suppress(ImportError):
        from glide_sync import Batch, GlideClient, GlideClientConfiguration, NodeAddress

        glide = GlideClient.create(
            GlideClientConfiguration([NodeAddress("127.0.0.1", port)], request_timeout=60000)
        )

        def glide_get() -> object:
            b = Batch(is_atomic=False)
            for k in keys:
                b.get(k)
            return glide.exec(b, raise_on_error=True)

        getters["valkey-glide (sync)"] = glide_get
    into = torch.empty((len(keys), block), dtype=torch.uint8)
    targets = [memoryview(into.numpy()[i]) for i in range(len(keys))]
    for conns in (1, 4):
        url = parse_redis_url(f"redis://127.0.0.1:{port}/0")
        transport = RedisTransport(url, 60.0, connections=conns)

        def ours(t: RedisTransport = transport) -> object:
            return t.get_into(keys, targets, [64] * len(keys))

        getters[f"kvoffload transport, {conns} conn (into slots)"] = ours
    return getters


def client_choice(setup: Setup, block: int, batch: int, repeats: int) -> None:
    """Plain pipelined GET of ``batch`` values with each client, interleaved."""
    port = setup.ports[0]
    value = os.urandom(block + 64)
    keys = [b"c:%d" % i for i in range(batch)]
    with redis.Redis(host="127.0.0.1", port=port) as c:
        for k in keys:
            c.set(k, value)
    getters = client_getters(port, keys, block)
    times: dict[str, list[float]] = {name: [] for name in getters}
    for _ in range(repeats):
        for name, get in getters.items():
            start = time.perf_counter()
            get()
            times[name].append(time.perf_counter() - start)
    n = batch * len(value)
    print(f"\nclient choice ({setup.mode}): pipelined GET of {batch} x {len(value)} B, one batch")
    for name, t in times.items():
        print(f"  {name:42s} {gbps(t, n)} GB/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--modes", nargs="+", default=["standalone", "cluster"], choices=["standalone", "cluster"]
    )
    parser.add_argument("--block-kib", type=int, default=256, help="256 KiB: a small-model block")
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--connections", type=int, default=4, help="per server (per master)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=4, help="batches per timed operation")
    parser.add_argument("--clients", action="store_true", help="also compare client libraries")
    args = parser.parse_args()
    block = args.block_kib * 1024
    print(
        f"remote tier vs redis-benchmark and redis-py, {args.block_kib} KiB blocks, "
        f"{args.connections} connections per master, median [min-max] of {args.repeats} "
        f"interleaved repeats of {args.rounds} batches; load {loadavg()}",
        flush=True,
    )
    for mode in args.modes:
        with servers(mode) as setup:
            for batch in args.batches:
                t = bench(setup, block, batch, args)
                value = header_size(len(make_offload_key(bytes(32))), VALUE_ALIGN) + block
                report(setup, batch, value, args.rounds, t)
            if args.clients and mode == "standalone":
                client_choice(setup, block, max(args.batches), args.repeats)
    print(f"load at the end {loadavg()}")


if __name__ == "__main__":
    main()
