"""The reference inference engine: a Llama/Qwen2/Qwen3 model over a paged, cross-layer KV cache."""

from kvoffload.engine.attention import AttentionMetadata, slot_mapping
from kvoffload.engine.config import EngineConfig
from kvoffload.engine.engine import Engine
from kvoffload.engine.loader import load_model
from kvoffload.engine.model import DecoderModel
from kvoffload.engine.model_config import (
    PRESETS,
    ModelConfig,
    RopeScaling,
    config_from_hf,
    preset_config,
)
from kvoffload.engine.request import RequestOutput, RequestStatus
from kvoffload.engine.sampling import SamplingParams, make_generator, sample
from kvoffload.engine.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

__all__ = [
    "PRESETS",
    "AttentionMetadata",
    "ByteTokenizer",
    "DecoderModel",
    "Engine",
    "EngineConfig",
    "HFTokenizer",
    "ModelConfig",
    "RequestOutput",
    "RequestStatus",
    "RopeScaling",
    "SamplingParams",
    "Tokenizer",
    "config_from_hf",
    "load_model",
    "make_generator",
    "preset_config",
    "sample",
    "slot_mapping",
]
