"""Request bodies of the OpenAI routes, and their translation into the engine's SamplingParams.

Unknown fields are accepted and ignored (OpenAI's clients add new optional fields often, and a
server that rejected them would break clients on every SDK release); fields that would change the
answer in ways this server cannot honour (tools, a JSON response_format, suffix, several prompts)
answer 400 instead of being silently dropped.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from server.engine.params import InvalidRequestError, SamplingParams

MAX_LOGPROBS = SamplingParams.MAX_LOGPROBS
INT32_MAX = 2 ** 31 - 1


class RequestBody(BaseModel):
    # extra="allow" rather than "ignore": body.py logs the names it ignores, at debug level.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class StreamOptions(RequestBody):
    include_usage: bool = False


class _Sampling(RequestBody):
    """The sampling fields both routes share: OpenAI's, plus the extras vLLM users rely on."""
    model: str | None = None
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    seed: int | None = Field(None, ge=-(2 ** 63), lt=2 ** 64)
    user: str | None = None
    best_of: int | None = None
    # vLLM's extras
    top_k: int = Field(0, ge=-1, le=INT32_MAX)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    repetition_penalty: float = Field(1.0, gt=0.0, le=100.0)
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def _bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        out: dict[int, float] = {}
        for key, value in self.logit_bias.items():
            try:
                token = int(key)
            except ValueError:
                raise InvalidRequestError(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
            out[token] = max(-100.0, min(100.0, value))  # OpenAI's documented range
        return out

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequestError("best_of is not supported; leave it out or set it equal to n", "best_of")
        if self.stop_token_ids and any(not 0 <= t <= INT32_MAX for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids must be non-negative token ids", "stop_token_ids")
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k, min_p=self.min_p, seed=self.seed, max_tokens=max_tokens,
            min_tokens=self.min_tokens, stop=self.stop, stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos, include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=logprobs, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
            logit_bias=self._bias(), skip_special_tokens=self.skip_special_tokens)


class CompletionRequest(_Sampling):
    prompt: Any = None
    max_tokens: int | None = Field(16, ge=1)   # OpenAI's default for completions
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None

    def prompt_input(self) -> tuple[str | None, list[int] | None]:
        """(text, None) or (None, token ids): one prompt per request."""
        p = self.prompt
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]  # a batch of one
        if isinstance(p, str):
            if not p:
                raise InvalidRequestError("prompt is empty; send some text or token ids", "prompt")
            return p, None
        if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            return None, list(p)
        if isinstance(p, list) and len(p) > 1 and all(isinstance(x, (str, list)) for x in p):
            raise InvalidRequestError(f"got {len(p)} prompts; this server takes one prompt per request "
                                      "(send several requests concurrently instead)", "prompt")
        if p is None:
            raise InvalidRequestError("prompt is required", "prompt")
        raise InvalidRequestError("prompt must be a string, a list of one string, or a list of token ids "
                                  f"(got {type(p).__name__})", "prompt")

    def to_params(self) -> SamplingParams:
        if self.suffix:
            raise InvalidRequestError("suffix is not supported; leave it out", "suffix")
        if self.echo and self.logprobs is not None:
            # Prompt log-probs are not computed by the engine; echoing without them would mislead.
            raise InvalidRequestError("echo with logprobs is not supported; drop one of them", "echo")
        return self.sampling_params(self.max_tokens, self.logprobs)


class ChatMessage(RequestBody):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    def template_dict(self, index: int) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise InvalidRequestError(
                        f"messages[{index}].content[{j}] has type {part.get('type')!r}; only text parts "
                        '({"type": "text", "text": "..."}) are supported', f"messages[{index}].content")
                texts.append(part["text"])
            content = "\n".join(texts)
        if content is None and self.role != "assistant":
            raise InvalidRequestError(f"messages[{index}].content is required for role {self.role!r}",
                                      f"messages[{index}].content")
        out: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name:
            out["name"] = self.name
        return out


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None
    # vLLM's extras for templates
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    def template_messages(self) -> list[dict[str, Any]]:
        if not self.messages:
            raise InvalidRequestError("messages is empty; send at least one message", "messages")
        return [m.template_dict(i) for i, m in enumerate(self.messages)]

    def to_params(self) -> SamplingParams:
        if self.tools:
            raise InvalidRequestError("tools are not supported by this server; leave tools out", "tools")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise InvalidRequestError("only response_format {\"type\": \"text\"} is supported", "response_format")
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs: true", "top_logprobs")
        max_tokens = self.max_completion_tokens or self.max_tokens  # None: up to the context limit
        return self.sampling_params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None)


class UpdateWeightsRequest(RequestBody):
    path: str | None = None
    weight_version: str | None = None
