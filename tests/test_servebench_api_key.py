"""``bench serve`` against a server that needs a key: it sends ``$OPENAI_API_KEY`` as
``vllm bench serve`` does, and never shows it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from serve_cases import serve

KEY = "sk-bench-test-4f1c9a"


def _bench(url: str, output: Path, key: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
    if key is not None:
        env["OPENAI_API_KEY"] = key
    return subprocess.run(
        [sys.executable, "-m", "kvoffload.cli.main", "bench", "serve", "--base-url", url,
         "--model", "tiny", "--dataset-name", "random", "--num-prompts", "3",
         "--random-input-len", "16", "--random-output-len", "2", "--output-json", str(output)],
        capture_output=True, text=True, timeout=150, check=False, env=env,
    )


def test_the_key_in_openai_api_key_is_sent_and_never_shown(tmp_path) -> None:
    with serve("--api-key", KEY) as server:
        with_key = _bench(server.url, tmp_path / "with.json", KEY)
        without = _bench(server.url, tmp_path / "without.json", None)
    assert with_key.returncode == 0, with_key.stdout + with_key.stderr
    r = json.loads((tmp_path / "with.json").read_text())
    assert (r["completed"], r["failed"]) == (3, 0)
    assert KEY not in with_key.stdout + with_key.stderr + (tmp_path / "with.json").read_text()
    # Without it the server refuses every request (401): none completes.
    failed = without.returncode != 0 or json.loads((tmp_path / "without.json").read_text())[
        "completed"] == 0
    assert failed, without.stdout + without.stderr
