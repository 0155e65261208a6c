"""``KVEventsConfig``: vLLM's ``--kv-events-config`` fields, plus two of ours.

Built from the JSON given on the command line (:meth:`KVEventsConfig.from_json`) or a dict
(:meth:`KVEventsConfig.from_dict`). Values are checked and normalised on construction; a bad
value or an unknown field raises :class:`~kvoffload.errors.ConfigError` naming the field. Like
vLLM (pydantic), booleans may be given as strings (``"True"``, ``"false"``, ``"1"``, ``"no"``...)
and integers as decimal strings.

Block hashes are published as vLLM publishes them: 64-bit ints unless
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`` (vLLM's variable, read as vLLM reads it) or
``int_block_hashes: false`` asks for raw bytes.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvoffload.errors import ConfigError
from kvoffload.events.protocol import binds_by_default

__all__ = ["INT_BLOCK_HASHES_ENV", "PUBLISHERS", "KVEventsConfig", "default_int_block_hashes"]

#: Publisher kinds: ``"zmq"`` (:class:`~kvoffload.events.publisher.ZmqEventPublisher`) and
#: ``"null"`` (publishes nothing).
PUBLISHERS = ("zmq", "null")
_SCHEMES = ("tcp://", "ipc://", "inproc://")
_TRUE = frozenset({"true", "1", "yes", "on"})
_FALSE = frozenset({"false", "0", "no", "off"})
#: vLLM's switch between int (its default) and bytes block hashes in KV events.
INT_BLOCK_HASHES_ENV = "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"


def default_int_block_hashes(env: Mapping[str, str] | None = None) -> bool:
    """Whether vLLM, run in ``env`` (default: this process's environment), publishes block hashes
    as ints: unless :data:`INT_BLOCK_HASHES_ENV` is an integer that is 0 (vLLM reads it with
    ``bool(int(value))``; a value that is not an integer raises ``ConfigError`` naming it)."""
    value = (os.environ if env is None else env).get(INT_BLOCK_HASHES_ENV, "1")
    try:
        return bool(int(value))
    except ValueError:
        raise ConfigError(INT_BLOCK_HASHES_ENV, f"expected 0 or 1, got {value!r}") from None


def _as_bool(field: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        text = value.strip().lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
    raise ConfigError(field, f"expected a boolean (true/false), got {value!r}")


def _as_int(field: str, value: Any, minimum: int) -> int:
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(field, f"expected an integer, got {value!r}")
    if value < minimum:
        raise ConfigError(field, f"must be >= {minimum}, got {value}")
    return value


def _as_endpoint(field: str, value: Any) -> str:
    if not isinstance(value, str) or not value.startswith(_SCHEMES) or value.endswith("//"):
        raise ConfigError(
            field, f"expected a ZMQ address (tcp://, ipc:// or inproc://), got {value!r}"
        )
    return value


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """Where and how KV cache events are published. Defaults are vLLM's, except ``endpoint``:
    loopback (events carry every prompt's token ids; vLLM's default binds every interface)."""

    #: Publish events at all.
    enable_kv_cache_events: bool = False
    #: ``"zmq"`` or ``"null"``; unset means ``"zmq"`` when events are enabled, else ``"null"``.
    publisher: str | None = None
    #: PUB address; bound or connected as ``bind`` says.
    endpoint: str = "tcp://127.0.0.1:5557"
    #: ROUTER address serving replays of the last ``buffer_steps`` batches (always bound).
    replay_endpoint: str | None = None
    #: Batches kept for replay.
    buffer_steps: int = 10_000
    #: ZMQ send high-water mark of the PUB socket, in messages (0: unlimited).
    hwm: int = 100_000
    #: Batches waiting for the sender thread; when full, the oldest is dropped and counted.
    max_queue_size: int = 100_000
    #: Topic frame of every message (subscribers filter by prefix).
    topic: str = ""
    #: Ours: write events as legacy positional arrays (pre-vLLM #42892 consumers).
    legacy_array_events: bool = False
    #: Ours: publish block hashes as 64-bit ints (true) or raw bytes (false); unset: as vLLM
    #: does (:func:`default_int_block_hashes`: ints unless VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0),
    #: the variable read only when events are enabled (as vLLM reads it only when it publishes;
    #: with events off, unset is ``True`` and a bad variable stops nothing).
    int_block_hashes: bool = None  # type: ignore[assignment]  # None: unset, resolved on construction
    #: Ours: bind ``endpoint`` (true) or connect to a subscriber that binds it (false); unset:
    #: bind a wildcard, loopback, ipc or inproc address, connect to any other (vLLM's rule, plus
    #: loopback; :func:`~kvoffload.events.protocol.binds_by_default`).
    bind: bool | None = None

    def __post_init__(self) -> None:
        put = object.__setattr__  # frozen: normalised values are set once, here
        enabled = _as_bool("enable_kv_cache_events", self.enable_kv_cache_events)
        put(self, "enable_kv_cache_events", enabled)
        publisher = self.publisher
        if publisher is None:
            publisher = "zmq" if enabled else "null"
        if publisher not in PUBLISHERS:
            raise ConfigError("publisher", f"expected one of {list(PUBLISHERS)}, got {publisher!r}")
        put(self, "publisher", publisher)
        put(self, "endpoint", _as_endpoint("endpoint", self.endpoint))
        if self.replay_endpoint is not None:
            put(self, "replay_endpoint", _as_endpoint("replay_endpoint", self.replay_endpoint))
        put(self, "buffer_steps", _as_int("buffer_steps", self.buffer_steps, 0))
        put(self, "hwm", _as_int("hwm", self.hwm, 0))
        put(self, "max_queue_size", _as_int("max_queue_size", self.max_queue_size, 1))
        if not isinstance(self.topic, str):
            raise ConfigError("topic", f"expected a string, got {self.topic!r}")
        put(self, "legacy_array_events", _as_bool("legacy_array_events", self.legacy_array_events))
        if self.int_block_hashes is None:
            put(self, "int_block_hashes", default_int_block_hashes() if enabled else True)
        else:
            put(self, "int_block_hashes", _as_bool("int_block_hashes", self.int_block_hashes))
        if self.bind is not None:
            put(self, "bind", _as_bool("bind", self.bind))

    @property
    def publisher_binds(self) -> bool:
        """Whether the publisher binds ``endpoint`` (else it connects): ``bind`` when set, else
        :func:`~kvoffload.events.protocol.binds_by_default`."""
        return binds_by_default(self.endpoint) if self.bind is None else self.bind

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> KVEventsConfig:
        """Build a config from ``values``; an unknown key raises ``ConfigError`` naming it."""
        if not isinstance(values, dict):
            raise ConfigError("kv_events_config", f"expected a JSON object, got {values!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        for name in values:
            if name not in known:
                raise ConfigError(str(name), f"unknown field; known fields: {sorted(known)}")
        return cls(**values)

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """Build a config from a JSON object, e.g. ``'{"enable_kv_cache_events": "True"}'``."""
        try:
            values = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError("kv_events_config", f"invalid JSON: {exc}") from exc
        return cls.from_dict(values)

    def to_json(self) -> str:
        """Return the JSON that :meth:`from_json` turns back into this config."""
        return json.dumps(dataclasses.asdict(self))
