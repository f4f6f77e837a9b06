"""Per-request sampling parameters, validated here and only here, with errors that name the field.

The HTTP schemas check types; every range lives in `validate` (one place, so the two can never
drift), and the in-process LLM gets the same checks as the server."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

INT32_MAX = 2 ** 31 - 1
INT64_MIN, INT64_MAX = -(2 ** 63), 2 ** 63 - 1


# Below this a temperature is greedy (vLLM's _SAMPLING_EPS): dividing logits by 1e-300 overflows
# them to inf, and the softmax of infs is NaN, which sampled token id 0 every time.
GREEDY_TEMPERATURE = 1e-5


class InvalidRequestError(ValueError):
    """A request the engine cannot serve as asked; `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


class RequestOutputKind(enum.IntEnum):
    """When the engine hands out a request's outputs (vLLM's names). Every output carries both the whole
    so far and the delta since the previous one, so CUMULATIVE and DELTA are the same here: an output at
    every step. FINAL_ONLY: one output when the first tokens are sampled (time to first token; admission
    is confirmed) and one when the request finishes; nothing in between, and a sequence without stop
    strings is detokenized once, at its end (as is a stream's whose text the API process makes as it goes:
    text_by_api). The in-process LLM.generate and non-streaming HTTP requests
    use it: nobody reads the steps in between, and building, sending and waking for them cost host
    time on every step for every sequence."""
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass(frozen=True)
class StructuredOutputs:
    """Constrain the output (vLLM's StructuredOutputsParams): exactly one of these."""
    json: str | dict | None = None       # a JSON schema (object or its text)
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None           # Lark or GBNF (llama.cpp) grammar text
    json_object: bool = False            # any JSON object
    # JSON without free whitespace by default (vLLM's disable_any_whitespace): with it, small
    # models at temperature 1 pad with newlines until max_tokens and the JSON never closes.
    whitespace_flexible: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise InvalidRequestError("structured outputs take exactly one of json, regex, choice, grammar or "
                                      f"json_object (got {', '.join(given) or 'none'})", "structured_outputs")


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                     # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16        # None: up to the context limit
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None        # top-k log-probs to return beside each sampled token (0: that token only)
    prompt_logprobs: int | None = None  # the same for every prompt token but the first (computed on the prefill)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputs | None = None
    # The compiled form of structured_outputs (server/engine/structured.py); the server compiles it
    # off the engine thread, the engine compiles it on admission when nobody did.
    grammar: Any = field(default=None, repr=False, compare=False)
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # The experts each token was routed to, on the finished output (CompletionOutput.routed_experts). None: the
    # engine's default, which is yes when it records them (--enable-return-routed-experts; vLLM returns them
    # to every request then); the HTTP routes say yes or no per request.
    return_routed_experts: bool | None = None
    # Internal (no request field): the API process makes this request's text from the token ids of its deltas
    # (server/api/engine_client.py), so the engine produces none per step: it treats the sequences as
    # FINAL_ONLY ones without stop strings (lazy text, decoded once at the end: the final text every delta's
    # last SeqDelta carries). The API sets it for a streamed request without stop strings when its tokenizer is
    # prefix_stable (detokenizer.py): detokenizing a streamed step costs the engine thread ~1 us per sequence.
    text_by_api: bool = False

    MAX_LOGPROBS = 20          # OpenAI's and vLLM's default limit for sampled tokens
    MAX_PROMPT_LOGPROBS = 100  # teacher scoring asks for more (TRL's get_sequence_logprobs: 100)
    MAX_N = 128

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def validate(self, vocab_size: int | None = None) -> None:
        def bad(param: str, message: str) -> InvalidRequestError:
            return InvalidRequestError(message, param=param)

        if not isinstance(self.n, int) or self.n < 1 or self.n > self.MAX_N:
            raise bad("n", f"n must be an integer from 1 to {self.MAX_N}, got {self.n!r}")
        if self.temperature < 0:
            raise bad("temperature", f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1 or self.top_k > INT32_MAX:
            raise bad("top_k", f"top_k must be -1 or 0 (off) or a positive integer, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise bad("min_tokens", f"min_tokens must be between 0 and max_tokens, got {self.min_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= self.MAX_LOGPROBS:
            raise bad("logprobs", f"logprobs must be between 0 and {self.MAX_LOGPROBS}, got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= self.MAX_PROMPT_LOGPROBS:
            raise bad("prompt_logprobs", f"prompt_logprobs must be between 0 and {self.MAX_PROMPT_LOGPROBS}, "
                                         f"got {self.prompt_logprobs}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not 0.0 < self.repetition_penalty <= 100.0:
            raise bad("repetition_penalty", f"repetition_penalty must be in (0, 100], got {self.repetition_penalty}")
        if self.seed is not None and not INT64_MIN <= self.seed <= INT64_MAX:
            raise bad("seed", f"seed must fit in a signed 64-bit integer, got {self.seed}")
        if any(not 0 <= int(t) <= INT32_MAX for t in self.stop_token_ids):
            raise bad("stop_token_ids", "stop_token_ids must be non-negative token ids")
        if vocab_size is not None:
            ids = list(self.stop_token_ids) + list((self.logit_bias or {}).keys())
            out = [i for i in ids if not 0 <= int(i) < vocab_size]
            if out:
                raise bad("stop_token_ids" if out[0] in self.stop_token_ids else "logit_bias",
                          f"token ids must be in [0, {vocab_size}), got {out[0]}")

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
