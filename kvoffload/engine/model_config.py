"""Model configuration of the reference engine: :class:`ModelConfig`, its presets, and the parser
of Hugging Face ``config.json`` files for the Llama, Qwen2 and Qwen3 families.

Every field is validated in ``__post_init__``; a bad value raises
:class:`~kvoffload.errors.ConfigError` naming the field. A ``config.json`` that asks for
something the model does not implement (sliding windows, MoE, an unknown RoPE variant, another
activation) is rejected the same way rather than run wrongly.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from kvoffload.errors import ConfigError

__all__ = [
    "ARCHITECTURES",
    "PRESETS",
    "ModelConfig",
    "RopeScaling",
    "config_from_hf",
    "preset_config",
]

#: Hugging Face ``architectures`` entry -> family name used in :attr:`ModelConfig.architecture`.
ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}

_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """A RoPE frequency rescaling, as in Hugging Face ``rope_parameters`` / ``rope_scaling``.

    ``linear`` divides every inverse frequency by ``factor``; ``llama3`` is Llama 3.1's
    wavelength-dependent rescaling (uses all four fields).
    """

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in ("linear", "llama3"):
            raise ConfigError(
                "rope_scaling",
                f"unsupported rope_type {self.rope_type!r}; supported: {_ROPE_TYPES}",
            )
        if not (math.isfinite(self.factor) and self.factor > 0):
            raise ConfigError(
                "rope_scaling", f"factor must be a positive number, got {self.factor!r}"
            )
        if self.rope_type == "llama3" and not (
            self.high_freq_factor > self.low_freq_factor > 0
            and self.original_max_position_embeddings > 0
        ):
            raise ConfigError(
                "rope_scaling",
                "llama3 needs high_freq_factor > low_freq_factor > 0 and "
                "original_max_position_embeddings > 0",
            )


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape and numerics of a decoder-only transformer (pre-norm, RoPE, GQA, SwiGLU MLP).

    ``attention_bias`` puts biases on the q/k/v projections, ``o_proj_bias`` on the output
    projection (Qwen2: q/k/v only; Llama/Qwen3 with ``attention_bias: true``: all four).
    ``qk_norm`` is Qwen3's per-head RMSNorm on queries and keys, applied before RoPE.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    qk_norm: bool = False
    attention_bias: bool = False
    o_proj_bias: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    eos_token_id: int = 0
    rope_scaling: RopeScaling | None = None

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES.values():
            raise ConfigError(
                "architecture",
                f"unknown family {self.architecture!r}; "
                f"supported: {sorted(ARCHITECTURES.values())}",
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(name, f"must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                "num_kv_heads", f"{self.num_kv_heads} does not divide num_heads={self.num_heads}"
            )
        if self.head_dim % 2:
            raise ConfigError("head_dim", f"RoPE needs an even head_dim, got {self.head_dim}")
        if not (
            isinstance(self.rope_theta, (int, float))
            and math.isfinite(self.rope_theta)
            and self.rope_theta > 0
        ):
            raise ConfigError("rope_theta", f"must be a positive number, got {self.rope_theta!r}")
        if not (isinstance(self.rms_norm_eps, (int, float)) and 0 < self.rms_norm_eps < 1):
            raise ConfigError("rms_norm_eps", f"must be in (0, 1), got {self.rms_norm_eps!r}")
        eos = self.eos_token_id
        if isinstance(eos, bool) or not isinstance(eos, int) or not 0 <= eos < self.vocab_size:
            raise ConfigError(
                "eos_token_id", f"must be an id in [0, vocab_size={self.vocab_size}), got {eos!r}"
            )

    @property
    def q_size(self) -> int:
        """Width of the query projection (``num_heads * head_dim``)."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of the key (and of the value) projection (``num_kv_heads * head_dim``)."""
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, element_size: int) -> int:
        """Bytes of KV cache one token occupies across all layers, keys and values."""
        return self.num_layers * 2 * self.kv_size * element_size

    def num_parameters(self) -> int:
        """Number of weights (embeddings counted once when tied)."""
        h, layer = self.hidden_size, 0
        layer += h * (self.q_size + 2 * self.kv_size) + self.q_size * h  # q/k/v/o projections
        layer += 3 * h * self.intermediate_size  # gate, up, down
        layer += 2 * h  # two RMSNorms
        if self.attention_bias:
            layer += self.q_size + 2 * self.kv_size
        if self.o_proj_bias:
            layer += h
        if self.qk_norm:
            layer += 2 * self.head_dim
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + embeddings + h


#: Random-weight models for tests and benchmarks (byte-level tokenizer, EOS id 256).
PRESETS: dict[str, ModelConfig] = {
    # Runs in milliseconds on one CPU core: for tests.
    "tiny": ModelConfig(
        architecture="qwen3",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        qk_norm=True,
        max_position_embeddings=32768,
        eos_token_id=256,
    ),
    # The benchmark default: recomputing a 2k-token prefix costs ~1 s on 2 CPU cores, while its
    # KV (32 MiB in float32) copies in milliseconds. See docs/model.md for measured figures.
    "small": ModelConfig(
        architecture="qwen3",
        vocab_size=512,
        hidden_size=512,
        intermediate_size=1536,
        num_layers=8,
        num_heads=8,
        num_kv_heads=4,
        head_dim=64,
        qk_norm=True,
        max_position_embeddings=32768,
        eos_token_id=256,
    ),
}


