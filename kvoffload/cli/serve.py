"""``kvoffload serve``: an OpenAI-compatible HTTP server over the reference engine."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from kvoffload.cli.args import int_in

__all__ = ["add_parser"]


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "serve",
        help="an OpenAI-compatible server over the reference engine",
        description="Serve the reference engine over HTTP with OpenAI's API (/v1/completions, "
        "/v1/chat/completions, /v1/models), plus /health, /metrics (Prometheus, same port) and "
        "/kv_event_sources. Requests are batched continuously; SIGTERM finishes the requests in "
        "flight, lets their stores reach the tiers, and exits 0.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int_in(0, 65535), default=8000, help="port to listen on")
    p.add_argument(
        "--served-model-name", default=None, help="the model name clients use (default: --model)"
    )
    p.add_argument(
        "--log-level",
        default="warning",
        choices=("critical", "error", "warning", "info", "debug"),
        help="server log level",
    )
    _add_engine_flags(p)
    p.set_defaults(func=_run, parser=p)


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    from kvoffload.cli.interim_engine_flags import add_engine_flags

    add_engine_flags(parser)


def _run(args: argparse.Namespace) -> int:
    from kvoffload.cli.interim_engine_flags import engine_config_from_args
    from kvoffload.errors import ConfigError
    from kvoffload.serving.server import serve

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        config = engine_config_from_args(args)
    except ConfigError as exc:
        args.parser.error(str(exc))
    try:
        return serve(config, args.host, args.port, args.served_model_name, args.log_level)
    except ConfigError as exc:
        args.parser.exit(2, f"kvoffload serve: error: {exc}\n")
