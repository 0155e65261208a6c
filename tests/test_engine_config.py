"""``EngineConfig``'s unit spellings and the deprecated aliases of the previous release."""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from typing import Any

import pytest
from engine_cases import one_thread  # noqa: F401 - autouse fixture

from kvoffload.engine import Engine, EngineConfig
from kvoffload.engine.config import RENAMED_SETTINGS
from kvoffload.errors import ConfigError

#: An old spelling with a value its setting accepts (the TTL needs a URL: not connected here).
OLD_VALUES: dict[str, Any] = {
    "kv_lookup_retry_seconds": 7.5,
    "kv_remote_ttl": 30.0,
    "kv_remote_lookup_wait": 0.5,
    "log_stats_interval": 3.0,
}
NEEDS: dict[str, dict[str, Any]] = {"kv_remote_ttl": {"kv_remote_url": "redis://127.0.0.1:1", "kv_offloading_size": 0.01}}


def test_every_duration_is_in_seconds_named_s() -> None:
    """The unit rule: a duration field ends in ``_s``; the aliases map old spellings onto it."""
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    assert set(RENAMED_SETTINGS.values()) <= names
    assert not set(RENAMED_SETTINGS) & names
    assert not [n for n in names if n.endswith(("_seconds", "_interval", "_ttl", "_wait"))]
    assert set(OLD_VALUES) == set(RENAMED_SETTINGS)


@pytest.mark.parametrize("old", sorted(RENAMED_SETTINGS))
def test_old_spelling_is_a_deprecated_alias(old: str) -> None:
    new = RENAMED_SETTINGS[old]
    with pytest.warns(DeprecationWarning, match=f"'{old}' is deprecated.*use '{new}'") as record:
        config = EngineConfig(**{old: OLD_VALUES[old]}, **NEEDS.get(old, {}))
    assert getattr(config, new) == OLD_VALUES[old]
    assert record[0].filename == __file__  # points at the caller, not at kvoffload
    assert config == EngineConfig(**{new: OLD_VALUES[old]}, **NEEDS.get(old, {}))


def test_engine_accepts_the_old_spelling_and_warns_at_its_caller() -> None:
    with pytest.warns(DeprecationWarning, match="use 'kv_lookup_retry_s'") as record:
        engine = Engine("tiny", block_size=4, num_device_blocks=8, kv_lookup_retry_seconds=9.0)
    with engine:
        assert engine.config.kv_lookup_retry_s == 9.0
    assert [r.filename for r in record] == [__file__]  # one warning, at this line


def test_both_spellings_at_once_are_refused_naming_the_new_one() -> None:
    with pytest.raises(ConfigError) as info, warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        EngineConfig(log_stats_interval=1.0, log_stats_interval_s=2.0)  # type: ignore[call-arg]
    assert info.value.field == "log_stats_interval_s"
    with pytest.raises(ConfigError) as info:
        Engine("tiny", kv_lookup_retry_seconds=1.0, kv_lookup_retry_s=2.0)
    assert info.value.field == "kv_lookup_retry_s"


def test_new_spellings_do_not_warn_and_errors_name_them() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        EngineConfig(kv_lookup_retry_s=1.0, log_stats_interval_s=1.0)
    for name in RENAMED_SETTINGS.values():
        negative: dict[str, Any] = {name: -1.0}
        with pytest.raises(ConfigError) as info:
            EngineConfig(**negative, kv_remote_url="redis://127.0.0.1:1", kv_offloading_size=1)
        assert info.value.field == name
    with pytest.raises(ConfigError) as info, pytest.warns(DeprecationWarning):
        EngineConfig(kv_remote_lookup_wait=0.0)  # type: ignore[call-arg]  # refused under its new name
    assert info.value.field == "kv_remote_lookup_wait_s"


def test_signature_and_fields_show_the_new_names_only() -> None:
    params = inspect.signature(EngineConfig).parameters
    assert set(RENAMED_SETTINGS.values()) <= set(params)
    assert not set(RENAMED_SETTINGS) & set(params)


def test_a_typo_is_still_refused() -> None:
    with pytest.raises(ConfigError) as info:
        Engine("tiny", kv_lookup_retry_second=1.0)
    assert info.value.field == "kv_lookup_retry_second"
