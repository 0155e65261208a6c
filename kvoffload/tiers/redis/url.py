"""Parsing of the remote tier's URL (``kv_remote_url``) without ever showing its credentials.

Accepted forms (redis-py's own schemes, plus ``+cluster`` for Cluster mode, which redis-py's
``RedisCluster`` takes as a list of seed nodes rather than one URL)::

    redis://[[user]:password@]host[:port][/db]           standalone, plain TCP
    rediss://[[user]:password@]host[:port][/db]          standalone, TLS
    redis+cluster://[[user]:password@]host:port[,host:port...]   Cluster, plain TCP (db 0 only)
    rediss+cluster://...                                          Cluster, TLS

The port defaults to 6379, the db to 0. Credentials missing from the URL are taken from the
environment variables :data:`USERNAME_ENV` and :data:`PASSWORD_ENV` (so they need not appear on a
command line). ``rediss`` URLs accept the query options ``ssl_ca_certs``, ``ssl_certfile``,
``ssl_keyfile`` (files that must exist) and ``ssl_cert_reqs`` (``none``, ``optional``,
``required``), as redis-py names them: ``rediss://host:6380/0?ssl_ca_certs=/etc/ssl/ca.pem``
trusts the CA that signed the server's certificate (without it, the system's CAs). Every scheme
accepts ``namespace=NAME`` (letters, digits, ``-``, ``_``, ``.``; at most 64): the tier's keys get
``NAME:`` after ``kvo:``, so engines with different namespaces share no blocks on one server
(``bench throughput --compare`` gives each run a fresh one).

Invariant: :meth:`RedisURL.redacted` and ``repr`` never contain the password; error messages of
this module name the setting and show the URL with the password replaced by ``***``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, quote, unquote

from kvoffload.errors import ConfigError

__all__ = [
    "DEFAULT_PORT",
    "PASSWORD_ENV",
    "SETTING",
    "USERNAME_ENV",
    "RedisURL",
    "parse_redis_url",
    "redacted_url",
]

#: The setting every error names (the EngineConfig field; ``--kv-remote-url`` on the CLI).
SETTING = "kv_remote_url"
USERNAME_ENV = "KVOFFLOAD_REMOTE_USERNAME"
PASSWORD_ENV = "KVOFFLOAD_REMOTE_PASSWORD"
DEFAULT_PORT = 6379

_SCHEMES = {
    "redis": (False, False),
    "rediss": (True, False),
    "redis+cluster": (False, True),
    "rediss+cluster": (True, True),
}
_TLS_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs")
_TLS_FILES = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile")
_CERT_REQS = ("none", "optional", "required")
_NAMESPACE_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")
_NAMESPACE_MAX = 64


@dataclass(frozen=True, slots=True)
class RedisURL:
    """A parsed ``kv_remote_url``. ``nodes`` holds one address, or the Cluster's seed nodes."""

    tls: bool
    cluster: bool
    nodes: tuple[tuple[str, int], ...]
    db: int = 0
    username: str | None = field(default=None, repr=False)
    password: str | None = field(default=None, repr=False)
    tls_options: tuple[tuple[str, str], ...] = ()
    #: Keys are stored under ``kvo:NAMESPACE:`` (``""``: under ``kvo:``).
    namespace: str = ""

    def redacted(self) -> str:
        """The URL with the password shown as ``***`` (the username is kept)."""
        scheme = ("rediss" if self.tls else "redis") + ("+cluster" if self.cluster else "")
        auth = ""
        if self.username or self.password:
            auth = quote(self.username or "", safe="") + (":***" if self.password else "") + "@"
        hosts = ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in self.nodes)
        db = "" if self.cluster else f"/{self.db}"
        namespace = f"?namespace={self.namespace}" if self.namespace else ""
        return f"{scheme}://{auth}{hosts}{db}{namespace}"

    def scrub(self, text: str) -> str:
        """``text`` with every occurrence of the password replaced by ``***``."""
        if not self.password:
            return text
        return text.replace(self.password, "***").replace(quote(self.password, safe=""), "***")

    def __repr__(self) -> str:
        return f"RedisURL({self.redacted()!r})"


def redacted_url(url: str) -> str:
    """``url`` as it may be shown: the password (plain or percent-encoded) replaced by ``***``,
    whether or not the URL parses; the environment is not read."""
    try:
        return parse_redis_url(url, env={}).redacted()
    except ConfigError:
        return _shown(url)


