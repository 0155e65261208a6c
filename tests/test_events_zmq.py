"""Publisher and subscriber over real ZMQ sockets (127.0.0.1, ipc in a tmp dir, inproc)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import zmq

from kvoffload.errors import ConfigError, ContractError
from kvoffload.events import (
    BlockRemoved,
    BlockStored,
    EventDecoder,
    EventEncoder,
    KVEventBatch,
    KVEventsConfig,
    KVEventSubscriber,
    NullEventPublisher,
    PublisherState,
    ReceivedBatch,
    ZmqEventPublisher,
    create_event_publisher,
)

LOOPBACK = "tcp://127.0.0.1:*"  # bound on an ephemeral loopback port


def _batch(i: int) -> KVEventBatch:
    stored = BlockStored(
        [i.to_bytes(8, "big")], None, list(range(16)), 16, None, "CPU", None, group_idx=0
    )
    return KVEventBatch(float(i), [stored, BlockRemoved([i], "GPU")])


def _sync(pub: ZmqEventPublisher, sub: KVEventSubscriber) -> int:
    """Publish probes until one arrives (slow-joiner); return the seq the next batch will get."""
    for _ in range(200):
        pub.publish(KVEventBatch(0.0, []))
        received = sub.receive(0.05)
        if received is not None:
            while sub.receive(0.05) is not None:  # probes still in flight
                pass
            return pub.stats()["published"]
    raise AssertionError("subscriber never received a probe")


def _receive(sub: KVEventSubscriber, n: int, timeout_s: float = 10.0) -> list[ReceivedBatch]:
    return list(sub.iter_batches(max_batches=n, timeout_s=timeout_s))


def _publish_until_the_gap_is_filled(
    pub: ZmqEventPublisher, sub: KVEventSubscriber, first: int
) -> list[ReceivedBatch]:
    """Publish live batches from ``first`` on until one arrives (it triggers the gap fill of
    what ``sub`` missed); return every batch delivered, through the last one published."""
    for i in range(first, first + 200):
        pub.publish(_batch(i))
        received = sub.receive(0.05)
        if received is not None:
            return [received, *_receive(sub, pub.stats()["published"] - 1 - received.seq)]
    raise AssertionError("no live batch arrived")


def _wait_sent(pub: ZmqEventPublisher, n: int) -> None:
    deadline = time.monotonic() + 10
    while pub.stats()["sent"] < n and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pub.stats()["sent"] == n


def _check_stream(pub: ZmqEventPublisher, sub: KVEventSubscriber, n: int = 50) -> None:
    """``sub`` joined with ``start_seq=None``: the probes lost before it connected are no gap."""
    first = _sync(pub, sub)
    for i in range(n):
        pub.publish(_batch(i))
    got = _receive(sub, n)
    assert [r.seq for r in got] == list(range(first, first + n))
    assert [r.batch.events for r in got] == [_batch(i).events for i in range(n)]
    assert all(r.batch.data_parallel_rank == 0 and not r.replayed for r in got)
    assert sub.stats()["gaps"] == 0


def test_tcp_stream_is_contiguous() -> None:
    with ZmqEventPublisher(LOOPBACK) as pub, KVEventSubscriber(pub.endpoint, start_seq=None) as sub:
        assert pub.endpoint.startswith("tcp://127.0.0.1:")
        _check_stream(pub, sub)


def test_ipc_stream_is_contiguous(tmp_path: Path) -> None:
    with (
        ZmqEventPublisher(f"ipc://{tmp_path}/ev") as pub,
        KVEventSubscriber(pub.endpoint, start_seq=None) as sub,
    ):
        _check_stream(pub, sub)


def test_inproc_stream_with_a_shared_context() -> None:
    ctx = zmq.Context()
    try:
        with (
            ZmqEventPublisher("inproc://kv-ev", context=ctx) as pub,
            KVEventSubscriber("inproc://kv-ev", context=ctx, start_seq=None) as sub,
        ):
            _check_stream(pub, sub, n=10)
    finally:
        ctx.term()


def test_publisher_connects_to_a_subscriber_that_binds() -> None:
    with (
        KVEventSubscriber(LOOPBACK, start_seq=None) as sub,
        ZmqEventPublisher(sub.endpoint, bind=False) as pub,
    ):
        _check_stream(pub, sub, n=10)


def test_topic_filters() -> None:
    with (
        ZmqEventPublisher(LOOPBACK, topic="kv@pod-1") as pub,
        KVEventSubscriber(pub.endpoint, topic="kv@pod-1") as sub,
        KVEventSubscriber(pub.endpoint, topic="kv@pod-2") as other,
    ):
        _sync(pub, sub)
        pub.publish(_batch(1))
        assert sub.receive(5.0) is not None
        assert other.receive(0.3) is None


def test_late_subscriber_recovers_missed_batches_through_replay() -> None:
    with ZmqEventPublisher(LOOPBACK, replay_endpoint=LOOPBACK) as pub:
        for i in range(20):  # nobody is listening yet
            pub.publish(_batch(i))
        _wait_sent(pub, 20)
        with KVEventSubscriber(
            pub.endpoint, replay_endpoint=pub.replay_endpoint, start_seq=0
        ) as sub:
            got = _publish_until_the_gap_is_filled(pub, sub, first=20)
            last = pub.stats()["published"]
            assert [r.seq for r in got] == list(range(last))
            assert [r.batch.events for r in got] == [_batch(i).events for i in range(last)]
            assert all(r.replayed for r in got[:20])
            assert not got[-1].replayed
            gaps = sub.take_gaps()
            assert len(gaps) == 1 and gaps[0].first_seq == 0 and gaps[0].lost == 0
            assert gaps[0].recovered == gaps[0].end_seq >= 20
            assert sub.take_gaps() == []


def test_catch_up_fetches_history_without_waiting_for_a_live_batch() -> None:
    with ZmqEventPublisher(LOOPBACK, replay_endpoint=LOOPBACK, buffer_steps=8) as pub:
        for i in range(12):
            pub.publish(_batch(i))
        _wait_sent(pub, 12)
        with KVEventSubscriber(
            pub.endpoint, replay_endpoint=pub.replay_endpoint, start_seq=0
        ) as sub:
            assert sub.catch_up() == 8  # the buffer keeps the last 8
            got = _receive(sub, 8, timeout_s=2.0)
            assert [r.seq for r in got] == list(range(4, 12))
            assert [g.lost for g in sub.take_gaps()] == [4]  # 0..3 fell out of the buffer
            assert sub.next_seq == 12


# vLLM 0.33's publisher (vllm/distributed/kv_events.py, ZmqEventPublisher._service_replay)
# answers a replay request [client, b"", start_seq] with (client, b"", topic, seq, payload) per
# buffered batch from start_seq on, then (client, b"", b"", END_SEQ, b""); seq is 8 big-endian
# bytes and END_SEQ is -1 as 8 signed big-endian bytes. A DEALER client sees these frames
# without the client id. The two helpers below build frames that way.
VLLM_END_SEQ = (-1).to_bytes(8, "big", signed=True)


def _vllm_replay_frames(topic: bytes, buffered: list[tuple[int, bytes]], start: int) -> list:
    """The frames a DEALER receives from vLLM 0.33's replay socket."""
    frames = [[b"", topic, seq.to_bytes(8, "big"), buf] for seq, buf in buffered if seq >= start]
    return [*frames, [b"", b"", VLLM_END_SEQ, b""]]


