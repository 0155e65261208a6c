"""The router's event loop never waits for a follower thread, and its lifecycles are states.

A real ZMQ publisher and a real HTTP backend on loopback (its ``/health`` only), the router run
in-process on one event loop: a batch of KV events is applied on that loop (the follower thread
only receives and decodes), so a follower busy with a batch never stalls a decision, a backend
leaving the rotation, or the streams the loop relays."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest
import uvicorn
from aiohttp import web

from kvoffload.errors import ContractError, KVOffloadError
from kvoffload.events import BlockStored, KVEventBatch
from kvoffload.events.publisher import ZmqEventPublisher
from kvoffload.routing import app as app_module
from kvoffload.routing.app import BackendLost, BackendUnavailable, build_app
from kvoffload.routing.follower import EventFollower, FollowerState
from kvoffload.routing.policies import create_policy
from kvoffload.routing.router import BackendSpec, Router, RouterState
from kvoffload.serving.prompts import PromptTokenizer

pytestmark = pytest.mark.timeout(60)

BS = 4
TOKENS = list(range(1, 2 * BS + 1))  # two full blocks


async def _health_server() -> tuple[web.AppRunner, str]:
    async def health(_: web.Request) -> web.Response:
        return web.Response()

    app = web.Application()
    app.router.add_get("/health", health)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


def _state(machine: Router | EventFollower) -> RouterState | FollowerState:
    """``machine.state`` as read now (an ``assert ... .state is`` narrows it for mypy, which
    then takes a later check, after a call that changed the state, as impossible)."""
    return machine.state


async def _until(check: Callable[[], bool], what: str) -> None:
    """Yield to the loop until ``check()`` (bounded: 20 s)."""
    deadline = time.monotonic() + 20
    while not check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)


def _with_router(body: Callable[[Router, ZmqEventPublisher], Awaitable[None]]) -> None:
    pub = ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", topic="kv")
    with pub:
        # published before the router subscribes: its follower fetches it by replay
        pub.publish(KVEventBatch(0.0, [BlockStored([11, 12], None, TOKENS, BS, None, "GPU",
                                                   None)]))

        async def run() -> None:
            runner, url = await _health_server()
            spec = BackendSpec(url, events=pub.endpoint, replay=pub.replay_endpoint, topic="kv")
            router = Router([spec], create_policy(), PromptTokenizer("tiny"), BS,
                            health_interval_s=3600, metrics_interval_s=3600)
            try:
                await router.start()
                await body(router, pub)
            finally:
                await router.stop()
                await runner.cleanup()

        asyncio.run(run())


def test_a_batch_is_applied_on_the_loop_so_a_busy_follower_never_stalls_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Applying a batch off the loop is what stalled it: the follower thread held the index's
    lock for a whole batch while ``rank`` (on the loop) waited for it, and taking a backend
    out of rotation joined that thread for up to 5 s. Here any application of a batch off the
    loop is held (until 5 s pass) and recorded. Before, the follower's thread applied it: the
    decision below waited for the lock, and the recorded thread was the follower's."""
    threads: list[threading.Thread] = []
    entered = threading.Event()

    async def body(router: Router, _: ZmqEventPublisher) -> None:
        loop_thread = threading.current_thread()
        index = router.index
        apply = index.apply

        def recorded(instance: int, events: Any) -> None:
            threads.append(threading.current_thread())
            if threading.current_thread() is not loop_thread:
                entered.set()
                threading.Event().wait(5)  # a follower thread busy inside its batch
            apply(instance, events)

        monkeypatch.setattr(index, "apply", recorded)
        await _until(lambda: bool(threads), "the batch was never applied")
        ranking = router.rank(TOKENS, None)  # on the loop, while any follower may be busy
        assert ranking.matches[ranking.backends[0].index_id].device == 2  # type: ignore[index]
        router.mark_dead(router.backends[0], "test")  # stops its follower: no join
        assert router.backends[0].follower is None and router.index.num_keys() == 0

    _with_router(body)
    assert threads and all(t is threads[0] for t in threads)
    assert not entered.is_set() and threads[0].name == "MainThread"  # the loop's thread


