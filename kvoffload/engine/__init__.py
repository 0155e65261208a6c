"""The reference inference engine: a Llama/Qwen2/Qwen3 model over a paged, cross-layer KV cache.

Exports are imported on first use (:mod:`kvoffload._lazy`), so its torch-free modules
(``model_config``: the presets) are cheap to import on their own, e.g. by the router.
"""

from typing import TYPE_CHECKING

from kvoffload._lazy import lazy_exports

if TYPE_CHECKING:  # the names as the type checker sees them; imported on use at run time
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

_LAZY = {
    "AttentionMetadata": "kvoffload.engine.attention",
    "slot_mapping": "kvoffload.engine.attention",
    "EngineConfig": "kvoffload.engine.config",
    "Engine": "kvoffload.engine.engine",
    "load_model": "kvoffload.engine.loader",
    "DecoderModel": "kvoffload.engine.model",
    "PRESETS": "kvoffload.engine.model_config",
    "ModelConfig": "kvoffload.engine.model_config",
    "RopeScaling": "kvoffload.engine.model_config",
    "config_from_hf": "kvoffload.engine.model_config",
    "preset_config": "kvoffload.engine.model_config",
    "RequestOutput": "kvoffload.engine.request",
    "RequestStatus": "kvoffload.engine.request",
    "SamplingParams": "kvoffload.engine.sampling",
    "make_generator": "kvoffload.engine.sampling",
    "sample": "kvoffload.engine.sampling",
    "ByteTokenizer": "kvoffload.engine.tokenizer",
    "HFTokenizer": "kvoffload.engine.tokenizer",
    "Tokenizer": "kvoffload.engine.tokenizer",
}
__getattr__, __dir__ = lazy_exports(__name__, _LAZY)

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
