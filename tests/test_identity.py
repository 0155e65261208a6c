"""Model identity by content (``kvoffload.identity``): real checkpoint files, real digests.

The same weights at two paths are one model; other weights, another configuration, another dtype
or another preset seed are another; a path never enters the name; the weights' digest is cached
beside them and never served stale, and a cache that cannot be written costs time, never a
failure.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import types
from pathlib import Path

import pytest
import torch
from model_cases import make_hf_model, one_thread, save_hf_model  # noqa: F401 - autouse fixture

from kvoffload import filedigest
from kvoffload.engine.loader import PRESET_FORMAT_VERSION, load_model, model_identity
from kvoffload.engine.model_config import preset_config
from kvoffload.errors import ConfigError
from kvoffload.identity import (
    IDENTITY_FORMAT,
    canonical_architecture,
    checkpoint_fingerprint,
    fingerprint_from_vllm,
    model_fingerprint,
    weights_digest,
)
from kvoffload.tiers import KVLayout

pytest.importorskip("transformers")

#: SHA-256 of the ``tiny`` preset's weights at seed 0, per preset format version. A change that
#: makes a seed draw other weights must bump PRESET_FORMAT_VERSION (else the blocks of the old
#: weights would be served to the new ones) and add its digest here.
PRESET_WEIGHTS_SHA256 = {1: "776603cdcff3c4936a3b7ac48e2902b0486ad6771a205e22c51dd47feca8f47b"}
F32 = torch.float32


@pytest.fixture(scope="module")
def weights_a(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_hf_model(make_hf_model("qwen3"), tmp_path_factory.mktemp("a") / "ckpt")


@pytest.fixture(autouse=True)
def settled_files(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Files written by the test count as settled (cacheable) at once, and the user cache
    directory is the test's own."""
    monkeypatch.setattr(filedigest, "RACY_WINDOW_S", 0.0)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))


def fresh_copy(source: Path, target: Path) -> Path:
    """A copy of the checkpoint without its digest cache."""
    return Path(shutil.copytree(source, target, ignore=shutil.ignore_patterns(".kvoffload-*")))


def perturbed_copy(source: Path, target: Path) -> Path:
    """``source``'s checkpoint with one weight changed by one ulp-sized step (same shapes,
    same sizes on disk)."""
    from safetensors.torch import load_file, save_file

    fresh_copy(source, target)
    (weights,) = target.glob("*.safetensors")
    tensors = load_file(str(weights))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] += 1e-3
    save_file(tensors, str(weights), metadata={"format": "pt"})
    return target


def test_same_weights_at_two_paths_are_one_model(weights_a: Path, tmp_path: Path) -> None:
    copy = Path(shutil.copytree(weights_a, tmp_path / "elsewhere" / "renamed"))
    a = checkpoint_fingerprint(weights_a, F32)
    assert a.startswith(IDENTITY_FORMAT + ":")
    assert checkpoint_fingerprint(copy, F32) == a
    assert checkpoint_fingerprint(copy, "fp32") == checkpoint_fingerprint(copy, "torch.float32")
    assert model_identity(str(copy), F32) == a == model_identity(str(weights_a), F32, seed=7)


def test_other_weights_config_or_dtype_are_another_model(weights_a: Path, tmp_path: Path) -> None:
    a = checkpoint_fingerprint(weights_a, F32)
    b = perturbed_copy(weights_a, tmp_path / "b")
    assert checkpoint_fingerprint(b, F32) != a
    assert checkpoint_fingerprint(weights_a, torch.bfloat16) != a
    c = Path(shutil.copytree(weights_a, tmp_path / "c"))
    config = json.loads((c / "config.json").read_text())
    config["rope_theta"] = config.get("rope_theta", 10000.0) * 2
    (c / "config.json").write_text(json.dumps(config))
    assert checkpoint_fingerprint(c, F32) != a


def test_provenance_in_config_json_is_not_part_of_the_model(
    weights_a: Path, tmp_path: Path
) -> None:
    c = Path(shutil.copytree(weights_a, tmp_path / "c"))
    config = json.loads((c / "config.json").read_text())
    config.update({"_name_or_path": "/somewhere/else", "transformers_version": "9.9.9"})
    (c / "config.json").write_text(json.dumps(config, indent=7))
    assert checkpoint_fingerprint(c, F32) == checkpoint_fingerprint(weights_a, F32)
    assert canonical_architecture({"a": {"_x": 1, "y": 2}, "_z": 3}) == {"a": {"y": 2}}