def preset_config(name: str) -> ModelConfig:
    """The preset called ``name``; :class:`ConfigError` naming ``model`` if there is none."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError("model", f"no preset {name!r}; presets: {sorted(PRESETS)}") from None


def config_from_hf(
    hf: Mapping[str, Any], generation_config: Mapping[str, Any] | None = None
) -> ModelConfig:
    """Translate a Hugging Face ``config.json`` (already parsed) into a :class:`ModelConfig`.

    ``eos_token_id`` comes from ``config.json``, else from ``generation_config.json``; where it
    is a list, the first id is taken. Accepts both the transformers 4 layout (``rope_theta`` +
    ``rope_scaling``) and the transformers 5 layout (``rope_parameters``). Raises
    :class:`ConfigError` for an unsupported architecture or any setting this model would
    silently get wrong.
    """
    archs = hf.get("architectures") or []
    supported = [a for a in archs if a in ARCHITECTURES]
    if not supported:
        raise ConfigError(
            "architectures", f"{archs!r} is not supported; supported: {sorted(ARCHITECTURES)}"
        )
    family = ARCHITECTURES[supported[0]]

    def need(key: str) -> Any:
        if key not in hf:
            raise ConfigError(key, "missing from config.json")
        return hf[key]

    _reject_unsupported(hf)
    hidden_size = need("hidden_size")
    num_heads = need("num_attention_heads")
    head_dim = hf.get("head_dim") or (hidden_size // num_heads if num_heads else 0)
    rope_theta, rope_scaling = _parse_rope(hf)

    if family == "qwen2":
        attention_bias, o_proj_bias = True, False
    else:
        attention_bias = o_proj_bias = bool(hf.get("attention_bias", False))

    eos = _eos_token_id(hf, generation_config)

    return ModelConfig(
        architecture=family,
        vocab_size=need("vocab_size"),
        hidden_size=hidden_size,
        intermediate_size=need("intermediate_size"),
        num_layers=need("num_hidden_layers"),
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        rope_theta=float(rope_theta),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        qk_norm=family == "qwen3",
        attention_bias=attention_bias,
        o_proj_bias=o_proj_bias,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=hf.get("max_position_embeddings", 32768),
        eos_token_id=eos,
        rope_scaling=rope_scaling,
    )


def _reject_unsupported(hf: Mapping[str, Any]) -> None:
    """:class:`ConfigError` for a ``config.json`` setting this model would silently get wrong."""
    hidden_act = hf.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise ConfigError("hidden_act", f"only 'silu' is implemented, got {hidden_act!r}")
    if hf.get("mlp_bias", False):
        raise ConfigError("mlp_bias", "MLP biases are not implemented")
    if hf.get("use_sliding_window", False):
        raise ConfigError("use_sliding_window", "sliding-window attention is not implemented")
    layer_types = hf.get("layer_types")
    if layer_types and any(t != "full_attention" for t in layer_types):
        raise ConfigError(
            "layer_types",
            f"only full_attention layers are implemented, got {sorted(set(layer_types))}",
        )
    if hf.get("pretraining_tp", 1) not in (1, None):
        raise ConfigError("pretraining_tp", "only pretraining_tp == 1 is implemented")


def _eos_token_id(hf: Mapping[str, Any], generation_config: Mapping[str, Any] | None) -> Any:
    """The EOS id from ``config.json``, else ``generation_config.json`` (first of a list)."""
    eos = hf.get("eos_token_id")
    if eos is None and generation_config is not None:
        eos = generation_config.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    if eos is None:
        raise ConfigError(
            "eos_token_id",
            "missing from config.json and generation_config.json (needed to stop generation)",
        )
    return eos


def _parse_rope(hf: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    """``(rope_theta, rope_scaling)`` from either config layout."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(params, Mapping):
        raise ConfigError("rope_parameters", f"expected an object, got {params!r}")
    rope_theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    if params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ConfigError("partial_rotary_factor", "partial rotary embeddings are not implemented")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in _ROPE_TYPES:
        raise ConfigError(
            "rope_scaling", f"unsupported rope_type {rope_type!r}; supported: {_ROPE_TYPES}"
        )
    if rope_type == "default":
        return rope_theta, None
    known = {f.name for f in fields(RopeScaling)}
    kwargs = {k: v for k, v in params.items() if k in known and k != "rope_type"}
    if "factor" not in kwargs:
        raise ConfigError("rope_scaling", f"rope_type {rope_type!r} needs a 'factor'")
    if rope_type == "llama3" and "original_max_position_embeddings" not in kwargs:
        kwargs["original_max_position_embeddings"] = hf.get("max_position_embeddings", 8192)
    return rope_theta, RopeScaling(rope_type=rope_type, **kwargs)
