"""Store and load bandwidth of the worker side, next to a plain contiguous copy of the same bytes.

Each configuration (layout, block_size_factor, batch of offloaded blocks) copies a batch with
random, non-contiguous engine block ids and random host slots through
:class:`~kvoffload.worker.OffloadingConnectorWorker` (submit -> wait, planning included), and, in
the same run and interleaved with it, a single contiguous ``copy_`` of the same number of bytes
between the engine's storage and the host buffer: the memory-bandwidth limit on a CPU engine
(the faster of torch's threads and one thread, see ``plain_copy_seconds``), the pinned
host<->device copy limit on CUDA. Times are the best of ``--reps`` rounds (the figure
least disturbed by other processes on a shared machine; small batches get more rounds); the
ratio is ours / contiguous.

Layouts: ``cross`` = one tensor [N, layers, 2, tokens, kv_heads, head_dim] (the reference
engine's); ``per-layer`` = one tensor per layer [N, 2, tokens, kv_heads, head_dim] (page = one
layer's block). Methods (CPU engine): ``threads`` = the default CPUCopyHandler (memmove on copy
threads), ``torch`` = the staged torch reference (TorchCopyHandler), the CUDA path.

``--primitives`` instead compares the CPU copy primitives the threaded handler was chosen from,
gathering random pages into a contiguous buffer.

Usage: .venv/bin/python benchmarks/transfer_bandwidth.py [--quick] [--memory-gib 4] [--primitives] ...
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from kvoffload.load_store_specs import CPULoadStoreSpec, GPULoadStoreSpec
from kvoffload.transfer import ConnectorMetadata, TransferJob
from kvoffload.worker import OffloadingConnectorWorker

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8": torch.uint8}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--tokens", type=int, default=16, help="tokens per engine block")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--factors", default="1,4", help="block_size_factor values")
    p.add_argument("--batches", default="1,8,64,256", help="offloaded blocks per transfer")
    p.add_argument("--layouts", default="cross,per-layer")
    p.add_argument(
        "--methods",
        default=None,
        help="threads and/or torch on CPU (default threads); torch on CUDA",
    )
    p.add_argument("--reps", type=int, default=5)
    p.add_argument(
        "--threads", type=int, default=None, help="copy threads (default: kvoffload's default)"
    )
    p.add_argument(
        "--memory-gib", type=float, default=4.0, help="cap on engine cache + host pool bytes"
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="8 layers, batches 1,8,64, 3 reps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--primitives", action="store_true", help="compare CPU gather primitives instead"
    )
    args = p.parse_args()
    if args.quick:
        args.layers, args.batches, args.reps = 8, "1,8,64", 3
    return args


def make_engine_cache(
    args: argparse.Namespace, layout: str, num_blocks: int
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The engine's KV tensors and one flat byte view of their (single) storage."""
    dtype = DTYPES[args.dtype]
    block = (2, args.tokens, args.kv_heads, args.head_dim)
    if layout == "cross":
        kv = torch.zeros((num_blocks, args.layers, *block), dtype=dtype, device=args.device)
        tensors = [kv]
    else:  # one tensor per layer, carved out of one allocation as engines do
        kv = torch.zeros((args.layers, num_blocks, *block), dtype=dtype, device=args.device)
        tensors = list(kv.unbind(0))
    return tensors, kv.view(-1).view(torch.uint8)


