"""Store and load bandwidth of the disk tier, next to a raw sequential write and read of the same
bytes with plain ``os.write`` / ``os.read`` on the same filesystem (the limit).

For each batch size (offloaded blocks per job) one repeat runs, interleaved: the tier storing the
batch from host slots to block files (submit -> every block published) and the raw sequential
write of the same bytes (payloads + headers, one ``os.write`` per block file's bytes) into one
new file; then the tier loading the batch back into other slots (header and checksum verified)
and the raw sequential reads of that file. The order of tier and raw alternates between repeats,
so neither side always runs first (dirty-page writeback, CPU frequency). Every repeat writes new
keys into a new tier directory and a new raw file (removed beforehand, untimed); the tier's 256
hash directories are created beforehand (untimed), as a tier that ran a while has them. Figures are
medians of ``--repeats`` interleaved repeats, with the spread (min-max); ratio = median tier /
median raw.

Reads are shown against two limits: plain ``os.read`` of the file (the issue's definition; each
call returns a new bytes object whose memory malloc recycles, so the destination stays in the
CPU cache: a generous limit) and ``os.readv`` of the same payload bytes into the same host slots
the tier loads into (the same destination memory as the tier: the like-for-like limit). By
default both sides read what they just wrote, from the page cache (no device I/O);
``--cold`` first ``fsync``s and evicts every file of both sides from the page cache
(``posix_fadvise(DONTNEED)``, no root needed), so both read from the device.

The tier is in steady state: its hash directories exist and it has made its spare files while
idle (an untimed store, drained, before the timed one). ``--full`` starts it at its bound, so
every timed store evicts as many blocks as it writes (and recycles the victims' files: the
benchmark is the directory's only user). ``--background-writer`` keeps another process writing
(64 MiB at a time, ``fsync``ed) to the same filesystem during every measurement, as other jobs
do on a shared machine: file creation is what suffers most then.

Also ``--scan-blocks N``: time a warm restart (index rebuild) over N block files.

Usage: PYTHONPATH=. python benchmarks/disk_bandwidth.py [--dir DIR] [--block-kib 512]
       [--batches 16,64,256] [--repeats 7] [--threads 4] [--o-direct] [--cold] [--full]
       [--background-writer]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import torch

from kvoffload.keys import OffloadKey, make_offload_key
from kvoffload.manager_contract import ReqContext
from kvoffload.tiers import KVLayout, TierJob
from kvoffload.tiers.disk.files import file_bytes
from kvoffload.tiers.disk.settings import DiskTierSettings
from kvoffload.tiers.disk.tier import LEDGER_BYTES, DiskTier


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--dir", default=None, help="directory on the filesystem to measure (default: a temp dir)"
    )
    p.add_argument("--block-kib", type=int, default=512, help="payload bytes per block, KiB")
    p.add_argument("--batches", default="16,64,256")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=4, help="the tier's I/O threads")
    p.add_argument(
        "--o-direct", action="store_true", help="O_DIRECT for the tier (raw side stays buffered)"
    )
    p.add_argument(
        "--cold", action="store_true", help="evict both sides' files from the page cache first"
    )
    p.add_argument(
        "--full", action="store_true", help="the tier starts at its bound: each store evicts"
    )
    p.add_argument(
        "--background-writer",
        action="store_true",
        help="another process keeps writing to the filesystem meanwhile (contention)",
    )
    p.add_argument(
        "--scan-blocks", type=int, default=0, help="only time a warm restart over N files"
    )
    return p.parse_args()


def evict(paths: list[Path]) -> None:
    """Write back and drop ``paths`` from the page cache (their next reads hit the device)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def layout(block_bytes: int) -> KVLayout:
    return KVLayout("bench", "bfloat16", 16, 32, 8, 128, block_bytes)


def aligned_pool(num_slots: int, block_bytes: int) -> tuple[torch.Tensor, memoryview]:
    """A host pool whose slots start 4 KiB aligned (O_DIRECT needs it)."""
    raw = torch.empty(num_slots * block_bytes + 4096, dtype=torch.uint8)
    offset = (-raw.data_ptr()) % 4096
    flat = raw[offset : offset + num_slots * block_bytes]
    flat.random_(0, 256)
    return raw, flat.view(num_slots, block_bytes).numpy().data


def slot_bytes(pool: memoryview) -> int:
    """Bytes of one slot of ``pool`` (slots x block bytes, as :func:`aligned_pool` makes it)."""
    return pool.nbytes // len(pool)


def raw_write(path: Path, pool: memoryview, n: int, file_size: int) -> float:
    """Write ``n * file_size`` bytes from the pool into a new file, sequentially with plain
    os.write (one call per block file's bytes); seconds."""
    flat = pool.cast("B")
    with contextlib.suppress(FileNotFoundError):
        path.unlink()  # untimed, like the tier's fresh directory
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        left, off = n * file_size, 0
        while left:
            chunk = min(left, file_size, len(flat) - off)
            written = os.write(fd, flat[off : off + chunk])
            left -= written
            off = (off + written) % len(flat)
    finally:
        os.close(fd)
    return time.perf_counter() - start