def test_replay_frames_are_vllms() -> None:
    """Our replay answer, received by a raw DEALER, equals frame for frame what vLLM 0.33 sends
    for the same buffer; a malformed request is ignored and counted."""
    encoder = EventEncoder()
    with ZmqEventPublisher(LOOPBACK, topic="kv@pod", replay_endpoint=LOOPBACK) as pub:
        for i in range(6):
            pub.publish(_batch(i))
        _wait_sent(pub, 6)
        ctx = zmq.Context()
        dealer = ctx.socket(zmq.DEALER)
        try:
            dealer.connect(pub.replay_endpoint)
            dealer.send_multipart([b"", b"bad"])  # not an 8-byte seq: ignored and counted
            dealer.send_multipart([b"", (3).to_bytes(8, "big")])
            frames = []
            for _ in range(10):
                assert dealer.poll(5000)
                frames.append(dealer.recv_multipart())
                if frames[-1][2:3] == [VLLM_END_SEQ]:
                    break
        finally:
            dealer.close(linger=0)
            ctx.term()
        buffered = [(i, encoder.encode(_batch(i))) for i in range(6)]
        want = _vllm_replay_frames(b"kv@pod", buffered, 3)
        assert [f[:3] for f in frames] == [f[:3] for f in want]
        assert [EventDecoder().decode(f[3]).events for f in frames[:-1]] == [
            EventDecoder().decode(f[3]).events for f in want[:-1]
        ]
        assert frames[-1] == want[-1]
        stats = pub.stats()
        assert stats["replay_requests"] == 1 and stats["bad_replay_requests"] == 1


