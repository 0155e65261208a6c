"""A second process writing to a disk tier, stopped mid-store, for the ledger tests.

``python disk_tier_proc.py DIR BLOCKS FIRST_KEY WRITES``: opens a disk tier of ``BLOCKS`` blocks
at ``DIR`` (the layout of ``tier_cases``), stores 8 blocks and waits for them (its spare files
are made meanwhile), then submits a store of 16 more whose ``WRITES``-th block write (and every
later one) blocks for good, prints ``stuck`` and waits to be killed: its reservations are taken,
exactly ``WRITES - 1`` blocks published (one I/O thread), the rest never written.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

from tier_cases import disk_tier, host_pool, key, wait_jobs

from kvoffload.keys import OffloadKey
from kvoffload.tiers import TierJob


def main() -> None:
    path, blocks, first, writes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    started = 0
    lock = threading.Lock()
    armed = threading.Event()  # set for the second store
    never = threading.Event()

    def hook(op: str, k: OffloadKey) -> None:
        nonlocal started
        if op != "write" or not armed.is_set():
            return
        with lock:
            started += 1
            if started == writes:
                print("stuck", flush=True)
        if started >= writes:
            never.wait()

    # One I/O thread: when the WRITES-th write starts, the earlier ones are published.
    tier = disk_tier(Path(path), host_pool(24), blocks=blocks, fault_hook=hook, num_threads=1)
    tier.submit_store(TierJob(1, [key(first + i) for i in range(8)], list(range(8))))
    if not all(r.success for r in wait_jobs(tier)):
        sys.exit("the first store failed")
    armed.set()
    tier.submit_store(TierJob(2, [key(first + 8 + i) for i in range(16)], list(range(8, 24))))
    never.wait()


if __name__ == "__main__":
    main()
