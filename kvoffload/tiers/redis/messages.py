"""What the remote tier says about Redis failures: the cause of a failed key, and one line, in
our words, for a server that cannot be used at start. Passwords never appear (every message
shows the URL redacted and scrubs the server's text)."""

from __future__ import annotations

import ssl
from typing import Any

from kvoffload.tiers.redis.connection import RespError, RespErrorRaised
from kvoffload.tiers.redis.url import PASSWORD_ENV, USERNAME_ENV, RedisURL

__all__ = ["cluster_node_problem", "connect_problem", "failure_cause"]


def failure_cause(result: Any) -> str:
    """The :class:`~kvoffload.tiers.contract.TierJobResult` cause of a failed command's result: an
    ``OSError`` (``"timeout"`` or ``"io"``) or an error reply (``OOM``: ``"full"``;
    ``WRONGTYPE``, a value that is not a string: ``"corrupt"``; any other: ``"io"``)."""
    if isinstance(result, TimeoutError):
        return "timeout"
    if isinstance(result, RespError):
        if result.kind == "OOM":
            return "full"
        if result.kind == "WRONGTYPE":
            return "corrupt"
    return "io"


def _standalone_url(url: RedisURL) -> str:
    host, port = url.nodes[0]
    host = f"[{host}]" if ":" in host else host
    return f"{'rediss' if url.tls else 'redis'}://{host}:{port}/0"


def cluster_node_problem(url: RedisURL) -> str:
    """A standalone URL names a Cluster node (whose other slots live on other nodes)."""
    cluster = url.redacted().replace("://", "+cluster://", 1).rsplit("/", 1)[0]
    return (
        f"{url.redacted()} is a Redis Cluster node: use {cluster} (as a single server it would "
        "answer MOVED for the keys other nodes serve, and their stores would be dropped)"
    )


def connect_problem(url: RedisURL, exc: BaseException, optional: bool) -> str:
    """One line saying why the server at ``url`` cannot be used; ``optional``: the engine runs
    on without the tier (so the advice to set ``kv_remote_optional`` is left out)."""
    where = url.redacted()
    if isinstance(exc, RespErrorRaised):
        return _refusal(url, exc.error)
    text = url.scrub(str(exc)) or type(exc).__name__
    if isinstance(exc, ssl.SSLCertVerificationError) or "CERTIFICATE_VERIFY_FAILED" in text:
        ca = dict(url.tls_options).get("ssl_ca_certs")
        trusted = f"ssl_ca_certs={ca}" if ca else "the system's CAs (no ssl_ca_certs given)"
        return (
            f"{where}: the server's TLS certificate did not verify against {trusted}: {text} "
            "(give the CA that signed it in kv_remote_url: "
            "rediss://host:port/db?ssl_ca_certs=/path/to/ca.pem)"
        )
    if isinstance(exc, ssl.SSLError):
        return f"{where}: the TLS handshake failed: {text} (is it a TLS port?)"
    advice = "start the server or fix the URL"
    if not optional:
        advice = "start the server, fix the URL, or set kv_remote_optional to run without the tier"
    return f"cannot reach {where}: {text} ({advice})"


def _refusal(url: RedisURL, error: RespError) -> str:
    where, text = url.redacted(), url.scrub(error.text)
    if error.kind == "NOAUTH" or "must be called with the client already authenticated" in text:
        return (
            f"{where}: the server requires a password and none was given (put it in the URL, "
            f"redis://:PASSWORD@host:port/db, or in {PASSWORD_ENV})"
        )
    if "without any password configured" in text or "no password is set" in text:
        return (
            f"{where}: a password was given (in the URL or {PASSWORD_ENV}) but the server has "
            "none configured: remove it"
        )
    if error.kind == "WRONGPASS" or "invalid password" in text or "invalid username" in text:
        return (
            f"{where}: the server refused the credentials (from the URL or the "
            f"{USERNAME_ENV} / {PASSWORD_ENV} environment): {text}"
        )
    if "cluster support disabled" in text:
        return f"{where}: the server is not in Cluster mode ({text}): use {_standalone_url(url)}"
    return f"{where}: the server refused the connection: {text}"
