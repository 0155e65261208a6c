"""``load_model``: a preset with seeded random weights, or a local Hugging Face checkpoint.

A checkpoint is a directory with ``config.json`` and safetensors weights (``model.safetensors``,
any ``*.safetensors``, or shards listed in ``model.safetensors.index.json``) of a
``LlamaForCausalLM``, ``Qwen2ForCausalLM`` or ``Qwen3ForCausalLM``. Tensors are read one at a
time and copied straight into the model's fused parameters, so peak memory is the model plus
one tensor. Every problem (unsupported architecture, missing file, missing/unexpected/misshapen
tensor) raises :class:`~kvoffload.errors.ConfigError` before the model is returned.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch

from kvoffload.checkpoint_files import read_json_object, weight_files
from kvoffload.engine.model import DecoderLayer, DecoderModel
from kvoffload.engine.model_config import PRESETS, ModelConfig, config_from_hf, preset_config
from kvoffload.engine.setting_choices import DTYPE_SPELLINGS, DTYPES
from kvoffload.engine.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer
from kvoffload.errors import ConfigError
from kvoffload.identity import checkpoint_fingerprint, preset_fingerprint

__all__ = [
    "DTYPES",
    "PRESET_FORMAT_VERSION",
    "init_random_weights",
    "is_preset",
    "load_model",
    "load_model_config",
    "model_identity",
    "resolve_device",
    "resolve_dtype",
]

#: Bump whenever a preset's seed draws other weights (a change to :func:`init_random_weights` or
#: to the order of parameters): the blocks of the old weights then stop matching. (A change to a
#: preset's configuration needs no bump: the configuration is part of the identity.)
PRESET_FORMAT_VERSION = 1

_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, canonical) for name, canonical in DTYPE_SPELLINGS.items()
}


def resolve_device(device: torch.device | str) -> torch.device:
    """``device`` as a :class:`torch.device`; :class:`ConfigError` if unusable here."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError("device", f"cannot parse {device!r}: {exc}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device", f"{device!r} requested but CUDA is not available")
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError("device", f"only cpu and cuda are supported, got {device!r}")
    return dev


def resolve_dtype(dtype: torch.dtype | str | None, device: torch.device) -> torch.dtype:
    """``dtype``, or the default: float32 on CPU, bfloat16 on CUDA."""
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype) and dtype in _DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    raise ConfigError("dtype", f"{dtype!r} is not one of {sorted(_DTYPES)}")


def load_model(
    model: str,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | str | None = None,
    seed: int = 0,
) -> tuple[DecoderModel, ModelConfig, Tokenizer]:
    """Load a preset (``"tiny"``, ``"small"``) or a checkpoint directory.

    Presets get random weights drawn from ``seed`` on the CPU in float32 and then cast, so the
    same ``(model, seed, dtype)`` gives bit-identical weights in every process and on every
    device. Checkpoints ignore ``seed``.
    """
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    if is_preset(model):
        config = preset_config(model)
        net = DecoderModel(config, torch_dtype, dev)
        init_random_weights(net, seed)
        return net.eval(), config, ByteTokenizer(config.vocab_size, config.eos_token_id)
    return _load_checkpoint(_checkpoint_dir(model), torch_dtype, dev)


def load_model_config(model: str) -> ModelConfig:
    """The configuration of a preset or a checkpoint directory, without loading weights."""
    if is_preset(model):
        return preset_config(model)
    return _checkpoint_config(_checkpoint_dir(model))


def is_preset(model: str) -> bool:
    """Whether ``model`` names a preset (it does even where a directory of that name exists:
    ``load_model`` and :func:`model_identity` both decide by this)."""
    return model in PRESETS


def model_identity(model: str, dtype: torch.dtype, seed: int = 0) -> str:
    """The name of ``model`` (as :func:`load_model` takes it) run in ``dtype`` in shared tiers:
    :func:`kvoffload.identity.preset_fingerprint` (name, configuration, seed,
    :data:`PRESET_FORMAT_VERSION`) or :func:`kvoffload.identity.checkpoint_fingerprint`
    (``config.json`` and the weights' digest; the checkpoint's path plays no part)."""
    if is_preset(model):
        config = dataclasses.asdict(preset_config(model))
        return preset_fingerprint(model, config, dtype, seed, PRESET_FORMAT_VERSION)
    return checkpoint_fingerprint(_checkpoint_dir(model), dtype)


def _checkpoint_dir(model: str) -> Path:
    directory = Path(model)
    if not directory.is_dir():
        raise ConfigError(
            "model", f"{model!r} is neither a preset {sorted(PRESETS)} nor a directory"
        )
    return directory


def _checkpoint_config(directory: Path) -> ModelConfig:
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ConfigError("model", f"no config.json in {directory}")
    hf = read_json_object(config_path)
    generation_path = directory / "generation_config.json"
    generation = read_json_object(generation_path) if generation_path.is_file() else None
    return config_from_hf(hf, generation)


