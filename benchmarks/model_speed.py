"""Speed of the reference model over the paged KV cache, and what recomputing a prefix costs next
to copying its KV. Measured in one run, side by side:

* prefill of one ``--context``-token prompt (tokens/s), the same prompt in 4 chunks, and the last
  quarter alone after a prefix hit (3/4 of the prompt already cached);
* decode step time (forward + logits) for batches of 1, 8 and 32 sequences at ``--context``;
* the KV of one ``--context``-token prefix: its size, and the time to copy its blocks out of the
  cache into a host buffer and back (``index_select`` / ``index_copy_``), as the offloading path
  would, next to the time to recompute it.

Run: ``.venv/bin/python benchmarks/model_speed.py [--model small] [--context 2048] [--threads N]``.
Block ids are shuffled, the cache is filled with random values. Wall-clock minimum over
``--repeat`` runs; CPU time is printed too because the machine may be shared. Asserts nothing.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial

import torch

from kvoffload.engine import AttentionMetadata, DecoderModel, load_model


def timed(fn: Callable[[], object], repeat: int) -> tuple[float, float]:
    """(min wall seconds, min CPU seconds) over ``repeat`` runs after one warm-up."""
    fn()
    walls, cpus = [], []
    for _ in range(repeat):
        w, c = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - w)
        cpus.append(time.process_time() - c)
    return min(walls), min(cpus)


def forward(
    model: DecoderModel, cache: torch.Tensor, ids: torch.Tensor, md: AttentionMetadata
) -> torch.Tensor:
    with torch.inference_mode():
        return model.compute_logits(model(ids, md.positions(), cache, md))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="small")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    model, config, _ = load_model(args.model)
    ctx, bs = args.context, args.block_size
    blocks_per_seq = -(-(ctx + 1) // bs)
    batch = 32
    num_blocks = batch * blocks_per_seq
    cache = model.allocate_kv_cache(num_blocks, bs).normal_()
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).tolist()
    tables = [order[i * blocks_per_seq : (i + 1) * blocks_per_seq] for i in range(batch)]
    ids = torch.randint(0, 256, (ctx,), generator=torch.Generator().manual_seed(1))
    print(
        f"model={args.model} params={config.num_parameters() / 1e6:.1f}M "
        f"layers={config.num_layers} hidden={config.hidden_size} "
        f"heads={config.num_heads}/{config.num_kv_heads}x{config.head_dim} "
        f"dtype={model.dtype} threads={args.threads} context={ctx} block_size={bs}"
    )

    full = AttentionMetadata.build([0], [ctx], [tables[0]], bs)
    wall, cpu = timed(lambda: forward(model, cache, ids, full), args.repeat)
    prefill_wall = wall
    print(
        f"prefill {ctx} tokens, one sequence      : {wall * 1e3:8.1f} ms  "
        f"{ctx / wall:7.0f} tok/s  (cpu {cpu * 1e3:.0f} ms)"
    )

    quarter = ctx // 4

    def chunked() -> None:
        for k in range(4):
            md = AttentionMetadata.build([k * quarter], [quarter], [tables[0]], bs)
            forward(model, cache, ids[k * quarter : (k + 1) * quarter], md)

    wall, cpu = timed(chunked, args.repeat)
    print(
        f"prefill in 4 chunks of {quarter}            : {wall * 1e3:8.1f} ms  "
        f"{ctx / wall:7.0f} tok/s  (cpu {cpu * 1e3:.0f} ms)"
    )
    hit = AttentionMetadata.build([ctx - quarter], [quarter], [tables[0]], bs)
    wall, cpu = timed(lambda: forward(model, cache, ids[-quarter:], hit), args.repeat)
    print(
        f"prefill last {quarter} after a 3/4 prefix hit: {wall * 1e3:8.1f} ms  "
        f"({prefill_wall / wall:.1f}x faster than full; cpu {cpu * 1e3:.0f} ms)"
    )

    for b in (1, 8, 32):
        md = AttentionMetadata.build([ctx] * b, [1] * b, tables[:b], bs)
        step_ids = ids[:b]
        wall, cpu = timed(partial(forward, model, cache, step_ids, md), args.repeat)
        print(
            f"decode step, batch {b:2d} at {ctx} context: {wall * 1e3:8.1f} ms  "
            f"(cpu {cpu * 1e3:.0f} ms)"
        )

    kv_bytes = model.kv_bytes_per_token() * ctx
    prefix_blocks = torch.tensor(tables[0][: ctx // bs])
    host = torch.empty((len(prefix_blocks), *cache.shape[1:]), dtype=cache.dtype)
    wall_out, _ = timed(lambda: torch.index_select(cache, 0, prefix_blocks, out=host), args.repeat)
    wall_in, _ = timed(lambda: cache.index_copy_(0, prefix_blocks, host), args.repeat)
    print(
        f"KV per token {model.kv_bytes_per_token()} B; "
        f"{ctx}-token prefix = {kv_bytes / 2**20:.1f} MiB: "
        f"copy out {wall_out * 1e3:.2f} ms, copy in {wall_in * 1e3:.2f} ms, "
        f"recompute {prefill_wall * 1e3:.0f} ms "
        f"({prefill_wall / wall_in:.0f}x the copy in)"
    )


if __name__ == "__main__":
    main()
