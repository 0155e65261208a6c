"""Operator endpoints of ``kvoffload serve``: ``/admin/{lookup,pin,unpin,clear,warm,pins}``.

Behind the front door like every path but ``/health`` and ``/metrics`` (the API key when one is
set; the body cap). Bodies are JSON objects; a prompt is ``prompt`` (text, tokenized as the
completions endpoint does, or token ids) or ``messages`` (chat, rendered with the model's chat
template as the chat endpoint does). Each control runs on the engine thread between two steps
(:meth:`~kvoffload.serving.loop.EngineLoop.call`); warming is one of the server's requests
(prefill only, one token), so it is batched with the traffic and never blocks it.

Answers: 200 with a JSON object; 400 for bad input (unknown tier, empty prompt, negative TTL:
``param`` names the field); 409 when a pin is refused (over a tier's quota, or its blocks could
not be stored); 503 when the engine cannot serve. ``docs/admin.md`` lists every field.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvoffload.engine import Engine
from kvoffload.engine.admin import EngineAdmin
from kvoffload.managers.pins import NotCached, PinQuotaExceeded
from kvoffload.serving.errors import APIError
from kvoffload.serving.loop import EngineLoop, Unavailable
from kvoffload.serving.prompts import PromptTokenizer, chat_messages
from kvoffload.serving.request_body import check_token_ids, parse_json_object

__all__ = ["AdminMetrics", "admin_registry", "admin_router"]

T = TypeVar("T")

#: How long a pin or warm waits for its prefill's stores to land in the tiers.
_STORE_WAIT_S = 60.0
_FIELDS = {
    "lookup": {"prompt", "messages"},
    "pin": {"prompt", "messages", "tiers", "owner", "ttl_s"},
    "unpin": {"prompt", "messages", "owner", "id"},
    "clear": {"tiers", "model", "unpin"},
    "warm": {"prompt", "messages", "tiers"},
}


def admin_router(
    loop: EngineLoop, tokenizer: PromptTokenizer, registries: list[CollectorRegistry]
) -> APIRouter:
    """The ``/admin`` endpoints over ``loop``'s engine (prompts tokenized by ``tokenizer``);
    their metrics join ``registries`` (served on ``/metrics``)."""
    registries.append(admin_registry(loop.engine))
    router = APIRouter(prefix="/admin")
    engine = loop.engine
    vocab = engine.model_config.vocab_size

    async def on_engine(fn: Callable[[EngineAdmin], T]) -> T:
        try:
            return await asyncio.wrap_future(loop.call(lambda: fn(engine.admin)))
        except Unavailable as exc:
            raise APIError(exc.message, status=503) from None
        except PinQuotaExceeded as exc:
            raise APIError(str(exc), "tiers", status=409, code="pin_quota_exceeded") from None
        except OSError as exc:  # a shared tier's server (a clear of Redis) could not be reached
            raise APIError(f"a tier's server did not answer: {type(exc).__name__}", status=503,
                           code="tier_unavailable") from None

    async def body_of(raw: Request, command: str) -> dict[str, Any]:
        body = parse_json_object(await raw.body())
        unknown = sorted(set(body) - _FIELDS[command])
        if unknown:
            raise APIError(f"unknown field {unknown[0]!r}; {command} takes "
                           f"{sorted(_FIELDS[command])}", unknown[0])
        return body

    def prompt_of(body: dict[str, Any], required: bool = True) -> list[int] | None:
        prompt, messages = body.get("prompt"), body.get("messages")
        if messages is not None:
            if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) for m in messages
            ):
                raise APIError("messages must be a non-empty list of message objects", "messages")
            return tokenizer.encode_chat(chat_messages(messages))
        if isinstance(prompt, str):
            if not prompt:
                raise APIError("the prompt must not be empty", "prompt")
            return tokenizer.encode(prompt)
        if isinstance(prompt, list):
            return check_token_ids(prompt, "prompt", vocab)
        if prompt is None and not required:
            return None
        raise APIError("give a 'prompt' (text or token ids) or 'messages'", "prompt")

    async def warm(ids: list[int], tiers: Any, wait_for: Any = None) -> None:
        """Run the prefill-only request, then wait until its blocks are in the tiers (or no
        transfer of the engine is left that could bring them: a tier too small for them)."""
        token_ids, sampling, params = await on_engine(lambda a: a.warm_request(ids, tiers))
        stream = loop.add(f"admin-warm-{uuid.uuid4().hex}", token_ids, sampling, params or None)
        async for delta in stream:
            if delta.error is not None:
                if isinstance(delta.error, Unavailable):
                    raise APIError(delta.error.message, status=503)
                raise APIError.from_config_error(delta.error, "prompt")
        deadline = time.monotonic() + _STORE_WAIT_S
        wanted = tiers if wait_for is None else wait_for
        while not await on_engine(lambda a: a.warmed(ids, wanted) or not _stores_in_flight(a)):
            if time.monotonic() > deadline:
                raise APIError(f"the prompt's stores did not land within {_STORE_WAIT_S:.0f} s",
                               status=503)
            await asyncio.sleep(0.005)

    @router.post("/lookup")
    async def lookup(raw: Request) -> dict[str, Any]:
        body = await body_of(raw, "lookup")
        ids = await asyncio.to_thread(prompt_of, body)
        return await on_engine(lambda a: a.lookup(ids or []))

    @router.post("/pin")
    async def pin(raw: Request) -> dict[str, Any]:
        body = await body_of(raw, "pin")
        ids = await asyncio.to_thread(prompt_of, body) or []
        tiers, owner, ttl = body.get("tiers", ["host"]), body.get("owner", "operator"), body.get("ttl_s")

        def attempt(a: EngineAdmin) -> dict[str, Any] | None:
            try:
                return a.pin(ids, tiers, owner, ttl)
            except NotCached:
                return None

        answer = await on_engine(attempt)
        computed = answer is None
        if answer is None:  # not (all) cached: compute and store it, then pin
            await warm(ids, _store_tiers(tiers), tiers)
            try:
                answer = await on_engine(lambda a: a.pin(ids, tiers, owner, ttl))
            except NotCached as exc:
                raise APIError(f"pin refused: the prompt was computed but {exc}; the tier may "
                               "be too small or refusing stores", "tiers", status=409,
                               code="not_cached") from None
        return {**answer, "computed": computed}

    @router.post("/unpin")
    async def unpin(raw: Request) -> dict[str, Any]:
        body = await body_of(raw, "unpin")
        ids = await asyncio.to_thread(prompt_of, body, False)
        owner, pin_id = body.get("owner"), body.get("id")
        for name, value in (("owner", owner), ("id", pin_id)):
            if value is not None and not isinstance(value, str):
                raise APIError(f"{name} must be a string", name)
        return await on_engine(lambda a: a.unpin(ids, owner, pin_id))

    @router.post("/clear")
    async def clear(raw: Request) -> dict[str, Any]:
        body = await body_of(raw, "clear")
        unpin_too = body.get("unpin", False)
        if not isinstance(unpin_too, bool):
            raise APIError("unpin must be true or false", "unpin")
        answer, remote = await on_engine(
            lambda a: a.clear_local(body.get("tiers"), body.get("model"), unpin_too))
        if remote is None:
            return answer
        # The server's SCAN + UNLINK (seconds for a large namespace) runs off the engine
        # thread: steps go on meanwhile.
        try:
            keys = await asyncio.to_thread(remote.run)
        except OSError as exc:
            await on_engine(lambda a: a.finish_clear(answer, remote, None))
            raise APIError(f"a tier's server did not answer: {type(exc).__name__}", status=503,
                           code="tier_unavailable") from None
        return await on_engine(lambda a: a.finish_clear(answer, remote, keys))

    @router.post("/warm")
    async def warm_endpoint(raw: Request) -> dict[str, Any]:
        body = await body_of(raw, "warm")
        ids = await asyncio.to_thread(prompt_of, body) or []
        tiers = body.get("tiers")
        await on_engine(lambda a: a.warm_request(ids, tiers))  # checks the tiers first
        await warm(ids, tiers)
        return await on_engine(lambda a: a.lookup(ids))

    @router.get("/pins")
    async def pins() -> dict[str, Any]:
        return await on_engine(lambda a: a.pins())

    return router


def _store_tiers(tiers: Any) -> Any:
    """The tiers a pin's warm-up stores into: the pin's, or every tier for a host-only pin
    (stores always reach the host; a host pin needs nothing more)."""
    return None if tiers in (["host"], "host") else tiers


def _stores_in_flight(admin: EngineAdmin) -> bool:
    engine: Engine = admin.engine
    connector = engine.connector
    return connector is not None and (connector.has_pending_jobs() or bool(engine.scheduler.held))


class AdminMetrics(Collector):
    """``kvoffload_admin_*``: blocks removed by clears (per tier), pins and pinned blocks (per
    tier). Read at each scrape from the engine's admin (0 before its first use)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Iterable[Metric]:
        admin = self.engine._admin  # read-only; None until an operator used a control
        cleared = CounterMetricFamily(
            "kvoffload_admin_cleared_blocks", "Blocks removed by operator clears.", labels=["tier"]
        )
        pinned = GaugeMetricFamily(
            "kvoffload_admin_pinned_blocks", "Blocks held by operator pins.", labels=["tier"]
        )
        pins = GaugeMetricFamily("kvoffload_admin_pins", "Live operator pins.")
        counts = dict(admin.cleared) if admin is not None else {}
        tiers = admin.tiers if admin is not None else []
        for tier in tiers:
            cleared.add_metric([tier], counts.get(tier, 0))
        if admin is not None:
            table = admin.pin_table
            for tier in list(table.sites):
                pinned.add_metric([tier], table.pinned_blocks(tier))
            pins.add_metric([], len(table.pin_ids()))
        else:
            pins.add_metric([], 0)
        yield cleared
        yield pinned
        yield pins


def admin_registry(engine: Engine) -> CollectorRegistry:
    """A registry holding :class:`AdminMetrics` (served on ``/metrics`` with the others)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(AdminMetrics(engine))
    return registry