def test_subscriber_recovers_a_gap_from_a_vllm_framed_replay_socket() -> None:
    """A publisher that frames as vLLM 0.33 does (raw PUB + ROUTER sockets here): the subscriber
    fills its gap from the replay answer."""
    encoder = EventEncoder()
    payloads = [encoder.encode(_batch(i)) for i in range(4)]
    ctx = zmq.Context()
    pub, router = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
    pub.bind(LOOPBACK)
    router.bind(LOOPBACK)
    served = threading.Event()

    def serve_one_replay() -> None:
        if router.poll(10_000):
            client, _, start = router.recv_multipart()
            buffered = list(enumerate(payloads))
            for frame in _vllm_replay_frames(b"kv", buffered, int.from_bytes(start, "big")):
                router.send_multipart([client, *frame])
            served.set()

    server = threading.Thread(target=serve_one_replay)
    server.start()
    try:
        with KVEventSubscriber(
            pub.getsockopt_string(zmq.LAST_ENDPOINT),
            "kv",
            router.getsockopt_string(zmq.LAST_ENDPOINT),
            start_seq=0,
        ) as sub:
            got = None
            for _ in range(200):  # slow joiner: repeat the live batch until it arrives
                pub.send_multipart([b"kv", (3).to_bytes(8, "big"), payloads[3]])
                got = sub.receive(0.05)
                if got is not None:
                    break
            assert got is not None and got.seq == 0 and got.replayed
            rest = [got, *_receive(sub, 3, timeout_s=5.0)]
            assert [r.seq for r in rest] == [0, 1, 2, 3]
            assert [r.batch.events for r in rest] == [_batch(i).events for i in range(4)]
            # The server thread sets ``served`` after its last send: the frames may be read first.
            assert served.wait(10.0) and sub.stats()["malformed"] == 0
    finally:
        server.join()
        pub.close(linger=0)
        router.close(linger=0)
        ctx.term()


def test_shutdown_flushes_what_is_queued() -> None:
    with KVEventSubscriber(LOOPBACK) as sub:
        pub = ZmqEventPublisher(sub.endpoint, bind=False)
        first = _sync(pub, sub)
        for i in range(500):
            pub.publish(_batch(i))
        pub.shutdown(timeout_s=5.0)
        assert pub.state is PublisherState.CLOSED
        stats = pub.stats()
        assert stats["sent"] == stats["published"] == first + 500
        assert stats["dropped"] == 0 and stats["queued"] == 0
        got = _receive(sub, 500)
        assert [r.seq for r in got] == list(range(first, first + 500))


def test_publish_never_blocks_without_a_subscriber_and_counts_drops() -> None:
    n = 20_000
    big = KVEventBatch(0.0, [_batch(0).events[0]] * 100)
    with ZmqEventPublisher(LOOPBACK, max_queue_size=2, hwm=1) as pub:
        for _ in range(n):
            pub.publish(big)  # the same object every time: publish only queues a reference
        assert pub.stats()["published"] == n
        assert pub.dropped > 0
    stats = pub.stats()
    assert stats["sent"] + stats["dropped"] + stats["encode_errors"] == n


def test_publish_never_blocks_with_a_subscriber_that_never_reads() -> None:
    n = 5_000
    with ZmqEventPublisher(LOOPBACK, max_queue_size=2, hwm=1) as pub:
        stalled = zmq.Context()
        sock = stalled.socket(zmq.SUB)
        sock.setsockopt(zmq.RCVHWM, 1)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(pub.endpoint)
        try:
            for i in range(n):
                pub.publish(_batch(i))
            assert pub.stats()["published"] == n
            pub.shutdown(timeout_s=0.5)  # bounded even though the subscriber holds messages
            assert pub.state is PublisherState.CLOSED
        finally:
            sock.close(linger=0)
            stalled.term()
    stats = pub.stats()
    assert stats["sent"] + stats["dropped"] + stats["encode_errors"] == n


