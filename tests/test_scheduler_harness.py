"""The fake engine's checks can fail: each test breaks one thing on purpose (in the worker, the
connector's output or the manager) and expects the harness to notice. Without these, a green
scheduler suite could mean a blind oracle.
"""

from __future__ import annotations

from typing import Any

import pytest
from fake_engine import FakeEngine, TransferExecutor, make_tokens, single_group

from kvoffload.scheduler import ConnectorUpdate
from kvoffload.transfer import ConnectorMetadata, TransferJob


def mid_block_hit(engine: FakeEngine) -> None:
    """A's 4 offloaded blocks are in the tier, 5 of its engine blocks cached: B loads from the
    middle of offloaded block 1 (the mid-block scenario of ``test_scheduler_loads.py``)."""
    prompt = make_tokens(49, 1)
    engine.add_request(prompt, max_tokens=1)
    engine.run()
    engine.evict_free_blocks(7)
    engine.add_request([*prompt, 7, 8, 9], max_tokens=2, req_id="b")
    engine.run()


def test_sound_run_passes() -> None:
    mid_block_hit(FakeEngine(single_group(4, 3), num_engine_blocks=32))


def test_oracle_catches_a_load_that_ignores_the_page_offset(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pages = TransferExecutor._pages

    def no_skip(self: TransferExecutor, job: TransferJob) -> list[tuple[int, int, int, int]]:
        out = pages(self, job)
        if job.is_store:
            return out
        f = self.engine.config.groups[0].block_size_factor
        slots = list(dict.fromkeys(s for _, _, s, _ in out))
        return [(g, bid, slots[i // f], i % f) for i, (g, bid, _, _) in enumerate(out)]

    monkeypatch.setattr(TransferExecutor, "_pages", no_skip)
    with pytest.raises(AssertionError, match=r"holds .* expected"):
        mid_block_hit(FakeEngine(single_group(4, 3), num_engine_blocks=32))


def test_oracle_catches_a_failed_load_reported_as_loaded() -> None:
    engine = FakeEngine(single_group(4), fail=lambda job, w: not job.is_store)
    update = engine.connector.update_connector_output

    def lying(results: Any) -> ConnectorUpdate:
        out = update(results)
        return ConnectorUpdate(out.loaded + out.failed_loads, [], out.freed)

    engine.connector.update_connector_output = lying  # type: ignore[method-assign]
    with pytest.raises(AssertionError, match=r"holds .* expected"):
        mid_block_hit(engine)


def test_reuse_check_catches_a_missing_flush() -> None:
    engine = FakeEngine(single_group(4), num_engine_blocks=16, store_delay=None)
    build = engine.connector.build_connector_meta

    def no_flush(output: Any) -> ConnectorMetadata:
        meta = build(output)
        return ConnectorMetadata(meta.load_jobs, meta.store_jobs, [])

    engine.connector.build_connector_meta = no_flush  # type: ignore[method-assign,assignment]
    engine.add_request(make_tokens(17, 1), max_tokens=30)
    engine.add_request(make_tokens(33, 2), max_tokens=30)
    with pytest.raises(AssertionError, match="reallocated while a transfer uses it"):
        engine.run()


def test_tier_check_catches_a_failed_store_made_readable() -> None:
    engine = FakeEngine(single_group(4), fail=lambda job, w: job.is_store)
    complete_store = engine.manager.complete_store
    engine.manager.complete_store = lambda keys, ctx, success=True: complete_store(keys, ctx, True)  # type: ignore[method-assign]
    engine.add_request(make_tokens(9, 1))
    with pytest.raises(AssertionError, match="holds wrong data"):
        engine.run()


def test_block_accounting_catches_blocks_never_freed() -> None:
    engine = FakeEngine(single_group(4), load_delay=None)
    prompt = make_tokens(17, 1)
    engine.add_request(prompt)
    engine.run()
    engine.drop_prefix_cache()
    engine.add_request([*prompt, 1], req_id="b")
    engine.step()
    engine.abort("b")  # during its load: blocks kept until the connector frees it
    free_blocks = engine._free_blocks
    engine._free_blocks = lambda req: None if req.request_id == "b" else free_blocks(req)  # type: ignore[method-assign]
    engine.executor.complete()
    with pytest.raises(AssertionError, match=r"engine block .*: ref 1 != 0"):
        engine.run()
