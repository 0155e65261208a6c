"""STOPGAP until branch ``cli``'s ``kvoffload/cli/engine_flags.py`` is merged (its
``MILESTONE engine-flags:`` commit): the few engine flags ``kvoffload serve`` needs meanwhile.
Deleted at that merge; do not extend."""

from __future__ import annotations

import argparse
from typing import Any

from kvoffload.cli.args import int_in, real_in

__all__ = ["add_engine_flags", "engine_config_from_args"]


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="small")
    p.add_argument("--num-device-blocks", type=int_in(1), default=None)
    p.add_argument("--kv-offloading-size", type=real_in(0), default=0.0)
    p.add_argument("--max-num-seqs", type=int_in(1), default=16)
    p.add_argument("--max-num-batched-tokens", type=int_in(1), default=2048)
    p.add_argument("--kv-events-config", default=None)
    p.add_argument("--kv-disk-path", default=None)
    p.add_argument("--kv-disk-size", type=real_in(0), default=0.0)
    p.add_argument("--kv-remote-url", default=None)
    p.add_argument("--seed", type=int_in(0), default=0)


def engine_config_from_args(args: argparse.Namespace) -> Any:
    from kvoffload.engine import EngineConfig

    names = ("model", "num_device_blocks", "kv_offloading_size", "max_num_seqs",
             "max_num_batched_tokens", "kv_events_config", "kv_disk_path", "kv_disk_size",
             "kv_remote_url", "seed")
    return EngineConfig(**{n: getattr(args, n) for n in names})
