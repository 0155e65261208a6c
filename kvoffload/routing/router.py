"""``Router``: the backends, their KV events and costs, and the routing decision.

Backends are discovered from their ``/kv_event_sources`` (kvoffload's and vLLM's servers answer
it; a wildcard or ``0.0.0.0`` host is the backend's own), or given explicitly. A backend that
fails its health check (``failures`` in a row) or a request's connection is out of rotation and
its index entries are dropped; when it answers again it rejoins and its events are replayed.
Each decision tokenizes the prompt as the backends do, asks the index what every healthy
backend holds of it, and lets the policy rank them; its cost is recorded (:attr:`decision_us`).

Threads: the index is touched only on the router's event loop. Each backend's
:class:`~kvoffload.routing.follower.EventFollower` receives and decodes its events on a thread
of its own and hands each batch to the loop, so nothing on the loop waits for a follower (no
lock, no join): a relayed stream never stalls behind a batch. Background work (health checks,
scrapes, event batches) that fails is logged once per task and cause, and counted
(:attr:`Router.failures`).

Lifecycle: ``CREATED`` -> :meth:`~Router.start` -> ``RUNNING`` -> :meth:`~Router.stop` ->
``STOPPED`` (also from ``CREATED``; stopping twice is a no-op); any other move, and using the
connections outside ``RUNNING``, raises :class:`~kvoffload.errors.ContractError`.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from kvoffload.errors import ContractError
from kvoffload.events.messages import KVCacheEvent
from kvoffload.routing.connections import Connections
from kvoffload.routing.costs import BackendCosts, parse_metrics, share_compute_cost
from kvoffload.routing.follower import EventFollower
from kvoffload.routing.policies import BackendLoad, Policy, prefill_s
from kvoffload.routing.prefix_index import Match, PrefixIndex
from kvoffload.routing.prefix_keys import token_bytes
from kvoffload.serving.errors import APIError
from kvoffload.serving.guard import ApiKey
from kvoffload.serving.prompts import PromptTokenizer, chat_messages
from kvoffload.serving.request_body import check_token_ids

__all__ = ["Backend", "BackendSpec", "Ranking", "Router", "RouterState", "Ticket"]

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


class _Step(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    DONE = "done"


class Ticket:
    """One routed request's share of its backend's load: prefill until its first token, then
    decode, then nothing (PREFILL -> DECODE -> DONE). Each step happens once; a step asked for
    again, or out of order, is a no-op, so every path may end a ticket."""

    def __init__(self, backend: Backend, prefill_s: float, blocks: int) -> None:
        self.backend = backend
        self.prefill_s = prefill_s
        self.blocks = blocks
        self.step = _Step.PREFILL
        load = backend.load
        load.in_flight += 1
        load.start_prefill(id(self), prefill_s, blocks, time.monotonic())

    def first_token(self) -> None:
        if self.step is _Step.PREFILL:
            load = self.backend.load
            load.end_prefill(id(self), self.blocks, time.monotonic())
            load.decode_blocks += self.blocks
            self.step = _Step.DECODE

    def done(self) -> None:
        if self.step is _Step.DONE:
            return
        self.first_token()
        load = self.backend.load
        load.decode_blocks -= self.blocks
        load.in_flight -= 1
        self.step = _Step.DONE


class RouterState(enum.Enum):
    """Where a router is in its life: CREATED -> RUNNING -> STOPPED."""

    CREATED = "created"
    RUNNING = "running"
    STOPPED = "stopped"


_MOVES = {
    RouterState.CREATED: {RouterState.RUNNING, RouterState.STOPPED},
    RouterState.RUNNING: {RouterState.STOPPED},
    RouterState.STOPPED: set(),
}


class Router:
    """Routes requests over ``specs`` with ``policy``. Every method but :meth:`prompt_ids`
    (which reads only the tokenizer, and runs on a worker thread) runs on the server's event
    loop: the index, the backends' loads and states are that thread's alone."""

    def __init__(
        self,
        specs: list[BackendSpec],
        policy: Policy,
        tokenizer: PromptTokenizer,
        block_size: int = 16,
        health_interval_s: float = 1.0,
        failures: int = 2,
        metrics_interval_s: float = 1.0,
        stream_idle_timeout_s: float = 60.0,
        backend_api_key: ApiKey | None = None,
    ) -> None:
        self.policy = policy
        self.backend_api_key = backend_api_key
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.index = PrefixIndex(block_size)
        self.backends = [Backend(s, BackendCosts(block_size)) for s in specs]
        self.health_interval_s = health_interval_s
        self.max_failures = failures
        self.metrics_interval_s = metrics_interval_s
        #: the longest a relayed stream waits for its backend's next chunk
        self.stream_idle_timeout_s = stream_idle_timeout_s
        self.decision_us: deque[float] = deque(maxlen=100_000)
        # matched_blocks: cached blocks of the prompts on the backends chosen; best_matched_
        # blocks: on the backends holding most of them (what a policy trades for load)
        # bad_answers: requests whose backend answered malformed HTTP (502)
        self.counters = dict.fromkeys(("requests", "retries", "no_backend", "backend_lost",
                                       "bad_answers", "matched_blocks", "best_matched_blocks"), 0)
        #: background failures by (task, cause: the exception's type); each logged once
        self.failures: Counter[tuple[str, str]] = Counter()
        #: (backend URL, what) of the warnings given: each once per router
        self._warned: set[tuple[str, str]] = set()
        self._state = RouterState.CREATED
        self._connections: Connections | None = None
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def state(self) -> RouterState:
        return self._state

    @property
    def connections(self) -> Connections:
        """The HTTP connections to the backends (only while ``RUNNING``)."""
        if self._state is not RouterState.RUNNING or self._connections is None:
            raise ContractError(f"the router is {self._state.value}: it has no connections")
        return self._connections

    @property
    def session(self) -> aiohttp.ClientSession:
        """The pooled HTTP session (health checks, metrics, model lists); only while
        ``RUNNING``."""
        return self.connections.pooled

    @property
    def stale_retries(self) -> int:
        """POSTs sent a second time after a kept-alive connection closed under them."""
        return 0 if self._connections is None else self._connections.stale_retries

    def _move(self, to: RouterState) -> None:
        if to not in _MOVES[self._state]:
            raise ContractError(f"the router is {self._state.value}: cannot become {to.value}")
        self._state = to

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        self._move(RouterState.RUNNING)
        key = self.backend_api_key
        self._connections = Connections(aiohttp.ClientTimeout(total=None, sock_connect=5),
                                        key.header() if key is not None else None)
        await asyncio.gather(*(self._check(b) for b in self.backends))
        for backend in self.backends:
            if not backend.healthy:
                self._warn_once(backend, "unreachable", "backend %s does not answer /health: "
                                "no request goes to it until it does")
        self._tasks = [
            asyncio.create_task(self._every("health", self.health_interval_s, self._check)),
            asyncio.create_task(self._every("scrape", self.metrics_interval_s, self._scrape)),
        ]

    async def stop(self) -> None:
        """Stop checking, following and connecting. Idempotent."""
        if self._state is RouterState.STOPPED:
            return
        self._move(RouterState.STOPPED)
        for task in self._tasks:
            task.cancel()
        for backend in self.backends:
            self._leave(backend)
        if self._connections is not None:
            await self._connections.close()

    async def _every(
        self, task: str, interval: float, action: Callable[[Backend], Awaitable[None]]
    ) -> None:
        while True:
            await asyncio.sleep(interval)
            results = await asyncio.gather(*(action(b) for b in self.backends),
                                           return_exceptions=True)
            for backend, result in zip(self.backends, results, strict=True):
                if isinstance(result, Exception):
                    self.failed(task, backend, result)
                elif isinstance(result, BaseException):  # cancelled: the router stops
                    raise result

    def _warn_once(self, backend: Backend, what: str, text: str) -> None:
        """Log ``text`` (``%s``: the backend's URL) the first time ``what`` is found of
        ``backend``."""
        if (backend.url, what) not in self._warned:
            self._warned.add((backend.url, what))
            logger.warning(text, backend.url)

    def failed(self, task: str, backend: Backend, exc: BaseException) -> None:
        """Count a background failure of ``task`` for ``backend``; the first of each cause is
        logged (with its traceback), the rest only counted."""
        cause = (task, type(exc).__name__)
        self.failures[cause] += 1
        if self.failures[cause] == 1:
            logger.error("%s of %s failed: %r (logged once; counted in /metrics as "
                         "kvoffload_route_background_failures)", task, backend.url, exc,
                         exc_info=exc)

    async def _check(self, backend: Backend) -> None:
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
        if not backend.healthy:
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
        if self._state is not RouterState.RUNNING:  # stopped while we asked
            return
        iid = self.index.add_instance(group)
        backend.index_id = iid
        if events:
            backend.follower = EventFollower(
                backend.url, events, replay, topic or "",
                apply=lambda evs: self._apply_of(backend, iid, evs),
                reset=lambda: self._reset_of(backend, iid),
                loop=asyncio.get_running_loop(),
            ).start()
        elif self.policy.needs_match:
            self._warn_once(backend, "no events", f"backend %s publishes no KV events (none at "
                            f"its /kv_event_sources, none given in --backend): {self.policy.name} "
                            "cannot see what it caches")
        backend.lost = asyncio.Event()
        backend.healthy = True
        logger.warning("backend %s in rotation", backend.url)

    async def _event_source(self, backend: Backend) -> Mapping[str, Any] | None:
        try:
            async with self.session.get(f"{backend.url}/kv_event_sources", timeout=_short()) as r:
                sources = await r.json() if r.status == 200 else {}
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError):
            return None
        if not isinstance(sources, Mapping) or not sources:
            return None
        first = sources.get("0", next(iter(sources.values())))
        return first if isinstance(first, Mapping) else None

    def _apply(self, iid: int, events: list[KVCacheEvent]) -> None:
        self.index.apply(iid, events)

    def _apply_of(self, backend: Backend, iid: int, events: list[KVCacheEvent]) -> None:
        """A batch of ``backend``'s events, on the loop; a batch the index cannot apply is
        counted (:meth:`failed`) and the follower goes on with the next."""
        try:
            self._apply(iid, events)
        except Exception as exc:
            self.failed("events", backend, exc)

    def _reset_of(self, backend: Backend, iid: int) -> None:
        """``backend``'s entries dropped before its events are replayed afresh, on the loop."""
        try:
            self.index.clear(iid)
        except Exception as exc:
            self.failed("events", backend, exc)

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
            self.index.remove_instance(backend.index_id)
            backend.index_id = None

    # -- decisions ---------------------------------------------------------------------------

    def prompt_ids(self, path: str, body: Mapping[str, Any]) -> list[int] | None:
        """The prompt's token ids as the backends will see them (``None``: not a prompt the
        router understands; the backend will answer the error). A request of several prompts
        goes to one backend, so it is placed by its first prompt's. Token ids out of range
        (:func:`~kvoffload.serving.request_body.check_token_ids`) raise :class:`APIError`."""
        try:
            if path.endswith("chat/completions"):
                messages = body.get("messages")
                if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
                    return None
                return self.tokenizer.encode_chat(chat_messages(messages))
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
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

    def holdings(self, token_ids: list[int]) -> list[tuple[Backend, Match]]:
        """What each healthy backend holds of the prompt ``token_ids``, as the index knows it
        (the :class:`Match` a ``kv_aware`` decision weighs), in ``--backend`` order."""
        healthy = [b for b in self.backends if b.healthy and b.index_id is not None]
        ids = [b.index_id for b in healthy if b.index_id is not None]
        matches = self.index.match(token_bytes(token_ids), ids)
        return [(b, matches[i]) for b, i in zip(healthy, ids, strict=True)]

    def rank(self, token_ids: list[int] | None, session_key: str | None) -> Ranking:
        """Healthy backends in the policy's order (its choice first, then the retries, next-best
        first), with what each holds of the prompt. Allocation-light: a handful of small
        objects per decision, none per block (a decision that allocates little rarely trips a
        garbage collection)."""
        healthy: list[Backend] = []
        ids: list[int] = []
        for b in self.backends:
            if b.healthy and b.index_id is not None:
                healthy.append(b)
                ids.append(b.index_id)
        if not healthy:
            return Ranking(healthy, {}, 0)
        data = token_bytes(token_ids) if token_ids else b""
        matches: dict[int, Match] = {}
        if token_ids and self.policy.needs_match:
            matches = self.index.match(data, ids)
        order = self.policy.order(healthy, matches, session_key)
        if matches:
            chosen = matches.get(ids[order[0]])
            self.counters["matched_blocks"] += chosen.cached if chosen is not None else 0
            self.counters["best_matched_blocks"] += max(m.cached for m in matches.values())
        return Ranking([healthy[i] for i in order], matches, len(data) // (self.block_size * 4))


@dataclass(slots=True)
class Ranking:
    """A decision: ``backends`` healthy, best first (the rest: retries, next-best first); ``matches``
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
