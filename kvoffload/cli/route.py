"""``kvoffload route``: a KV-aware HTTP router over OpenAI-compatible backends."""

from __future__ import annotations

import argparse
import gc
import logging
import signal
import socket
from typing import TYPE_CHECKING, Any

from uvicorn.config import LOG_LEVELS

from kvoffload.cli.args import int_in, real_in
from kvoffload.cli.command import command
from kvoffload.cli.flagspec import Flag, add_flags, resolve_flags
from kvoffload.cli.front_door_flags import (
    API_KEY_ENV,
    BACKEND_API_KEY_ENV,
    FRONT_DOOR_FLAGS,
    api_key_from,
    secret,
)
from kvoffload.cli.listen_socket import bind_listener
from kvoffload.routing.policies import POLICIES, TIER_WEIGHTS

if TYPE_CHECKING:
    from kvoffload.routing.router import BackendSpec

__all__ = ["ROUTE_FLAGS", "add_parser"]


#: The router's flags.
ROUTE_FLAGS: tuple[Flag, ...] = (
    Flag("backend", "a backend (repeat); its KV events are found at its /kv_event_sources "
         "unless given", kind="append", default=(), unset="none: at least one is required",
         unit="URL[,events=tcp://H:P][,replay=tcp://H:P][,topic=T][,remote_group=G]"),
    Flag("host", "address to listen on", default="127.0.0.1", unit="HOST", section="server"),
    Flag("port", "port to listen on", parse=int_in(0, 65535), default=8080, unit="PORT",
         section="server"),
    Flag("policy", "routing policy", choices=POLICIES, default="kv_aware"),
    Flag("tier_weights", "kv_aware: how cached blocks count (measured costs, tier-blind, Dynamo's "
         "static credits)", choices=TIER_WEIGHTS, default="measured"),
    Flag("model", "the backends' model (preset or checkpoint directory), for its tokenizer and "
         "chat template", default="small", unit="MODEL"),
    Flag("block_size", "the backends' block size", parse=int_in(1), default=16, unit="TOKENS"),
    Flag("health_interval", "seconds between health checks", parse=real_in(0, positive=True),
         default=1.0, unit="SECONDS", section="backends' health"),
    Flag("health_failures", "failed checks in a row that take a backend out of rotation",
         parse=int_in(1), default=2, unit="N", section="backends' health"),
    Flag("metrics_interval", "seconds between scrapes of the backends' /metrics (measured "
         "costs)", parse=real_in(0, positive=True), default=1.0, unit="SECONDS",
         section="backends' health"),
    Flag("stream_idle_timeout", "seconds a streamed answer may go without a byte from its "
         "backend before it ends with an error event", parse=real_in(0, positive=True),
         default=60.0, unit="SECONDS"),
    Flag("log_level", "log level", choices=tuple(LOG_LEVELS), default="warning", section="server"),
    *FRONT_DOOR_FLAGS,
    Flag("backend_api_key", "the key sent to every backend as 'Authorization: Bearer KEY'",
         parse=secret, unit="KEY", unset=f"${BACKEND_API_KEY_ENV}, else none", section="server"),
)


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "route",
        help="a KV-aware router over OpenAI-compatible backends",
        description="Route OpenAI API requests over backends (kvoffload serve, vllm serve). With "
        "--policy kv_aware (default) it follows every backend's KV events and sends each request "
        "where its predicted time to first token is lowest: blocks to compute and blocks to "
        "load from each tier, at each backend's measured costs, plus its queue. It warns once "
        "per backend that does not answer, or that publishes no KV events (kv_aware cannot see "
        "its cache).",
    )
    add_flags(p, ROUTE_FLAGS, section="routing")
    p.set_defaults(func=_run, parser=p)


@command
def _run(args: argparse.Namespace) -> int:
    from kvoffload.routing.router import BackendSpec

    args = resolve_flags(args)
    if not args.backend:
        args.parser.error("give at least one --backend URL")
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        specs = [BackendSpec.parse(b) for b in args.backend]
    except ValueError as exc:
        args.parser.error(str(exc))
    sock = bind_listener(args.host, args.port)  # in use: one line, exit 2, before the tokenizer
    with sock:  # closed here too when the router cannot start
        return _serve_routes(args, specs, sock)


def _serve_routes(args: argparse.Namespace, specs: list[BackendSpec], sock: socket.socket) -> int:
    """Build the router over ``specs`` and serve it on ``sock`` until it stops."""
    import uvicorn

    from kvoffload.routing.app import build_app
    from kvoffload.routing.policies import create_policy
    from kvoffload.routing.router import Router
    from kvoffload.serving.prompts import PromptTokenizer
    from kvoffload.serving.server import KEEP_ALIVE_S

    # A model whose tokenizer cannot be loaded is a ConfigError (one line, command), never a
    # silent fall back to byte-level ids that match none of the backends' blocks.
    tokenizer = PromptTokenizer(args.model, require_tokenizer=True)
    router = Router(
        specs, create_policy(args.policy, args.tier_weights), tokenizer, args.block_size,
        args.health_interval, args.health_failures, args.metrics_interval,
        args.stream_idle_timeout,
        backend_api_key=api_key_from(args.backend_api_key, BACKEND_API_KEY_ENV),
    )
    app = build_app(router, api_key_from(args.api_key, API_KEY_ENV), args.max_request_bytes)
    # Everything imported and built so far lives as long as the process: out of every future
    # collection, so a full one walks only what serving creates (the index never: it is
    # untracked by construction), and its pause stays short in whichever request it lands.
    gc.collect()
    gc.freeze()
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port,
                                           log_level=args.log_level, access_log=False,
                                           timeout_keep_alive=KEEP_ALIVE_S))
    previous = signal.signal(signal.SIGTERM, lambda *_: None)  # uvicorn re-raises it at the end
    try:
        server.run(sockets=[sock])  # Ctrl-C: KeyboardInterrupt once it stopped (one line, exit 130)
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0 if server.started else 1
