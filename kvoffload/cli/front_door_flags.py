"""The front-door flags ``serve`` and ``route`` share: the API key and the request body cap
(:mod:`kvoffload.serving.guard`). A key given by flag shows in the process list; the
environment variable does not, so it is the way to pass one in production."""

from __future__ import annotations

import argparse
import os

from kvoffload.cli.args import int_in
from kvoffload.cli.flagspec import Flag
from kvoffload.serving.guard import DEFAULT_MAX_REQUEST_BYTES, ApiKey

__all__ = ["API_KEY_ENV", "BACKEND_API_KEY_ENV", "FRONT_DOOR_FLAGS", "api_key_from", "secret"]

API_KEY_ENV = "KVOFFLOAD_API_KEY"
BACKEND_API_KEY_ENV = "KVOFFLOAD_BACKEND_API_KEY"


def secret(text: str) -> str:
    """A key as given: refused when empty or padded, never echoed in the error."""
    if not text or text != text.strip():
        raise argparse.ArgumentTypeError("must be a non-empty key without surrounding spaces")
    return text


FRONT_DOOR_FLAGS: tuple[Flag, ...] = (
    Flag("api_key", "a key every request but /health and /metrics must carry as "
         "'Authorization: Bearer KEY'", parse=secret, unit="KEY",
         unset=f"${API_KEY_ENV}, else none: no key needed", section="server"),
    Flag("max_request_bytes", "the largest request body taken (larger: 413)",
         parse=int_in(1024), default=DEFAULT_MAX_REQUEST_BYTES, unit="BYTES", section="server"),
)


def api_key_from(given: str | None, env: str) -> ApiKey | None:
    """The key of the flag, else of the environment variable ``env`` (unset or empty: none)."""
    text = given or os.environ.get(env, "")
    return ApiKey(text) if text else None
