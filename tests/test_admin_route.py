"""``kvoffload admin`` through a real ``kvoffload route`` over two ``kvoffload serve`` sharing one
Redis: lookups per backend equal what the router's event-fed index holds, with the router's
predicted TTFT; controls fan out to every backend (or the ones named); bad input is one clear
error (400, CLI exit 2); the router's key guards its /admin and the backends' key is passed on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
from collections.abc import Iterator
from typing import Any

import pytest
from serve_cases import Process, http_json, route, serve

KEY, BACKEND_KEY = "route-admin-key", "backend-admin-key"
HOST_GIB = 64 * 512 * 16 / 2**30  # 64 blocks of 16 tiny-preset tokens
PROMPT = "The fleet's shared system prompt, long enough. " * 3  # 8 full blocks


@pytest.fixture(scope="module")
def fleet(redis_server: Any) -> Iterator[tuple[Process, Process, Process]]:
    url = redis_server.url + "?namespace=admin-route"
    flags = ("--kv-offloading-size", str(HOST_GIB), "--kv-remote-url", url,
             "--api-key", BACKEND_KEY)
    env = {"KVOFFLOAD_BACKEND_API_KEY": BACKEND_KEY}
    with serve(*flags) as a, serve(*flags) as b, \
            route([a, b], "--api-key", KEY, env=env, key=KEY) as router:
        yield a, b, router


def admin(router: Process, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, KVOFFLOAD_API_KEY=KEY)
    return subprocess.run(
        [sys.executable, "-m", "kvoffload.cli.main", "admin", "--url", router.url, *args],
        capture_output=True, text=True, env=env, timeout=120,
    )


def lookup(router: Process) -> dict[str, dict[str, Any]]:
    done = admin(router, "--json", "lookup", PROMPT)
    assert done.returncode == 0, done.stderr
    return {b["url"]: b for b in json.loads(done.stdout)["backends"]}


def until_indexed(router: Process, check: Any) -> dict[str, dict[str, Any]]:
    """Lookups until ``check`` holds (the router's index follows the backends' events, which
    arrive on their own): bounded in time."""
    deadline = time.monotonic() + 30
    while True:
        got = lookup(router)
        if check(got) or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


def test_lookup_equals_the_index_for_two_backends_sharing_redis(
    fleet: tuple[Process, Process, Process],
) -> None:
    a, b, router = fleet
    before = lookup(router)
    assert set(before) == {a.url, b.url}
    for entry in before.values():
        assert entry["answer"]["cached_tokens"] == 0
        assert set(entry["index_tokens"].values()) == {0}
        assert entry["predicted_ttft_s"] >= 0
    warmed = http_json(f"{router.url}/admin/warm", {"prompt": PROMPT, "backends": [a.url]},
                       key=KEY)
    assert [w["url"] for w in warmed["backends"]] == [a.url]
    full = 128
    got = until_indexed(router, lambda g: g[a.url]["index_tokens"]["device"] == full
                        and g[b.url]["index_tokens"]["remote"] == full)
    on_a, on_b = got[a.url], got[b.url]
    # A computed it: device, host and the shared server; the index sees its device run first.
    assert on_a["answer"]["tiers"] == {"device": full, "host": full, "remote": full}
    assert on_a["index_tokens"] == {"device": full, "host": 0, "disk": 0, "remote": 0}
    # B never saw it: only the shared server holds it for B, and the index knows that too.
    assert on_b["answer"]["tiers"] == {"device": 0, "host": 0, "remote": full}
    assert on_b["index_tokens"] == {"device": 0, "host": 0, "disk": 0, "remote": full}
    assert on_b["answer"]["cached_tokens"] == full
    assert on_a["predicted_ttft_s"] <= on_b["predicted_ttft_s"]
    text = admin(router, "lookup", PROMPT).stdout
    assert f"== {a.url}  predicted TTFT" in text and f"== {b.url}  predicted TTFT" in text


def test_pins_and_clears_fan_out_to_every_backend(fleet: tuple[Process, Process, Process]) -> None:
    a, b, router = fleet
    done = admin(router, "--json", "pin", PROMPT, "--owner", "launch")
    assert done.returncode == 0, done.stderr
    pinned = {p["url"]: p["answer"] for p in json.loads(done.stdout)["backends"]}
    assert set(pinned) == {a.url, b.url}
    assert all(p["owner"] == "launch" and p["blocks"] == 8 for p in pinned.values())
    got = lookup(router)
    assert all(got[u]["answer"]["pinned_tokens"]["host"] == 128 for u in (a.url, b.url))
    listed = json.loads(admin(router, "--json", "pins").stdout)["backends"]
    assert [len(x["answer"]["pins"]) for x in listed] == [1, 1]
    cleared = json.loads(admin(router, "--json", "clear", "--all", "--unpin").stdout)
    for entry in cleared["backends"]:
        assert entry["answer"]["removed_blocks"]["host"] >= 8
        assert [p["owner"] for p in entry["answer"]["unpinned"]] == ["launch"]
    got = lookup(router)
    assert all(got[u]["answer"]["tiers"] == {"device": 0, "host": 0, "remote": 0}
               for u in (a.url, b.url))


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": ""}, "prompt"),
        ({"prompt": PROMPT, "backends": ["http://127.0.0.1:1"]}, "backends"),
        ({"prompt": PROMPT, "backends": []}, "backends"),
    ],
)
def test_bad_lookups_are_400(fleet: tuple[Process, Process, Process], body: dict[str, Any],
                             param: str) -> None:
    _, _, router = fleet
    with pytest.raises(urllib.error.HTTPError) as err:
        http_json(f"{router.url}/admin/lookup", body, key=KEY)
    with err.value:
        assert err.value.code == 400
        assert json.loads(err.value.read())["error"]["param"] == param


def test_bad_input_from_every_backend_is_cli_exit_2(
    fleet: tuple[Process, Process, Process],
) -> None:
    a, b, router = fleet
    done = admin(router, "pin", PROMPT, "--tier", "nvme")
    assert done.returncode == 2
    assert "2 of 2 backends failed" in done.stderr and "unknown or missing tier" in done.stderr
    assert a.url in done.stderr and b.url in done.stderr and BACKEND_KEY not in done.stderr
    done = admin(router, "pin", PROMPT, "--ttl", "-3")  # refused before anything is sent
    assert done.returncode == 2 and "argument --ttl: must be a finite number > 0" in done.stderr


def test_the_router_key_guards_its_admin(fleet: tuple[Process, Process, Process]) -> None:
    _, _, router = fleet
    with pytest.raises(urllib.error.HTTPError) as err:
        http_json(f"{router.url}/admin/pins", key=BACKEND_KEY)
    err.value.close()
    assert err.value.code == 401
