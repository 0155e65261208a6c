"""``kvoffload serve``: an OpenAI-compatible HTTP server over the reference engine."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from uvicorn.config import LOG_LEVELS

from kvoffload.cli.args import int_in
from kvoffload.cli.command import command
from kvoffload.cli.engine_flags import add_engine_flags
from kvoffload.cli.flagspec import Flag, add_flags
from kvoffload.cli.front_door_flags import API_KEY_ENV, FRONT_DOOR_FLAGS, api_key_from
from kvoffload.cli.host_tier_size import HOST_TIER_DEFAULT

__all__ = ["SERVE_FLAGS", "add_parser"]


#: The server's own flags (the engine's and its tiers' come from ``engine_flags``).
SERVE_FLAGS: tuple[Flag, ...] = (
    Flag("host", "address to listen on", default="127.0.0.1", unit="HOST"),
    Flag("port", "port to listen on", parse=int_in(0, 65535), default=8000, unit="PORT"),
    Flag("served_model_name", "the model name clients use", unit="NAME", unset="--model"),
    Flag("log_level", "server log level", choices=tuple(LOG_LEVELS), default="warning"),
    *FRONT_DOOR_FLAGS,
)
#: Engine flags serve leaves out: /metrics is on the server's own port.
_NOT_FOR_SERVE = ("metrics_port", "metrics_host")


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "serve",
        help="an OpenAI-compatible server over the reference engine",
        description="Serve the reference engine over HTTP with OpenAI's API (/v1/completions, "
        "/v1/chat/completions, /v1/models), plus /health, /metrics (Prometheus, same port) and "
        "/kv_event_sources. With --api-key (or KVOFFLOAD_API_KEY) every endpoint but /health "
        "and /metrics needs 'Authorization: Bearer KEY'. Requests are batched continuously; SIGTERM finishes the requests in "
        "flight, lets their stores reach the tiers, and exits 0.",
    )
    add_flags(p, SERVE_FLAGS, section="server")
    add_engine_flags(p, defaults={"kv_offloading_size": HOST_TIER_DEFAULT}, exclude=_NOT_FOR_SERVE)
    p.set_defaults(func=_run, parser=p)


@command
def _run(args: argparse.Namespace) -> int:
    import logging

    from kvoffload.cli.engine_flags import engine_config_from_args
    from kvoffload.cli.flagspec import resolve_flags
    from kvoffload.cli.listen_socket import bind_listener

    flags = resolve_flags(args)  # the host tier's default is read from the machine here, once
    # In use: one line, exit 2, before anything imports torch (the config's device check does).
    sock = bind_listener(flags.host, flags.port)
    with sock:  # closed here too when a setting is refused or the engine cannot start
        config = engine_config_from_args(flags)  # a refused flag or bad setting: one line, exit 2
        from kvoffload.serving.server import serve

        if args.kv_offloading_size is None:
            print(f"kvoffload serve: host tier {config.kv_offloading_size:g} GiB "
                  f"({HOST_TIER_DEFAULT.text}; --kv-offloading-size sets it, 0 turns it off)",
                  file=sys.stderr, flush=True)
        logging.basicConfig(level=flags.log_level.upper(),
                            format="%(levelname)s %(name)s: %(message)s")
        status = serve(config, flags.host, flags.port, flags.served_model_name, flags.log_level,
                       sock=sock, api_key=api_key_from(flags.api_key, API_KEY_ENV),
                       max_request_bytes=flags.max_request_bytes)
    _exit_now(status)
    return status  # pragma: no cover - not reached


def _exit_now(status: int) -> None:
    """End the process at once: the server has stopped and the engine is closed (its stores
    landed, its events sent), so nothing is left to finalize, and the interpreter's own teardown
    (collecting the model's and torch's objects, 1-5 s measured) only delays the exit that a
    supervisor waits for. Logs and output are flushed first."""
    import logging
    import os
    import sys

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