def _shown(url: str) -> str:
    """``url`` with anything that may be a password (the part before ``@``) hidden."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return "<not a URL>"
    netloc, slash, path = rest.partition("/")
    if "@" in netloc:
        netloc = "***@" + netloc.rpartition("@")[2]
    return f"{scheme}://{netloc}{slash}{path.split('?')[0]}"


def _parse_host_port(text: str, url: str) -> tuple[str, int]:
    if text.startswith("["):  # [IPv6]:port
        host, _, rest = text[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
    else:
        host, _, port_text = text.rpartition(":") if ":" in text else (text, "", "")
    if not host:
        raise ConfigError(SETTING, f"no host in {_shown(url)}")
    if not port_text:
        return host, DEFAULT_PORT
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ConfigError(SETTING, f"bad port {port_text!r} in {_shown(url)}")
    return host, int(port_text)


def parse_redis_url(url: str, env: Mapping[str, str] | None = None) -> RedisURL:
    """Parse ``url`` (see the module docstring); :class:`ConfigError` naming ``kv_remote_url``
    and showing the URL without its password on any problem. ``env`` defaults to
    ``os.environ``."""
    env = os.environ if env is None else env
    if not isinstance(url, str):
        raise ConfigError(SETTING, f"must be a string URL, got {type(url).__name__}")
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in _SCHEMES:
        raise ConfigError(
            SETTING,
            f"{_shown(url)} is not a Redis URL; use one of "
            + ", ".join(f"{s}://" for s in _SCHEMES),
        )
    tls, cluster = _SCHEMES[scheme.lower()]
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    userinfo, at, hosts_text = netloc.rpartition("@")
    username = password = None
    if at:
        user_text, colon, pass_text = userinfo.partition(":")
        username = unquote(user_text) or None
        password = unquote(pass_text) if colon else None
        if not colon and username is not None:  # redis://secret@host: a password alone
            username, password = None, username
    username = username or env.get(USERNAME_ENV) or None
    password = password or env.get(PASSWORD_ENV) or None

    hosts = [h for h in hosts_text.split(",") if h]
    if not hosts:
        raise ConfigError(SETTING, f"no host in {_shown(url)}")
    if len(hosts) > 1 and not cluster:
        raise ConfigError(SETTING, f"several hosts need the redis+cluster:// scheme: {_shown(url)}")
    nodes = tuple(_parse_host_port(h, url) for h in hosts)

    path = path.strip("/")
    if path and (not path.isdigit()):
        raise ConfigError(SETTING, f"the path must be a db number, got {path!r} in {_shown(url)}")
    db = int(path) if path else 0
    if cluster and db:
        raise ConfigError(SETTING, f"Redis Cluster has db 0 only, got /{db} in {_shown(url)}")

    options = parse_qsl(query, keep_blank_values=True)
    namespace = _namespace(options, url)
    options = [(name, value) for name, value in options if name != "namespace"]
    for name, value in options:
        if name not in _TLS_OPTIONS:
            raise ConfigError(
                SETTING,
                f"unknown option {name!r} in {_shown(url)}; known: {(*_TLS_OPTIONS, 'namespace')}",
            )
        if not tls:
            raise ConfigError(SETTING, f"{name} needs the rediss:// scheme (TLS)")
        if name == "ssl_cert_reqs" and value not in _CERT_REQS:
            raise ConfigError(SETTING, f"ssl_cert_reqs must be one of {_CERT_REQS}, got {value!r}")
        if name in _TLS_FILES and not os.path.isfile(value):
            raise ConfigError(SETTING, f"{name}={value!r} in {_shown(url)}: no such file")
    return RedisURL(tls, cluster, nodes, db, username, password, tuple(options), namespace)


def _namespace(options: list[tuple[str, str]], url: str) -> str:
    """The ``namespace`` option's value (``""`` without one); one at most, of safe characters."""
    values = [value for name, value in options if name == "namespace"]
    if not values:
        return ""
    if len(values) > 1:
        raise ConfigError(SETTING, f"namespace is given {len(values)} times in {_shown(url)}")
    value = values[0]
    if not value or len(value) > _NAMESPACE_MAX or not set(value) <= _NAMESPACE_CHARS:
        raise ConfigError(
            SETTING,
            f"namespace must be 1-{_NAMESPACE_MAX} letters, digits, '-', '_' or '.', got {value!r}",
        )
    return value
