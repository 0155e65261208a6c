"""What naming a model by its content costs at engine start (``kvoffload.identity``).

Measured side by side, as the median [min-max] of ``--repeats`` interleaved rounds:

* the ``small`` preset: its identity (configuration, seed and format version; no file is read),
  next to loading the preset (drawing its random weights);
* a checkpoint of the ``small`` preset's weights (~100 MB of safetensors) and a ``--gib`` GiB
  checkpoint, both written to a temporary directory: the weights' digest uncached with the
  files in the page cache (``hot``), uncached with the files evicted from the page cache first
  (``cold``, ``posix_fadvise(DONTNEED)``: read from the device), and cached (``cached``: one
  ``stat`` per file); next to reading the same bytes (which loading the weights does anyway).

Run: ``.venv/bin/python benchmarks/model_identity_cost.py [--gib 1] [--repeats 5]``.
Asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from disk_bandwidth import evict  # this directory: the scripts run from it
from safetensors.torch import save_file

from kvoffload import filedigest
from kvoffload.engine.loader import load_model, model_identity
from kvoffload.identity import checkpoint_fingerprint

_CONFIG = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 512}


def write_checkpoint(directory: Path, tensors: dict[str, torch.Tensor]) -> int:
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(_CONFIG))
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return sum(t.numel() * t.element_size() for t in tensors.values())


def uncache(directory: Path) -> None:
    (directory / filedigest.CACHE_NAME).unlink(missing_ok=True)


def measure(cases: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """Seconds of each case per round, the cases interleaved in every round."""
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, case in cases.items():
            start = time.perf_counter()
            case()
            times[name].append(time.perf_counter() - start)
    return times


def show(label: str, times: list[float], nbytes: int = 0) -> None:
    med = statistics.median(times)
    rate = f"  {nbytes / med / 1e9:6.2f} GB/s" if nbytes else ""
    print(
        f"  {label:<34} {med * 1e3:10.2f} ms [{min(times) * 1e3:.2f}-{max(times) * 1e3:.2f}]{rate}"
    )


def checkpoint_cases(directory: Path) -> dict[str, Callable[[], object]]:
    def cold() -> None:
        uncache(directory)
        evict(sorted(directory.glob("*.safetensors")))
        checkpoint_fingerprint(directory, "float32")

    def hot() -> None:
        uncache(directory)
        checkpoint_fingerprint(directory, "float32")

    return {
        "digest, cold (read from the device)": cold,
        "digest, hot (page cache)": hot,
        "digest, cached": lambda: checkpoint_fingerprint(directory, "float32"),
        "read the file (hot; loading reads it)": lambda: (
            directory / "model.safetensors"
        ).read_bytes(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    filedigest.RACY_WINDOW_S = 0.0  # files written just now may be cached
    torch.set_num_threads(1)
    print(f"median [min-max] of {args.repeats} interleaved rounds")
    preset = measure(
        {
            "identity": lambda: model_identity("small", torch.float32, 0),
            "load_model (random weights)": lambda: load_model("small"),
        },
        args.repeats,
    )
    print("small preset")
    for name, times in preset.items():
        show(name, times)
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMPDIR")) as tmp:
        model, _, _ = load_model("small")
        small = {name: p.detach().contiguous() for name, p in model.state_dict().items()}
        small_bytes = write_checkpoint(Path(tmp) / "small", small)
        n = int(args.gib * 2**30) // 4 // 16
        big = {f"w{i}": torch.randn(n) for i in range(16)}
        big_bytes = write_checkpoint(Path(tmp) / "big", big)
        del big, small, model
        for label, directory, nbytes in (
            (f"checkpoint of the small preset ({small_bytes / 1e6:.0f} MB)", "small", small_bytes),
            (f"checkpoint of {big_bytes / 2**30:.2f} GiB", "big", big_bytes),
        ):
            by_case = measure(checkpoint_cases(Path(tmp) / directory), args.repeats)
            print(label)
            for name, values in by_case.items():
                show(name, values, 0 if "cached" in name else nbytes)


if __name__ == "__main__":
    main()
