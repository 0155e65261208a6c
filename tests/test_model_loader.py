"""load_model, config.json parsing and tokenizers: what loads, and the clear errors for the rest."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from model_cases import (
    make_hf_model,
    one_thread,  # noqa: F401 - autouse fixture
    run_chunks,
    save_hf_model,
)
from safetensors.torch import load_file, save_file

from kvoffload.engine import (
    PRESETS,
    ByteTokenizer,
    HFTokenizer,
    ModelConfig,
    RopeScaling,
    config_from_hf,
    load_model,
    preset_config,
)
from kvoffload.engine.loader import load_model_config
from kvoffload.errors import ConfigError

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_hf_model(make_hf_model("qwen2"), tmp_path_factory.mktemp("qwen2"))


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir(exist_ok=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _edit_config(path: Path, **changes: Any) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def _load_quietly(path: Path, **kwargs: Any) -> Any:
    with pytest.warns(UserWarning, match="byte-level"):
        return load_model(str(path), **kwargs)


def test_presets_load_with_a_byte_tokenizer() -> None:
    for name in PRESETS:
        config = preset_config(name)
        assert config.vocab_size > config.eos_token_id >= 256
    model, config, tok = load_model("tiny")
    assert config is PRESETS["tiny"] and model.dtype == torch.float32
    assert isinstance(tok, ByteTokenizer) and tok.eos_token_id == config.eos_token_id


@pytest.mark.parametrize(
    ("model", "field", "message"),
    [
        ("no-such-preset", "model", "neither a preset"),
        ("tiny", "dtype", "int8"),
        ("tiny", "device", "tpu"),
    ],
)
def test_bad_arguments(model: str, field: str, message: str) -> None:
    kwargs: dict[str, Any] = (
        {"dtype": "int8"} if field == "dtype" else {"device": "tpu"} if field == "device" else {}
    )
    with pytest.raises(ConfigError, match=message) as info:
        load_model(model, **kwargs)
    assert info.value.field == field


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_cuda_without_cuda_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="CUDA is not available"):
        load_model("tiny", device="cuda")


def test_unsupported_architecture(checkpoint: Path, tmp_path: Path) -> None:
    path = _copy(checkpoint, tmp_path / "m")
    _edit_config(path, architectures=["MistralForCausalLM"])
    with pytest.raises(ConfigError, match=r"MistralForCausalLM.*not supported") as info:
        load_model(str(path))
    assert info.value.field == "architectures"


def test_missing_config_or_weights(checkpoint: Path, tmp_path: Path) -> None:
    path = _copy(checkpoint, tmp_path / "m")
    (path / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match=r"no \*\.safetensors"):
        load_model(str(path))
    (path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ConfigError, match="only safetensors is supported"):
        load_model(str(path))
    (path / "config.json").unlink()
    with pytest.raises(ConfigError, match=r"no config\.json"):
        load_model(str(path))


def test_missing_unexpected_and_misshapen_tensors(checkpoint: Path, tmp_path: Path) -> None:
    path = _copy(checkpoint, tmp_path / "m")
    tensors = load_file(str(checkpoint / "model.safetensors"))

    missing = {k: v for k, v in tensors.items() if k != "model.layers.1.self_attn.k_proj.bias"}
    save_file(missing, str(path / "model.safetensors"))
    with pytest.raises(
        ConfigError, match=r"1 missing tensors \['model.layers.1.self_attn.k_proj.bias'\]"
    ):
        load_model(str(path))

    save_file(
        {**tensors, "model.layers.0.mlp.experts.0.weight": torch.zeros(2)},
        str(path / "model.safetensors"),
    )
    with pytest.raises(ConfigError, match="1 unexpected"):
        load_model(str(path))

    save_file(
        {**tensors, "model.layers.0.mlp.up_proj.weight": torch.zeros(95, 64)},
        str(path / "model.safetensors"),
    )
    with pytest.raises(ConfigError, match=r"up_proj.weight has shape \(95, 64\)"):
        load_model(str(path))

    (path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ConfigError, match="cannot read"):
        load_model(str(path))


def test_missing_shard(tmp_path: Path) -> None:
    save_hf_model(make_hf_model("qwen3"), tmp_path, max_shard_size="40KB")
    sorted(tmp_path.glob("model-*.safetensors"))[-1].unlink()
    with pytest.raises(
        ConfigError, match=r"shards listed in model\.safetensors\.index\.json are missing"
    ):
        load_model(str(tmp_path))


def test_dtype_and_ignored_tensors(checkpoint: Path, tmp_path: Path) -> None:
    """bfloat16 on CPU runs and stays close to float32; a stale rotary ``inv_freq`` is ignored."""
    path = _copy(checkpoint, tmp_path / "m")
    tensors = load_file(str(checkpoint / "model.safetensors"))
    save_file(
        {**tensors, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)},
        str(path / "model.safetensors"),
    )
    fp32, _, _ = _load_quietly(path)
    bf16, _, _ = _load_quietly(path, dtype="bf16")
    assert bf16.dtype == torch.bfloat16 and bf16.allocate_kv_cache(2, 4).dtype == torch.bfloat16
    ids = list(range(10, 30))
    a = run_chunks(fp32, fp32.allocate_kv_cache(8, 4), ids, [12, 8], [3, 1, 4, 0, 6], 4)
    b = run_chunks(bf16, bf16.allocate_kv_cache(8, 4), ids, [12, 8], [3, 1, 4, 0, 6], 4)
    assert b.dtype == torch.float32
    assert (a - b).abs().max() < 0.1 * a.abs().max()


def test_hf_tokenizer_is_used_when_present(checkpoint: Path, tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = _copy(checkpoint, tmp_path / "m")
    vocab = {"[UNK]": 0, "</s>": 2, "hello": 5, "world": 6}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["</s>"])
    tok.save(str(path / "tokenizer.json"))
    _, config, loaded = load_model(str(path))
    assert isinstance(loaded, HFTokenizer) and loaded.eos_token_id == config.eos_token_id == 2
    assert loaded.encode("hello world") == [5, 6]
    assert loaded.decode([5, 2, 6]) == "hello world"
    (path / "tokenizer.json").write_text("{broken")
    with pytest.raises(ConfigError, match="cannot read"):
        load_model(str(path))


def test_byte_tokenizer_round_trip() -> None:
    tok = ByteTokenizer(512, 256)
    text = "héllo, wörld ✓"
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids) and tok.decode(ids) == text
    assert tok.decode([*ids, 256, 300, 511]) == text  # EOS and non-byte ids are dropped
    assert tok.decode([0xE2, 0x9C]) == "\ufffd"  # a truncated code point does not raise
    with pytest.raises(ConfigError, match="eos_token_id"):
        ByteTokenizer(512, 512)


BASE = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 100,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "eos_token_id": [7, 8],
    "rope_theta": 5e5,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
    },
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
}


def test_transformers_4_style_config() -> None:
    c = config_from_hf(BASE)
    assert (c.architecture, c.num_kv_heads, c.head_dim, c.eos_token_id, c.rope_theta) == (
        "llama",
        4,
        8,
        7,
        5e5,
    )
    assert c.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 4096)
    assert c.tie_word_embeddings and not c.attention_bias and not c.qk_norm
    no_eos = {k: v for k, v in BASE.items() if k != "eos_token_id"}
    assert config_from_hf(no_eos, {"eos_token_id": 9}).eos_token_id == 9
    with pytest.raises(ConfigError, match="eos_token_id"):
        config_from_hf(no_eos)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"layer_types": ["sliding_attention"]}, "layer_types"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
        ({"rope_scaling": {"rope_type": "linear"}}, "rope_scaling"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({"num_key_value_heads": 3}, "num_kv_heads"),
        ({"vocab_size": 5}, "eos_token_id"),
        ({"intermediate_size": 0}, "intermediate_size"),
        ({"architectures": []}, "architectures"),
    ],
)
def test_unsupported_or_invalid_config_fields(change: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        config_from_hf({**BASE, **change})
    assert info.value.field == field


def test_model_config_validation() -> None:
    with pytest.raises(ConfigError, match="head_dim"):
        ModelConfig("qwen3", 512, 64, 128, 2, 4, 2, 15, eos_token_id=256)
    with pytest.raises(ConfigError, match="architecture"):
        ModelConfig("gpt2", 512, 64, 128, 2, 4, 2, 16, eos_token_id=256)
    with pytest.raises(ConfigError, match="no preset 'huge'"):
        preset_config("huge")


@pytest.mark.parametrize(
    ("file", "content", "message"),
    [
        ("config.json", "[1, 2]", "must hold a JSON object"),
        ("config.json", b"\xff\xfe{}", "cannot read"),  # not UTF-8
        ("model.safetensors.index.json", '{"weight_map": ["a"]}', "weight_map must map"),
        ("model.safetensors.index.json", '{"weight_map": {"w": 3}}', "weight_map must map"),
        ("model.safetensors.index.json", "[]", "must hold a JSON object"),
    ],
)
def test_malformed_model_files_are_config_errors(
    checkpoint: Path, tmp_path: Path, file: str, content: str | bytes, message: str
) -> None:
    """A config.json or shard index of the wrong shape: a ConfigError naming ``model`` (no
    AttributeError from indexing a list), from the full load and from the config-only read."""
    path = _copy(checkpoint, tmp_path / "m")
    target = path / file
    target.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ConfigError, match=message) as info:
        load_model(str(path))
    assert info.value.field == "model"
    if file == "config.json":
        with pytest.raises(ConfigError, match=message):
            load_model_config(str(path))
