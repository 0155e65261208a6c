"""``kvoffload events listen`` against a real publisher on 127.0.0.1."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from kvoffload.cli.main import main
from kvoffload.events import (
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    KVEventBatch,
    ZmqEventPublisher,
)

LOOPBACK = "tcp://127.0.0.1:*"


def _batch(i: int) -> KVEventBatch:
    stored = BlockStored([bytes([i]) * 32], None, list(range(4)), 4, None, "CPU", None, group_idx=0)
    return KVEventBatch(float(i), [stored, BlockRemoved([i], "GPU")])


@contextmanager
def _publisher(history: int) -> Iterator[ZmqEventPublisher]:
    """A publisher that sent ``history`` batches, then keeps publishing (bounded) from a thread."""
    pub = ZmqEventPublisher(LOOPBACK, replay_endpoint=LOOPBACK)
    for i in range(history):
        pub.publish(_batch(i))
    stop = threading.Event()

    def keep_publishing() -> None:
        for i in range(history, history + 500):
            if stop.wait(0.02):
                return
            pub.publish(_batch(i))

    thread = threading.Thread(target=keep_publishing)
    thread.start()
    try:
        yield pub
    finally:
        stop.set()
        thread.join(5)
        pub.shutdown()


def _listen(pub: ZmqEventPublisher, *extra: str) -> int:
    argv = ["events", "listen", "--endpoint", pub.endpoint, "--replay", pub.replay_endpoint]
    return main([*argv, "--from-seq", "0", "--timeout", "10", *extra])


def test_listen_prints_one_line_per_event_from_the_first_batch(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with _publisher(history=3) as pub:
        assert _listen(pub, "--max-batches", "6") == 0
    out, err = capsys.readouterr()
    lines = [line for line in out.splitlines() if not line.startswith("gap:")]
    assert len(lines) == 12  # 6 batches of 2 events
    seqs = [int(line.split()[0]) for line in lines]
    assert seqs == [s for s in range(6) for _ in range(2)]
    assert all(line.split()[1] == "R" for line in lines[:6])  # history came through replay
    assert "BlockStored   host" in lines[0] and f"[{(bytes([0]) * 8).hex()}]" in lines[0]
    assert "BlockRemoved  device" in lines[1]
    assert err.startswith("6 batches")


def test_listen_json_lines(capsys: pytest.CaptureFixture[str]) -> None:
    with _publisher(history=2) as pub:
        assert _listen(pub, "--json", "--max-batches", "3") == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    events = [r for r in records if "type" in r]
    assert [(r["seq"], r["type"]) for r in events[:4]] == [
        (0, "BlockStored"),
        (0, "BlockRemoved"),
        (1, "BlockStored"),
        (1, "BlockRemoved"),
    ]
    first = events[0]
    assert first["block_hashes"] == [(bytes([0]) * 32).hex()]
    assert (
        first["medium"] == "CPU"
        and first["tier"] == "host"
        and first["token_ids"] == [0, 1, 2, 3]
        and first["replayed"] is True
    )
    assert first["data_parallel_rank"] == 0
    assert all(
        set(r["gap"]) == {"first_seq", "end_seq", "recovered", "lost"}
        for r in records
        if "gap" in r
    )


def test_listen_index_table(capsys: pytest.CaptureFixture[str]) -> None:
    with _publisher(history=4) as pub:
        assert _listen(pub, "--index", "--max-batches", "4") == 0
    out = capsys.readouterr().out
    table = out.strip().split("\n\n")[-1].splitlines()
    assert table[0].split() == ["tier", "blocks"]
    assert table[1].split() == ["host", "4"]
    assert table[2].split() == ["device", "0"]
    assert table[3].startswith("batches 4,")
    assert "\x1b[" not in out  # not a terminal: no screen control


def test_listen_bad_endpoint_is_a_clean_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["events", "listen", "--endpoint", "tcp://127.0.0.1:not-a-port", "--timeout", "0.1"])
        == 2
    )
    assert "endpoint" in capsys.readouterr().err


def test_events_group_never_imports_torch() -> None:
    code = (
        "import sys\n"
        "from kvoffload.cli.main import main\n"
        "rc = main(['events', 'listen', '--endpoint', 'tcp://127.0.0.1:9', '--timeout', '0.1'])\n"
        "assert rc == 0, rc\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert time.monotonic() - started < 60


def _stored(*hashes: int) -> KVEventBatch:
    blocks: list[ExternalBlockHash] = [bytes([h]) * 32 for h in hashes]
    return KVEventBatch(
        0.0, [BlockStored(blocks, None, [0] * 4 * len(blocks), 4, None, "CPU", None)]
    )


def test_listen_index_clears_when_the_publisher_restarts(tmp_path: Path) -> None:
    """A restarted publisher numbers from 0 again and holds nothing of what the old one
    announced: the --index table drops the old blocks (as routers do) instead of keeping them."""
    endpoint = f"ipc://{tmp_path}/ev"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    argv = ["events", "listen", "--endpoint", endpoint, "--index", "--json", "--refresh", "0.05"]
    code = f"import sys; from kvoffload.cli.main import main; sys.exit(main({[*argv, '--timeout', '30']!r}))"
    listener = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env
    )
    assert listener.stdout is not None
    out = listener.stdout

    def cpu_blocks_until(
        stop: Callable[[int], bool], pub: ZmqEventPublisher, batch: KVEventBatch
    ) -> int:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            pub.publish(batch)
            ready, _, _ = select.select([out], [], [], 0.05)
            if ready:
                line = out.readline()
                cpu = json.loads(line)["index"].get("host", 0)
                if stop(cpu):
                    return cpu
        raise AssertionError("the listener never showed the expected table")

    try:
        with ZmqEventPublisher(endpoint) as old:
            # Restarts are seen as sequence numbers going back. Number the old publisher's
            # batches far beyond what the new one can reach before the deadline (one batch per
            # 50 ms poll), so the listener sees the new numbers as lower whichever of the new
            # publisher's first batches it misses while reconnecting.
            for _ in range(1000):
                old.publish(_stored(1, 2))
            assert cpu_blocks_until(lambda n: n == 2, old, _stored(1, 2)) == 2
        with ZmqEventPublisher(endpoint) as new:
            assert cpu_blocks_until(lambda n: n != 2, new, _stored(3)) == 1
    finally:
        listener.kill()
        listener.wait()
        listener.stdout.close()


def test_listen_started_before_the_engine_recovers_its_first_batches(tmp_path: Path) -> None:
    """Issue 21: ``events listen --replay`` started before the run printed "replay from seq 0
    timed out" (its catch-up asked a replay socket nobody served yet); without --replay it
    reported "0 gaps" although it missed the first batches. Now the catch-up waits for the
    publisher quietly and the batches it missed live come through replay: none lost."""
    endpoint, replay = f"ipc://{tmp_path}/ev", f"ipc://{tmp_path}/replay"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    argv = ["events", "listen", "--endpoint", endpoint, "--replay", replay, "--max-batches", "40"]
    code = f"import sys; from kvoffload.cli.main import main; sys.exit(main({[*argv, '--timeout', '30']!r}))"
    listener = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        time.sleep(1.5)  # the listener is up (and has tried its catch-up) before the publisher
        with ZmqEventPublisher(endpoint, replay_endpoint=replay) as pub:
            for i in range(200):  # the first ones go out before the listener is connected
                pub.publish(_batch(i % 200))
                if listener.poll() is not None:
                    break
                time.sleep(0.02)
            out, err = listener.communicate(timeout=30)
    finally:
        if listener.poll() is None:
            listener.kill()
            listener.communicate()
    assert listener.returncode == 0, err
    assert "timed out" not in err
    seqs = sorted({int(line.split()[0]) for line in out.splitlines() if not line.startswith("gap")})
    assert seqs == list(range(40))
    assert err.strip().splitlines()[-1].endswith(", 0 batches lost"), err
