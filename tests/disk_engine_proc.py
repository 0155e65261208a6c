"""A separate engine process on a disk tier, for the multi-process tests.

``python disk_engine_proc.py DIR SIZE_GIB FIRST_SEED ROUNDS OUT_JSON [--forever]``: serves the
``random_mix`` workloads of seeds ``FIRST_SEED ..`` (``ROUNDS`` of them) with a small host tier in
front of the disk tier at ``DIR`` and writes each round's output tokens to ``OUT_JSON``.
``--forever`` keeps serving new rounds until killed (the SIGKILL test), printing ``round N``
after each.
"""

from __future__ import annotations

import json
import sys

from engine_cases import host_gib, random_mix, tiny_engine


def main() -> None:
    path, size, seed, rounds = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    out = sys.argv[5]
    forever = "--forever" in sys.argv
    engine = tiny_engine(
        num_device_blocks=24,
        kv_offloading_size=host_gib(6),
        kv_disk_path=path,
        kv_disk_size=size,
    )
    results = []
    round_no = 0
    while forever or round_no < rounds:
        prompts, params = random_mix(seed + round_no, num_prompts=10)
        results.append([o.output_token_ids for o in engine.generate(prompts, params)])
        round_no += 1
        print(f"round {round_no}", flush=True)
    engine.drain()
    engine.close()
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
