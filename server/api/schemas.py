"""Request bodies of the OpenAI routes, and their translation into the engine's SamplingParams.

Types are checked here; every range is checked once, in SamplingParams.validate, so the HTTP API
and the in-process LLM can never disagree. Unknown fields are accepted and logged at debug level
(OpenAI's clients add optional fields often, and a server that rejected them would break clients
on every SDK release), except the fields in UNSUPPORTED: each of those would change the generated
tokens in a way this server does not implement, so it answers 400 naming the field rather than
silently generating something else.
"""
from __future__ import annotations

import json
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict

from server.wire.params import InvalidRequestError, RequestOutputKind, SamplingParams, StructuredOutputs


class RequestBody(BaseModel):
    # extra="allow" rather than "ignore": body.py logs the names it ignores, at debug level.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class StreamOptions(RequestBody):
    include_usage: bool = False


def _set(value: Any) -> bool:
    return value not in (None, False, [], {}, "")


# Fields (OpenAI's or vLLM's) that change what is generated and that this server does not implement:
# field -> (is it asking for something, what to do instead).
UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "suffix": (_set, "leave it out"),
    "best_of": (lambda v: v not in (None, 1), "leave it out or set it equal to n"),
    "use_beam_search": (_set, "beam search is not implemented; sample n choices instead"),
    "length_penalty": (lambda v: v not in (None, 1, 1.0), "it only applies to beam search"),
    "early_stopping": (_set, "it only applies to beam search"),
    "bad_words": (_set, "use logit_bias with -100 on those tokens"),
    "allowed_token_ids": (_set, "use structured_outputs (choice or regex) or logit_bias"),
    "logits_processors": (_set, "custom logits processors are not supported"),
    "truncate_prompt_tokens": (_set, "truncate the prompt yourself (see POST /tokenize)"),
    "prompt_embeds": (_set, "send text or token ids"),
    "tools": (_set, "describe the tools in a message instead"),
    "tool_choice": (lambda v: v not in (None, "none"), "tool calling is not supported"),
    "functions": (_set, "function calling is not supported"),
    "function_call": (lambda v: v not in (None, "none"), "function calling is not supported"),
    "audio": (_set, "audio output is not supported"),
    "modalities": (lambda v: _set(v) and list(v) != ["text"], "only text output is supported"),
    "reasoning_effort": (_set, "pass it in chat_template_kwargs if the model's template reads it"),
    "verbosity": (_set, "leave it out"),
    "web_search_options": (_set, "web search is not supported"),
    "vllm_xargs": (_set, "leave it out"),
    "thinking_token_budget": (_set, "leave it out"),
    "guided_whitespace_pattern": (_set, "leave it out; set structured_outputs.disable_any_whitespace instead"),
    "structural_tag": (_set, "use structured_outputs json, regex, choice or grammar"),
}


class _Sampling(RequestBody):
    """The sampling fields both routes share: OpenAI's, plus the extras vLLM users rely on."""
    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    user: str | None = None
    response_format: dict[str, Any] | None = None
    # vLLM's extras
    top_k: int = 0
    min_p: float = 0.0
    min_tokens: int = 0
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    return_routed_experts: bool = False  # SGLang's field; the server needs --enable-return-routed-experts
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

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

    def check_supported(self) -> None:
        values = {**dict(self), **(self.model_extra or {})}
        for name, (asks, instead) in UNSUPPORTED.items():
            if name in values and asks(values[name]):
                raise InvalidRequestError(f"{name} is not supported by this server; {instead}", name)
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options is only allowed with stream: true", "stream_options")

    def structured(self) -> tuple[StructuredOutputs | None, str]:
        """What the output must match, from whichever field asked for it (at most one), and that field."""
        asked: list[tuple[str, StructuredOutputs]] = []
        rf = self.response_format
        if rf is not None:
            kind = rf.get("type", "text")
            if kind == "json_object":
                asked.append(("response_format", StructuredOutputs(json_object=True)))
            elif kind == "json_schema":
                spec = rf.get("json_schema")
                schema = spec.get("schema") if isinstance(spec, dict) else None
                if not isinstance(schema, dict):
                    raise InvalidRequestError('response_format json_schema needs {"json_schema": {"name": ..., '
                                              '"schema": {...}}}', "response_format")
                asked.append(("response_format", StructuredOutputs(json=schema)))
            elif kind != "text":
                raise InvalidRequestError(f"response_format type {kind!r} is not supported; use text, json_object "
                                          "or json_schema", "response_format")
        if self.structured_outputs:
            so = dict(self.structured_outputs)
            keys = {"json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace"}
            unknown = sorted(k for k, v in so.items() if k not in keys and _set(v))
            if unknown:
                raise InvalidRequestError(f"structured_outputs.{unknown[0]} is not supported; use one of json, "
                                          "regex, choice, grammar, json_object", "structured_outputs")
            choice = so.get("choice")
            if choice is not None and (not isinstance(choice, list) or not all(isinstance(c, str) for c in choice)):
                raise InvalidRequestError("structured_outputs.choice must be a list of strings", "structured_outputs")
            asked.append(("structured_outputs", StructuredOutputs(
                json=so.get("json"), regex=so.get("regex"), choice=choice, grammar=so.get("grammar"),
                json_object=bool(so.get("json_object")),
                whitespace_flexible=so.get("disable_any_whitespace") is False)))
        for name, kw in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                         ("guided_grammar", "grammar")):
            value = getattr(self, name)
            if value is not None:
                asked.append((name, StructuredOutputs(**{kw: value})))
        if len(asked) > 1:
            raise InvalidRequestError(f"{asked[0][0]} and {asked[1][0]} both constrain the output; send one",
                                      asked[1][0])
        return (asked[0][1], asked[0][0]) if asked else (None, "")

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None) -> SamplingParams:
        self.check_supported()
        spec, _ = self.structured()
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k, min_p=self.min_p, seed=self.seed, max_tokens=max_tokens,
            min_tokens=self.min_tokens, stop=self.stop, stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos, include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
            logit_bias=self._bias(), skip_special_tokens=self.skip_special_tokens, structured_outputs=spec,
            return_routed_experts=self.return_routed_experts,
            # A whole response needs only the end: no output (frame item, wake-up, text) per step.
            output_kind=RequestOutputKind.CUMULATIVE if self.stream else RequestOutputKind.FINAL_ONLY)


