"""KV event throughput: end to end through ZMQ PUB -> SUB on loopback, and encode-only cost.

Each batch holds 100 self-describing ``BlockStored`` events (one 32-byte hash, a parent hash,
16 token ids each), the shape of an engine step that offloads 100 blocks. Measured in one run:

* encode only: msgpack bytes of one batch, map form (default) and legacy array form;
* decode only: what a subscriber pays per batch;
* ``publish()``: what the engine step pays per batch (queueing only; sending is on a thread);
* end to end: batches published back to back in this process, received and decoded by a
  :class:`~kvoffload.events.KVEventSubscriber` in a child process; events per second from the
  first publish to the last batch decoded, with the batches lost (0 expected) reported.

* engine step time, events on vs off: two engines with offloading, identical but for
  ``kv_events_config``, run the same rounds of requests (shared prefixes cycling through a small
  device cache and host tier, so both tiers store, load and evict), alternating which goes
  first each round; every ``step()`` is timed, drains included. The events engine publishes on
  ZMQ with no subscriber (``publish()`` only queues; sending is on the publisher's thread).

Run: ``.venv/bin/python benchmarks/events_throughput.py [--batches N] [--engine-rounds R]``
(``--engine-only`` for the step-time part alone, ``--engine-model tiny`` for a worst case where
a step costs about a millisecond). Asserts nothing.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import statistics
import time
from multiprocessing.connection import Connection

from kvoffload.events import (
    MEDIUM_CPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventDecoder,
    EventEncoder,
    KVEventBatch,
    KVEventSubscriber,
    ZmqEventPublisher,
)

EVENTS_PER_BATCH = 100
TOKENS_PER_EVENT = 16


def make_batch(step: int) -> KVEventBatch:
    """One engine step's events: 100 stored blocks of 16 tokens, chained by parent hash."""
    events: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
    for i in range(EVENTS_PER_BATCH):
        block = step * EVENTS_PER_BATCH + i
        events.append(
            BlockStored(
                block_hashes=[block.to_bytes(32, "big")],
                parent_block_hash=(block - 1).to_bytes(32, "big") if i else None,
                token_ids=list(range(block, block + TOKENS_PER_EVENT)),
                block_size=TOKENS_PER_EVENT,
                lora_id=None,
                medium=MEDIUM_CPU,
                lora_name=None,
                group_idx=0,
            )
        )
    return KVEventBatch(ts=time.time(), events=events)


