"""``kvoffload route``: a KV-aware HTTP router over OpenAI-compatible backends."""

from __future__ import annotations

import argparse
import logging
import signal
from typing import Any

from kvoffload.cli.args import int_in, real_in

__all__ = ["add_parser"]


def add_parser(subparsers: Any) -> None:
    from kvoffload.routing.policies import POLICIES, TIER_WEIGHTS

    p = subparsers.add_parser(
        "route",
        help="a KV-aware router over OpenAI-compatible backends",
        description="Route OpenAI API requests over backends (kvoffload serve, vllm serve). With "
        "--policy kv_aware (default) it follows every backend's KV events and sends each request "
        "where its predicted time to first token is lowest: blocks to compute and blocks to "
        "load from each tier, at each backend's measured costs, plus its queue.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--backend",
        action="append",
        required=True,
        metavar="URL[,events=tcp://H:P][,replay=tcp://H:P][,topic=T][,remote_group=G]",
        help="a backend (repeat); its KV events are discovered from /kv_event_sources unless given",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int_in(0, 65535), default=8080, help="port to listen on")
    p.add_argument("--policy", choices=POLICIES, default="kv_aware", help="routing policy")
    p.add_argument(
        "--tier-weights",
        choices=TIER_WEIGHTS,
        default="measured",
        help="kv_aware: how cached blocks count (measured costs, tier-blind, Dynamo's credits)",
    )
    p.add_argument(
        "--model", default="small", help="the backends' model (preset or checkpoint directory), "
        "for its tokenizer and chat template"
    )
    p.add_argument("--block-size", type=int_in(1), default=16, help="the backends' block size")
    p.add_argument("--health-interval", type=real_in(0, positive=True), default=1.0,
                   help="seconds between health checks")
    p.add_argument("--health-failures", type=int_in(1), default=2,
                   help="failed checks in a row that take a backend out of rotation")
    p.add_argument("--metrics-interval", type=real_in(0, positive=True), default=1.0,
                   help="seconds between scrapes of the backends' /metrics (measured costs)")
    p.add_argument("--log-level", default="warning",
                   choices=("critical", "error", "warning", "info", "debug"))
    p.set_defaults(func=_run, parser=p)


def _run(args: argparse.Namespace) -> int:
    import uvicorn

    from kvoffload.errors import ConfigError
    from kvoffload.routing.app import build_app
    from kvoffload.routing.policies import Policy
    from kvoffload.routing.router import BackendSpec, Router
    from kvoffload.serving.prompts import PromptTokenizer

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        specs = [BackendSpec.parse(b) for b in args.backend]
        tokenizer = PromptTokenizer(args.model)
    except (ValueError, ConfigError) as exc:
        args.parser.error(str(exc))
    router = Router(
        specs, Policy(args.policy, args.tier_weights), tokenizer, args.block_size,
        args.health_interval, args.health_failures, args.metrics_interval,
    )
    server = uvicorn.Server(uvicorn.Config(build_app(router), host=args.host, port=args.port,
                                           log_level=args.log_level, access_log=False))
    previous = signal.signal(signal.SIGTERM, lambda *_: None)  # uvicorn re-raises it at the end
    try:
        server.run()
    except KeyboardInterrupt:
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0 if server.started else 1
