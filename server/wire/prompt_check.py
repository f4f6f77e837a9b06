"""The checks every prompt passes before it runs, as one pure function of the static facts (vocabulary
size, context length): the engine runs them on admission, and the API process runs the same ones
before a multi-prompt request starts, so one bad prompt rejects the whole request without a round trip."""
from __future__ import annotations

from dataclasses import replace

from server.wire.params import InvalidRequestError, SamplingParams


def check_prompt_ids(prompt_token_ids: list[int] | None, params: SamplingParams, vocab_size: int,
                     max_model_len: int) -> tuple[list[int], SamplingParams]:
    """The prompt's token ids and the params to run it with (max_tokens resolved), or InvalidRequestError."""
    params.validate(vocab_size)
    ids = [int(t) for t in prompt_token_ids or ()]
    if not ids:
        raise InvalidRequestError("the prompt is empty; send at least one token", param="prompt")
    if any(not 0 <= t < vocab_size for t in ids):
        raise InvalidRequestError(f"prompt token ids must be in [0, {vocab_size})", param="prompt")
    limit = max_model_len
    if len(ids) >= limit:
        raise InvalidRequestError(
            f"the prompt has {len(ids)} tokens, but this model's context is {limit} tokens "
            "(prompt plus at least one generated token); shorten the prompt", param="prompt",
            code="context_length_exceeded")
    if params.max_tokens is None:
        params = replace(params, max_tokens=limit - len(ids))
    elif len(ids) + params.max_tokens > limit:
        raise InvalidRequestError(
            f"this model's context is {limit} tokens; the prompt has {len(ids)} and max_tokens asks for "
            f"{params.max_tokens} more; lower max_tokens to at most {limit - len(ids)}", param="max_tokens",
            code="context_length_exceeded")
    return ids, params