def _per_call_us(fn, n: int, repeat: int = 5) -> float:
    """Best of ``repeat`` runs of ``n`` calls, in microseconds per call."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, time.perf_counter() - start)
    return best / n * 1e6


def _subscriber(endpoint: str, conn: Connection) -> None:
    """Child process: acknowledge a probe, then receive the announced range of batches."""
    with KVEventSubscriber(endpoint) as sub:
        while (probe := sub.receive(5.0)) is None:
            pass
        conn.send(("ready", probe.seq))
        first_seq, count = conn.recv()
        events = received = 0
        last_at = time.monotonic()
        deadline = last_at + 120
        while received < count and time.monotonic() < deadline:
            got = sub.receive(1.0)
            if got is None or got.seq < first_seq:
                continue
            received += 1
            events += len(got.batch.events)
            last_at = time.monotonic()
            if got.seq == first_seq + count - 1:
                break
        conn.send((last_at, received, events, sub.stats()["lost"]))


def end_to_end(num_batches: int, legacy: bool) -> tuple[float, int, int, int, float]:
    """Return (events/s, batches received, events received, batches lost, publish seconds)."""
    batches = [make_batch(step) for step in range(num_batches)]
    ctx = mp.get_context("spawn")
    with ZmqEventPublisher("tcp://127.0.0.1:*", legacy_array_events=legacy) as pub:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_subscriber, args=(pub.endpoint, child), daemon=True)
        proc.start()
        for _ in range(3000):  # probes until the subscription is live (slow-joiner)
            pub.publish(KVEventBatch(time.time(), []))
            if parent.poll(0.01):
                break
        parent.recv()
        time.sleep(0.2)  # let the remaining probes drain
        first_seq = pub.stats()["published"]
        parent.send((first_seq, num_batches))
        start = time.monotonic()
        for batch in batches:
            pub.publish(batch)
        publish_s = time.monotonic() - start
        last_at, received, events, lost = parent.recv()
        proc.join(10)
    return events / (last_at - start), received, events, lost, publish_s


def _timed_round(engine, prompts: list[list[int]], params) -> tuple[float, int, int]:
    """Run ``prompts`` to completion and drain; return (seconds in step(), steps, batches published)."""
    published = engine.publisher.stats()["published"]
    for prompt in prompts:
        engine.add_request(prompt, params)
    spent, steps = 0.0, 0
    while engine.has_unfinished() or engine.connector.has_pending_jobs() or engine.scheduler.held:
        start = time.perf_counter()
        engine.step()
        spent += time.perf_counter() - start
        steps += 1
    return spent, steps, engine.publisher.stats()["published"] - published


def _draw(rng: random.Random, n: int, vocab: int, eos: int) -> list[int]:
    """``n`` random token ids, never EOS."""
    out: list[int] = []
    while len(out) < n:
        t = rng.randrange(1, vocab)
        if t != eos:
            out.append(t)
    return out


def engine_step_overhead(model: str, rounds: int, threads: int) -> None:
    """Print the engine's step time with KV events on and off, measured alternately in one run."""
    # Imported here: the end-to-end part's spawned subscriber re-imports this module, and it
    # should not pay for torch.
    import torch

    from kvoffload.engine import Engine, SamplingParams

    torch.set_num_threads(threads)
    block_size, prefix_blocks, num_prefixes = 16, 16, 6
    request_blocks = prefix_blocks + 2  # prefix, suffix and output
    probe = Engine(model, num_device_blocks=1)
    block_bytes = probe.model.kv_bytes_per_token() * block_size
    vocab, eos = probe.model_config.vocab_size, probe.model_config.eos_token_id
    probe.close()
    common = {
        "block_size": block_size,
        # The device holds three requests and the host tier four: of the six prefixes cycling
        # through, some come back from the host tier and some are recomputed; both tiers evict.
        "num_device_blocks": 3 * request_blocks,
        "kv_offloading_size": 4 * request_blocks * block_bytes / 2**30,
        "max_num_seqs": 4,
    }
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://127.0.0.1:*",
        "replay_endpoint": "tcp://127.0.0.1:*",
    }
    rng = random.Random(0)
    prefixes = [_draw(rng, prefix_blocks * block_size, vocab, eos) for _ in range(num_prefixes)]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    engines = {
        "off": Engine(model, **common),
        "on": Engine(model, **common, kv_events_config=events),
    }
    per_round: dict[str, list[float]] = {"off": [], "on": []}
    steps = dict.fromkeys(per_round, 0)
    published = 0
    try:
        for r in range(rounds + 1):  # round 0 warms up
            prompts = [p + _draw(rng, 8, vocab, eos) for p in rng.sample(prefixes, len(prefixes))]
            order = ("off", "on") if r % 2 == 0 else ("on", "off")
            for name in order:
                spent, n, batches = _timed_round(engines[name], prompts, params)
                if r > 0:
                    per_round[name].append(spent)
                    steps[name] += n
                    published += batches if name == "on" else 0
        stats = engines["on"].stats()
    finally:
        for engine in engines.values():
            engine.close()
    med = {k: statistics.median(v) * 1e3 for k, v in per_round.items()}
    mean_step = {k: sum(per_round[k]) / steps[k] * 1e3 for k in per_round}
    print(
        f"engine step time, events on vs off ({model} preset, {threads} torch thread(s), {rounds} "
        f"rounds of {num_prefixes} requests, alternating; events engine published {published} batches, "
        f"offloaded {int(stats['offload_stored_blocks'])} blocks, loaded {int(stats['offload_loaded_blocks'])}, "
        f"evicted {int(stats['offload_tier_evicted_blocks'])} host / {int(stats['device_evicted_blocks'])} device):"
    )
    print(f"{'':34}{'events off':>12}{'events on':>12}{'difference':>12}")
    print(
        f"{'median step() time per round, ms':34}{med['off']:>12.1f}{med['on']:>12.1f}"
        f"{100 * (med['on'] / med['off'] - 1):>+11.2f}%"
    )
    print(
        f"{'mean time per step, ms':34}{mean_step['off']:>12.3f}{mean_step['on']:>12.3f}"
        f"{100 * (mean_step['on'] / mean_step['off'] - 1):>+11.2f}%"
    )
    print(f"{'steps':34}{steps['off']:>12}{steps['on']:>12}")
    paired = statistics.median(
        on / off for on, off in zip(per_round["on"], per_round["off"], strict=True)
    )
    print(
        f"median of per-round ratios on/off (paired, robust to drift): {100 * (paired - 1):+.2f}%"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=2000, help="batches per end-to-end run")
    parser.add_argument(
        "--engine-model", default="small", help="engine preset for the step-time part"
    )
    parser.add_argument("--engine-rounds", type=int, default=12, help="measured rounds per engine")
    parser.add_argument(
        "--engine-threads", type=int, default=1, help="torch threads of the engines"
    )
    parser.add_argument("--engine-only", action="store_true", help="only the engine step-time part")
    args = parser.parse_args()
    if args.engine_only:
        engine_step_overhead(args.engine_model, args.engine_rounds, args.engine_threads)
        return

    batch = make_batch(0)
    map_encoder, legacy_encoder, decoder = EventEncoder(), EventEncoder(True), EventDecoder()
    map_bytes, legacy_bytes = map_encoder.encode(batch), legacy_encoder.encode(batch)
    enc_map = _per_call_us(lambda: map_encoder.encode(batch), 2000)
    enc_legacy = _per_call_us(lambda: legacy_encoder.encode(batch), 2000)
    dec_map = _per_call_us(lambda: decoder.decode(map_bytes), 2000)
    dec_legacy = _per_call_us(lambda: decoder.decode(legacy_bytes), 2000)

    pub = ZmqEventPublisher("tcp://127.0.0.1:*")
    publish_us = _per_call_us(lambda: pub.publish(batch), 3000, repeat=3)
    pub.shutdown(timeout_s=30.0)  # let the sender drain what was queued

    print(f"batch: {EVENTS_PER_BATCH} BlockStored events x {TOKENS_PER_EVENT} token ids")
    print(f"{'':32}{'map form':>14}{'legacy array':>14}")
    print(f"{'msgpack bytes per batch':32}{len(map_bytes):>14}{len(legacy_bytes):>14}")
    print(f"{'encode us/batch':32}{enc_map:>14.1f}{enc_legacy:>14.1f}")
    print(f"{'decode us/batch':32}{dec_map:>14.1f}{dec_legacy:>14.1f}")
    map_rate, legacy_rate = (EVENTS_PER_BATCH / us * 1e6 for us in (enc_map, enc_legacy))
    print(f"{'encode-only events/s':32}{map_rate:>14,.0f}{legacy_rate:>14,.0f}")
    print(f"publish() us/batch (engine side, queueing only): {publish_us:.2f}")
    print()
    print(
        "end to end, PUB -> SUB on 127.0.0.1, subscriber decoding in a child process, "
        f"{args.batches} batches:"
    )
    rates = {}
    for legacy in (False, True):
        rate, received, events, lost, publish_s = end_to_end(args.batches, legacy)
        form = "legacy array" if legacy else "map form"
        rates[form] = rate
        print(
            f"  {form:<13}{rate:>12,.0f} events/s  ({received} batches, {events} events received,"
            f" {lost} lost; publish() calls took {publish_s * 1e3:.1f} ms in all)"
        )
    print(
        "end-to-end / encode-only events/s: "
        f"map form {rates['map form'] / map_rate:.3f}, "
        f"legacy {rates['legacy array'] / legacy_rate:.3f}"
    )
    print()
    engine_step_overhead(args.engine_model, args.engine_rounds, args.engine_threads)


if __name__ == "__main__":
    main()
