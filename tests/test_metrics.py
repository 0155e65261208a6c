"""Prometheus metrics of a real engine: scraped over HTTP with a real client while the engine runs,
parsed with prometheus_client's parser, and checked against the engine's own counters and the KV
events it published (over real ZMQ sockets), with transfer failures injected for real."""

from __future__ import annotations

import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest
from engine_cases import (
    assert_same_outputs,
    cycling_rounds,
    greedy,
    host_gib,
    one_thread,  # noqa: F401 - autouse fixture
    reference_outputs,
    tiny_engine,
)
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from test_engine_events import Follower, _events_config

from kvoffload.engine import Engine
from kvoffload.errors import ConfigError
from kvoffload.events.messages import MEDIUM_CPU, BlockStored
from kvoffload.metrics import SOURCES, external_hits, hit_rates, stats_delta, tokens_by_source
from kvoffload.worker import FaultInjectingHandler

ROUNDS = cycling_rounds(num_prefixes=4, prefix_blocks=6, num_rounds=3, seed=11)
FLAT = [p for r in ROUNDS for p in r]
# One request at a time and room for every request's blocks: no preemption, so every request is
# admitted once and the per-request counts must add up to the engine-wide ones.
CYCLING = {"num_device_blocks": 24, "max_num_seqs": 1, "kv_offloading_size": host_gib(64)}

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str) -> Samples:
    """GET ``url`` and parse it: ``{(sample name, sorted labels): value}``."""
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        text = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def _inject(engine: Engine, direction: tuple[str, str], fail: Callable[[int], bool]) -> Any:
    assert engine.worker is not None
    router = engine.worker.offloading_worker
    handler = FaultInjectingHandler(router.handler(*direction), fail)
    router.register_handler(*direction, handler, replace=True)
    return handler


def _every_other(job_id: int) -> bool:
    return job_id % 2 == 0


@pytest.fixture(scope="module")
def reference() -> list:
    return reference_outputs(FLAT, greedy())


