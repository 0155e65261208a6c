"""Who binds a KV event address, over real ZMQ sockets on loopback: events stay on this host by
default, a publisher on a loopback address binds it (so ``route`` and ``events listen``, which
connect, receive), a connecting publisher meets a subscriber told to bind, and a subscriber that
no publisher reaches says so instead of waiting in silence."""

from __future__ import annotations

import logging
import socket

import pytest

from kvoffload.cli.main import main
from kvoffload.events import (
    KVEventBatch,
    KVEventsConfig,
    KVEventSubscriber,
    ZmqEventPublisher,
    create_event_publisher,
    exposed_beyond_host,
    publisher_binds,
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _first_batch(pub: ZmqEventPublisher, sub: KVEventSubscriber) -> bool:
    """Publish until one batch arrives (slow joiner), bounded: whether one did."""
    for _ in range(100):
        pub.publish(KVEventBatch(0.0, []))
        if sub.receive(0.05) is not None:
            return True
    return False


def test_defaults_keep_events_on_loopback() -> None:
    config = KVEventsConfig(enable_kv_cache_events=True)
    assert config.endpoint == "tcp://127.0.0.1:5557"
    assert not exposed_beyond_host(config.endpoint)
    assert config.publisher_binds


@pytest.mark.parametrize(
    ("endpoint", "exposed"),
    [
        ("tcp://127.0.0.1:5557", False),
        ("tcp://127.0.0.2:*", False),
        ("tcp://localhost:5557", False),
        ("tcp://[::1]:5557", False),
        ("ipc:///tmp/kv-events", False),
        ("inproc://kv", False),
        ("tcp://*:5557", True),
        ("tcp://0.0.0.0:5557", True),
        ("tcp://[::]:5557", True),
        ("tcp://10.1.2.3:5557", True),
        ("tcp://eth0:5557", True),
    ],
)
def test_exposed_beyond_host(endpoint: str, exposed: bool) -> None:
    assert exposed_beyond_host(endpoint) is exposed


def test_vllms_rule_is_kept_and_ours_binds_loopback() -> None:
    assert not publisher_binds("tcp://127.0.0.1:5557")  # vLLM's publisher connects there
    assert KVEventsConfig(endpoint="tcp://127.0.0.1:5557").publisher_binds
    assert not KVEventsConfig(endpoint="tcp://127.0.0.1:5557", bind=False).publisher_binds
    assert not KVEventsConfig(endpoint="tcp://10.1.2.3:5557").publisher_binds  # vLLM's rule
    as_json = '{"endpoint": "tcp://10.1.2.3:5557", "bind": "true"}'  # vLLM-style boolean
    assert KVEventsConfig.from_json(as_json).publisher_binds


def test_a_publisher_on_a_loopback_address_binds_it_and_a_subscriber_receives() -> None:
    """The configuration that published into the void: a non-wildcard loopback address, the
    subscriber connecting (as ``route`` and ``events listen`` do)."""
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=endpoint)
    pub = create_event_publisher(config)
    assert isinstance(pub, ZmqEventPublisher)
    with pub, KVEventSubscriber(endpoint, start_seq=None) as sub:
        assert pub.endpoint == endpoint
        assert _first_batch(pub, sub)


def test_binding_beyond_loopback_warns_of_the_prompts_it_carries(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Checked before binding (so the test binds nothing beyond loopback): the warning names
    the risk."""
    from kvoffload.events.publisher import warn_if_exposed

    with caplog.at_level(logging.WARNING, logger="kvoffload.events.publisher"):
        warn_if_exposed("endpoint", "tcp://127.0.0.1:5557")
        assert not caplog.records
        warn_if_exposed("replay_endpoint", "tcp://*:5558")
    (record,) = caplog.records
    assert "tcp://*:5558" in record.message and "token ids" in record.message


def test_a_connecting_publisher_meets_a_subscriber_told_to_bind() -> None:
    """vLLM's publisher connects to a non-wildcard address: bind the subscriber there."""
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    with (
        KVEventSubscriber(endpoint, start_seq=None, bind=True) as sub,
        ZmqEventPublisher(endpoint, bind=False) as pub,
    ):
        assert _first_batch(pub, sub)


def test_a_publisher_the_default_rule_makes_connect_warns(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM's rule connects a publisher given a specific non-loopback address: nothing flows
    unless a subscriber binds it, so the default's choice is a warning (an explicit
    ``bind=False`` is not). The rule is made to choose connect on a loopback address here, so
    that the test sends nothing beyond this host."""
    import kvoffload.events.publisher as publisher_module

    monkeypatch.setattr(publisher_module, "binds_by_default", lambda endpoint: False)
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    with caplog.at_level(logging.WARNING, "kvoffload.events.publisher"):
        with ZmqEventPublisher(endpoint, bind=False):
            pass
        assert not [r for r in caplog.records if "subscriber must bind" in r.message]
        with ZmqEventPublisher(endpoint) as pub:
            assert not pub.binds
    warned = [r for r in caplog.records if "subscriber must bind" in r.message]
    assert len(warned) == 1 and endpoint in warned[0].message


def test_a_subscriber_no_publisher_reaches_warns(caplog: pytest.LogCaptureFixture) -> None:
    """Nothing is bound at the address (both sides connect, say): the subscriber warns once,
    naming the address and the rule, instead of staying silent."""
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    with (
        caplog.at_level(logging.WARNING, logger="kvoffload.events.subscriber"),
        KVEventSubscriber(endpoint, start_seq=None, warn_unreached_s=0) as sub,
    ):
        for _ in range(100):
            assert sub.receive(0.02) is None
            if caplog.records:
                break
        assert not sub.reached
        for _ in range(5):
            sub.receive(0.01)
    (record,) = caplog.records
    assert endpoint in record.message and "bind" in record.message


def test_a_publisher_reaching_the_subscriber_is_seen_before_any_batch() -> None:
    """The connection itself (no batch published) marks the subscriber reached: the watch
    stops, and no warning can come later."""
    with (
        ZmqEventPublisher("tcp://127.0.0.1:*") as pub,
        KVEventSubscriber(pub.endpoint, start_seq=None, warn_unreached_s=3600) as sub,
    ):
        for _ in range(500):
            assert sub.receive(0.01) is None
            if sub.reached:
                break
        assert sub.reached


def test_events_listen_bind_receives_from_a_connecting_publisher(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import threading

    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    done = threading.Event()

    def publish() -> None:
        # Connects (bind=False) and keeps publishing until the listener has its batch.
        with ZmqEventPublisher(endpoint, bind=False) as pub:
            for _ in range(500):
                pub.publish(KVEventBatch(0.0, []))
                if done.wait(0.02):
                    return

    thread = threading.Thread(target=publish)
    thread.start()
    try:
        argv = ["events", "listen", "--endpoint", endpoint, "--bind", "--from-seq", "0"]
        assert main([*argv, "--max-batches", "1", "--timeout", "10"]) == 0
    finally:
        done.set()
        thread.join()
    assert capsys.readouterr().err.startswith("1 batches")
