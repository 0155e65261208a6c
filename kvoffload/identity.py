"""Model identity by content: the name a model's KV blocks carry in shared tiers.

A disk or Redis tier is shared by engines that never met, so a block may only ever be served to
the model that computed it. Given its tokens, a block's bytes are determined by

* the architecture: ``config.json`` as parsed, canonicalised (keys sorted; provenance that
  does not change the computation dropped: keys starting with ``_`` such as
  ``_name_or_path``, and ``transformers_version``);
* the dtype the model computes in;
* the weights: the digest of the checkpoint's weight files (:mod:`kvoffload.filedigest`:
  xxh3-128 of their bytes, cached beside them), or, for a preset, its name, seed and format
  version;
* settings outside ``config.json`` that change the computation (vLLM's on-the-fly
  quantization).

:func:`model_fingerprint` is the one function that turns these into a name;
:func:`preset_fingerprint`, :func:`checkpoint_fingerprint` and :func:`fingerprint_from_vllm`
gather its inputs. A path never enters it: the same weights at two paths share blocks, other
weights at the same path never do. A name starts with :data:`IDENTITY_FORMAT`; a fingerprint
written by an older kvoffload (which named a model by its path) never equals one.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import xxhash

from kvoffload.checkpoint_files import read_json_object, weight_files
from kvoffload.errors import ConfigError
from kvoffload.filedigest import file_digests

__all__ = [
    "IDENTITY_FORMAT",
    "canonical_architecture",
    "checkpoint_fingerprint",
    "fingerprint_from_vllm",
    "model_fingerprint",
    "preset_fingerprint",
    "weights_digest",
]

log = logging.getLogger(__name__)

#: The prefix of every model name this module makes; a new format gets a new prefix.
IDENTITY_FORMAT = "kvo-model-v1"
#: Top-level ``config.json`` keys that record provenance, not computation (besides ``_*``).
_PROVENANCE_KEYS = frozenset({"transformers_version"})
_DTYPE_ALIASES = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16"}
#: Names weights nobody else can have: one per process (see :func:`fingerprint_from_vllm`).
_PRIVATE_WEIGHTS = f"private:{secrets.token_hex(16)}"


def model_fingerprint(
    architecture: Mapping[str, Any],
    dtype: Any,
    weights: str,
    runtime: Mapping[str, Any] | None = None,
) -> str:
    """``"kvo-model-v1:<32 hex>"``: the model's name in shared tiers.

    ``architecture``: ``config.json`` as parsed (or a preset's configuration); ``dtype``: what
    the model computes in (``torch.bfloat16``, ``"bfloat16"``, ``"bf16"`` are one dtype);
    ``weights``: :func:`weights_digest` of the weight files, or a preset's name for them;
    ``runtime``: settings outside ``config.json`` that change the KV bytes.
    """
    document = {
        "architecture": canonical_architecture(architecture),
        "dtype": _dtype_name(dtype),
        "weights": weights,
        "runtime": dict(runtime or {}),
    }
    text = json.dumps(document, sort_keys=True, separators=(",", ":"), default=str)
    return f"{IDENTITY_FORMAT}:{xxhash.xxh3_128_hexdigest(text.encode())}"


def canonical_architecture(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` without provenance keys (``_*`` at any depth, ``transformers_version``)."""
    return {
        key: canonical_architecture(value) if isinstance(value, Mapping) else value
        for key, value in config.items()
        if not str(key).startswith("_") and key not in _PROVENANCE_KEYS
    }


def preset_fingerprint(
    name: str, architecture: Mapping[str, Any], dtype: Any, seed: int, format_version: int
) -> str:
    """A preset model's name: its configuration, dtype, and weights named by preset name, seed
    and ``format_version`` (bumped when the same seed draws other weights). Never equal to a
    checkpoint's, whatever directory shares the preset's name."""
    weights = f"preset:{name}:seed={seed}:format={format_version}"
    return model_fingerprint(architecture, dtype, weights)


def weights_digest(files: Sequence[Path]) -> str:
    """The digest of a checkpoint's weight files (all in one directory): each file's name and
    content digest, in name order. Cached per file beside them (:mod:`kvoffload.filedigest`)."""
    ordered = sorted(files, key=lambda p: p.name)
    entries = [[p.name, d] for p, d in zip(ordered, file_digests(ordered), strict=True)]
    text = json.dumps(entries, separators=(",", ":"))
    return f"files:{xxhash.xxh3_128_hexdigest(text.encode())}"


def checkpoint_fingerprint(directory: Path, dtype: Any) -> str:
    """The name of the Hugging Face checkpoint in ``directory`` run in ``dtype``: its
    ``config.json`` and the digest of its safetensors weights. :class:`ConfigError` naming
    ``model`` when either cannot be read."""
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ConfigError("model", f"no config.json in {directory}")
    architecture = read_json_object(config_path)
    return model_fingerprint(architecture, dtype, weights_digest(weight_files(directory)))


def fingerprint_from_vllm(
    model_config: Any,
    weight_files: Sequence[str | os.PathLike[str]] | None = None,
    dtype: Any = None,
    download_dir: str | None = None,
) -> str:
    """The name of the model vLLM serves, from its ``ModelConfig`` (``vllm_config.model_config``).

    Reads ``model_config.model`` (a local directory, a file such as a GGUF, or a Hugging Face
    repo id; vLLM's ``OffloadingModelConfig`` calls it ``name``), ``.revision``, ``.dtype``
    (overridden by ``dtype``), ``.hf_config`` (the configuration vLLM runs, overrides included;
    else ``config.json``) and ``.quantization``; attributes it lacks count as unset.
    ``weight_files``: the files vLLM loaded its weights from; by default the checkpoint's
    weight files, found in the local directory or, for a repo id, in the local Hugging Face
    cache (``download_dir``: vLLM's ``load_config.download_dir``) at ``revision`` (no network). When no weight file can be found, the name is private to
    this process (its blocks are never served to another process) and a warning says so.
    """
    source = str(getattr(model_config, "model", None) or getattr(model_config, "name", ""))
    directory = _local_checkpoint(source, getattr(model_config, "revision", None), download_dir)
    files = (
        [Path(f) for f in weight_files]
        if weight_files is not None
        else _vllm_weight_files(source, directory)
    )
    architecture = _vllm_architecture(model_config, directory)
    if files:
        weights = _files_digest(files)
    else:
        log.warning(
            "cannot find the weight files of %r: its KV blocks are private to this process "
            "(pass weight_files to share them)",
            source,
        )
        weights = _PRIVATE_WEIGHTS
    runtime = {"quantization": getattr(model_config, "quantization", None)}
    if dtype is None:
        dtype = getattr(model_config, "dtype", None)
    return model_fingerprint(architecture, dtype, weights, runtime)


def _dtype_name(dtype: Any) -> str:
    name = str(dtype).removeprefix("torch.")
    return _DTYPE_ALIASES.get(name, name)


def _files_digest(files: Sequence[Path]) -> str:
    """:func:`weights_digest` of files that may lie in several directories."""
    by_directory: dict[Path, list[Path]] = {}
    for path in files:
        by_directory.setdefault(path.parent, []).append(path)
    parts = [weights_digest(group) for _, group in sorted(by_directory.items())]
    return parts[0] if len(parts) == 1 else "+".join(parts)


def _local_checkpoint(source: str, revision: str | None, cache_dir: str | None) -> Path | None:
    """The directory holding ``source``: itself, the directory of a file, or the local Hugging
    Face cache's snapshot of repo ``source`` at ``revision`` (``None`` when there is none)."""
    path = Path(source)
    if path.is_dir():
        return path
    if path.is_file():
        return path.parent
    try:
        from huggingface_hub import snapshot_download

        return Path(
            snapshot_download(source, revision=revision, cache_dir=cache_dir, local_files_only=True)
        )
    except Exception:  # not installed, not a repo id, not cached: nothing local to read
        return None


def _vllm_weight_files(source: str, directory: Path | None) -> list[Path]:
    """The files vLLM loads weights from: a weights file named directly, else the checkpoint's
    safetensors (``*.bin``, then ``*.pt`` where there are none, as vLLM falls back)."""
    if Path(source).is_file():
        return [Path(source)]
    if directory is None:
        return []
    try:
        return weight_files(directory)
    except ConfigError:
        return sorted(directory.glob("*.bin")) or sorted(directory.glob("*.pt"))


def _vllm_architecture(model_config: Any, directory: Path | None) -> Mapping[str, Any]:
    hf_config = getattr(model_config, "hf_config", None)
    if hf_config is not None and hasattr(hf_config, "to_dict"):
        return hf_config.to_dict()
    if isinstance(hf_config, Mapping):
        return hf_config
    if directory is not None and (directory / "config.json").is_file():
        return read_json_object(directory / "config.json")
    return {}
