"""``kvoffload events listen``: print KV cache events as they arrive, or a live per-tier table.

Imports only :mod:`kvoffload.events` (no torch), so it starts fast next to a router.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, TextIO

import msgspec

from kvoffload.cli.args import int_in, real_in
from kvoffload.errors import ConfigError
from kvoffload.events import (
    AllBlocksCleared,
    BlockIndex,
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    Gap,
    KVCacheEvent,
    KVEventSubscriber,
    ReceivedBatch,
    tier_of,
)

__all__ = ["add_parser"]

# Longest single wait, so that --timeout and the table refresh are honoured promptly.
_POLL_S = 0.2
# How long without a publisher before a warning says that nothing may be bound at the address.
_WARN_UNREACHED_S = 10.0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    events = subparsers.add_parser("events", help="KV cache events (ZMQ, vLLM wire format)")
    commands = events.add_subparsers(dest="events_command", required=True, metavar="{listen}")
    listen = commands.add_parser(
        "listen",
        help="subscribe to a publisher and print its events",
        description="Subscribe to a KV event publisher and print events as they arrive (one line "
        "each, or JSON lines), filling sequence gaps from the replay socket when given.",
    )
    listen.add_argument(
        "--endpoint",
        default="tcp://127.0.0.1:5557",
        help="publisher address (default: %(default)s)",
    )
    listen.add_argument(
        "--bind",
        action="store_true",
        help="bind --endpoint instead of connecting, for a publisher that connects (vLLM's does "
        "when its endpoint is a tcp address without a wildcard, e.g. tcp://127.0.0.1:5557)",
    )
    listen.add_argument("--topic", default="", help="topic prefix to subscribe to (default: all)")
    listen.add_argument(
        "--replay", metavar="ENDPOINT", help="the publisher's replay address, to fill gaps"
    )
    listen.add_argument(
        "--from-seq",
        type=int_in(0),
        default=0,
        metavar="N",
        help="first batch wanted (default: %(default)s, everything): batches from N on that "
        "did not arrive live are a gap, fetched from --replay at start and whenever one opens",
    )
    listen.add_argument("--json", action="store_true", help="print JSON lines instead of text")
    listen.add_argument(
        "--index",
        action="store_true",
        help="show a refreshing table of blocks per tier instead of events",
    )
    listen.add_argument(
        "--refresh",
        type=real_in(0, positive=True),
        default=1.0,
        metavar="S",
        help="table refresh period (default: %(default)s s)",
    )
    listen.add_argument(
        "--max-batches",
        type=int_in(1),
        metavar="N",
        help="stop after N batches (default: no limit)",
    )
    listen.add_argument(
        "--timeout",
        type=real_in(0),
        metavar="S",
        help="stop after S seconds (default: run until Ctrl-C or --max-batches)",
    )
    listen.set_defaults(func=_listen, parser=listen)


def _listen(args: argparse.Namespace) -> int:
    out = sys.stdout
    index = BlockIndex() if args.index else None
    start = time.monotonic()
    deadline = None if args.timeout is None else start + args.timeout
    try:
        subscriber = KVEventSubscriber(
            args.endpoint,
            args.topic,
            args.replay,
            start_seq=args.from_seq,
            bind=True if args.bind else None,
            warn_unreached_s=_WARN_UNREACHED_S,
        )
    except ConfigError as exc:
        print(f"kvoffload events listen: {exc}", file=sys.stderr)
        return 2
    with subscriber as sub:
        if args.replay is not None:
            sub.catch_up()
        batches = replayed = 0
        next_refresh = start + args.refresh
        try:
            while args.max_batches is None or batches < args.max_batches:
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    break
                wait = _POLL_S if deadline is None else min(_POLL_S, deadline - now)
                received = sub.receive(wait)
                gaps = sub.take_gaps()
                if index is None:
                    for gap in gaps:
                        _print_gap(out, gap, args.json)
                if received is not None:
                    batches += 1
                    replayed += received.replayed
                    if index is None:
                        _print_batch(out, received, args.json)
                    else:
                        if received.restarted:  # the old table describes a publisher gone
                            index.clear()
                        index.apply(received.batch)
                if index is not None and time.monotonic() >= next_refresh:
                    _print_index(out, index, batches, sub.stats(), args.json)
                    next_refresh = time.monotonic() + args.refresh
        except KeyboardInterrupt:
            pass
        if index is not None:
            _print_index(out, index, batches, sub.stats(), args.json)
        stats = sub.stats()
    print(
        f"{batches} batches ({replayed} through replay), {stats['gaps']} gaps, "
        f"{stats['lost']} batches lost",
        file=sys.stderr,
    )
    return 0


def _hash_text(h: ExternalBlockHash | None) -> str:
    """Hex of a hash's last 8 bytes, so bytes and int hashes of one block print alike."""
    if h is None:
        return "-"
    return h[-8:].hex() if isinstance(h, bytes) else f"{h:016x}"