@pytest.mark.parametrize("fault", [None, "load", "store"])
def test_scraped_metrics_agree_with_counters_and_events(reference: list, fault: str | None) -> None:
    with (
        tiny_engine(**CYCLING, metrics_port=0, kv_events_config=_events_config()) as engine,
        Follower(engine) as follower,
    ):
        injected = None
        if fault == "load":
            injected = _inject(engine, ("CPU", "GPU"), _every_other)
        elif fault == "store":
            injected = _inject(engine, ("GPU", "CPU"), _every_other)
        server = engine.metrics_server
        assert server is not None
        # A scraper on another thread all along (exercises the snapshot lock), and scrapes from
        # this thread between steps, at known points of the run.
        stop, background = threading.Event(), []

        def keep_scraping() -> None:
            while not stop.is_set():
                background.append(scrape(server.url))

        thread = threading.Thread(target=keep_scraping)
        thread.start()
        try:
            outputs, mid_run = [], []
            for prompt in FLAT:
                engine.add_request(prompt, greedy())
                while engine.has_unfinished():
                    outputs += engine.step()
                    mid_run.append(
                        (
                            engine.stats()["steps"],
                            value(scrape(server.url), "kvoffload_engine_steps_total"),
                        )
                    )
            engine.drain()
        finally:
            stop.set()
            thread.join()
        assert background
        assert all(steps == scraped for steps, scraped in mid_run)
        outputs.sort(key=lambda o: int(o.request_id.split("-")[1]))
        assert_same_outputs(outputs, reference)

        stats = engine.stats()
        samples = scrape(server.url)
        follower.sync()
        assert stats["preemptions"] == 0
        # Counters: one definition, the same value everywhere.
        for metric, key in [
            ("kvoffload_offload_stored_blocks_total", "offload_stored_blocks"),
            ("kvoffload_offload_loaded_blocks_total", "offload_loaded_blocks"),
            ("kvoffload_offload_failed_loads_total", "offload_failed_loads"),
            ("kvoffload_offload_failed_stores_total", "offload_failed_stores"),
            ("kvoffload_offload_store_bytes_total", "offload_store_bytes"),
            ("kvoffload_prompt_tokens_total", "prompt_tokens"),
            ("kvoffload_generation_tokens_total", "output_tokens"),
            ("kvoffload_events_published_total", "events_published"),
        ]:
            assert value(samples, metric) == stats[key], metric
        tier = {"tier": "host"}
        stored_events = sum(
            len(e.block_hashes)
            for e in follower.events
            if isinstance(e, BlockStored) and e.medium == MEDIUM_CPU
        )
        assert (
            value(samples, "kvoffload_tier_stored_blocks_total", **tier)
            == stats["offload_tier_stored_blocks"]
            == stored_events
            > 0
        )
        assert (
            value(samples, "kvoffload_tier_used_blocks", **tier)
            == stats["offload_tier_used_blocks"]
        )
        assert (
            value(samples, "kvoffload_tier_capacity_blocks", **tier)
            == stats["offload_tier_capacity_blocks"]
        )
        assert (
            value(samples, "kvoffload_tier_failed_store_blocks_total", **tier)
            == stats["offload_tier_failed_store_blocks"]
        )
        # Injected failures are counted where they happened.
        if fault == "load":
            assert injected is not None
            assert stats["offload_failed_loads"] == len(injected.injected) > 0
            assert (
                value(samples, "kvoffload_offload_recomputed_tokens_total", tier="host")
                == stats["offload_failed_load_tokens_host"]
                > 0
            )
        elif fault == "store":
            assert injected is not None
            assert stats["offload_failed_stores"] == len(injected.injected) > 0
            assert stats["offload_tier_failed_store_blocks"] > 0
        else:
            assert stats["offload_failed_loads"] == stats["offload_failed_stores"] == 0
        # Tokens by source: the scraped series, the engine's counters and the requests agree.
        sources = tokens_by_source(stats)
        for source in SOURCES:
            assert (
                value(samples, "kvoffload_tokens_by_source_total", source=source) == sources[source]
            )
        assert sum(sources.values()) == stats["prefix_cache_queries"] == stats["prompt_tokens"]
        assert sources["device"] == sum(o.cached_tokens_engine for o in outputs)
        assert sources["host"] == sum(o.cached_tokens_offload for o in outputs) > 0
        assert sources["disk"] == sources["remote"] == 0
        rates = hit_rates(stats)
        missed = stats["prefix_cache_queries"] - stats["prefix_cache_hits"]
        assert rates["external"] == pytest.approx(sources["host"] / missed)
        assert value(samples, "kvoffload_external_prefix_cache_hits_total") == sources["host"]
        # Histograms: one TTFT per request, one ITL per later token.
        assert value(samples, "kvoffload_time_to_first_token_seconds_count") == len(FLAT)
        assert value(samples, "kvoffload_inter_token_latency_seconds_count") == sum(
            len(o.inter_token_latencies) for o in outputs
        )
        loads = stats["offload_load_jobs"] - stats["offload_failed_loads"]
        assert (
            value(samples, "kvoffload_offload_transfer_seconds_count", direction="CPU_to_GPU")
            == loads
        )
    # The server stopped with the engine.
    with pytest.raises(urllib.error.URLError):
        scrape(server.url)


def test_port_in_use_is_a_config_error_naming_the_setting() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match="metrics_port") as info:
            tiny_engine(num_device_blocks=16, kv_offloading_size=host_gib(8), metrics_port=port)
        assert str(port) in str(info.value)


@pytest.mark.parametrize(
    ("field", "bad"),
    [
        ("metrics_port", -1),
        ("metrics_port", 70000),
        ("metrics_port", "80"),
        ("log_stats_interval_s", -1.0),
    ],
)
def test_bad_metrics_settings_are_config_errors(field: str, bad: Any) -> None:
    with pytest.raises(ConfigError, match=field):
        tiny_engine(num_device_blocks=16, **{field: bad})


def test_registries_are_per_engine() -> None:
    with tiny_engine(num_device_blocks=16) as a, tiny_engine(num_device_blocks=16) as b:
        a.generate([[5] * 20], greedy(2))
        assert a.metrics.registry.get_sample_value("kvoffload_generation_tokens_total") == 2
        assert b.metrics.registry.get_sample_value("kvoffload_generation_tokens_total") == 0


