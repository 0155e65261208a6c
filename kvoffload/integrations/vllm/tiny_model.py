"""A tiny Llama checkpoint and tokenizer, made locally: vLLM's real engine with no model hub.

``python -m kvoffload.integrations.vllm.tiny_model DIR`` writes a Hugging Face checkpoint that
vLLM loads like any other (``LLM(model=DIR)``, ``vllm bench throughput --model DIR``): a Llama of
2 layers, hidden size 256, 4 attention heads / 2 KV heads (head size 64), bf16, random weights
from a fixed seed, and a byte-level BPE tokenizer (vocabulary 2048) trained with ``tokenizers`` on
a generated corpus. Same arguments, same bytes: the weights and the tokenizer are deterministic.

One token of KV is 2 layers x 2 (K, V) x 2 heads x 64 x 2 bytes = 1 KiB, so one 128-token block
of vLLM's CPU backend is 128 KiB (:data:`KV_BYTES_PER_TOKEN`).

Imports ``transformers`` and ``tokenizers`` (not vLLM).
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

__all__ = ["KV_BYTES_PER_TOKEN", "VOCAB_SIZE", "corpus", "write_tiny_llama"]

VOCAB_SIZE = 2048
NUM_LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 2, 256, 4, 2, 64
#: KV bytes per token of the tiny model (bf16): layers x (K, V) x KV heads x head size x 2.
KV_BYTES_PER_TOKEN = NUM_LAYERS * 2 * KV_HEADS * HEAD_DIM * 2

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


def write_tiny_llama(directory: str | Path, seed: int = 0) -> Path:
    """Write the checkpoint and tokenizer into ``directory`` (created); return it."""
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

    config = transformers.LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=8192,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(out))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(write_tiny_llama(args.directory, args.seed))


if __name__ == "__main__":
    main()
