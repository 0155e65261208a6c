"""The Redis / Valkey tier: blocks shared by every engine on a server or Cluster
(``docs/remote-tier.md``). "Remote" names where its blocks live (events' locality ``remote``);
"Redis" names what holds them.

Two halves, importing downward only:

* **The tier** (what it stores and knows): :mod:`~kvoffload.tiers.redis.tier` (:class:`RedisTier`,
  the tier contract), :mod:`~kvoffload.tiers.redis.config` (:class:`RemoteTierConfig`, key
  prefixes), :mod:`~kvoffload.tiers.redis.blocks` (blocks as values),
  :mod:`~kvoffload.tiers.redis.answers` (what it knows of the server's keys),
  :mod:`~kvoffload.tiers.redis.admin` (dropping a namespace) and
  :mod:`~kvoffload.tiers.redis.clear` (dropping one layout's blocks), both over
  :mod:`~kvoffload.tiers.redis.unlink` (``SCAN`` then ``UNLINK`` on every master).
* **The wire** (how it talks): :mod:`~kvoffload.tiers.redis.transport` (pipelines, pooling,
  fan-out), :mod:`~kvoffload.tiers.redis.connection` (RESP over one socket),
  :mod:`~kvoffload.tiers.redis.topology` (Cluster slots), :mod:`~kvoffload.tiers.redis.url`
  (``kv_remote_url`` without its credentials) and :mod:`~kvoffload.tiers.redis.messages` (failure
  causes, one line each).
"""

from kvoffload._lazy import lazy_exports

__all__ = ["VALUE_ALIGN", "RedisTier", "RemoteTierConfig", "remote_key_prefix"]

# The tier loads on first use: the wire modules import without it.
__getattr__, __dir__ = lazy_exports(__name__, dict.fromkeys(__all__, "kvoffload.tiers.redis.tier"))
