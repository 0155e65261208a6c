"""How ``kvoffload serve`` shapes its answers: OpenAI's completions and chat objects (whole, or
as stream chunks), with logprobs and usage, for the choices of one job."""

from __future__ import annotations

import time
import uuid
from typing import Any

from kvoffload.serving.context import ServingContext
from kvoffload.serving.output import TextAssembler, TextPiece, chat_logprobs, completion_logprobs
from kvoffload.serving.protocol import ChatCompletionRequest, CompletionRequest
from kvoffload.serving.request_params import Job

__all__ = ["AnswerFormat", "ChatFormat", "CompletionFormat"]


class AnswerFormat:
    """How one API shapes its answers (completions or chat), for the choices of one job."""

    prefix = ""
    prompt_param = "prompt"
    chunk_object = ""

    def __init__(self, ctx: ServingContext, job: Job, decode: Any) -> None:
        body = job.body
        self.job = job
        self.model = ctx.model_name
        self.decode = decode
        self.token_bytes = ctx.loop.engine.tokenizer.token_bytes
        self.created = int(time.time())
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        self.kv_transfer_params = body.kv_transfer_params
        self.as_token_ids = bool(body.return_tokens_as_token_ids)

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    def usage(self, assemblers: list[TextAssembler]) -> dict[str, Any]:
        """Prompt tokens counted once per prompt (not per choice), as vLLM."""
        job = self.job
        n = len(job.choices) // len(job.prompts)
        prompt = sum(len(p) for p in job.prompts)
        cached = 0
        for choice, assembler in zip(job.choices, assemblers, strict=True):
            output = assembler.output
            if choice.index % n == 0 and output is not None:
                cached += output.cached_tokens_engine + output.cached_tokens_offload
        completion = sum(len(a.token_ids) for a in assemblers)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def usage_chunk(self, assemblers: list[TextAssembler]) -> dict[str, Any]:
        out = self._envelope(self.chunk_object, [])
        out["usage"] = self.usage(assemblers)
        return out

    def opening(self) -> list[dict[str, Any]]:
        """Chunks a stream begins with, before any token."""
        return []

    def chunk(self, index: int, piece: TextPiece, assembler: TextAssembler) -> dict[str, Any]:
        raise NotImplementedError

    def full(self, assemblers: list[TextAssembler]) -> dict[str, Any]:
        raise NotImplementedError

    @staticmethod
    def _whole(assembler: TextAssembler) -> TextPiece:
        return TextPiece(assembler.text, assembler.token_ids, assembler.logprobs)

    @staticmethod
    def _stop_reason(piece: TextPiece, assembler: TextAssembler) -> str | int | None:
        return None if piece.finish_reason is None else assembler.stop_reason


class CompletionFormat(AnswerFormat):
    prefix = "cmpl"
    chunk_object = "text_completion"

    def __init__(self, ctx: ServingContext, job: Job, decode: Any) -> None:
        super().__init__(ctx, job, decode)
        body = job.body
        self.want_logprobs = isinstance(body, CompletionRequest) and body.logprobs is not None
        self._offsets = [0] * len(job.choices)
        n = len(job.choices) // len(job.prompts)
        #: per choice, the prompt text still to echo (sent with its first chunk)
        self._echo = [job.echo[i // n] if job.echo else "" for i in range(len(job.choices))]

    def _logprobs(self, index: int, piece: TextPiece) -> dict[str, Any] | None:
        if not self.want_logprobs:
            return None
        out = completion_logprobs(piece, self.decode, self._offsets[index], self.as_token_ids)
        self._offsets[index] += len(piece.text)
        return out

    def _choice(self, index: int, piece: TextPiece, assembler: TextAssembler) -> dict[str, Any]:
        echo, self._echo[index] = self._echo[index], ""
        return {"index": index, "text": echo + piece.text,
                "logprobs": self._logprobs(index, piece),
                "finish_reason": piece.finish_reason,
                "stop_reason": self._stop_reason(piece, assembler)}

    def chunk(self, index: int, piece: TextPiece, assembler: TextAssembler) -> dict[str, Any]:
        return self._envelope("text_completion", [self._choice(index, piece, assembler)])

    def full(self, assemblers: list[TextAssembler]) -> dict[str, Any]:
        choices = []
        for i, assembler in enumerate(assemblers):
            whole = self._whole(assembler)
            whole.finish_reason = assembler.finish_reason
            choices.append(self._choice(i, whole, assembler))
        out = self._envelope("text_completion", choices)
        out["usage"] = self.usage(assemblers)
        out["kv_transfer_params"] = self.kv_transfer_params
        return out


class ChatFormat(AnswerFormat):
    prefix = "chatcmpl"
    prompt_param = "messages"
    chunk_object = "chat.completion.chunk"

    def __init__(self, ctx: ServingContext, job: Job, decode: Any) -> None:
        super().__init__(ctx, job, decode)
        body = job.body
        self.top = ((body.top_logprobs or 0) if body.logprobs else None) if isinstance(
            body, ChatCompletionRequest) else None

    def _logprobs(self, piece: TextPiece) -> dict[str, Any] | None:
        if self.top is None:
            return None
        return chat_logprobs(piece, self.decode, self.top, self.token_bytes, self.as_token_ids)

    def opening(self) -> list[dict[str, Any]]:
        """A role-only chunk per choice, as vLLM begins a chat stream."""
        return [self._envelope("chat.completion.chunk", [
            {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
             "finish_reason": None}]) for i in range(len(self.job.choices))]

    def chunk(self, index: int, piece: TextPiece, assembler: TextAssembler) -> dict[str, Any]:
        # Always a "content", "" while the text is held back or empty (a special token), as vLLM:
        # clients (`vllm bench serve`) count a chunk whose delta has content and no role as a token.
        delta = {"content": piece.text}
        choice = {"index": index, "delta": delta, "logprobs": self._logprobs(piece),
                  "finish_reason": piece.finish_reason,
                  "stop_reason": self._stop_reason(piece, assembler)}
        return self._envelope("chat.completion.chunk", [choice])

    def full(self, assemblers: list[TextAssembler]) -> dict[str, Any]:
        choices = []
        for i, assembler in enumerate(assemblers):
            message = {"role": "assistant", "content": assembler.text}
            choices.append({"index": i, "message": message,
                            "logprobs": self._logprobs(self._whole(assembler)),
                            "finish_reason": assembler.finish_reason,
                            "stop_reason": assembler.stop_reason})
        out = self._envelope("chat.completion", choices)
        out["usage"] = self.usage(assemblers)
        out["kv_transfer_params"] = self.kv_transfer_params
        return out
