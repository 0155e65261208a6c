"""Parsing of ``kv_remote_url``: the accepted forms, clear errors, and passwords never shown."""

from __future__ import annotations

import string
from urllib.parse import quote

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from kvoffload.errors import ConfigError
from kvoffload.tiers.redis.url import PASSWORD_ENV, USERNAME_ENV, RedisURL, parse_redis_url


def test_standalone_forms() -> None:
    url = parse_redis_url("redis://cache.local", env={})
    assert url == RedisURL(False, False, (("cache.local", 6379),), 0)
    url = parse_redis_url("rediss://user:pw@10.0.0.1:7000/3", env={})
    assert (url.tls, url.cluster, url.nodes, url.db) == (True, False, (("10.0.0.1", 7000),), 3)
    assert (url.username, url.password) == ("user", "pw")
    assert parse_redis_url("redis://:pw@h", env={}).password == "pw"
    assert parse_redis_url("redis://pw@h", env={}).password == "pw"  # redis-cli's -a style
    assert parse_redis_url("redis://[::1]:6380", env={}).nodes == (("::1", 6380),)


def test_cluster_forms() -> None:
    url = parse_redis_url("redis+cluster://a:7000,b:7001,[::1]:7002", env={})
    assert url.cluster and url.nodes == (("a", 7000), ("b", 7001), ("::1", 7002))
    assert url.redacted() == "redis+cluster://a:7000,b:7001,[::1]:7002"
    assert parse_redis_url("rediss+cluster://h:1/0", env={}).tls


def test_credentials_from_environment_when_the_url_has_none() -> None:
    env = {USERNAME_ENV: "svc", PASSWORD_ENV: "from-env"}
    url = parse_redis_url("redis://h", env=env)
    assert (url.username, url.password) == ("svc", "from-env")
    assert parse_redis_url("redis://u:mine@h", env=env).password == "mine"


def test_tls_options(tmp_path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("a CA")
    url = parse_redis_url(f"rediss://h?ssl_cert_reqs=none&ssl_ca_certs={ca}", env={})
    assert dict(url.tls_options) == {"ssl_cert_reqs": "none", "ssl_ca_certs": str(ca)}


def test_namespace_option_on_every_scheme(tmp_path) -> None:
    """``namespace=NAME`` names where the keys live; shown (it is no secret), default empty."""
    assert parse_redis_url("redis://h", env={}).namespace == ""
    url = parse_redis_url("redis://:pw@h:1/2?namespace=bench-1.a_b", env={})
    assert (url.namespace, url.db, url.tls_options) == ("bench-1.a_b", 2, ())
    assert url.redacted() == "redis://:***@h:1/2?namespace=bench-1.a_b"
    assert parse_redis_url("redis+cluster://a:1,b:2?namespace=x", env={}).namespace == "x"
    ca = tmp_path / "ca.pem"
    ca.write_text("a CA")
    url = parse_redis_url(f"rediss://h?ssl_ca_certs={ca}&namespace=n", env={})
    assert (url.namespace, dict(url.tls_options)) == ("n", {"ssl_ca_certs": str(ca)})


def test_a_namespace_keeps_the_keys_apart() -> None:
    from kvoffload.tiers.contract import KVLayout
    from kvoffload.tiers.redis.config import remote_key_prefix

    layout = KVLayout("m", "float32", 4, 1, 1, 8, 64)
    plain, spaced = remote_key_prefix(layout), remote_key_prefix(layout, "run-1")
    assert spaced == b"kvo:run-1:" + plain[len(b"kvo:") :]
    assert remote_key_prefix(layout, "run-2") != spaced


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("redis://h?namespace=", "namespace must be"),
        ("redis://h?namespace=a:b", "namespace must be"),
        ("redis://h?namespace=" + "n" * 65, "namespace must be"),
        ("redis://h?namespace=a&namespace=b", "namespace is given 2 times"),
        ("http://h", "not a Redis URL"),
        ("h:6379", "not a Redis URL"),
        ("redis://", "no host"),
        ("redis://h:0", "bad port"),
        ("redis://h:99999", "bad port"),
        ("redis://h:x", "bad port"),
        ("redis://a:1,b:2", "redis\\+cluster"),
        ("redis://h/db1", "db number"),
        ("redis+cluster://h:1/2", "db 0 only"),
        ("redis://h?ssl_cert_reqs=none", "needs the rediss"),
        ("rediss://h?ssl_cert_reqs=maybe", "ssl_cert_reqs"),
        ("redis://h?timeout=3", "unknown option"),
        ("rediss://h?ssl_ca_certs=/no/ca.pem", "ssl_ca_certs='/no/ca.pem' .*no such file"),
        ("rediss://h?ssl_certfile=/no/c.pem", "ssl_certfile='/no/c.pem' .*no such file"),
        ("rediss://h?ssl_keyfile=/no/k.pem", "ssl_keyfile='/no/k.pem' .*no such file"),
    ],
)
def test_bad_urls_name_the_setting(url: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match) as info:
        parse_redis_url(url, env={})
    assert info.value.field == "kv_remote_url"


_secret = st.text(string.ascii_letters + string.digits + "!$%&*+-.~", min_size=6, max_size=30)


@given(password=_secret, user=st.sampled_from(["", "alice"]), bad_port=st.booleans())
def test_the_password_is_never_shown(password: str, user: str, bad_port: bool) -> None:
    text = f"redis://{user}:{quote(password, safe='')}@host:{'x' if bad_port else 1}/0"
    try:
        url = parse_redis_url(text, env={})
    except ConfigError as exc:
        assert password not in str(exc) and quote(password, safe="") not in str(exc)
        return
    assert password not in url.redacted() and password not in repr(url)
    assert url.scrub(f"error near {password}!") == "error near ***!"


@given(password=_secret)
def test_the_tier_config_never_shows_the_password(password: str) -> None:
    from kvoffload.tiers.redis.config import RemoteTierConfig

    assume(password not in repr(RemoteTierConfig(url="redis://alice:x@host:1/0")))  # "Remote"
    config = RemoteTierConfig(url=f"redis://alice:{quote(password, safe='')}@host:1/0")
    for text in (repr(config), str(config)):
        assert password not in text and quote(password, safe="") not in text
        assert "redis://alice:***@host:1/0" in text