def test_weights_overwritten_in_place_are_another_model(weights_a: Path, tmp_path: Path) -> None:
    """The issue's first repro at the function level: the same folder, other weights (same
    sizes, the digest of the old ones cached beside them)."""
    folder = fresh_copy(weights_a, tmp_path / "model")
    a = checkpoint_fingerprint(folder, F32)
    assert (folder / filedigest.CACHE_NAME).is_file()  # A's digest is cached
    other = perturbed_copy(weights_a, tmp_path / "b")
    (weights,) = folder.glob("*.safetensors")
    stat = weights.stat()
    _wait_for_the_filesystem_clock(tmp_path, stat.st_ctime_ns)
    weights.write_bytes(next(other.glob("*.safetensors")).read_bytes())  # in place: same inode
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # even the mtime put back
    assert weights.stat().st_size == stat.st_size and weights.stat().st_ino == stat.st_ino
    assert checkpoint_fingerprint(folder, F32) == checkpoint_fingerprint(other, F32) != a


def _wait_for_the_filesystem_clock(directory: Path, past_ns: int) -> None:
    """Until a file written now gets a ctime after ``past_ns`` (file timestamps are coarse:
    without this, a rewrite could land in the same tick and only the racy window, zeroed in
    these tests, would tell the bytes apart)."""
    probe = directory / "clock-probe"
    for _ in range(10_000):
        probe.write_bytes(b"")
        if probe.stat().st_ctime_ns > past_ns:
            return
    raise AssertionError("the filesystem clock does not advance")


def test_digest_is_cached_and_a_fresh_file_is_not(weights_a: Path, tmp_path: Path, monkeypatch):
    folder = fresh_copy(weights_a, tmp_path / "model")
    files = sorted(folder.glob("*.safetensors"))
    calls: list[Path] = []
    real = filedigest.file_digest

    def counted(path: Path) -> str:
        calls.append(path)
        return real(path)

    monkeypatch.setattr(filedigest, "file_digest", counted)
    first = weights_digest(files)
    assert weights_digest(files) == first and calls == files  # hashed once
    # A file changed within the racy window is hashed every time until it has settled.
    monkeypatch.setattr(filedigest, "RACY_WINDOW_S", 3600.0)
    (folder / filedigest.CACHE_NAME).unlink()
    calls.clear()
    weights_digest(files)
    weights_digest(files)
    assert calls == files * 2
    assert not (folder / filedigest.CACHE_NAME).exists()


def test_unwritable_checkpoint_directory_caches_elsewhere_or_recomputes(
    weights_a: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    folder = fresh_copy(weights_a, tmp_path / "model")
    want = checkpoint_fingerprint(weights_a, F32)
    (folder / filedigest.CACHE_NAME).mkdir()  # the cache file cannot be written there
    assert checkpoint_fingerprint(folder, F32) == want
    assert list((tmp_path / "xdg" / "kvoffload" / "digests").glob("*.json"))  # cached elsewhere
    # Neither place writable: recomputed, never an error, one warning per directory.
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker / "cache"))
    other = fresh_copy(weights_a, tmp_path / "model2")
    (other / filedigest.CACHE_NAME).mkdir()
    with caplog.at_level(logging.WARNING, logger="kvoffload.filedigest"):
        assert checkpoint_fingerprint(other, F32) == want
        assert checkpoint_fingerprint(other, F32) == want
    warnings = [r for r in caplog.records if "recomputed at every start" in r.getMessage()]
    assert len(warnings) == 1


@pytest.mark.parametrize(
    "content", ["{not json", "[]", '{"format": 99}', '{"format": 1, "entries": 5}']
)
def test_a_damaged_cache_is_ignored_and_rewritten(weights_a: Path, tmp_path: Path, content) -> None:
    folder = fresh_copy(weights_a, tmp_path / "model")
    (folder / filedigest.CACHE_NAME).write_text(content)
    assert checkpoint_fingerprint(folder, F32) == checkpoint_fingerprint(weights_a, F32)
    assert json.loads((folder / filedigest.CACHE_NAME).read_text())["format"] == 1


def test_a_forged_cache_entry_for_other_bytes_is_not_served(weights_a: Path, tmp_path: Path):
    folder = fresh_copy(weights_a, tmp_path / "model")
    want = checkpoint_fingerprint(folder, F32)
    cache = folder / filedigest.CACHE_NAME
    data = json.loads(cache.read_text())
    for entry in data["entries"].values():
        entry["key"]["size"] += 1  # an entry for other bytes
        entry["digest"] = "xxh3-128:" + "0" * 32
    cache.write_text(json.dumps(data))
    assert checkpoint_fingerprint(folder, F32) == want


def test_unreadable_checkpoints_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"no config\.json"):
        checkpoint_fingerprint(tmp_path, F32)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"no \*\.safetensors"):
        checkpoint_fingerprint(tmp_path, F32)


