"""A tiny Llama checkpoint and tokenizer, made locally: vLLM's real engine with no model hub.

``python -m kvoffload.integrations.vllm.tiny_model DIR`` writes a Hugging Face checkpoint that
vLLM loads like any other (``LLM(model=DIR)``, ``vllm bench throughput --model DIR``): a Llama of
2 layers, hidden size 256, 4 attention heads / 2 KV heads (head size 64), bf16, random weights
from a fixed seed, and a byte-level BPE tokenizer trained with ``tokenizers`` on a generated
corpus. Same arguments, same bytes: the weights and the tokenizer are deterministic. The model's
vocabulary is 2048 ids, the tokenizer's only 446 (the corpus's 42 words need no more merges), so
most ids a random model generates decode to no text.

One token of KV is 2 layers x 2 (K, V) x 2 heads x 64 x 2 bytes = 1 KiB, so one 128-token block
of vLLM's CPU backend is 128 KiB (:data:`KV_BYTES_PER_TOKEN`). ``--size`` picks a larger shape of
:data:`SIZES` (``wide``: 4 layers, hidden 1024, 16 heads / 4 KV heads, 4 KiB of KV per token),
whose prefill costs far more than an engine step's fixed costs, as a real model's does; the
tokenizer is the same.

Imports ``transformers`` and ``tokenizers`` (not vLLM).
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass
from pathlib import Path

__all__ = ["KV_BYTES_PER_TOKEN", "SIZES", "VOCAB_SIZE", "ModelShape", "corpus", "write_tiny_llama"]

VOCAB_SIZE = 2048


@dataclass(frozen=True)
class ModelShape:
    """A Llama's shape: layers, hidden size, attention heads, KV heads (head size 64)."""

    num_layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int = 64

    @property
    def kv_bytes_per_token(self) -> int:
        """bf16: layers x (K, V) x KV heads x head size x 2 bytes."""
        return self.num_layers * 2 * self.kv_heads * self.head_dim * 2


#: ``tiny`` is the default (the tests' model); ``wide`` is where prefill dominates a step.
SIZES = {"tiny": ModelShape(2, 256, 4, 2), "wide": ModelShape(4, 1024, 16, 4)}
#: KV bytes per token of the tiny model.
KV_BYTES_PER_TOKEN = SIZES["tiny"].kv_bytes_per_token

_WORDS = [
    "cache",
    "block",
    "prefix",
    "token",
    "layer",
    "model",
    "request",
    "offload",
    "tier",
    "disk",
    "host",
    "memory",
    "key",
    "value",
    "engine",
    "step",
    "batch",
    "prompt",
    "answer",
    "system",
    "user",
    "document",
    "turn",
    "shared",
    "store",
    "load",
    "evict",
    "hit",
    "miss",
    "policy",
    "queue",
    "thread",
    "copy",
    "page",
    "slot",
    "chunk",
    "event",
    "stream",
    "vector",
    "matrix",
    "head",
    "attention",
]


def corpus(num_lines: int = 2000, seed: int = 0) -> list[str]:
    """Generated English-like lines (the tokenizer's training text and the prompts' words)."""
    rng = random.Random(seed)
    return [" ".join(rng.choices(_WORDS, k=rng.randint(8, 24))) for _ in range(num_lines)]


def write_tiny_llama(directory: str | Path, seed: int = 0, size: str = "tiny") -> Path:
    """Write the checkpoint (shape ``SIZES[size]``) and tokenizer into ``directory`` (created);
    return it."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(seed=seed), trainer=trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(str(out))

    shape = SIZES[size]
    config = transformers.LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=shape.hidden,
        intermediate_size=2 * shape.hidden,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=8192,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",  # type: ignore[call-arg]  # a PretrainedConfig keyword
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)  # type: ignore[arg-type]
    model.save_pretrained(str(out))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    args = parser.parse_args()
    print(write_tiny_llama(args.directory, args.seed, args.size))


if __name__ == "__main__":
    main()
