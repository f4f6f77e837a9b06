"""A non-streamed completion's body is encoded piece by piece (each prompt's choices as its final output
arrives): the bytes must be what one JSONResponse of the whole envelope writes. And log-probs at k = 0 with
token ids as names (TRL's rollouts) take the fast path (the engine's tuples, read as they are) with the
general path's object."""
from __future__ import annotations

import json

from fastapi.responses import JSONResponse

from server.api.formatting import CompletionLogprobs, TokenNames, encode_json, encoded_envelope, envelope
from server.wire.logprob_list import LogprobList


def test_encoded_envelope_is_the_whole_envelope_encoded():
    choices = [{"index": i, "text": f"t{i} \"quoted\" é ✓", "logprobs": {"token_logprobs": [-0.5, -9999.0]},
                "finish_reason": "length"} for i in range(5)]
    usage = {"prompt_tokens": 3, "completion_tokens": 10, "total_tokens": 13}
    # a served name that spells the marker the choices are spliced at, inside a JSON string
    model = 'm"choices":[]'
    parts = [encode_json(choices[:2])[1:-1], encode_json(choices[2:3])[1:-1], encode_json(choices[3:])[1:-1]]
    body = encoded_envelope("text_completion", "cmpl-1", 7, model, parts, usage=usage)
    whole = JSONResponse(envelope("text_completion", "cmpl-1", 7, model, choices, usage=usage)).body
    assert body == whole
    assert json.loads(body)["choices"] == choices


def test_k0_log_probs_with_token_ids_as_names_match_the_general_path():
    ids = [5, 17, 5, 900]
    pieces = {5: " a", 17: "é", 900: None}
    wire = [(t, -0.25 * (i + 1), 1, pieces[t]) for i, t in enumerate(ids)]
    wire[1] = (17, float("-inf"), 3, "é")  # reported as the floor
    entries = LogprobList(wire)
    for as_ids in (False, True):
        fast = CompletionLogprobs(0, 4, TokenNames(as_ids)).build(ids, entries)
        general = CompletionLogprobs(0, 4, TokenNames(as_ids)).build(ids, list(entries) + [None])  # None: general path
        for key in fast:
            assert fast[key] == general[key][:len(ids)], key
        names = [f"token_id:{t}" for t in ids] if as_ids else [" a", "é", " a", ""]
        assert fast["tokens"] == names
        assert fast["text_offset"] == [4, 6, 7, 9]  # the texts' lengths, whatever the names
        assert fast["top_logprobs"][1] == {names[1]: -9999.0}
