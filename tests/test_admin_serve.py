"""``kvoffload admin`` against a real ``kvoffload serve`` process: the endpoints sit behind the
API key; pin computes an uncached prompt and is refused whole past the quota; warm makes the
first real request a full hit; clears are counted in /metrics; bad input is one clear error
(HTTP 400 naming the field, CLI exit 2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
from collections.abc import Iterator
from typing import Any

import pytest
from serve_cases import Process, http_json, serve

KEY = "admin-test-key"
BLOCK = 16
#: A host tier of 16 blocks of 16 tiny-preset tokens (512 bytes each).
HOST_GIB = 16 * 512 * BLOCK / 2**30
SYSTEM = "You are careful. Be brief. " * 4  # about 6 blocks


@pytest.fixture(scope="module")
def server() -> Iterator[Process]:
    with serve("--kv-offloading-size", str(HOST_GIB), "--block-size", str(BLOCK),
               "--api-key", KEY) as process:
        yield process


def admin(server: Process, *args: str, key: str | None = KEY) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "KVOFFLOAD_API_KEY"}
    if key is not None:
        env["KVOFFLOAD_API_KEY"] = key
    return subprocess.run(
        [sys.executable, "-m", "kvoffload.cli.main", "admin", "--url", server.url, *args],
        capture_output=True, text=True, env=env, timeout=120,
    )


def admin_json(server: Process, *args: str) -> Any:
    done = admin(server, "--json", *args)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def post(server: Process, path: str, body: dict[str, Any], key: str | None = KEY) -> Any:
    return http_json(f"{server.url}{path}", body, key=key)


def error_of(server: Process, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    with pytest.raises(urllib.error.HTTPError) as err:
        post(server, path, body)
    with err.value:
        return err.value.code, json.loads(err.value.read())["error"]


def test_the_endpoints_need_the_key(server: Process) -> None:
    with pytest.raises(urllib.error.HTTPError) as err:
        http_json(f"{server.url}/admin/pins")
    err.value.close()
    assert err.value.code == 401
    done = admin(server, "pins", key=None)
    assert done.returncode == 1 and "401" in done.stderr and KEY not in done.stderr


def test_pin_computes_an_uncached_prompt_then_lookup_shows_it(server: Process) -> None:
    before = admin_json(server, "lookup", SYSTEM)
    assert before["cached_tokens"] == 0 and before["tiers"]["host"] == 0
    pin = admin_json(server, "pin", SYSTEM, "--owner", "ops", "--ttl", "3600")
    assert pin["computed"] is True and pin["owner"] == "ops" and pin["expires_at"] is not None
    blocks = before["prompt_tokens"] // BLOCK
    after = admin_json(server, "lookup", SYSTEM)
    assert after["tiers"]["host"] == after["pinned_tokens"]["host"] == blocks * BLOCK
    listed = admin_json(server, "pins")
    assert [p["id"] for p in listed["pins"]] == [pin["id"]]
    assert listed["pinned_blocks"] == {"host": blocks}
    text = admin(server, "pins").stdout
    assert pin["id"] in text and f"host {blocks}/8" in text
    assert admin_json(server, "unpin", "--owner", "ops")["unpinned"][0]["id"] == pin["id"]
    assert admin_json(server, "pins")["pins"] == []


def test_a_pin_past_the_quota_is_refused(server: Process) -> None:
    long_prompt = "An operator pins far too much text. " * 40  # > 8 blocks of the 16-block host
    done = admin(server, "pin", long_prompt)
    assert done.returncode == 1
    assert "409" in done.stderr and "pinned quota is 8 blocks" in done.stderr
    assert admin_json(server, "pins")["pins"] == []


def test_warm_makes_the_first_request_a_full_hit(server: Process) -> None:
    prompt = "Launch day: a shared preamble. " * 3
    warmed = admin_json(server, "warm", prompt)
    full = warmed["prompt_tokens"] // BLOCK * BLOCK
    assert warmed["tiers"]["host"] == full
    answer = post(server, "/v1/completions",
                  {"prompt": prompt + " And the question.", "max_tokens": 2})
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] >= full


def test_clears_are_counted_in_metrics(server: Process) -> None:
    admin_json(server, "warm", "Something to clear away, block after block. " * 3)
    answer = admin_json(server, "clear", "--tier", "device", "--tier", "host")
    assert answer["removed_blocks"]["host"] > 0
    metrics = http_json_text(f"{server.url}/metrics")
    counted = {line.split("}")[0].split('"')[1]: float(line.rsplit(" ", 1)[1])
               for line in metrics.splitlines()
               if line.startswith("kvoffload_admin_cleared_blocks_total{")}
    assert counted["host"] >= answer["removed_blocks"]["host"]
    text = admin(server, "clear", "--all").stdout
    assert text.startswith("removed blocks:")


def http_json_text(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=30) as response:
        return str(response.read().decode())


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/admin/pin", {"prompt": "hello there", "tiers": ["nvme"]}, "tiers"),
        ("/admin/pin", {"prompt": "hello there", "ttl_s": -1}, "ttl_s"),
        ("/admin/lookup", {"prompt": ""}, "prompt"),
        ("/admin/lookup", {"prompt": []}, "prompt"),
        ("/admin/warm", {"prompt": "x", "tiers": "disk"}, "tiers"),
        ("/admin/clear", {"tiers": ["gpu"]}, "tiers"),
        ("/admin/clear", {"model": "zz"}, "model"),
        ("/admin/lookup", {"prompt": "x", "ttl": 5}, "ttl"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(
    server: Process, path: str, body: dict[str, Any], param: str
) -> None:
    status, error = error_of(server, path, body)
    assert status == 400 and error["param"] == param, error


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["pin", "hello there", "--tier", "nvme"], "unknown or missing tier ['nvme']"),
        (["pin", "hello there", "--ttl", "-1"], "argument --ttl: must be a finite number > 0"),
        (["lookup", ""], "the prompt must not be empty"),
        (["lookup"], "a prompt is required"),
        (["clear"], "name the tiers to clear"),
        (["unpin"], "name what to unpin"),
    ],
)
def test_bad_input_is_cli_exit_2(server: Process, args: list[str], message: str) -> None:
    done = admin(server, *args)
    assert done.returncode == 2, done
    # The parser's refusals are its usage line and one error line; the server's, one line.
    lines = 2 if message.startswith("argument ") else 1
    assert message in done.stderr and done.stderr.count("\n") == lines


def test_the_cli_imports_no_torch_and_says_when_unreachable() -> None:
    code = ("import sys\nfrom kvoffload.cli.main import main\n"
            "try:\n    main(['admin', '--url', 'http://127.0.0.1:9', 'pins'])\n"
            "except SystemExit as exc:\n    print(exc.code, 'torch' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["1", "False"]
    assert "cannot reach http://127.0.0.1:9" in done.stderr


def test_the_pin_quota_flag_sets_each_tiers_quota() -> None:
    with serve("--kv-offloading-size", str(HOST_GIB), "--block-size", str(BLOCK),
               "--kv-pin-quota", "0.25") as process:
        assert http_json(f"{process.url}/admin/pins")["quota_blocks"] == {"host": 4}
