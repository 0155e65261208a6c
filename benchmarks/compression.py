"""What the tiers' block codecs (``kvoffload.tiers.codec``) do to KV our engine's models produce.

Three parts, each printed as a table (``--json`` adds one machine-readable line per part):

* **codecs**: ratio and GB/s (of raw bytes, one core: one thread, ``torch.set_num_threads(1)``)
  to compress and to decompress each offloaded block (timed by the thread's CPU time unless
  ``--clock wall``: a shared machine's load does not lower it), per codec: ``zstd`` and ``lz4`` on the
  bytes as they are, ``planes+lz4``, ``planes+zstd`` (the lossless codec the tiers use) and
  ``fp8`` (the lossy one). Medians over ``--repeat`` interleaved rounds (every codec once per
  round, so a change in the machine's load hits all of them alike).
* **lossy**: what fp8 costs the model: for each prompt of a fixed set, the prefix's KV is
  computed, round-tripped through fp8, and the rest of the prompt is computed against it (and
  against the exact KV); per position: whether the greedy next token agrees, and the KL
  divergence of the next-token distribution from the exact one. Mean over all positions.
* **end to end**: ``--e2e`` runs ``benchmarks/compression_e2e.py``'s two scenarios.

KV comes from real forward passes of ``small`` (the engine's benchmark preset, random weights
from seed 0) and of the wide Llama (``kvoffload.integrations.vllm.tiny_model``'s ``wide``
checkpoint, written to a temporary directory), over prompts of the tiny Llama's word corpus
tokenized by each model's tokenizer, in ``--dtype`` (bf16 by default: the dtype offloaded KV has on
GPUs; the engine's CPU default is fp32).

Run: ``PYTHONPATH=. .venv/bin/python benchmarks/compression.py [--models small wide]
[--dtype bfloat16] [--tokens 4096] [--repeat 5]``. Asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import lz4.block
import torch
import zstandard

from kvoffload.engine import AttentionMetadata, DecoderModel, load_model
from kvoffload.tiers.codec import BlockCodec
from kvoffload.tiers.codec.planes import join_into, split
from kvoffload.tiers.contract import KVLayout

BLOCK_TOKENS = 16
LIFEBOATCACHE = "lifeboatcache (stated): lossless 1.18x on synthetic fp16 KV, 1.46x on bf16; fp8 2x"


def load(name: str, dtype: str, workdir: Path) -> tuple[DecoderModel, object, object]:
    """``small`` (a preset) or ``wide`` (the wide tiny Llama checkpoint, written once)."""
    if name == "wide":
        from kvoffload.integrations.vllm.tiny_model import write_tiny_llama

        path = workdir / "wide"
        if not path.exists():
            write_tiny_llama(path, size="wide")
        return load_model(str(path), dtype=dtype)
    return load_model(name, dtype=dtype)


def prompts(tokenizer: object, count: int, tokens: int, seed: int = 0) -> list[list[int]]:
    """``count`` prompts of ``tokens`` ids: sentences of the tiny Llama's corpus words."""
    import random

    from kvoffload.integrations.vllm.tiny_model import corpus

    lines = corpus()
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        ids: list[int] = []
        while len(ids) < tokens:
            ids.extend(tokenizer.encode(rng.choice(lines) + " "))  # type: ignore[attr-defined]
        out.append(ids[:tokens])
    return out


def prefill(
    model: DecoderModel, ids: list[int], cache: torch.Tensor, table: list[int], cached: int = 0
) -> torch.Tensor:
    """Compute ``ids`` after ``cached`` tokens already in ``cache``; the logits of each."""
    md = AttentionMetadata.build([cached], [len(ids)], [table], BLOCK_TOKENS)
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), md.positions(), cache, md)
        return model.compute_logits(hidden).float()


