"""Prompts as token ids, exactly as ``kvoffload serve`` feeds them to the engine.

Shared by the server and the router (``kvoffload route`` must hash the same tokens the backends
cache), and free of torch. A preset model (``tiny``, ``small``; a preset name wins over a
directory of that name, as in the engine's loader) is byte-level: a prompt's ids are its UTF-8
bytes, and chat messages go through :data:`DEFAULT_CHAT_TEMPLATE`. A checkpoint directory uses
its ``tokenizer.json`` (special tokens added as the model expects, like the engine's tokenizer)
and the ``chat_template`` of its ``tokenizer_config.json``, rendered with Jinja2 as Hugging
Face's ``apply_chat_template`` does and tokenized without adding special tokens again (the
template writes them).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvoffload.engine.model_config import PRESETS
from kvoffload.errors import ConfigError

__all__ = ["DEFAULT_CHAT_TEMPLATE", "PRESET_NAMES", "PromptTokenizer", "chat_messages"]

#: The engine's presets, from their one source (``kvoffload.engine.model_config``: torch-free,
#: so the router knows them without importing torch).
PRESET_NAMES: frozenset[str] = frozenset(PRESETS)

#: The chat template of models without one (the presets): one line per turn, then the
#: assistant's header.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def chat_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as the chat template sees them: ``role``, ``content`` (text parts joined) and
    ``name`` when set. Raises :class:`ConfigError` for content that is not text."""
    out = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, list):
            parts = [p.get("text") if isinstance(p, Mapping) and p.get("type") == "text" else None
                     for p in content]
            if any(not isinstance(p, str) for p in parts):
                raise ConfigError(f"messages.{i}.content", "only text content parts are supported")
            content = "".join(parts)  # type: ignore[arg-type]
        clean = {"role": message.get("role"), "content": content, "name": message.get("name")}
        out.append({k: v for k, v in clean.items() if v is not None})
    return out


def _raise_exception(message: str) -> None:
    raise ConfigError("messages", message)


def _compile(template: str) -> Callable[..., str]:
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    try:
        compiled = env.from_string(template)
    except TemplateError as exc:
        raise ConfigError("chat_template", f"cannot compile: {exc}") from exc

    def render(**context: Any) -> str:
        try:
            return compiled.render(**context)
        except TemplateError as exc:
            raise ConfigError("messages", f"the chat template failed: {exc}") from exc

    return render


class PromptTokenizer:
    """Turns completion prompts and chat messages into the token ids the engine caches.

    ``model`` is a preset name or a checkpoint directory, as given to the engine. Where a
    checkpoint's tokenizer cannot be loaded (no ``tokenizer.json``, no ``tokenizers`` package)
    the ids are byte-level, as the engine's; with ``require_tokenizer`` (the router, whose
    backends may be vLLM's) that, and a model that is neither a preset nor a directory, is a
    :class:`ConfigError` naming ``model`` instead: byte-level ids would key every prompt's
    blocks differently from the backends', and routing would silently stop seeing any cache.
    """

    def __init__(self, model: str, *, require_tokenizer: bool = False) -> None:
        self.model = model
        directory = Path(model)
        self._hf: Any = None
        self._special: dict[str, str] = {}
        template = DEFAULT_CHAT_TEMPLATE
        if require_tokenizer and model not in PRESET_NAMES and not directory.is_dir():
            raise ConfigError(
                "model", f"{model!r} is neither a preset {sorted(PRESET_NAMES)} nor a checkpoint "
                "directory: give the backends' checkpoint directory (its tokenizer.json), so "
                "prompts are tokenized as the backends do")
        if model not in PRESET_NAMES and directory.is_dir():
            self._hf = _load_hf_tokenizer(directory, require_tokenizer)
            config = _read_json(directory / "tokenizer_config.json")
            template = _chat_template(config) or DEFAULT_CHAT_TEMPLATE
            for name in ("bos_token", "eos_token"):
                value = config.get(name)
                if isinstance(value, Mapping):
                    value = value.get("content")
                if isinstance(value, str):
                    self._special[name] = value
        self._render = _compile(template)

    def encode(self, text: str) -> list[int]:
        """A completion prompt's ids (special tokens added as the model expects)."""
        if self._hf is None:
            return list(text.encode("utf-8"))
        return list(self._hf.encode(text, add_special_tokens=True).ids)

    def render_chat(self, messages: Sequence[Mapping[str, Any]]) -> str:
        """The chat template applied to ``messages``, ending with the assistant's header."""
        return self._render(messages=list(messages), add_generation_prompt=True, **self._special)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """A chat's ids: the rendered template, tokenized without adding special tokens."""
        text = self.render_chat(messages)
        if self._hf is None:
            return list(text.encode("utf-8"))
        return list(self._hf.encode(text, add_special_tokens=False).ids)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError("model", f"cannot read {path}: {exc}") from exc
    return data if isinstance(data, dict) else {}


def _chat_template(config: Mapping[str, Any]) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _load_hf_tokenizer(directory: Path, required: bool) -> Any:
    """``directory``'s tokenizer; ``None`` (byte-level ids, as the engine falls back to) where it
    cannot be loaded, unless ``required`` (then a :class:`ConfigError` naming ``model``)."""
    path = directory / "tokenizer.json"
    reason = None
    if not path.is_file():
        reason = f"no tokenizer.json in {directory}"
    else:
        try:
            from tokenizers import Tokenizer
        except ImportError:
            reason = "the 'tokenizers' package is not installed"
    if reason is not None:
        if required:
            raise ConfigError("model", f"{reason}: cannot tokenize prompts as the backends do")
        return None
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # a corrupt file or an unknown format version
        raise ConfigError("tokenizer", f"cannot read {path}: {exc}") from exc