def raw_read(path: Path, chunk: int) -> float:
    """Plain os.read of the file in ``chunk``-byte reads (each bytes object dropped at once, so
    its memory is reused: the destination stays in the CPU cache, a generous limit)."""
    start = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        while os.read(fd, chunk):
            pass
    finally:
        os.close(fd)
    return time.perf_counter() - start


def raw_readv(path: Path, pool: memoryview, first_slot: int, n: int, file_size: int) -> float:
    """Sequential os.readv of the file into the same host slots the tier loads into."""
    flat = pool.cast("B")
    b = slot_bytes(pool)
    start = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        for i in range(n):
            os.readv(fd, [flat[(first_slot + i) * b : (first_slot + i + 1) * b]])
            os.lseek(fd, file_size - b, os.SEEK_CUR)
    finally:
        os.close(fd)
    return time.perf_counter() - start


def tier_store(tier: DiskTier, job_id: int, keys: list[OffloadKey]) -> float:
    """Store ``keys`` from slots 0.. and wait until every block is published; seconds."""
    start = time.perf_counter()
    tier.submit_store(TierJob(job_id, keys, list(range(len(keys)))), ReqContext("bench"))
    tier.drain_jobs()
    seconds = time.perf_counter() - start
    (stored,) = tier.get_finished_jobs()
    assert stored.success, stored.failed_keys
    return seconds


def tier_load(tier: DiskTier, job_id: int, keys: list[OffloadKey], first_slot: int) -> float:
    """Load ``keys`` into slots ``first_slot``.. (each block verified); seconds."""
    slots = list(range(first_slot, first_slot + len(keys)))
    start = time.perf_counter()
    tier.submit_load(TierJob(job_id, keys, slots), ReqContext("bench"))
    tier.drain_jobs()
    seconds = time.perf_counter() - start
    (loaded,) = tier.get_finished_jobs()
    assert loaded.success, loaded.failed_keys
    return seconds


def rotated(names: list[str], k: int) -> list[str]:
    """``names`` rotated by ``k``: each repeat starts with another side."""
    k %= len(names)
    return names[k:] + names[:k]