def test_queue_drops_show_up_as_lost_batches_at_the_subscriber() -> None:
    with KVEventSubscriber(LOOPBACK, start_seq=None) as sub:  # the probes it joined on: no gap
        pub = ZmqEventPublisher(sub.endpoint, bind=False, max_queue_size=1)
        first = _sync(pub, sub)
        for i in range(3000):
            pub.publish(_batch(i))
        pub.shutdown(timeout_s=5.0)
        # The last batch is never dropped (drops take the oldest), so every gap gets closed.
        received: set[int] = set()
        for r in sub.iter_batches(timeout_s=10.0):
            received.add(r.seq)
            if r.seq == first + 2999:
                break
        assert first + 2999 in received
        lost = sum(g.lost for g in sub.take_gaps())
        assert len(received) + lost == 3000
        assert pub.dropped > 0  # the engine thread holds the GIL: the sender falls behind
        assert lost == pub.dropped  # nothing else went missing on loopback


def test_lifecycle_and_misuse() -> None:
    pub = ZmqEventPublisher(LOOPBACK)
    assert pub.state is PublisherState.RUNNING
    with pytest.raises(ContractError, match="KVEventBatch"):
        pub.publish([1.0, []])
    pub.shutdown()
    pub.shutdown()  # idempotent
    assert pub.state is PublisherState.CLOSED
    with pytest.raises(ContractError, match="CLOSED"):
        pub.publish(_batch(0))
    null = NullEventPublisher()
    null.publish(_batch(0))
    assert null.stats() == {"published": 1}
    null.shutdown()
    with pytest.raises(ContractError, match="CLOSED"):
        null.publish(_batch(0))
    sub = KVEventSubscriber("tcp://127.0.0.1:1")
    sub.close()
    with pytest.raises(ContractError, match="closed"):
        sub.receive(0.0)


def test_bind_and_connect_failures_name_the_field() -> None:
    ctx = zmq.Context()
    try:
        with ZmqEventPublisher("inproc://taken", context=ctx):
            with pytest.raises(ConfigError) as info:
                ZmqEventPublisher("inproc://taken", context=ctx)
            assert info.value.field == "endpoint"
            with pytest.raises(ConfigError) as info:
                ZmqEventPublisher(LOOPBACK, replay_endpoint="inproc://taken", context=ctx)
            assert info.value.field == "replay_endpoint"
    finally:
        ctx.term()
    with pytest.raises(ConfigError) as info:
        ZmqEventPublisher("tcp://127.0.0.1:not-a-port")
    assert info.value.field == "endpoint"


def test_factory_applies_rank_topic_and_legacy_form(tmp_path: Path) -> None:
    config = KVEventsConfig.from_json(
        f'{{"enable_kv_cache_events": "True", "endpoint": "ipc://{tmp_path}/ev", "topic": "t",'
        f' "replay_endpoint": "ipc://{tmp_path}/replay", "legacy_array_events": true}}'
    )
    pub = create_event_publisher(config, data_parallel_rank=2)
    with pub:
        assert isinstance(pub, ZmqEventPublisher)
        assert pub.endpoint == f"ipc://{tmp_path}/ev_dp2"
        assert pub.replay_endpoint == f"ipc://{tmp_path}/replay_dp2"
        raw_ctx = zmq.Context()
        raw = raw_ctx.socket(zmq.SUB)
        raw.setsockopt(zmq.SUBSCRIBE, b"t")
        raw.connect(pub.endpoint)
        try:
            for _ in range(200):
                pub.publish(_batch(7))
                if raw.poll(50):
                    break
            topic, seq, payload = raw.recv_multipart()
            assert topic == b"t" and len(seq) == 8
            assert payload[10] == 0x92  # events is [[...], [...]]: first event is an array (legacy)
            batch = EventDecoder().decode(payload)
            assert batch.data_parallel_rank == 2 and batch.events == _batch(7).events
        finally:
            raw.close(linger=0)
            raw_ctx.term()