def kv_blocks(model: DecoderModel, ids: list[int]) -> tuple[list[bytes], KVLayout]:
    """The offloaded blocks (bytes, one per 16 tokens) of ``ids``' KV, and their layout."""
    nblocks = len(ids) // BLOCK_TOKENS
    cache = model.allocate_kv_cache(nblocks + 1, BLOCK_TOKENS)
    prefill(model, ids[: nblocks * BLOCK_TOKENS], cache, list(range(nblocks + 1)))
    raw, layout = cache_blocks(model, cache, nblocks)
    return [bytes(row.numpy().tobytes()) for row in raw], layout


def cache_blocks(
    model: DecoderModel, cache: torch.Tensor, nblocks: int
) -> tuple[torch.Tensor, KVLayout]:
    """The first ``nblocks`` blocks of ``cache`` as rows of bytes (a copy), and their layout."""
    raw = cache[:nblocks].contiguous().view(torch.uint8).reshape(nblocks, -1)
    c = model.config
    layout = KVLayout(
        "bench",
        str(cache.dtype),
        BLOCK_TOKENS,
        c.num_layers,
        c.num_kv_heads,
        c.head_dim,
        raw.shape[1],
    )
    return raw, layout


Codec = tuple[Callable[[bytes], bytes], Callable[[bytes], object]]


def codecs(layout: KVLayout) -> dict[str, Codec]:
    """name -> (compress, decompress) of one block."""
    width = torch.empty(0, dtype=getattr(torch, layout.dtype.split(".")[-1])).element_size()
    size = layout.block_bytes
    zc, zd = zstandard.ZstdCompressor(level=1), zstandard.ZstdDecompressor()
    lossless, lossy = BlockCodec("lossless", layout), BlockCodec("fp8", layout)
    out_buf = memoryview(bytearray(size))

    def planes_lz4(raw: bytes) -> bytes:
        return lz4.block.compress(b"".join(split(raw, width)))

    def planes_lz4_d(packed: bytes) -> None:
        joined = memoryview(lz4.block.decompress(packed))
        n = size // width
        join_into([joined[p * n : (p + 1) * n] for p in range(width)], width, out_buf)

    def ours(codec: BlockCodec) -> Codec:
        def enc(raw: bytes) -> bytes:
            frame = codec.encode(memoryview(raw))
            return raw if frame is None else frame

        def dec(frame: bytes) -> None:
            if len(frame) < size:
                codec.decode(memoryview(frame), out_buf)

        return enc, dec

    return {
        "zstd": (zc.compress, zd.decompress),
        "lz4": (lz4.block.compress, lz4.block.decompress),
        "planes+lz4": (planes_lz4, planes_lz4_d),
        "planes+zstd": ours(lossless),
        "fp8": ours(lossy),
    }


def measure_codecs(
    blocks: list[bytes], layout: KVLayout, repeat: int, clock: Callable[[], float]
) -> dict[str, dict[str, float]]:
    """Per codec: ratio, compress and decompress GB/s (medians of interleaved rounds) by
    ``clock`` (the thread's CPU time: one core's speed, whatever else the machine runs; or
    wall-clock)."""
    table = codecs(layout)
    raw_bytes = sum(map(len, blocks))
    times: dict[str, tuple[list[float], list[float]]] = {n: ([], []) for n in table}
    stored: dict[str, int] = {}
    for _ in range(repeat):
        for name, (enc, dec) in table.items():
            t0 = clock()
            packed = [enc(b) for b in blocks]
            t1 = clock()
            for p in packed:
                dec(p)
            t2 = clock()
            times[name][0].append(t1 - t0)
            times[name][1].append(t2 - t1)
            stored[name] = sum(map(len, packed))
    return {
        name: {
            "ratio": raw_bytes / stored[name],
            "compress_gbps": raw_bytes / statistics.median(c) / 1e9,
            "decompress_gbps": raw_bytes / statistics.median(d) / 1e9,
        }
        for name, (c, d) in times.items()
    }


