"""A clear of the Redis tier through ``kvoffload serve`` runs off the engine thread: while the
server's ``SCAN`` + ``UNLINK`` is held (a proxy that holds the replies on the clear's own new
connection, the engine's older connections flowing), a completion runs to its end; released, the
clear answers with every key it removed."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from remote_proxy import TrickleProxy
from serve_cases import http_json, serve

KEY = "admin-clear-key"
HOST_GIB = 64 * 512 * 16 / 2**30  # 64 blocks of 16 tiny-preset tokens
PROMPT = "A prompt whose blocks the clear takes off Redis. " * 3


@pytest.fixture
def proxy(redis_server: Any) -> Iterator[TrickleProxy]:
    proxy = TrickleProxy(redis_server.port)
    try:
        yield proxy
    finally:
        proxy.close()


def test_engine_steps_go_on_while_a_redis_clear_runs(proxy: TrickleProxy) -> None:
    url = proxy.url() + "?namespace=admin-clear-remote"
    with serve("--kv-offloading-size", str(HOST_GIB), "--kv-remote-url", url,
               "--api-key", KEY) as server:
        def post(path: str, body: dict[str, Any]) -> Any:
            return http_json(f"{server.url}{path}", body, timeout=60, key=KEY)

        warmed = post("/admin/warm", {"prompt": PROMPT, "tiers": ["host", "remote"]})
        stored = post("/admin/lookup", {"prompt": PROMPT})["tiers"]["remote"] // 16
        assert stored > 0, warmed
        answers: list[Any] = []
        proxy.hold_new()
        clear = threading.Thread(
            target=lambda: answers.append(post("/admin/clear", {"tiers": ["remote"]})))
        clear.start()
        try:
            assert proxy.held_connection.wait(30), "the clear never reached the server"
            # The clear's SCAN waits in the proxy: an engine step completes meanwhile.
            done = post("/v1/completions", {"prompt": "Something else.", "max_tokens": 2, "ignore_eos": True})
            assert done["usage"]["completion_tokens"] == 2
            assert clear.is_alive() and not answers  # still held: nothing answered it
        finally:
            proxy.release_new()
            clear.join(60)
        # The prompt's blocks, and any the completion stored before the SCAN passed.
        assert answers and answers[0]["removed_blocks"]["remote"] >= stored
        assert post("/admin/lookup", {"prompt": PROMPT})["tiers"]["remote"] == 0