def test_subscriber_notices_a_publisher_restart(tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/ev"
    with KVEventSubscriber(endpoint) as sub:
        with ZmqEventPublisher(endpoint) as pub:
            _sync(pub, sub)
            for i in range(5):
                pub.publish(_batch(i))
            assert len(_receive(sub, 5)) == 5
        with ZmqEventPublisher(endpoint) as pub:  # numbers start again at 0
            assert _sync(pub, sub) < 10
        assert sub.stats()["publisher_restarts"] == 1
        assert sub.next_seq == pub.stats()["published"]


def test_subscriber_address_errors_name_the_field() -> None:
    with pytest.raises(ConfigError) as info:
        KVEventSubscriber("tcp://127.0.0.1:not-a-port")
    assert info.value.field == "endpoint"
    with pytest.raises(ConfigError) as info:
        KVEventSubscriber("tcp://127.0.0.1:1", replay_endpoint="tcp://nowhere:x")
    assert info.value.field == "replay_endpoint"


def test_replay_timeout_counts_the_gap_as_lost() -> None:
    # A replay endpoint nobody serves: the gap fill times out and the live batch still arrives.
    with ZmqEventPublisher(LOOPBACK) as pub:
        for i in range(5):  # before anyone listens
            pub.publish(_batch(i))
        _wait_sent(pub, 5)
        with KVEventSubscriber(
            pub.endpoint, replay_endpoint="tcp://127.0.0.1:1", start_seq=0, replay_timeout_s=0.2
        ) as sub:
            first = _sync(pub, sub)
            gaps = sub.take_gaps()
            assert len(gaps) == 1 and gaps[0].first_seq == 0 and gaps[0].recovered == 0
            assert gaps[0].lost == gaps[0].end_seq >= 5
            assert sub.stats()["replay_timeouts"] == 1
            pub.publish(_batch(1))
            received = sub.receive(5.0)
            assert received is not None and received.seq == first


def test_a_subscriber_that_joins_late_counts_what_it_missed_as_a_gap() -> None:
    """Issue 21: joined after batches 0..4 and without a replay address, the subscriber's first
    batch has a sequence number above 0: that is a gap (lost), not "0 gaps"."""
    with ZmqEventPublisher(LOOPBACK) as pub:
        for i in range(5):  # before anyone listens
            pub.publish(_batch(i))
        _wait_sent(pub, 5)
        with KVEventSubscriber(pub.endpoint) as sub:
            first = _sync(pub, sub)
            (gap,) = sub.take_gaps()
            assert gap.first_seq == 0 and gap.recovered == 0 and gap.lost == gap.end_seq >= 5
            assert sub.stats()["gaps"] == 1 and sub.stats()["lost"] == gap.lost
            pub.publish(_batch(1))
            received = sub.receive(5.0)
            assert received is not None and received.seq == first


def test_catch_up_before_the_publisher_starts_asks_nothing_and_the_first_batch_fills_in(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 21: a subscriber started before its engine has no one to replay from yet: catch_up
    returns 0 at once, with no timeout and no warning; when the publisher comes up, the gap
    before its first live batch is recovered through replay."""
    endpoint, replay = f"ipc://{tmp_path}/ev", f"ipc://{tmp_path}/replay"
    with KVEventSubscriber(endpoint, replay_endpoint=replay, replay_timeout_s=0.3) as sub:
        started = time.monotonic()
        assert sub.catch_up() == 0
        assert time.monotonic() - started < 5
        assert sub.stats()["replay_timeouts"] == 0 and "replay" not in caplog.text
        with ZmqEventPublisher(endpoint, replay_endpoint=replay) as pub:
            for i in range(10):  # published before the subscription is connected: missed live
                pub.publish(_batch(i))
            _wait_sent(pub, 10)
            got = _publish_until_the_gap_is_filled(pub, sub, first=10)
            last = pub.stats()["published"]
        assert [r.seq for r in got] == list(range(last))
        assert all(r.replayed for r in got[:10])
        assert sub.stats()["lost"] == 0 and sub.stats()["replay_timeouts"] == 0
