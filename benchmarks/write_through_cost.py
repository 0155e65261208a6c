"""What writing through to disk costs where nothing is reused: `kvoffload bench throughput` on
the random workload (no shared prefix), host tier alone vs host + disk (every block written
through) vs host + disk writing only reused blocks (``--kv-tier-write-min-reuse 2``), runs
interleaved, medians with [min-max] of total tokens/s and of the run's CPU seconds (user +
system: on a shared machine the steadier measure of what the work costs).

``--baseline PATH`` adds the host and host + disk runs of another checkout (its sources first on
``PYTHONPATH``), e.g. the code before a change (``git worktree add /tmp/old HEAD~5``).

    .venv/bin/python benchmarks/write_through_cost.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKLOAD = [
    "--dataset-name", "random", "--num-prompts", "48", "--random-input-len", "512",
    "--random-output-len", "8", "--model", "tiny", "--num-device-blocks", "256",
    "--kv-offloading-size", "0.01", "--no-progress",
]  # fmt: skip
DISK = ["--kv-disk-size", "0.5"]
CONFIGS = {
    "host": [],
    "host+disk": DISK,
    "host+disk min_reuse=2": [*DISK, "--kv-tier-write-min-reuse", "2"],
}
_RUN = "import sys; from kvoffload.cli.main import main; sys.argv[0] = 'kvoffload'; main()"


def run(tree: Path, flags: list[str]) -> tuple[float, float]:
    """One run of ``tree``'s engine: total tokens/s and the child's CPU seconds."""
    with tempfile.TemporaryDirectory(prefix="kvo-wt-") as tmp:
        out = Path(tmp) / "out.json"
        disk = ["--kv-disk-path", str(Path(tmp) / "disk")] if "--kv-disk-size" in flags else []
        env = {**os.environ, "PYTHONPATH": str(tree)}
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run(
            [sys.executable, "-c", _RUN, "bench", "throughput", *WORKLOAD, *flags, *disk,
             "--output-json", str(out)],
            check=True, env=env, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        result = json.loads(out.read_text())["results"][0]
        return float(result["total_tokens_per_s"]), cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--baseline", type=Path, help="another checkout to compare with")
    args = parser.parse_args()
    runs: list[tuple[str, Path, list[str]]] = [(n, ROOT, f) for n, f in CONFIGS.items()]
    if args.baseline is not None:
        runs += [(f"baseline {n}", args.baseline, CONFIGS[n]) for n in ("host", "host+disk")]
    figures: dict[str, list[tuple[float, float]]] = {name: [] for name, _, _ in runs}
    for r in range(args.repeats):
        for name, tree, flags in runs if r % 2 == 0 else runs[::-1]:
            figures[name].append(run(tree, flags))
    load = os.getloadavg()[0]
    print(f"random workload, no reuse; {args.repeats} interleaved repeats (load {load:.1f})")
    for name, values in figures.items():
        tps = [t for t, _ in values]
        cpu = [c for _, c in values]
        print(
            f"  {name:<24} {statistics.median(tps):7.0f} tok/s [{min(tps):.0f}-{max(tps):.0f}]"
            f"  CPU {statistics.median(cpu):5.1f} s [{min(cpu):.1f}-{max(cpu):.1f}]"
        )


if __name__ == "__main__":
    main()
