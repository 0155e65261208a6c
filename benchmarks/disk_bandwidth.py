"""Store and load bandwidth of the disk tier, next to a raw sequential write and read of the same
bytes with plain ``os.write`` / ``os.read`` on the same filesystem (the limit).

For each batch size (offloaded blocks per job) one repeat runs, interleaved: the tier storing the
batch from host slots to block files (submit -> every block published), the raw write of the same
number of bytes (payloads + headers) into one file, the tier loading the batch back into other
slots (checksums verified), and the raw read of that file. Every repeat writes new keys into a
tier directory that is emptied between repeats. Figures are medians of ``--repeats`` interleaved
repeats, with the spread (min-max); the ratio is tier / raw.

Reads are shown against two limits: plain ``os.read`` (its buffer is recycled, so it stays in the
CPU cache: generous) and ``os.readv`` into the same host slots the tier loads into. The page cache
is in play for both sides alike unless ``--drop-caches`` (root) drops it before
every read, so that reads come from the device.

Also ``--scan-blocks N``: time a warm restart (index rebuild) over N block files.

Usage: PYTHONPATH=. python benchmarks/disk_bandwidth.py [--dir DIR] [--block-kib 512]
       [--batches 16,64,256] [--repeats 7] [--threads 4] [--o-direct] [--drop-caches]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from kvoffload.base import ReqContext
from kvoffload.keys import make_offload_key
from kvoffload.tiers import KVLayout, TierJob
from kvoffload.tiers.disk import LEDGER_BYTES, DiskTier
from kvoffload.tiers.diskfiles import file_bytes


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--dir", default=None, help="directory on the filesystem to measure (default: a temp dir)"
    )
    p.add_argument("--block-kib", type=int, default=512, help="payload bytes per block, KiB")
    p.add_argument("--batches", default="16,64,256")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=4, help="the tier's I/O threads")
    p.add_argument("--o-direct", action="store_true")
    p.add_argument(
        "--drop-caches", action="store_true", help="drop the page cache before reads (root)"
    )
    p.add_argument(
        "--scan-blocks", type=int, default=0, help="only time a warm restart over N files"
    )
    return p.parse_args()


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def layout(block_bytes: int) -> KVLayout:
    return KVLayout("bench", "bfloat16", 16, 32, 8, 128, block_bytes)


def aligned_pool(num_slots: int, block_bytes: int) -> tuple[torch.Tensor, memoryview]:
    """A host pool whose slots start 4 KiB aligned (O_DIRECT needs it)."""
    raw = torch.empty(num_slots * block_bytes + 4096, dtype=torch.uint8)
    offset = (-raw.data_ptr()) % 4096
    flat = raw[offset : offset + num_slots * block_bytes]
    flat.random_(0, 256)
    return raw, memoryview(flat.view(num_slots, block_bytes).numpy())


def raw_write(path: Path, pool: memoryview, n: int, file_size: int) -> float:
    """Write ``n * file_size`` bytes from the pool with plain os.write; seconds."""
    flat = pool.cast("B")
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left, off = n * file_size, 0
        while left:
            chunk = min(left, len(flat) - off)
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
    b = pool.shape[1]
    start = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        for i in range(n):
            os.readv(fd, [flat[(first_slot + i) * b : (first_slot + i + 1) * b]])
            os.lseek(fd, file_size - b, os.SEEK_CUR)
    finally:
        os.close(fd)
    return time.perf_counter() - start


def run_bandwidth(args: argparse.Namespace, root: Path) -> None:
    block_bytes = args.block_kib * 1024
    batches = [int(b) for b in args.batches.split(",")]
    biggest = max(batches)
    _keep, pool = aligned_pool(2 * biggest, block_bytes)
    fb = file_bytes(block_bytes)
    ctx = ReqContext("bench")
    results: dict[int, dict[str, list[float]]] = {b: {} for b in batches}
    serial = 0
    for rep in range(args.repeats):
        for batch in batches:
            tier_dir = root / "tier"
            shutil.rmtree(tier_dir, ignore_errors=True)
            tier = DiskTier(
                pool,
                layout(block_bytes),
                tier_dir,
                LEDGER_BYTES + (biggest + 1) * fb,
                num_threads=args.threads,
                o_direct=args.o_direct,
                rescan_interval=0,
            )
            keys = [make_offload_key(os.urandom(32)) for _ in range(batch)]
            nbytes = batch * block_bytes
            start = time.perf_counter()
            tier.submit_store(TierJob(serial, keys, list(range(batch))), ctx)
            tier.drain_jobs()
            store_s = time.perf_counter() - start
            (stored,) = tier.get_finished_jobs()
            assert stored.success, stored.failed_keys
            raw_path = root / "raw.bin"
            raw_w = raw_write(raw_path, pool, batch, fb)
            if args.drop_caches:
                drop_caches()
            start = time.perf_counter()
            tier.submit_load(TierJob(serial + 1, keys, list(range(biggest, biggest + batch))), ctx)
            tier.drain_jobs()
            load_s = time.perf_counter() - start
            (loaded,) = tier.get_finished_jobs()
            assert loaded.success, loaded.failed_keys
            if args.drop_caches:
                drop_caches()
            raw_r = raw_read(raw_path, fb)
            if args.drop_caches:
                drop_caches()
            raw_rv = raw_readv(raw_path, pool, biggest, batch, fb)
            tier.close()
            serial += 2
            r = results[batch]
            for name, seconds, size in (
                ("store", store_s, nbytes),
                ("raw_write", raw_w, batch * fb),
                ("load", load_s, nbytes),
                ("raw_read", raw_r, batch * fb),
                ("raw_readv", raw_rv, nbytes),
            ):
                r.setdefault(name, []).append(size / seconds / 1e9)
        print(f"repeat {rep + 1}/{args.repeats} done", flush=True)
    print(
        f"\nblock {args.block_kib} KiB payload ({fb} bytes per file), {args.threads} I/O threads, "
        f"o_direct={args.o_direct}, drop_caches={args.drop_caches}; "
        f"GB/s median [min-max] of {args.repeats} interleaved repeats"
    )
    print(
        f"{'batch':>6} | {'store':>22} | {'raw os.write':>22} | {'ratio':>5} | "
        f"{'load':>22} | {'raw os.read':>22} | {'ratio':>5} | {'raw readv->slots':>22} | "
        f"{'ratio':>5}"
    )
    for batch in batches:
        r = results[batch]

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


def run_scan(args: argparse.Namespace, root: Path) -> None:
    """Write N small block files, then time fresh tiers indexing them (warm restart)."""
    block_bytes = 4096
    n = args.scan_blocks
    _keep, pool = aligned_pool(256, block_bytes)
    fb = file_bytes(block_bytes)
    tier_dir = root / "scan"
    tier = DiskTier(
        pool,
        layout(block_bytes),
        tier_dir,
        LEDGER_BYTES + (n + 1) * fb,
        num_threads=args.threads,
        rescan_interval=0,
    )
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
        again = DiskTier(
            pool, layout(block_bytes), tier_dir, LEDGER_BYTES + (n + 1) * fb, rescan_interval=0
        )
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
        for name in ("tier", "scan", "raw.bin"):
            path = root / name
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            elif path.exists():
                path.unlink()
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