def test_no_batch_is_applied_once_a_follower_stopped() -> None:
    """``stop`` returns at once, and a batch the thread handed to the loop before is not applied
    after it: the application runs on the loop, which checks the follower's state first. The
    order is pinned: the loop (this test) waits until the thread has handed the batch over, so
    the hand-over cannot run before ``stop``."""
    applied: list[int] = []
    handed_over = threading.Event()

    async def body(router: Router, pub: ZmqEventPublisher) -> None:
        follower = router.backends[0].follower
        assert follower is not None and follower.state is FollowerState.RUNNING
        await _until(lambda: follower.batches == 1, "the first batch was never applied")
        loop = asyncio.get_running_loop()
        schedule = loop.call_soon_threadsafe

        def recorded(callback: Any, *args: Any) -> Any:
            handle = schedule(callback, *args)
            handed_over.set()
            return handle

        loop.call_soon_threadsafe = recorded  # type: ignore[assignment]
        follower._apply = lambda events: applied.append(len(events))
        pub.publish(KVEventBatch(1.0, [BlockStored([13], 12, TOKENS[:BS], BS, None, "GPU",
                                                   None)]))
        # Blocking the loop: the hand-over is queued behind this coroutine, so it runs after stop.
        assert handed_over.wait(30), "the thread never handed the batch over"
        follower.stop()
        assert _state(follower) is FollowerState.STOPPED
        await _until(lambda: not follower._thread.is_alive(), "the thread did not end")

    _with_router(body)
    assert handed_over.is_set() and applied == []


@pytest.mark.parametrize("held_step", ["tokenizing", "parsing"])
def test_a_request_is_read_off_the_loop(held_step: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """While a request's body is being parsed or its prompt tokenized (here: held until the
    router answers ``/health``, at most 5 s), the loop serves other requests. Before,
    tokenizing, and then parsing, ran on the loop: ``/health`` waited for them, and the held
    step saw no answer."""
    entered, answered = threading.Event(), threading.Event()
    seen: list[bool] = []

    async def run() -> None:
        runner, url = await _health_server()
        router = Router([BackendSpec(url)], create_policy(), PromptTokenizer("tiny"), BS,
                        health_interval_s=3600, metrics_interval_s=3600)
        encode = router.tokenizer.encode

        def held(text: str) -> list[int]:
            entered.set()
            seen.append(answered.wait(5))
            return encode(text)

        if held_step == "tokenizing":
            monkeypatch.setattr(router.tokenizer, "encode", held)
        else:
            parse = app_module.parse_json_object

            def held_parse(data: bytes) -> dict[str, Any]:
                entered.set()
                seen.append(answered.wait(5))
                return parse(data)

            monkeypatch.setattr(app_module, "parse_json_object", held_parse)
        server = uvicorn.Server(uvicorn.Config(build_app(router), host="127.0.0.1", port=0,
                                               log_level="warning"))
        serving = asyncio.create_task(server.serve())
        try:
            await _until(lambda: server.started, "the router did not start")
            port = server.servers[0].sockets[0].getsockname()[1]
            base = f"http://127.0.0.1:{port}"
            async with aiohttp.ClientSession() as client:
                post = asyncio.create_task(client.post(f"{base}/v1/completions",
                                                       json={"prompt": "hi", "max_tokens": 1}))
                await _until(entered.is_set, "the prompt was never tokenized")
                async with client.get(f"{base}/health") as health:
                    assert health.status == 200
                answered.set()
                (await post).release()
        finally:
            answered.set()
            server.should_exit = True
            await serving
            await runner.cleanup()

    asyncio.run(run())
    assert seen == [True]  # the held step saw the loop answer /health meanwhile
    assert seen == [True]


def test_router_lifecycle_moves_are_checked() -> None:
    async def run() -> None:
        router = Router([], create_policy(), PromptTokenizer("tiny"), BS)
        assert router.state is RouterState.CREATED
        with pytest.raises(ContractError, match="created"):
            router.connections  # noqa: B018 - no connections before start
        await router.start()
        assert _state(router) is RouterState.RUNNING and router.session is not None
        with pytest.raises(ContractError, match="running: cannot become running"):
            await router.start()
        await router.stop()
        await router.stop()  # idempotent
        assert _state(router) is RouterState.STOPPED
        with pytest.raises(ContractError, match="stopped"):
            router.connections  # noqa: B018
        with pytest.raises(ContractError, match="stopped: cannot become running"):
            await router.start()

    asyncio.run(run())


def test_follower_lifecycle_moves_are_checked() -> None:
    follower = EventFollower("f", "tcp://127.0.0.1:1", None, "", lambda _: None, lambda: None)
    assert follower.state is FollowerState.CREATED
    follower.stop()
    assert _state(follower) is FollowerState.STOPPED
    with pytest.raises(ContractError, match="STOPPED"):
        follower.start()


def test_router_errors_are_kvoffload_errors() -> None:
    assert issubclass(BackendLost, KVOffloadError) and issubclass(BackendLost, ConnectionError)
    assert issubclass(BackendUnavailable, KVOffloadError)