def init_random_weights(model: DecoderModel, seed: int) -> None:
    """Fill ``model`` with seeded random weights that make a lively model.

    Projections are drawn with std ``1/sqrt(fan_in)`` (unit-variance outputs), embeddings with
    std 1, norms are 1 and Qwen3's q/k norms 2: attention is then sharp enough that the output
    depends on the context (so tests notice corrupted KV), not near-uniform as with the usual
    0.02 init.
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm"):
                value = torch.full(param.shape, 2.0 if name.endswith("qk_norm") else 1.0)
            elif param.dim() == 1:  # biases
                value = torch.randn(param.shape, generator=generator) * 0.1
            else:
                std = 1.0 if name == "embed_tokens" else 1 / math.sqrt(param.shape[1])
                value = torch.randn(param.shape, generator=generator) * std
            param.copy_(value)


@dataclass(slots=True)
class _Target:
    """Where one checkpoint tensor goes: ``param[rows]`` (broadcast along rows if needed)."""

    param: torch.nn.Parameter
    rows: slice | None
    shape: tuple[int, ...]


def _targets(model: DecoderModel) -> dict[str, _Target]:
    """Hugging Face tensor name -> destination in our fused parameters."""
    c = model.config
    q, kv, inter, h, d = c.q_size, c.kv_size, c.intermediate_size, c.hidden_size, c.head_dim
    out: dict[str, _Target] = {
        "model.embed_tokens.weight": _Target(model.embed_tokens, None, (c.vocab_size, h)),
        "model.norm.weight": _Target(model.norm, None, (h,)),
    }
    if model.lm_head is not None:
        out["lm_head.weight"] = _Target(model.lm_head, None, (c.vocab_size, h))
    # model.layers holds DecoderLayers only (an nn.ModuleList is typed as yielding nn.Module).
    for i, layer in enumerate(cast(Iterable[DecoderLayer], model.layers)):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = _Target(layer.input_norm, None, (h,))
        out[p + "post_attention_layernorm.weight"] = _Target(layer.post_attention_norm, None, (h,))
        for proj, rows, width in (
            ("q", slice(0, q), q),
            ("k", slice(q, q + kv), kv),
            ("v", slice(q + kv, q + 2 * kv), kv),
        ):
            out[f"{p}self_attn.{proj}_proj.weight"] = _Target(layer.qkv_proj, rows, (width, h))
            if layer.qkv_bias is not None:
                out[f"{p}self_attn.{proj}_proj.bias"] = _Target(layer.qkv_bias, rows, (width,))
        out[p + "self_attn.o_proj.weight"] = _Target(layer.o_proj, None, (h, q))
        if layer.o_bias is not None:
            out[p + "self_attn.o_proj.bias"] = _Target(layer.o_bias, None, (h,))
        if layer.qk_norm is not None:
            out[p + "self_attn.q_norm.weight"] = _Target(layer.qk_norm, slice(0, c.num_heads), (d,))
            out[p + "self_attn.k_norm.weight"] = _Target(
                layer.qk_norm, slice(c.num_heads, None), (d,)
            )
        out[p + "mlp.gate_proj.weight"] = _Target(layer.gate_up_proj, slice(0, inter), (inter, h))
        out[p + "mlp.up_proj.weight"] = _Target(layer.gate_up_proj, slice(inter, None), (inter, h))
        out[p + "mlp.down_proj.weight"] = _Target(layer.down_proj, None, (h, inter))
    return out


def _load_checkpoint(
    directory: Path, dtype: torch.dtype, device: torch.device
) -> tuple[DecoderModel, ModelConfig, Tokenizer]:
    from safetensors import SafetensorError, safe_open

    config = _checkpoint_config(directory)
    files = weight_files(directory)
    model = DecoderModel(config, dtype, device)
    targets = _targets(model)
    loaded: set[str] = set()
    unexpected: list[str] = []
    with torch.no_grad():
        for file in files:
            try:
                with safe_open(str(file), framework="pt", device="cpu") as f:
                    for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                        target = targets.get(name)
                        if target is None:
                            if not _ignorable(name, config):
                                unexpected.append(name)
                            continue
                        tensor = f.get_tensor(name)
                        if tuple(tensor.shape) != target.shape:
                            raise ConfigError(
                                "model",
                                f"{file.name}: {name} has shape {tuple(tensor.shape)}, "
                                f"config.json implies {target.shape}",
                            )
                        dst = target.param if target.rows is None else target.param[target.rows]
                        dst.copy_(tensor)
                        loaded.add(name)
            except SafetensorError as exc:
                raise ConfigError("model", f"cannot read {file}: {exc}") from None
    missing = sorted(set(targets) - loaded)
    if missing or unexpected:
        raise ConfigError(
            "model",
            f"checkpoint in {directory} does not match config.json ({config.architecture}): "
            f"{len(missing)} missing tensors {missing[:5]}, "
            f"{len(unexpected)} unexpected {unexpected[:5]}",
        )
    tokenizer = load_tokenizer(directory, config.vocab_size, config.eos_token_id)
    return model.eval(), config, tokenizer


def _ignorable(name: str, config: ModelConfig) -> bool:
    """Tensors some checkpoints carry that the model recomputes or shares."""
    return name.endswith("rotary_emb.inv_freq") or (
        config.tie_word_embeddings and name == "lm_head.weight"
    )