def run_config(
    args, worker, engine_bytes, factor, batch, rng, job_ids
) -> dict[str, tuple[float, float]]:
    """Best seconds of (ours, contiguous) per direction for one batch size.

    Small batches get more rounds (up to 64 MiB of copies), since one preempted time slice on a
    shared machine swamps a sub-millisecond copy. Both copies touch random places in each round,
    so neither reads from a warm cache.
    """
    num_blocks = worker.layout.num_blocks
    pages = batch * factor
    nbytes = batch * worker.bytes_per_offloaded_block
    host = worker.host_pool.buffer
    rounds = max(args.reps, min(32, 2**26 // nbytes))
    times: dict[str, list[tuple[float, float]]] = {"store": [], "load": []}
    for _ in range(rounds + 1):  # the first round warms up and is dropped
        slots = rng.permutation(worker.num_host_blocks)[:batch].tolist()
        src_ids = rng.permutation(num_blocks)[:pages].tolist()
        dst_ids = rng.permutation(num_blocks)[:pages].tolist()
        at_engine = int(rng.integers(0, engine_bytes.numel() - nbytes + 1)) // 4096 * 4096
        at_host = int(rng.integers(0, host.numel() - nbytes + 1)) // 4096 * 4096
        engine_run, host_run = (
            engine_bytes[at_engine : at_engine + nbytes],
            host[at_host : at_host + nbytes],
        )

        contiguous = plain_copy_seconds(args.device, host_run, engine_run)
        job = TransferJob(
            next(job_ids), "bench", GPULoadStoreSpec(src_ids, [pages], [0]), CPULoadStoreSpec(slots)
        )
        t0 = time.perf_counter()
        worker.start_load_kv(ConnectorMetadata(store_jobs=[job]))
        worker.wait_for_save()  # (no forward pass here)
        worker.handle_preemptions([job.job_id])
        ours = time.perf_counter() - t0
        check(worker.get_finished(), job.job_id)
        times["store"].append((ours, contiguous))

        contiguous = plain_copy_seconds(args.device, engine_run, host_run)
        job = TransferJob(
            next(job_ids), "bench", CPULoadStoreSpec(slots), GPULoadStoreSpec(dst_ids, [pages], [0])
        )
        t0 = time.perf_counter()
        worker.start_load_kv(ConnectorMetadata(load_jobs=[job]))
        worker.offloading_worker.wait([job.job_id])
        ours = time.perf_counter() - t0
        worker.wait_for_save()
        check(worker.get_finished(), job.job_id)
        times["load"].append((ours, contiguous))
    return {d: (min(t[0] for t in ts[1:]), min(t[1] for t in ts[1:])) for d, ts in times.items()}


def plain_copy_seconds(device: str, dst: torch.Tensor, src: torch.Tensor) -> float:
    """Seconds of one contiguous ``dst.copy_(src)``.

    On CPU, the faster of torch's intra-op threads and a single thread: on a machine shared with
    other processes, torch's threads wait for each other at a barrier, and one descheduled thread
    can stretch a 2 MiB copy from 0.15 ms to 15 ms, which would flatter every ratio.
    """
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        return time.perf_counter() - t0
    threads = torch.get_num_threads()
    best = float("inf")
    for n in sorted({threads, 1}):
        torch.set_num_threads(n)
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    torch.set_num_threads(threads)
    return best


def check(results, job_id: int) -> None:
    if [(r.job_id, r.success) for r in results] != [(job_id, True)]:
        raise SystemExit(f"transfer {job_id} did not succeed: {results}")


def compare_primitives(args: argparse.Namespace) -> None:
    """Gather random pages into a contiguous buffer with each candidate primitive (CPU)."""
    total = 256 * 2**20
    threads = args.threads or torch.get_num_threads()
    print(
        f"gather of {total >> 20} MiB in random pages into a contiguous buffer; GB/s, best of {args.reps}"
    )
    names = [
        "copy_ (contiguous)",
        "narrow().copy_",
        "index_select u8",
        "index_select i64",
        "np.take",
        "memmove",
    ]
    names.append(f"memmove x{threads} threads")
    print(f"{'page KiB':>8} " + " | ".join(names))
    with ThreadPoolExecutor(threads) as pool:
        for page in (2**21, 2**16, 2**15):
            best = primitive_times(page, total, threads, pool, args.reps, args.seed)
            print(
                f"{page >> 10:>8} "
                + " | ".join(
                    f"{total / t / 1e9:{len(n)}.2f}" for n, t in zip(names, best, strict=True)
                )
            )


def primitive_times(
    page: int, total: int, threads: int, pool: ThreadPoolExecutor, reps: int, seed: int
) -> list[float]:
    """Best seconds of each primitive gathering ``total`` bytes in random ``page``-byte rows."""
    rows = total // page
    src = torch.ones(2 * rows, page, dtype=torch.uint8)
    dst = torch.zeros(rows, page, dtype=torch.uint8)
    ids = torch.from_numpy(np.random.default_rng(seed).permutation(2 * rows)[:rows])
    id_list = ids.tolist()
    d = (dst.data_ptr() + np.arange(rows) * page).tolist()
    s = (src.data_ptr() + ids.numpy() * page).tolist()
    n = [page] * rows

    def memmove(a: int, b: int) -> None:
        collections.deque(map(ctypes.memmove, d[a:b], s[a:b], n[a:b]), maxlen=0)

    def memmove_threads() -> None:
        step = -(-rows // threads)
        for f in [pool.submit(memmove, a, min(rows, a + step)) for a in range(0, rows, step)]:
            f.result()

    def narrow() -> None:
        for k, i in enumerate(id_list):
            dst[k].copy_(src[i])

    candidates = [
        lambda: dst.copy_(src[:rows]),
        narrow,
        lambda: torch.index_select(src, 0, ids, out=dst),
        lambda: torch.index_select(src.view(torch.int64), 0, ids, out=dst.view(torch.int64)),
        lambda: np.take(src.numpy(), ids.numpy(), axis=0, out=dst.numpy(), mode="clip"),
        lambda: memmove(0, rows),
        memmove_threads,
    ]
    best = [float("inf")] * len(candidates)
    for _ in range(reps):
        for k, fn in enumerate(candidates):
            t0 = time.perf_counter()
            fn()
            best[k] = min(best[k], time.perf_counter() - t0)
    return best


def main() -> None:
    args = parse_args()
    if args.primitives:
        compare_primitives(args)
        return
    cuda = args.device.startswith("cuda")
    methods = (args.methods or ("torch" if cuda else "threads")).split(",")
    if cuda and methods != ["torch"]:
        raise SystemExit("on CUDA only the torch method applies")
    factors = [int(x) for x in args.factors.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    layouts = args.layouts.split(",")
    elem = torch.empty(0, dtype=DTYPES[args.dtype]).element_size()
    block_bytes = args.layers * 2 * args.tokens * args.kv_heads * args.head_dim * elem
    limit = "pinned host<->device copy_" if cuda else "contiguous copy_"
    print(
        f"device {args.device}, torch {torch.__version__}, {torch.get_num_threads()} torch threads; "
        f"engine block = {args.layers} layers x K/V x {args.tokens} tokens x {args.kv_heads} heads x "
        f"{args.head_dim} x {elem} B = {block_bytes / 2**20:.2f} MiB; reps {args.reps}; "
        f"random engine ids and host slots; ratio = ours / {limit} of the same bytes (best of reps)"
    )
    head = f"{'layout':9} {'method':7} {'factor':>6} {'batch':>5} {'MiB':>7}"
    print(
        f"{head} {'store GB/s':>10} {'limit':>6} {'ratio':>6} {'load GB/s':>10} {'limit':>6} {'ratio':>6}"
    )
    rng = np.random.default_rng(args.seed)
    job_ids = iter(range(1, 10**9))
    cap = int(args.memory_gib * 2**30) // 2  # per side: engine cache, host pool
    for layout in layouts:
        for method in methods:
            for factor in factors:
                fitting = [b for b in batches if b * factor * block_bytes <= cap]
                for b in batches:
                    if b not in fitting:
                        need = 2 * b * factor * block_bytes / 2**30
                        print(
                            f"{layout:9} {method:7} {factor:>6} {b:>5}  skipped: needs {need:.1f} GiB (--memory-gib)"
                        )
                if not fitting:
                    continue
                num_blocks = max(fitting) * factor
                tensors, engine_bytes = make_engine_cache(args, layout, num_blocks)
                worker = OffloadingConnectorWorker(
                    factor, max(fitting) * factor * block_bytes, num_copy_threads=args.threads,
                    use_torch_copies=method == "torch",
                )  # fmt: skip
                worker.register_kv_caches(tensors, num_blocks=num_blocks)
                worker.host_pool.buffer.zero_()  # first touch outside the measurement
                try:
                    for batch in fitting:
                        res = run_config(args, worker, engine_bytes, factor, batch, rng, job_ids)
                        nbytes = batch * worker.bytes_per_offloaded_block
                        cells = []
                        for d in ("store", "load"):
                            ours, contiguous = res[d]
                            cells.append(
                                f"{nbytes / ours / 1e9:10.2f} {nbytes / contiguous / 1e9:6.2f} {contiguous / ours:6.2f}"
                            )
                        print(
                            f"{layout:9} {method:7} {factor:>6} {batch:>5} {nbytes / 2**20:7.0f} {cells[0]} {cells[1]}",
                            flush=True,
                        )
                finally:
                    worker.shutdown()
                del tensors, engine_bytes, worker


if __name__ == "__main__":
    main()