def lossy_cost(
    model: DecoderModel, prompt_set: list[list[int]], prefix_tokens: int
) -> dict[str, float]:
    """Greedy agreement and mean KL(exact || fp8) of the next-token distribution over the
    tokens after an fp8 round-tripped prefix (module docstring)."""
    agree = total = 0
    kls: list[float] = []
    for ids in prompt_set:
        nblocks = -(-len(ids) // BLOCK_TOKENS) + 1
        table = list(range(nblocks))
        prefix, rest = ids[:prefix_tokens], ids[prefix_tokens:]
        cache = model.allocate_kv_cache(nblocks, BLOCK_TOKENS)
        prefill(model, prefix, cache, table)
        exact_logits = prefill(model, rest, cache.clone(), table, cached=prefix_tokens)
        nprefix = prefix_tokens // BLOCK_TOKENS
        raw, layout = cache_blocks(model, cache, nprefix)
        fp8 = BlockCodec("fp8", layout)
        lossy_cache = cache.clone()
        flat = lossy_cache.view(torch.uint8).reshape(lossy_cache.shape[0], -1)
        for b in range(nprefix):
            frame = fp8.encode(memoryview(raw[b].numpy().tobytes()))
            if frame is None:
                raise RuntimeError("fp8 did not encode a block")
            out = bytearray(raw.shape[1])
            fp8.decode(memoryview(frame), memoryview(out))
            flat[b] = torch.frombuffer(out, dtype=torch.uint8)
        lossy_logits = prefill(model, rest, lossy_cache, table, cached=prefix_tokens)
        p = torch.log_softmax(exact_logits, dim=-1)
        q = torch.log_softmax(lossy_logits, dim=-1)
        kls.extend((p.exp() * (p - q)).sum(dim=-1).tolist())
        agree += int((exact_logits.argmax(-1) == lossy_logits.argmax(-1)).sum())
        total += len(rest)
    return {
        "greedy_agreement": agree / total,
        "mean_kl": statistics.fmean(kls),
        "max_kl": max(kls),
        "positions": total,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=["small", "wide"])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--tokens", type=int, default=4096, help="KV tokens per model (codecs)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=8, help="prompts of the lossy part")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument(
        "--clock",
        choices=["cpu", "wall"],
        default="cpu",
        help="time codecs by the thread's CPU time (default: one core's speed on a shared "
        "machine) or wall-clock",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(LIFEBOATCACHE)
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            model, _config, tokenizer = load(name, args.dtype, Path(tmp))
            ids = prompts(tokenizer, 1, args.tokens, seed=1)[0]
            blocks, layout = kv_blocks(model, ids)
            print(
                f"\n{name} ({args.dtype} KV, {len(blocks)} blocks of {layout.block_bytes} bytes, "
                f"one core, {args.clock} time; load average {os.getloadavg()[0]:.1f} on "
                f"{os.cpu_count()} CPUs)"
            )
            print(f"{'codec':12s} {'ratio':>6s} {'compress GB/s':>14s} {'decompress GB/s':>16s}")
            clock = time.thread_time if args.clock == "cpu" else time.perf_counter
            result = measure_codecs(blocks, layout, args.repeat, clock)
            for codec, r in result.items():
                print(
                    f"{codec:12s} {r['ratio']:6.3f} {r['compress_gbps']:14.3f} "
                    f"{r['decompress_gbps']:16.3f}"
                )
            if args.json:
                print(json.dumps({"part": "codecs", "model": name, "dtype": args.dtype, **result}))
            pset = prompts(tokenizer, args.prompts, args.prompt_tokens, seed=2)
            cost = lossy_cost(model, pset, args.prompt_tokens // 2)
            print(
                f"fp8 vs exact KV, {args.prompts} prompts x {args.prompt_tokens // 2} tokens "
                f"after an fp8 prefix of {args.prompt_tokens // 2}: greedy agreement "
                f"{cost['greedy_agreement']:.4f}, mean KL {cost['mean_kl']:.2e} nats "
                f"(max {cost['max_kl']:.2e})"
            )
            if args.json:
                print(json.dumps({"part": "lossy", "model": name, "dtype": args.dtype, **cost}))


if __name__ == "__main__":
    main()
