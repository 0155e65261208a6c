"""Issue 18's identity repros end to end, on a disk tier and on a real Redis server: a block is
only ever served to the model that computed it.

* Weights overwritten under the same path: the second model loads 0 blocks of the first and
  generates what it generates without offloading.
* A directory named like a preset (``./tiny/``) does not turn the seed off.
* The same weights copied to a second path share the first path's blocks.
* Blocks written in the old format (the model named by its path) are never served: in their old
  namespace they are never read; copied where a new block is looked up, they fail as another
  model's ("layout"), are recomputed and replaced.

The Redis cases run every engine in a process of its own (engines that never met); the disk
cases run them one after the other in this process.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_cases import one_thread  # noqa: F401 - autouse fixture
from identity_engine_proc import main as run_here
from model_cases import make_hf_model, save_hf_model
from redis_servers import RedisServer

from kvoffload import filedigest
from kvoffload.engine import Engine
from kvoffload.errors import ConfigError
from kvoffload.tiers.blockformat import CorruptBlockError, parse_header

pytest.importorskip("transformers")

HERE = Path(__file__).resolve().parent
MAX_TOKENS = 3
#: Four prompts of six 4-token blocks, valid for the tiny preset and the test checkpoints.
PROMPTS = [[random.Random(i).randrange(3, 256) for _ in range(24)] for i in range(4)]
#: Blocks a second engine can load of them: all but each prompt's last (whose last token is
#: computed, to sample the first output token from).
LOADABLE = len(PROMPTS) * (24 // 4 - 1)
GENEROUS_WAIT_S = 60.0


@pytest.fixture(autouse=True)
def user_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Weights A and weights B (other values, same architecture and file sizes)."""
    model = make_hf_model("qwen3")
    a = save_hf_model(model, tmp_path_factory.mktemp("weights") / "a")
    generator = torch.Generator().manual_seed(99)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.15)
    b = save_hf_model(model, tmp_path_factory.mktemp("weights") / "b")
    return a, b


@pytest.fixture(params=["disk", "redis"])
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """The settings of a shared tier, empty at the start of the test."""
    if request.param == "disk":
        yield {"kv_disk_path": str(tmp_path / "kv"), "kv_disk_size": 0.05}
        return
    server: RedisServer = request.getfixturevalue("redis_server")
    with server.client() as client:
        client.flushall()
    yield {"kv_remote_url": server.url, "kv_remote_lookup_wait_s": GENEROUS_WAIT_S}


def name_of(tier: dict[str, Any]) -> str:
    return "disk" if "kv_disk_path" in tier else "remote"


