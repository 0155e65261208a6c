"""Operator endpoints of ``kvoffload route``: the ``/admin`` controls of its backends, fleet-wide.

The same paths and bodies as a server's (:mod:`kvoffload.serving.admin`), plus an optional
``backends`` field (a list of backend URLs: only those; default every backend in rotation). Each
call is forwarded to every chosen backend at once (with the backends' API key) and the answers
come back per backend, in the router's backend order::

    {"backends": [{"url": ..., "answer": {...}} | {"url": ..., "status": 409, "error": "..."}]}

``/admin/lookup`` adds, per backend, what the router's prefix index holds of the prompt
(``index_tokens`` per tier, in the order the engine would use them) and the router's predicted
time to first token there (``predicted_ttft_s``: the backend's queue plus the prompt's prefill at
its measured costs), and names the backend the lowest prediction points at (``best``).

A call that fails on some backend answers with the failure's status (400 when every failure was
bad input, else the highest) and an error naming each backend that failed, the per-backend
answers included; a call that no backend could take is 503.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from typing import Any

import aiohttp
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from kvoffload.routing.connections import error_text
from kvoffload.routing.policies import prefill_s
from kvoffload.routing.prefix_index import Match
from kvoffload.routing.prefix_keys import token_bytes
from kvoffload.routing.router import Backend, Router
from kvoffload.serving.errors import APIError, error_body
from kvoffload.serving.request_body import parse_json_object

__all__ = ["admin_router"]

_COMMANDS = ("lookup", "pin", "unpin", "clear", "warm")


def admin_router(router: Router) -> APIRouter:
    """The ``/admin`` endpoints of ``router`` (see the module docstring)."""
    api = APIRouter(prefix="/admin")

    def fan_out(command: str) -> Any:
        async def endpoint(raw: Request) -> JSONResponse:
            body = parse_json_object(await raw.body())
            backends = _chosen(router, body.pop("backends", None))
            extra: dict[int, dict[str, Any]] = {}
            if command == "lookup":
                extra = await _predictions(router, backends, body)
            answers = await asyncio.gather(
                *(_call(router, b, "POST", f"/admin/{command}", body) for b in backends)
            )
            for i, entry in extra.items():
                answers[i].update(entry)
            return _answer(answers, best=_best(answers) if command == "lookup" else None)

        endpoint.__name__ = f"admin_{command}"
        return endpoint

    for command in _COMMANDS:
        api.add_api_route(f"/{command}", fan_out(command), methods=["POST"],
                          response_model=None)

    @api.get("/pins", response_model=None)
    async def pins(backends: str | None = None) -> JSONResponse:
        chosen = _chosen(router, backends.split(",") if backends else None)
        return _answer(list(await asyncio.gather(
            *(_call(router, b, "GET", "/admin/pins", None) for b in chosen))))

    return api


def _chosen(router: Router, urls: Any) -> list[Backend]:
    """The backends named (each must be one of the router's), else those in rotation."""
    if urls is None:
        chosen = [b for b in router.backends if b.healthy]
    else:
        if not isinstance(urls, list) or not all(isinstance(u, str) for u in urls) or not urls:
            raise APIError("backends must be a non-empty list of backend URLs", "backends")
        known = {b.url: b for b in router.backends}
        unknown = [u for u in urls if u.rstrip("/") not in known]
        if unknown:
            raise APIError(f"unknown backend {unknown[0]!r}; this router has {sorted(known)}",
                           "backends")
        chosen = [known[u.rstrip("/")] for u in urls]
    if not chosen:
        raise APIError("no backend is available", status=503)
    return chosen


async def _predictions(
    router: Router, backends: Sequence[Backend], body: dict[str, Any]
) -> dict[int, dict[str, Any]]:
    """Per backend (by position): what the index holds of the prompt and the predicted TTFT."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    ids = await asyncio.to_thread(router.prompt_ids, path, body)
    if not ids:
        raise APIError("give a non-empty 'prompt' (text or token ids) or 'messages'", "prompt")
    data = token_bytes(ids)
    indexed = [b.index_id for b in backends if b.index_id is not None]
    matches = router.index.match(data, indexed) if indexed else {}
    total = len(data) // (router.block_size * 4)
    now = time.monotonic()
    out: dict[int, dict[str, Any]] = {}
    bs = router.block_size
    for i, backend in enumerate(backends):
        m = matches.get(backend.index_id) if backend.index_id is not None else None
        m = m if m is not None else Match(total=total)
        out[i] = {
            "predicted_ttft_s": backend.load.queued_s(now) + prefill_s(backend.costs, m),
            "index_tokens": {"device": m.device * bs, "host": m.host * bs, "disk": m.disk * bs,
                             "remote": m.remote * bs},
            "indexed": backend.index_id is not None,
        }
    return out


async def _call(
    router: Router, backend: Backend, method: str, path: str, body: dict[str, Any] | None
) -> dict[str, Any]:
    """``backend``'s answer to one control: ``{"url", "answer"}`` or ``{"url", "status",
    "error"}`` (an unreachable backend is 502)."""
    url = f"{backend.url}{path}"
    try:
        if body is None:
            async with router.session.get(url) as resp:
                status, payload = resp.status, await resp.read()
        else:
            resp = await router.connections.post(
                url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
            async with resp:
                status, payload = resp.status, await resp.read()
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        return {"url": backend.url, "status": 502, "error": error_text(exc)}
    try:
        decoded = json.loads(payload)
    except ValueError:
        return {"url": backend.url, "status": 502, "error": "the backend's answer is not JSON"}
    if status == 200:
        return {"url": backend.url, "answer": decoded}
    error = decoded.get("error", {}) if isinstance(decoded, dict) else {}
    return {"url": backend.url, "status": status,
            "error": str(error.get("message", f"HTTP {status}")), "param": error.get("param")}


def _best(answers: Sequence[dict[str, Any]]) -> str | None:
    predicted = [(a["predicted_ttft_s"], a["url"]) for a in answers
                 if a.get("indexed") and "predicted_ttft_s" in a]
    return min(predicted)[1] if predicted else None


def _answer(answers: list[dict[str, Any]], best: str | None = None) -> JSONResponse:
    body: dict[str, Any] = {"backends": answers}
    if best is not None:
        body["best"] = best
    failed = [a for a in answers if "error" in a]
    if not failed:
        return JSONResponse(body)
    statuses = {a["status"] for a in failed}
    status = 400 if statuses == {400} else max(statuses)
    message = f"{len(failed)} of {len(answers)} backends failed: " + "; ".join(
        f"{a['url']}: {a['status']}: {a['error']}" for a in failed)
    params = {a.get("param") for a in failed} - {None}
    return JSONResponse(
        {**error_body(message, status, params.pop() if len(params) == 1 else None), **body},
        status_code=status,
    )