def _event_text(event: KVCacheEvent) -> str:
    if isinstance(event, BlockStored):
        hashes = event.block_hashes
        span = (
            _hash_text(hashes[0])
            if len(hashes) == 1
            else f"{_hash_text(hashes[0])}..{_hash_text(hashes[-1])}"
        )
        tier = tier_of(event.medium, event.locality)
        text = (
            f"BlockStored   {tier:<7} blocks={len(hashes)} [{span}] "
            f"parent={_hash_text(event.parent_block_hash)} tokens={len(event.token_ids)} "
            f"block_size={event.block_size} group={event.group_idx}"
        )
        return text if event.lora_name is None else f"{text} lora={event.lora_name}"
    if isinstance(event, BlockRemoved):
        hashes = event.block_hashes
        span = ",".join(_hash_text(h) for h in hashes[:4]) + (",..." if len(hashes) > 4 else "")
        tier = tier_of(event.medium, event.locality)
        return f"BlockRemoved  {tier:<7} blocks={len(hashes)} [{span}] group={event.group_idx}"
    if isinstance(event, AllBlocksCleared):
        return "AllBlocksCleared"
    return repr(event)


def _event_tier(event: KVCacheEvent) -> str:
    """The tier an event addresses (``AllBlocksCleared`` resets the device cache)."""
    if isinstance(event, BlockStored | BlockRemoved):
        return tier_of(event.medium, event.locality)
    return "device"


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    return value


def _print_batch(out: TextIO, received: ReceivedBatch, as_json: bool) -> None:
    batch = received.batch
    lines = []
    for event in batch.events:
        if as_json:
            record = {
                "seq": received.seq,
                "replayed": received.replayed,
                "ts": batch.ts,
                "data_parallel_rank": batch.data_parallel_rank,
                "type": type(event).__name__,
                "tier": _event_tier(event),
                **_jsonable(msgspec.to_builtins(event, builtin_types=(bytes,))),
            }
            lines.append(json.dumps(record))
        else:
            mark = "R" if received.replayed else " "
            lines.append(
                f"{received.seq:>8} {mark} dp={batch.data_parallel_rank} {_event_text(event)}"
            )
    if lines:
        out.write("\n".join(lines) + "\n")
        out.flush()


def _print_gap(out: TextIO, gap: Gap, as_json: bool) -> None:
    if as_json:
        record = {
            "gap": {
                "first_seq": gap.first_seq,
                "end_seq": gap.end_seq,
                "recovered": gap.recovered,
                "lost": gap.lost,
            }
        }
        out.write(json.dumps(record) + "\n")
    else:
        out.write(
            f"gap: batches {gap.first_seq}..{gap.end_seq - 1} missed live; "
            f"{gap.recovered} recovered through replay, {gap.lost} lost\n"
        )
    out.flush()


def _print_index(
    out: TextIO, index: BlockIndex, batches: int, stats: dict[str, int], as_json: bool
) -> None:
    counts = index.counts()
    if as_json:
        out.write(json.dumps({"index": counts, "batches": batches, "stats": stats}) + "\n")
        out.flush()
        return
    rows = [f"{'tier':<16}{'blocks':>12}"] + [f"{tier:<16}{n:>12}" for tier, n in counts.items()]
    rows.append(f"batches {batches}, gaps {stats['gaps']}, lost {stats['lost']}")
    clear = "\x1b[H\x1b[2J" if out.isatty() else ""
    out.write(clear + "\n".join(rows) + "\n\n")
    out.flush()
