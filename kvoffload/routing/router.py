"""``Router``: the backends, their KV events and costs, and the routing decision.

Backends are discovered from their ``/kv_event_sources`` (kvoffload's and vLLM's servers answer
it; a wildcard or ``0.0.0.0`` host is the backend's own), or given explicitly. A backend that
fails its health check (``failures`` in a row) or a request's connection is out of rotation and
its index entries are dropped; when it answers again it rejoins and its events are replayed.
Each decision tokenizes the prompt as the backends do, asks the index what every healthy
backend holds of it, and lets the policy choose; its cost is recorded (:attr:`decision_us`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from kvoffload.routing.connections import Connections
from kvoffload.routing.costs import BackendCosts, parse_metrics, share_compute_cost
from kvoffload.routing.follower import EventFollower
from kvoffload.routing.index import Match, PrefixIndex
from kvoffload.routing.keys import token_bytes
from kvoffload.routing.policies import BackendLoad, Policy, choose, prefill_s
from kvoffload.serving.errors import APIError
from kvoffload.serving.guard import ApiKey
from kvoffload.serving.prompts import PromptTokenizer, chat_messages
from kvoffload.serving.request_body import check_token_ids

__all__ = ["Backend", "BackendSpec", "Ranking", "Router", "Ticket"]

logger = logging.getLogger(__name__)


@dataclass
class BackendSpec:
    """A backend's URL and, optionally, its KV event endpoints and shared-tier group (else
    discovered from its ``/kv_event_sources``)."""

    url: str
    events: str | None = None
    replay: str | None = None
    topic: str | None = None
    remote_group: str | None = None

    @classmethod
    def parse(cls, text: str) -> BackendSpec:
        """``URL[,events=tcp://...][,replay=tcp://...][,topic=T][,remote_group=G]``."""
        url, *options = text.split(",")
        spec = cls(url.rstrip("/"))
        for option in options:
            key, sep, value = option.partition("=")
            if not sep or key not in ("events", "replay", "topic", "remote_group"):
                raise ValueError(f"unknown backend option {option!r} in {text!r}")
            setattr(spec, key, value)
        if not spec.url.startswith(("http://", "https://")):
            raise ValueError(f"a backend is an http(s) URL, got {url!r}")
        return spec


@dataclass
class Backend:
    spec: BackendSpec
    costs: BackendCosts
    load: BackendLoad = field(default_factory=BackendLoad)
    healthy: bool = False
    index_id: int | None = None
    follower: EventFollower | None = None
    failures: int = 0
    requests: int = 0
    #: set when it leaves the rotation: requests waiting for its first byte go elsewhere
    lost: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def url(self) -> str:
        return self.spec.url


class Ticket:
    """One routed request's share of its backend's load: prefill until its first token, then
    decode, then nothing. Each step happens once."""

    def __init__(self, backend: Backend, prefill_s: float, blocks: int) -> None:
        self.backend = backend
        self.prefill_s = prefill_s
        self.blocks = blocks
        self.state = "prefill"
        load = backend.load
        load.in_flight += 1
        load.start_prefill(id(self), prefill_s, blocks, time.monotonic())

    def first_token(self) -> None:
        if self.state == "prefill":
            load = self.backend.load
            load.end_prefill(id(self), self.blocks, time.monotonic())
            load.decode_blocks += self.blocks
            self.state = "decode"

    def done(self) -> None:
        if self.state == "done":
            return
        self.first_token()
        load = self.backend.load
        load.decode_blocks -= self.blocks
        load.in_flight -= 1
        self.state = "done"


class Router:
    """Routes requests over ``specs`` with ``policy``; :meth:`start` and :meth:`stop` run on the
    server's event loop."""

    def __init__(
        self,
        specs: list[BackendSpec],
        policy: Policy,
        tokenizer: PromptTokenizer,
        block_size: int = 16,
        health_interval_s: float = 1.0,
        failures: int = 2,
        metrics_interval_s: float = 1.0,
        backend_api_key: ApiKey | None = None,
    ) -> None:
        self.policy = policy
        self.backend_api_key = backend_api_key
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.index = PrefixIndex(block_size)
        self.lock = threading.Lock()
        self.backends = [Backend(s, BackendCosts(block_size)) for s in specs]
        self.health_interval_s = health_interval_s
        self.max_failures = failures
        self.metrics_interval_s = metrics_interval_s
        self.decision_us: deque[float] = deque(maxlen=100_000)
        # matched_blocks: cached blocks of the prompts on the backends chosen; best_matched_
        # blocks: on the backends holding most of them (what a policy trades for load)
        self.counters = dict.fromkeys(("requests", "retries", "no_backend", "backend_lost",
                                       "matched_blocks", "best_matched_blocks"), 0)
        self.connections: Connections | None = None
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def session(self) -> aiohttp.ClientSession | None:
        """The pooled HTTP session (health checks, metrics, model lists); ``None`` before
        :meth:`start`."""
        return None if self.connections is None else self.connections.pooled

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        key = self.backend_api_key
        self.connections = Connections(aiohttp.ClientTimeout(total=None, sock_connect=5),
                                       key.header() if key is not None else None)
        await asyncio.gather(*(self._check(b) for b in self.backends))
        self._tasks = [
            asyncio.create_task(self._every(self.health_interval_s, self._check)),
            asyncio.create_task(self._every(self.metrics_interval_s, self._scrape)),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for backend in self.backends:
            self._leave(backend)
        if self.connections is not None:
            await self.connections.close()

    async def _every(self, interval: float, action: Any) -> None:
        while True:
            await asyncio.sleep(interval)
            await asyncio.gather(*(action(b) for b in self.backends), return_exceptions=True)

    async def _check(self, backend: Backend) -> None:
        assert self.session is not None
        try:
            async with self.session.get(f"{backend.url}/health", timeout=_short()) as resp:
                ok = resp.status == 200
        except (TimeoutError, aiohttp.ClientError, OSError):
            ok = False
        if ok:
            backend.failures = 0
            if not backend.healthy:
                await self._join(backend)
        else:
            backend.failures += 1
            if backend.healthy and backend.failures >= self.max_failures:
                self.mark_dead(backend, "health check failed")

    async def _scrape(self, backend: Backend) -> None:
        if not backend.healthy or self.session is None:
            return
        try:
            async with self.session.get(f"{backend.url}/metrics", timeout=_short(5)) as resp:
                text = await resp.text()
        except (TimeoutError, aiohttp.ClientError, OSError):
            return
        backend.costs.update(await asyncio.to_thread(parse_metrics, text))
        share_compute_cost([b.costs for b in self.backends])

    async def _join(self, backend: Backend) -> None:
        """Back in rotation: a fresh index entry, its events followed from the start."""
        spec = backend.spec
        events, replay, topic, group = spec.events, spec.replay, spec.topic, spec.remote_group
        if events is None:
            source = await self._event_source(backend)
            if source:
                host = urlsplit(backend.url).hostname or "127.0.0.1"
                events = _at_host(source.get("endpoint"), host)
                replay = _at_host(source.get("replay_endpoint"), host)
                topic = source.get("topic", "") if topic is None else topic
                group = source.get("remote_tier") if group is None else group
                size = source.get("block_size")
                if isinstance(size, int) and size != self.block_size:
                    logger.warning("%s: block size %s, router keys %s-token blocks", backend.url,
                                   size, self.block_size)
        with self.lock:
            backend.index_id = self.index.add_instance(group)
        if events:
            iid = backend.index_id
            backend.follower = EventFollower(
                backend.url, events, replay, topic or "",
                apply=lambda evs, iid=iid: self._apply(iid, evs),
                reset=lambda iid=iid: self._clear(iid),
            ).start()
        backend.lost = asyncio.Event()
        backend.healthy = True
        logger.warning("backend %s in rotation", backend.url)

    async def _event_source(self, backend: Backend) -> dict[str, Any] | None:
        assert self.session is not None
        try:
            async with self.session.get(f"{backend.url}/kv_event_sources", timeout=_short()) as r:
                sources = await r.json() if r.status == 200 else {}
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError):
            return None
        if not isinstance(sources, Mapping) or not sources:
            return None
        first = sources.get("0", next(iter(sources.values())))
        return first if isinstance(first, Mapping) else None

    def _apply(self, iid: int, events: list[Any]) -> None:
        with self.lock:
            self.index.apply(iid, events)

    def _clear(self, iid: int) -> None:
        with self.lock:
            self.index.clear(iid)

    def mark_dead(self, backend: Backend, why: str) -> None:
        """Out of rotation, its index entries dropped; requests still waiting for its first byte
        are sent elsewhere (:attr:`Backend.lost`)."""
        if backend.healthy:
            logger.warning("backend %s out of rotation: %s", backend.url, why)
            self.counters["backend_lost"] += 1
        backend.healthy = False
        backend.lost.set()
        self._leave(backend)

    def _leave(self, backend: Backend) -> None:
        if backend.follower is not None:
            backend.follower.stop()
            backend.follower = None
        if backend.index_id is not None:
            with self.lock:
                self.index.remove_instance(backend.index_id)
            backend.index_id = None

    # -- decisions ---------------------------------------------------------------------------

    def prompt_ids(self, path: str, body: Mapping[str, Any]) -> list[int] | None:
        """The prompt's token ids as the backends will see them (``None``: not a prompt the
        router understands; the backend will answer the error). Token ids out of range
        (:func:`~kvoffload.serving.request_body.check_token_ids`) raise :class:`APIError`."""
        try:
            if path.endswith("chat/completions"):
                messages = body.get("messages")
                if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
                    return None
                return self.tokenizer.encode_chat(chat_messages(messages))
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
                prompt = prompt[0]
            if isinstance(prompt, str):
                return self.tokenizer.encode(prompt)
            if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                return check_token_ids(prompt, "prompt")  # ids the keys can pack, else 400
        except APIError:
            raise
        except Exception:  # a template error or odd content: the backend answers it
            return None
        return None

    def rank(self, token_ids: list[int] | None, session_key: str | None) -> Ranking:
        """Healthy backends, the policy's choice first, with what each holds of the prompt.
        Allocation-light: a handful of small objects per decision, none per block (a decision
        that allocates little rarely trips a garbage collection)."""
        healthy = [b for b in self.backends if b.healthy and b.index_id is not None]
        if not healthy:
            return Ranking(healthy, {}, 0)
        data = token_bytes(token_ids) if token_ids else b""
        matches: dict[int, Match] = {}
        if token_ids and self.policy.needs_match:
            ids = [b.index_id for b in healthy]
            with self.lock:
                matches = self.index.match(data, ids)  # type: ignore[arg-type]
        best = choose(self.policy, healthy, matches, session_key)
        if matches:
            chosen = matches.get(healthy[best].index_id)  # type: ignore[arg-type]
            self.counters["matched_blocks"] += chosen.cached if chosen is not None else 0
            self.counters["best_matched_blocks"] += max(m.cached for m in matches.values())
        healthy[0], healthy[best] = healthy[best], healthy[0]
        return Ranking(healthy, matches, len(data) // (self.block_size * 4))


@dataclass(slots=True)
class Ranking:
    """A decision: ``backends`` healthy, best first (the rest: retries, in order); ``matches``
    what each holds of the prompt (by index id; none when the policy does not look);
    ``total`` the prompt's full blocks."""

    backends: list[Backend]
    matches: dict[int, Match]
    total: int

    def prefill_s(self, backend: Backend) -> float:
        """The request's predicted prefill seconds on ``backend`` (its queue aside)."""
        m = self.matches.get(backend.index_id) if backend.index_id is not None else None
        return prefill_s(backend.costs, m if m is not None else Match(total=self.total))


def _short(seconds: float = 2.0) -> aiohttp.ClientTimeout:
    return aiohttp.ClientTimeout(total=seconds)


def _at_host(endpoint: Any, host: str) -> str | None:
    if not isinstance(endpoint, str) or not endpoint:
        return None
    for wildcard in ("://*:", "://0.0.0.0:", "://[::]:"):
        endpoint = endpoint.replace(wildcard, f"://{host}:")
    return endpoint
