"""Helpers for the model tests: tiny Hugging Face checkpoints and running our model on the cache."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from kvoffload.engine import AttentionMetadata, DecoderModel, load_model

VOCAB = 300


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """Autouse in every model test module: tiny models gain nothing from threads, and OpenMP's
    spinning threads make each op take milliseconds when the machine's cores are busy."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


#: Tiny configurations covering each family's peculiarities.
HF_CASES: dict[str, dict[str, Any]] = {
    # q/k RMSNorm, head_dim (24) unrelated to hidden_size / num_heads (16), GQA 4:2.
    "qwen3": {"head_dim": 24, "num_attention_heads": 4, "num_key_value_heads": 2},
    # q/k/v biases, no o_proj bias, GQA 4:1.
    "qwen2": {"num_attention_heads": 4, "num_key_value_heads": 1},
    # Multi-head (no GQA), biases on all four projections, tied embeddings, Llama 3.1 RoPE scaling
    # whose original context (16) is shorter than the prompts, so every frequency band matters.
    "llama": {
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "attention_bias": True,
        "tie_word_embeddings": True,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 500.0,
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    },
}


def make_hf_model(family: str, **overrides: Any) -> Any:
    """A tiny random transformers model of ``family`` with every weight perturbed (biases and
    norm weights included, so that none of them is an identity a bug could hide behind)."""
    import transformers

    classes = {
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    }
    config_cls, model_cls = classes[family]
    kwargs: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "max_position_embeddings": 512,
        "eos_token_id": 2,
        "bos_token_id": 1,
    }
    kwargs.update(HF_CASES[family])
    kwargs.update(overrides)
    torch.manual_seed(1234)
    model = model_cls(config_cls(**kwargs)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, 0.15)
    return model


def save_hf_model(model: Any, directory: Path, **kwargs: Any) -> Path:
    model.save_pretrained(str(directory), **kwargs)
    return directory


def hf_logits(model: Any, ids: Sequence[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([list(ids)])).logits[0].float()


def run_chunks(
    model: DecoderModel,
    kv_cache: torch.Tensor,
    ids: Sequence[int],
    chunks: Sequence[int],
    block_table: Sequence[int],
    block_size: int,
) -> torch.Tensor:
    """Feed ``ids`` through ``model`` in consecutive chunks of the given sizes (one sequence);
    returns the logits of every token, concatenated."""
    assert sum(chunks) == len(ids)
    out, done = [], 0
    with torch.inference_mode():
        for n in chunks:
            md = AttentionMetadata.build([done], [n], [block_table], block_size, model.device)
            md.check_invariants()
            chunk = torch.tensor(ids[done : done + n], device=model.device)
            hidden = model(chunk, md.positions(), kv_cache, md)
            out.append(model.compute_logits(hidden))
            done += n
    return torch.cat(out)


def random_blocks(num_blocks: int, count: int, seed: int) -> list[int]:
    """``count`` distinct, shuffled (so non-contiguous) block ids out of ``num_blocks``."""
    return torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))[
        :count
    ].tolist()


def fingerprint(preset: str, seed: int) -> str:
    """SHA-256 over a preset's weights and its logits for a fixed prompt."""
    model, _, _ = load_model(preset, seed=seed)
    digest = hashlib.sha256()
    for param in model.parameters():
        digest.update(param.detach().numpy().tobytes())
    logits = run_chunks(model, model.allocate_kv_cache(4, 16), [1, 2, 3, 4, 5], [5], [2], 16)
    digest.update(logits.numpy().tobytes())
    return digest.hexdigest()