def fresh_tier(args: argparse.Namespace, root: Path, pool: memoryview, batch: int) -> DiskTier:
    """A tier in steady state: every hash directory made, spare files made while idle (one
    untimed store, drained), and with ``--full`` at its bound (``batch`` blocks of others, so
    the timed store evicts as many as it writes). Untimed."""
    block_bytes = slot_bytes(pool)
    tier_dir = root / "tier"
    shutil.rmtree(tier_dir, ignore_errors=True)
    room = batch if args.full else 2 * batch + 1
    settings = DiskTierSettings(
        tier_dir,
        LEDGER_BYTES + room * file_bytes(block_bytes),
        num_threads=args.threads,
        o_direct=args.o_direct,
        rescan_interval=0,
    )
    tier = DiskTier(pool, layout(block_bytes), settings)
    for i in range(256):
        (tier.namespace / f"{i:02x}").mkdir(exist_ok=True)
    others = [make_offload_key(os.urandom(32)) for _ in range(batch if args.full else 1)]
    for k in range(0, len(others), len(pool) // 2):
        part = others[k : k + len(pool) // 2]
        tier_store(tier, -1 - k, part)  # drained: the tier refills its spare files after it
    return tier


def one_repeat(
    args: argparse.Namespace, root: Path, pool: memoryview, batch: int, rep: int
) -> dict[str, float]:
    """Seconds of each side for one batch: the writes, then the reads, in rotated order."""
    biggest = len(pool) // 2
    fb = file_bytes(slot_bytes(pool))
    tier = fresh_tier(args, root, pool, batch)
    keys = [make_offload_key(os.urandom(32)) for _ in range(batch)]
    raw_path = root / "raw.bin"
    writes = {
        "store": partial(tier_store, tier, 2 * rep, keys),
        "raw_write": partial(raw_write, raw_path, pool, batch, fb),
    }
    reads = {
        "load": partial(tier_load, tier, 2 * rep + 1, keys, biggest),
        "raw_read": partial(raw_read, raw_path, fb),
        "raw_readv": partial(raw_readv, raw_path, pool, biggest, batch, fb),
    }
    seconds = {}
    try:
        for name in rotated(list(writes), rep):
            seconds[name] = writes[name]()
        for name in rotated(list(reads), rep):
            if args.cold:
                evict([raw_path, *tier.namespace.rglob("*.kvb")])
            seconds[name] = reads[name]()
    finally:
        tier.close()
    return seconds


def run_bandwidth(args: argparse.Namespace, root: Path) -> None:
    block_bytes = args.block_kib * 1024
    batches = [int(b) for b in args.batches.split(",")]
    _keep, pool = aligned_pool(2 * max(batches), block_bytes)
    fb = file_bytes(block_bytes)
    results: dict[int, dict[str, list[float]]] = {b: {} for b in batches}
    with background_writer(root, args.background_writer):
        for rep in range(args.repeats):
            for batch in batches:
                seconds = one_repeat(args, root, pool, batch, rep)
                payload, files = batch * block_bytes, batch * fb
                sizes = {"store": payload, "raw_write": files, "load": payload}
                sizes |= {"raw_read": files, "raw_readv": payload}
                for name, secs in seconds.items():
                    results[batch].setdefault(name, []).append(sizes[name] / secs / 1e9)
            print(f"repeat {rep + 1}/{args.repeats} done", flush=True)
    print_table(args, results, fb)


def print_table(
    args: argparse.Namespace, results: dict[int, dict[str, list[float]]], fb: int
) -> None:
    print(
        f"\nblock {args.block_kib} KiB payload ({fb} bytes per file), {args.threads} I/O threads, "
        f"o_direct={args.o_direct}, page cache {'cold' if args.cold else 'warm'}, "
        f"tier {'full (each store evicts)' if args.full else 'not full'}, "
        f"{'a background writer' if args.background_writer else 'no background writer'}; "
        f"GB/s median [min-max] of {args.repeats} interleaved repeats"
    )
    print(
        f"{'batch':>6} | {'store':>22} | {'raw os.write':>22} | {'ratio':>5} | "
        f"{'load':>22} | {'raw os.read':>22} | {'ratio':>5} | {'raw readv->slots':>22} | "
        f"{'ratio':>5}"
    )
    for batch, r in results.items():

        def cell(name: str, r: dict[str, list[float]] = r) -> str:
            v = r[name]
            return f"{statistics.median(v):6.2f} [{min(v):5.2f}-{max(v):5.2f}]"

        store_ratio = statistics.median(r["store"]) / statistics.median(r["raw_write"])
        load_ratio = statistics.median(r["load"]) / statistics.median(r["raw_read"])
        readv_ratio = statistics.median(r["load"]) / statistics.median(r["raw_readv"])
        print(
            f"{batch:>6} | {cell('store'):>22} | {cell('raw_write'):>22} | {store_ratio:5.2f} | "
            f"{cell('load'):>22} | {cell('raw_read'):>22} | {load_ratio:5.2f} | "
            f"{cell('raw_readv'):>22} | {readv_ratio:5.2f}"
        )


@contextlib.contextmanager
def background_writer(root: Path, on: bool) -> Iterator[None]:
    """With ``on``: another process keeps writing to the same filesystem (64 MiB at a time,
    each ``fsync``ed, into one file it rewrites) while the body runs: the contention other jobs
    put on a shared machine's disk, made the same for every repeat and both sides."""
    if not on:
        yield
        return
    code = (
        "import os, sys\n"
        "buf = os.urandom(1 << 20)\n"
        "while True:\n"
        "    fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)\n"
        "    for _ in range(64): os.write(fd, buf)\n"
        "    os.fsync(fd); os.close(fd)\n"
    )
    writer = subprocess.Popen([sys.executable, "-c", code, str(root / "background.bin")])
    try:
        time.sleep(0.5)  # under way before the first measurement
        yield
    finally:
        writer.kill()
        writer.wait()


def run_scan(args: argparse.Namespace, root: Path) -> None:
    """Write N small block files, then time fresh tiers indexing them (warm restart)."""
    block_bytes = 4096
    n = args.scan_blocks
    _keep, pool = aligned_pool(256, block_bytes)
    fb = file_bytes(block_bytes)
    tier_dir = root / "scan"
    settings = DiskTierSettings(
        tier_dir, LEDGER_BYTES + (n + 1) * fb, num_threads=args.threads, rescan_interval=0
    )
    tier = DiskTier(pool, layout(block_bytes), settings)
    ctx = ReqContext("bench")
    start = time.perf_counter()
    for i in range(0, n, 256):
        m = min(256, n - i)
        keys = [make_offload_key(os.urandom(32)) for _ in range(m)]
        tier.submit_store(TierJob(i, keys, list(range(m))), ctx)
        if i % (256 * 16) == 0:
            tier.drain_jobs()
            tier.get_finished_jobs()
    tier.drain_jobs()
    tier.get_finished_jobs()
    tier.close()
    print(f"wrote {n} block files in {time.perf_counter() - start:.1f} s")
    times = []
    for _ in range(args.repeats):
        again = DiskTier(pool, layout(block_bytes), settings)
        assert again.stats()["used_blocks"] == n, again.stats()
        times.append(again.scan_seconds)
        again.close()
    print(
        f"warm restart over {n} block files: median {statistics.median(times):.3f} s "
        f"[{min(times):.3f}-{max(times):.3f}] of {args.repeats} (page cache warm)"
    )


def main() -> None:
    args = parse_args()
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="kvo-diskbw-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        if args.scan_blocks:
            run_scan(args, root)
        else:
            run_bandwidth(args, root)
    finally:
        for name in ("tier", "scan", "raw.bin", "background.bin"):
            path = root / name
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            elif path.exists():
                path.unlink()
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
