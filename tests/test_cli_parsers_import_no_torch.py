"""Building any command's parser (its ``--help`` included) imports no torch, so a usage error,
``--help`` or a port already in use answers at once instead of after torch's import; the serve
command's device check, which needs torch, runs only after its port is bound."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

COMMANDS = [[], ["serve"], ["route"], ["bench", "throughput"], ["bench", "serve"],
            ["bench", "trace"], ["events"], ["events", "listen"]]


def torch_loaded_after(code: str) -> bool:
    """Whether a fresh interpreter (our sources first, as the tests' PYTHONPATH has them) has
    imported torch after running ``code``."""
    probe = f"import json, sys\n{code}\nprint(json.dumps('torch' in sys.modules))\n"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr.decode()
    return bool(json.loads(done.stdout.decode().splitlines()[-1]))


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda a: " ".join(a) or "kvoffload")
def test_building_a_parser_imports_no_torch(argv: list[str]) -> None:
    assert not torch_loaded_after(
        f"from kvoffload.cli.main import build_parser\nbuild_parser({argv!r})"
    )


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda a: " ".join(a) or "kvoffload")
def test_help_imports_no_torch(argv: list[str]) -> None:
    code = (
        "import contextlib, io\n"
        "from kvoffload.cli.main import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        f"    try:\n        main({[*argv, '--help']!r})\n"
        "    except SystemExit as e:\n        assert e.code == 0, e.code\n"
    )
    assert not torch_loaded_after(code)


def test_serve_on_a_port_in_use_imports_no_torch() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code = (
            "from kvoffload.cli.main import main\n"
            f"status = main(['serve', '--model', 'tiny', '--port', '{port}'])\n"
            "assert status == 2, status\n"
        )
        assert not torch_loaded_after(code)
