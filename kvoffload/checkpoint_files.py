"""Which files make up a Hugging Face checkpoint directory: ``config.json`` and its weights.

One rule, read by the engine's loader (what it loads) and by :mod:`kvoffload.identity` (what
names the model): the weights are the shards listed in ``model.safetensors.index.json`` when
there is one, else every ``*.safetensors`` file. Problems raise
:class:`~kvoffload.errors.ConfigError` naming ``model``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvoffload.errors import ConfigError

__all__ = ["SAFETENSORS_INDEX", "read_json_object", "weight_files"]

SAFETENSORS_INDEX = "model.safetensors.index.json"


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``; :class:`ConfigError` naming ``model`` if unreadable."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError("model", f"cannot read {path}: {exc}") from None
    if not isinstance(value, dict):
        raise ConfigError("model", f"{path} must hold a JSON object")
    return value


def weight_files(directory: Path) -> list[Path]:
    """The checkpoint's safetensors weight files, sorted by name."""
    index = directory / SAFETENSORS_INDEX
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(
            isinstance(name, str) for name in weight_map.values()
        ):
            raise ConfigError(
                "model",
                f"{index} is not a valid safetensors index: weight_map must map names to files",
            )
        files = [directory / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ConfigError("model", f"shards listed in {index.name} are missing: {missing}")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        other = sorted(p.name for p in directory.glob("*.bin"))
        hint = f" (found {other}; only safetensors is supported)" if other else ""
        raise ConfigError("model", f"no *.safetensors weights in {directory}{hint}")
    return files