Prompt = tuple[str | None, list[int] | None]   # (text, None) or (None, token ids)


def _is_ids(p: Any) -> bool:
    return isinstance(p, list) and bool(p) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)


class CompletionRequest(_Sampling):
    prompt: Any = None
    max_tokens: int | None = 16   # OpenAI's default for completions
    echo: bool = False
    logprobs: int | None = None

    def prompts(self) -> list[Prompt]:
        """One or several prompts: a string, a list of strings, token ids, or a list of token-id lists."""
        p = self.prompt
        if p is None:
            raise InvalidRequestError("prompt is required", "prompt")
        if isinstance(p, str) or _is_ids(p):
            p = [p]
        if not isinstance(p, list) or not p:
            raise InvalidRequestError("prompt must be a string, a list of strings, a list of token ids or a list of "
                                      f"token-id lists (got {type(p).__name__ if p != [] else 'an empty list'})",
                                      "prompt")
        out: list[Prompt] = []
        for i, item in enumerate(p):
            where = f"prompt[{i}]" if len(p) > 1 else "prompt"
            if isinstance(item, str):
                if not item:
                    raise InvalidRequestError(f"{where} is empty; send some text or token ids", "prompt")
                out.append((item, None))
            elif _is_ids(item):
                out.append((None, list(item)))
            else:
                raise InvalidRequestError(f"{where} must be a string or a list of token ids (got {_shown(item)})",
                                          "prompt")
        return out

    def to_params(self) -> SamplingParams:
        # echo + logprobs: OpenAI's legacy scoring returns the prompt tokens' log-probs too.
        prompt_lps = self.prompt_logprobs
        if self.echo and self.logprobs is not None:
            prompt_lps = max(prompt_lps or 0, self.logprobs)
        return self.sampling_params(self.max_tokens, self.logprobs, prompt_lps)


def _shown(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, BaseModel) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


class ChatMessage(RequestBody):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    def template_dict(self, index: int) -> dict[str, Any]:
        if not self.role:
            raise InvalidRequestError(f"messages[{index}].role is empty", f"messages[{index}].role")
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


# Arguments the server passes to the chat template itself; a client may not override them.
RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "messages", "tokenize", "add_generation_prompt",
                                      "continue_final_message", "documents", "return_dict", "return_tensors",
                                      "chat_template"})


class ChatTemplateFields(RequestBody):
    """vLLM's fields that say how messages become a prompt: shared by /v1/chat/completions and /tokenize,
    so both render the same messages to the same tokens."""
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None

    def template_messages(self) -> list[dict[str, Any]]:
        if not self.messages:
            raise InvalidRequestError("messages is empty; send at least one message", "messages")
        msgs = [m.template_dict(i) for i, m in enumerate(self.messages)]
        if self.continue_final_message:
            if self.add_generation_prompt:
                raise InvalidRequestError("continue_final_message continues the last message, so it needs "
                                          "add_generation_prompt: false", "continue_final_message")
            if msgs[-1]["role"] != "assistant":
                raise InvalidRequestError("continue_final_message needs an assistant message last",
                                          "continue_final_message")
        return msgs

    def template_kwargs(self) -> dict[str, Any]:
        kwargs = dict(self.chat_template_kwargs or {})
        clash = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
        if clash:
            raise InvalidRequestError(f"chat_template_kwargs may not set {', '.join(clash)}", "chat_template_kwargs")
        kwargs["add_generation_prompt"] = self.add_generation_prompt
        if self.continue_final_message:
            kwargs["continue_final_message"] = True
        if self.documents is not None:
            kwargs["documents"] = self.documents
        if self.chat_template is not None:
            kwargs["chat_template"] = self.chat_template
        return kwargs


class ChatCompletionRequest(_Sampling, ChatTemplateFields):
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    echo: bool = False

    def to_params(self) -> SamplingParams:
        if self.echo:
            raise InvalidRequestError("echo is not supported on chat completions; leave it out", "echo")
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs: true", "top_logprobs")
        if self.max_completion_tokens is not None and self.max_completion_tokens < 1:
            raise InvalidRequestError(f"max_completion_tokens must be at least 1, got {self.max_completion_tokens}",
                                      "max_completion_tokens")
        max_tokens = self.max_completion_tokens or self.max_tokens  # None: up to the context limit
        return self.sampling_params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None,
                                    self.prompt_logprobs)


class UpdateWeightsRequest(RequestBody):
    path: str | None = None
    weight_version: str | None = None
