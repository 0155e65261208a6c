"""Checks on a request body that ``kvoffload serve`` and ``kvoffload route`` share: it is a JSON
object whose strings are valid Unicode, and token ids are in range. Each failure is an
:class:`~kvoffload.serving.errors.APIError` (status 400, the field named), never a crash.

JSON lets a string hold a lone surrogate (``"\\ud800"``), which no UTF-8 encoder (so no
tokenizer) accepts: such a body is refused here, naming the field that holds it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from kvoffload.serving.errors import APIError

__all__ = ["MAX_TOKEN_ID", "check_token_ids", "parse_json_object"]

#: Token ids are unsigned 32-bit numbers wherever they are packed (the router's block keys).
MAX_TOKEN_ID = 2**32 - 1
#: How a surrogate can reach a string parsed from UTF-8 JSON: an escape ``\uD800``-``\uDFFF``,
#: or its raw encoding (``ED A0``-``ED BF``, which ``json.loads`` decodes with surrogatepass).
_SURROGATE_HINT = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


def parse_json_object(data: bytes) -> dict[str, Any]:
    """``data`` parsed: a JSON object with no lone surrogate in any string (keys included)."""
    try:
        body = json.loads(data)
    except ValueError as exc:  # UnicodeDecodeError (not UTF-8) is a ValueError too
        raise APIError(f"malformed JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise APIError("the body must be a JSON object")
    if not _may_hold_surrogates(data):  # one scan of the bytes, not a walk of every value
        return body
    where = _lone_surrogate(body, "")
    if where is not None:
        raise APIError("the text holds a lone UTF-16 surrogate (not valid Unicode)",
                       where or None)
    return body


def _may_hold_surrogates(data: bytes) -> bool:
    """Whether a string parsed from ``data`` may hold a surrogate: always for UTF-16/32 JSON
    (``json.loads`` tells them by a NUL among the first bytes), else only where the bytes hold
    one's escape or raw encoding."""
    return b"\x00" in data[:4] or _SURROGATE_HINT.search(data) is not None


def _lone_surrogate(value: Any, path: str) -> str | None:
    """The dotted path of the first string under ``value`` that is not valid Unicode."""
    if isinstance(value, str):
        return None if _encodable(value) else path
    if isinstance(value, dict):
        items: Any = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        here = f"{path}.{key}" if path else str(key)
        if isinstance(key, str) and not _encodable(key):
            return here
        found = _lone_surrogate(item, here)
        if found is not None:
            return found
    return None


def _encodable(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_token_ids(ids: Sequence[Any], param: str, vocab_size: int = MAX_TOKEN_ID + 1) -> list[int]:
    """``ids`` as a list, non-empty, each an integer (not a bool) in ``[0, vocab_size)``; else
    an :class:`APIError` naming ``param`` (its message names the position at fault)."""
    out = list(ids)
    if not out:
        raise APIError("the prompt must not be empty", param)
    for i, token in enumerate(out):
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
            raise APIError(f"token ids must be integers in [0, {vocab_size}); position {i} is "
                           f"{token!r}", param)
    return out