def run(model: str, tier: dict[str, Any] | None, cwd: Path | None = None, **extra) -> dict:
    """One engine on ``PROMPTS``, with ``tier`` behind its host tier (``None``: no offloading).
    Redis engines run in a fresh process; the others here."""
    engine: dict[str, Any] = {"block_size": 4, "num_device_blocks": 64, **extra}
    if tier is not None:
        engine.update(
            kv_offloading_size=0.01, kv_lookup_retry_s=GENEROUS_WAIT_S, load_policy="always", **tier
        )
    spec = {"model": model, "engine": engine, "prompts": PROMPTS, "max_tokens": MAX_TOKENS}
    if tier is None or "kv_disk_path" in tier:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*byte-level.*")
            return run_here(spec)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE)])}
    proc = subprocess.run(
        [sys.executable, str(HERE / "identity_engine_proc.py"), json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=cwd,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def loaded(result: dict, tier: dict[str, Any]) -> int:
    return result["stats"][f"offload_tier_{name_of(tier)}_loaded_blocks"]


def stored(result: dict, tier: dict[str, Any]) -> int:
    return result["stats"][f"offload_tier_{name_of(tier)}_stored_blocks"]


def test_checkpoints_are_named_by_their_weights(
    checkpoints: tuple[Path, Path], tier: dict[str, Any], tmp_path: Path
) -> None:
    weights_a, weights_b = checkpoints
    folder = Path(shutil.copytree(weights_a, tmp_path / "models" / "x"))
    elsewhere = Path(shutil.copytree(weights_a, tmp_path / "other-host" / "y"))
    want_a, want_b = run(str(weights_a), None)["outputs"], run(str(weights_b), None)["outputs"]
    assert all(a != b for a, b in zip(want_a, want_b, strict=True))  # B is another model

    first = run(str(folder), tier)
    assert first["outputs"] == want_a and stored(first, tier) > 0
    # The same weights at another path: the first engine's blocks serve it.
    copy = run(str(elsewhere), tier)
    assert copy["outputs"] == want_a
    assert loaded(copy, tier) == LOADABLE
    assert copy["fingerprints"] == first["fingerprints"]
    # Other weights written under the first path (a fine-tune saved over the folder).
    for shard in weights_b.glob("*.safetensors"):
        shutil.copyfile(shard, folder / shard.name)
    second = run(str(folder), tier)
    assert second["outputs"] == want_b
    assert loaded(second, tier) == 0
    assert second["fingerprints"] != first["fingerprints"]


def test_a_directory_named_like_a_preset_keeps_the_seed(
    tier: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny").mkdir()  # empty: load_model still loads the preset
    want = [run("tiny", None, seed=seed)["outputs"] for seed in (0, 1)]
    assert all(a != b for a, b in zip(*want, strict=True))
    seed0 = run("tiny", tier, cwd=tmp_path, seed=0)
    assert seed0["outputs"] == want[0] and stored(seed0, tier) > 0
    seed1 = run("tiny", tier, cwd=tmp_path, seed=1)
    assert seed1["outputs"] == want[1]
    assert loaded(seed1, tier) == 0


def old_identity(engine: Engine) -> str:
    """The model name of the previous format: the path string, or ``<preset>@seed<seed>`` unless
    a directory of the preset's name exists."""
    model = engine.config.model
    return model if Path(model).is_dir() else f"{model}@seed{engine.config.seed}"


def test_blocks_of_the_old_format_are_never_served(
    tier: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request
) -> None:
    want = run("tiny", None)["outputs"]
    with monkeypatch.context() as old_release:
        old_release.setattr(Engine, "_model_identity", old_identity)
        old = run_here_for(tier, request)
    assert old["outputs"] == want and stored(old, tier) > 0
    new = run_here_for(tier, request)
    assert new["outputs"] == want and loaded(new, tier) == 0
    assert new["fingerprints"] != old["fingerprints"]
    # The old blocks where the new engine looks its blocks up: each one looked up is refused as
    # another model's, recomputed and replaced by a block of the new format.
    moved = move_blocks(tier, request, old["fingerprints"][0], new["fingerprints"][0])
    assert moved == stored(old, tier)
    again = run_here_for(tier, request)
    assert again["outputs"] == want
    name = name_of(tier)
    assert again["stats"][f"offload_tier_{name}_failed_load_layout"] == LOADABLE
    assert again["stats"][f"offload_tier_{name}_loaded_blocks"] == 0
    formats = block_formats(tier, request, new["fingerprints"][0])
    # Every block looked up was replaced. Each prompt's last block is never looked up (nor
    # served): it is replaced when its store is not skipped as already held.
    assert formats["new"] >= LOADABLE and formats["new"] + formats["old"] == moved


def run_here_for(tier: dict[str, Any], request: pytest.FixtureRequest) -> dict:
    """An engine of the tiny preset in this process (so that the old release can be patched in)."""
    engine: dict[str, Any] = {"block_size": 4, "num_device_blocks": 64, "kv_offloading_size": 0.01}
    engine.update(kv_lookup_retry_s=GENEROUS_WAIT_S, load_policy="always", **tier)
    return run_here({"model": "tiny", "engine": engine, "prompts": PROMPTS, "max_tokens": 3})


def move_blocks(tier: dict[str, Any], request, old_fp: str, new_fp: str) -> int:
    """Move every block of namespace ``old_fp`` to where namespace ``new_fp`` keeps the same
    key (over the new block, if any); returns how many were moved."""
    if "kv_disk_path" in tier:
        root = Path(tier["kv_disk_path"]) / "kvoffload-v2"
        files = list((root / old_fp).rglob("*.kvb"))
        for path in files:
            target = root / new_fp / path.relative_to(root / old_fp)
            target.parent.mkdir(exist_ok=True)
            os.replace(path, target)
        return len(files)
    with request.getfixturevalue("redis_server").client() as client:
        keys = list(client.scan_iter(match=f"kvo:{old_fp}:*".encode()))
        for key in keys:
            client.rename(key, key.replace(old_fp.encode(), new_fp.encode(), 1))
        return len(keys)


def block_formats(tier: dict[str, Any], request, fp: str) -> dict[str, int]:
    """How many blocks of namespace ``fp`` are of its format (``new``) or another (``old``)."""
    if "kv_disk_path" in tier:
        namespace = Path(tier["kv_disk_path"]) / "kvoffload-v2" / fp
        values = {bytes.fromhex(p.stem): p.read_bytes() for p in namespace.rglob("*.kvb")}
        align = 4096
    else:
        prefix = f"kvo:{fp}:".encode()
        with request.getfixturevalue("redis_server").client() as client:
            keys = list(client.scan_iter(match=prefix + b"*"))
            values = {k[len(prefix) :]: client.get(k) for k in keys}
        align = 8
    counts = {"new": 0, "old": 0}
    for key, value in values.items():
        try:
            parse_header(value, bytes.fromhex(fp), key, align)
            counts["new"] += 1
        except CorruptBlockError as exc:
            assert exc.cause == "layout"
            counts["old"] += 1
    return counts


def test_the_digest_cache_is_written_beside_the_checkpoint(
    checkpoints: tuple[Path, Path], tmp_path: Path
) -> None:
    """The engine's first start on a checkpoint hashes its weights (once they have settled);
    an engine without a shared tier never does."""
    folder = Path(
        shutil.copytree(checkpoints[0], tmp_path / "m", ignore=shutil.ignore_patterns(".kvo*"))
    )
    run(str(folder), None)
    assert not (folder / filedigest.CACHE_NAME).exists()
    disk = {"kv_disk_path": str(tmp_path / "kv"), "kv_disk_size": 0.05}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(filedigest, "RACY_WINDOW_S", 0.0)
        run(str(folder), disk)
    assert (folder / filedigest.CACHE_NAME).is_file()


def test_a_checkpoint_rewritten_while_it_loads_is_refused(
    checkpoints: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Weights B written over the folder just after the engine read weights A (the write placed
    at that instant by wrapping the loader): the engine must not name A's KV after B."""
    import kvoffload.engine.engine as engine_module

    weights_a, weights_b = checkpoints
    folder = Path(shutil.copytree(weights_a, tmp_path / "model"))
    real_load = engine_module.load_model

    def load_then_overwrite(*args: Any, **kwargs: Any) -> Any:
        loaded = real_load(*args, **kwargs)
        for shard in weights_b.glob("*.safetensors"):
            shutil.copyfile(shard, folder / shard.name)
        return loaded

    monkeypatch.setattr(engine_module, "load_model", load_then_overwrite)
    disk = {"kv_disk_path": str(tmp_path / "kv"), "kv_disk_size": 0.05}
    with pytest.raises(ConfigError, match="changed while it was loaded") as info:
        run(str(folder), disk)
    assert info.value.field == "model"
