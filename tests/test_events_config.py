"""KVEventsConfig: vLLM's fields and defaults, JSON from the command line, errors naming fields."""

from __future__ import annotations

import dataclasses

import pytest

from kvoffload.errors import ConfigError
from kvoffload.events import (
    KVEventsConfig,
    NullEventPublisher,
    create_event_publisher,
    offset_endpoint,
)
from kvoffload.events.config import INT_BLOCK_HASHES_ENV


def test_defaults_are_vllms_but_on_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's defaults, except the address: loopback, not every interface (events carry every
    prompt's token ids); ``bind``, ours, unset; block hashes as ints, as vLLM publishes them."""
    monkeypatch.delenv(INT_BLOCK_HASHES_ENV, raising=False)
    config = KVEventsConfig()
    assert dataclasses.asdict(config) == {
        "enable_kv_cache_events": False,
        "publisher": "null",
        "endpoint": "tcp://127.0.0.1:5557",
        "replay_endpoint": None,
        "buffer_steps": 10_000,
        "hwm": 100_000,
        "max_queue_size": 100_000,
        "topic": "",
        "legacy_array_events": False,
        "int_block_hashes": True,
        "bind": None,
    }


@pytest.mark.parametrize(("value", "as_int"), [("0", False), (" 0 ", False), ("1", True),
                                               ("7", True)])
def test_unset_int_block_hashes_follow_vllms_variable(
    monkeypatch: pytest.MonkeyPatch, value: str, as_int: bool
) -> None:
    """Unset, ``int_block_hashes`` is what vLLM publishes in the same environment: ints unless
    VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES is 0 (vLLM reads it with ``bool(int(value))``); given,
    it wins over the variable."""
    monkeypatch.setenv(INT_BLOCK_HASHES_ENV, value)
    assert KVEventsConfig(enable_kv_cache_events=True).int_block_hashes is as_int
    assert KVEventsConfig.from_json('{"enable_kv_cache_events": true}').int_block_hashes is as_int
    given = KVEventsConfig(enable_kv_cache_events=True, int_block_hashes=not as_int)
    assert given.int_block_hashes is not as_int


def test_a_variable_vllm_could_not_read_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(INT_BLOCK_HASHES_ENV, "yes")
    with pytest.raises(ConfigError) as info:
        KVEventsConfig(enable_kv_cache_events=True)
    assert info.value.field == INT_BLOCK_HASHES_ENV
    given = KVEventsConfig(enable_kv_cache_events=True, int_block_hashes=False)
    assert given.int_block_hashes is False  # given: not read


@pytest.mark.parametrize("value", ["true", "yes", ""])
def test_the_variable_is_read_only_when_events_are_enabled(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    """As vLLM reads it only when it publishes: with events off, a value it could not read stops
    nothing (every engine builds a config), and the unset field is vLLM's default, ints."""
    monkeypatch.setenv(INT_BLOCK_HASHES_ENV, value)
    assert KVEventsConfig().int_block_hashes is True
    assert KVEventsConfig.from_json('{"publisher": "zmq"}').int_block_hashes is True
    assert KVEventsConfig(int_block_hashes=False).int_block_hashes is False


def test_enabled_without_publisher_means_zmq() -> None:
    assert KVEventsConfig(enable_kv_cache_events=True).publisher == "zmq"
    assert KVEventsConfig(enable_kv_cache_events=True, publisher="null").publisher == "null"


def test_from_json_with_vllm_string_booleans() -> None:
    config = KVEventsConfig.from_json(
        '{"enable_kv_cache_events": "True", "publisher": "zmq", "topic": "kv-events",'
        ' "replay_endpoint": "tcp://*:5558", "buffer_steps": "500", "int_block_hashes": "false",'
        ' "legacy_array_events": 1}'
    )
    assert config.enable_kv_cache_events is True
    assert config.topic == "kv-events"
    assert config.replay_endpoint == "tcp://*:5558"
    assert config.buffer_steps == 500
    assert config.int_block_hashes is False
    assert config.legacy_array_events is True
    assert KVEventsConfig.from_json(config.to_json()) == config


@pytest.mark.parametrize("text", ["true", "TRUE", "1", "yes", "on", " True "])
def test_truthy_strings(text: str) -> None:
    assert KVEventsConfig.from_dict({"enable_kv_cache_events": text}).enable_kv_cache_events is True


@pytest.mark.parametrize("text", ["false", "False", "0", "no", "off"])
def test_falsy_strings(text: str) -> None:
    assert KVEventsConfig.from_dict({"int_block_hashes": text}).int_block_hashes is False


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"enable_kv_cache_events": "maybe"}, "enable_kv_cache_events"),
        ({"enable_kv_cache_events": 2}, "enable_kv_cache_events"),
        ({"legacy_array_events": None}, "legacy_array_events"),
        ({"int_block_hashes": []}, "int_block_hashes"),
        ({"publisher": "kafka"}, "publisher"),
        ({"endpoint": "http://localhost:5557"}, "endpoint"),
        ({"endpoint": 5557}, "endpoint"),
        ({"endpoint": "tcp://"}, "endpoint"),
        ({"replay_endpoint": "localhost:5558"}, "replay_endpoint"),
        ({"buffer_steps": -1}, "buffer_steps"),
        ({"buffer_steps": 1.5}, "buffer_steps"),
        ({"hwm": True}, "hwm"),
        ({"hwm": "lots"}, "hwm"),
        ({"max_queue_size": 0}, "max_queue_size"),
        ({"topic": 3}, "topic"),
        ({"enable_kv_cache_event": True}, "enable_kv_cache_event"),  # a typo: unknown field
    ],
)
def test_bad_values_name_the_field(values: dict, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        KVEventsConfig.from_dict(values)
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '"zmq"'])
def test_from_json_rejects_what_is_not_an_object(text: str) -> None:
    with pytest.raises(ConfigError) as info:
        KVEventsConfig.from_json(text)
    assert info.value.field == "kv_events_config"


def test_config_is_immutable() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        KVEventsConfig().topic = "x"  # type: ignore[misc]


@pytest.mark.parametrize(
    "config",
    [
        KVEventsConfig(),
        KVEventsConfig(publisher="zmq"),
        KVEventsConfig(enable_kv_cache_events=True, publisher="null"),
    ],
)
def test_factory_returns_a_null_publisher_unless_zmq_is_enabled(config: KVEventsConfig) -> None:
    with create_event_publisher(config) as publisher:
        assert isinstance(publisher, NullEventPublisher)


def test_endpoints_are_offset_by_data_parallel_rank() -> None:
    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint("tcp://*:5557", 3) == "tcp://*:5560"
    assert offset_endpoint("tcp://[::1]:5557", 1) == "tcp://[::1]:5558"
    assert offset_endpoint("tcp://127.0.0.1:*", 2) == "tcp://127.0.0.1:*"  # ephemeral: no offset
    assert offset_endpoint("ipc:///tmp/kv", 2) == "ipc:///tmp/kv_dp2"
    assert offset_endpoint("inproc://kv", 1) == "inproc://kv_dp1"