def test_stats_line_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    with (
        caplog.at_level("INFO", logger="kvoffload.engine"),
        tiny_engine(
            num_device_blocks=24, kv_offloading_size=host_gib(16), log_stats_interval_s=1e-9
        ) as engine,
    ):
        engine.generate([[5] * 40, [5] * 40], greedy(3))
    lines = [r.getMessage() for r in caplog.records if r.name == "kvoffload.engine"]
    assert lines
    assert any("Prefix cache hit rate" in line and "host tier usage" in line for line in lines)


def test_stats_delta_keeps_gauges() -> None:
    before = {"prompt_tokens": 10, "device_blocks": 64, "offload_tier_capacity_blocks": 100}
    after = {"prompt_tokens": 25, "device_blocks": 64, "offload_tier_capacity_blocks": 100}
    assert stats_delta(before, after) == {
        "prompt_tokens": 15,
        "device_blocks": 64,
        "offload_tier_capacity_blocks": 100,
    }


def test_dashboard_queries_only_exported_metrics() -> None:
    """Every metric the Grafana dashboard queries is one an offloading engine exports."""
    import json
    import re
    from pathlib import Path

    dashboard = json.loads(
        (Path(__file__).parent.parent / "docs" / "grafana-dashboard.json").read_text()
    )
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    wanted = {m for e in exprs for m in re.findall(r"\bkvoffload_[a-z_]+", e)}
    with tiny_engine(
        num_device_blocks=24, kv_offloading_size=host_gib(16), metrics_port=0
    ) as engine:
        engine.generate([[5] * 40, [6] * 40], greedy(3))
        assert engine.metrics_server is not None
        exported = {name for name, _ in scrape(engine.metrics_server.url)}
    assert wanted and wanted <= exported, wanted - exported


@given(
    queries=st.integers(0, 10**6),
    device_share=st.floats(0, 1),
    tiers=st.dictionaries(
        st.sampled_from(["host", "disk", "remote", "other"]),
        st.tuples(st.integers(0, 10**5), st.integers(0, 10**5)),
    ),
)
def test_tokens_by_source_add_up(
    queries: int, device_share: float, tiers: dict[str, tuple[int, int]]
) -> None:
    """Whatever the counters, the sources sum to the queried tokens, every source of SOURCES is
    reported, each tier counts its planned tokens less its failed ones, and the hit rates are
    the shares the sources say."""
    device = int(queries * device_share)
    stats: dict[str, float] = {"prefix_cache_queries": queries, "prefix_cache_hits": device}
    for tier, (served, failed) in tiers.items():
        stats[f"offload_hit_tokens_{tier}"] = served + failed
        stats[f"offload_failed_load_tokens_{tier}"] = failed
    sources = tokens_by_source(stats)
    assert set(SOURCES) <= set(sources)
    assert sum(sources.values()) == queries
    assert sources["device"] == device
    for tier, (served, _) in tiers.items():
        assert sources[tier] == served
    rates = hit_rates(stats)
    if queries:
        assert rates["prefix_cache"] == device / queries
    missed = queries - device
    if missed:
        assert rates["external"] == pytest.approx(external_hits(sources) / missed)


def test_async_tier_lookups_and_promotions_are_summaries() -> None:
    """Round trips of an asynchronous tier's lookups (per tier) and promotions are exported as
    Prometheus summaries whose count and sum are the tiers' own counters."""
    from prometheus_client import CollectorRegistry, generate_latest

    from kvoffload.metrics.engine_collector import StatsCollector

    stats = {
        "offload_load_jobs": 1,
        "offload_tier_promotion_jobs": 4,
        "offload_tier_promotion_us": 2_500_000,
    }
    tiers = {
        "host": {"capacity_blocks": 8},
        "remote": {"lookup_round_trips": 3, "lookup_round_trip_us": 1_500_000},
    }
    registry = CollectorRegistry()
    registry.register(StatsCollector(lambda: (stats, tiers), 1024))
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for s in family.samples
    }
    remote = (("tier", "remote"),)
    assert samples[("kvoffload_tier_lookup_round_trip_seconds_count", remote)] == 3
    assert samples[("kvoffload_tier_lookup_round_trip_seconds_sum", remote)] == 1.5
    assert ("kvoffload_tier_lookup_round_trip_seconds_count", (("tier", "host"),)) not in samples
    assert samples[("kvoffload_tier_promotion_seconds_count", ())] == 4
    assert samples[("kvoffload_tier_promotion_seconds_sum", ())] == 2.5