def test_a_directory_named_like_a_preset_is_still_the_preset(tmp_path, monkeypatch) -> None:
    """The issue's second repro at the function level: with ``./tiny/`` in the working
    directory, the seed still names the weights, as load_model still loads the preset."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny").mkdir()
    seeds = {model_identity("tiny", F32, seed) for seed in (0, 1, 2)}
    assert len(seeds) == 3
    assert model_identity("tiny", F32, 0) != model_identity("tiny", torch.bfloat16, 0)
    assert model_identity("tiny", F32, 0) != model_identity("small", F32, 0)


def test_no_new_name_equals_a_path_based_name_of_the_old_format(weights_a: Path) -> None:
    """Today's fingerprint named a model by its path string (``tiny@seed0`` for presets): the new
    names never coincide with one, so a block of the old format is never served."""
    new = {model_identity("tiny", F32, 0), model_identity(str(weights_a), F32)}
    old = {"tiny@seed0", str(weights_a)}
    assert not new & old

    def layout(model: str) -> bytes:
        return KVLayout(model, "torch.float32", 4, 2, 2, 16, 2048).fingerprint()

    assert not {layout(m) for m in new} & {layout(m) for m in old}


def test_preset_weights_are_pinned_to_the_format_version() -> None:
    """Changing what a seed draws without bumping PRESET_FORMAT_VERSION fails here."""
    model, _, _ = load_model("tiny", seed=0)
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        digest.update(name.encode() + param.detach().numpy().tobytes())
    assert PRESET_WEIGHTS_SHA256[PRESET_FORMAT_VERSION] == digest.hexdigest()
    assert dataclasses.asdict(preset_config("tiny"))  # the configuration is hashed as well


class StandInHFConfig:
    """What vLLM's ``model_config.hf_config`` offers the identity: ``to_dict()``."""

    def __init__(self, path: Path, **overrides: object) -> None:
        self.data = {**json.loads((path / "config.json").read_text()), **overrides}
        self.data["_name_or_path"] = str(path)

    def to_dict(self) -> dict:
        return dict(self.data)


def vllm_model_config(path: Path, **overrides: object) -> types.SimpleNamespace:
    """A stand-in for vLLM's ``ModelConfig`` with the attributes the identity reads."""
    fields = {
        "model": str(path),
        "revision": None,
        "dtype": torch.bfloat16,
        "hf_config": StandInHFConfig(path),
        "quantization": None,
    }
    return types.SimpleNamespace(**{**fields, **overrides})


def test_fingerprint_from_vllm(weights_a: Path, tmp_path: Path) -> None:
    copy = Path(shutil.copytree(weights_a, tmp_path / "copy"))
    other = perturbed_copy(weights_a, tmp_path / "other")
    a = fingerprint_from_vllm(vllm_model_config(weights_a))
    assert fingerprint_from_vllm(vllm_model_config(copy)) == a  # _name_or_path differs
    assert fingerprint_from_vllm(vllm_model_config(other)) != a
    assert fingerprint_from_vllm(vllm_model_config(weights_a, dtype=torch.float16)) != a
    assert fingerprint_from_vllm(vllm_model_config(weights_a), dtype="float16") != a
    assert fingerprint_from_vllm(vllm_model_config(weights_a, quantization="fp8")) != a
    overridden = vllm_model_config(weights_a, hf_config=StandInHFConfig(weights_a, rope_theta=1.0))
    assert fingerprint_from_vllm(overridden) != a  # hf_overrides change the computation
    # The files vLLM says it loaded, wherever they are; a repo id with files named explicitly.
    files = sorted(copy.glob("*.safetensors"))
    by_id = vllm_model_config(weights_a, model="org/not-a-local-path")
    assert fingerprint_from_vllm(by_id, weight_files=files) == a
    # The same engine's own name for the checkpoint is made by the same function.
    assert checkpoint_fingerprint(weights_a, torch.bfloat16) == model_fingerprint(
        json.loads((weights_a / "config.json").read_text()),
        "bfloat16",
        weights_digest(sorted(weights_a.glob("*.safetensors"))),
    )


def test_fingerprint_from_vllm_offloading_model_config(weights_a: Path, tmp_path: Path) -> None:
    """What vLLM's offloading spec sees of the model (``OffloadingModelConfig``: name, dtype):
    the configuration comes from config.json, the weights from the directory."""
    copy = fresh_copy(weights_a, tmp_path / "copy")
    name_only = types.SimpleNamespace(name=str(weights_a), dtype="bfloat16", max_model_len=0)
    a = fingerprint_from_vllm(name_only)
    assert a == fingerprint_from_vllm(types.SimpleNamespace(name=str(copy), dtype="bfloat16"))
    assert a == fingerprint_from_vllm(vllm_model_config(weights_a))  # stand-in: no overrides
    assert a != fingerprint_from_vllm(name_only, dtype="float16")


def test_fingerprint_from_vllm_without_weights_is_private(weights_a: Path, caplog) -> None:
    """A repo id that is neither local nor in the Hugging Face cache: nothing identifies its
    weights, so its blocks must never meet another process's."""
    unknown = vllm_model_config(weights_a, model="org/nowhere-to-be-found-123")
    with caplog.at_level(logging.WARNING, logger="kvoffload.identity"):
        first = fingerprint_from_vllm(unknown)
    assert "private to this process" in caplog.text
    assert fingerprint_from_vllm(unknown) == first  # stable within the process
    assert first != fingerprint_from_vllm(vllm_model_config(weights_a))
