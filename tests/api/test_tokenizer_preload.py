"""The API process loads its tokenizer on a thread while the engine loads (server/api/tokens.py): from the
folder the engine will use when that folder is known without a conversion, and never in place of another."""
from __future__ import annotations

from server.api.tokens import TokenizerPreload, Tokens
from server.model.source import cached_model_folder, resolve_model


def test_the_preloaded_tokenizer_serves_the_engines_folder_only(default_model_folder, tmp_path):
    # The default model (None) resolves, once converted, to the folder the engine loads.
    assert cached_model_folder(None) == resolve_model(None).folder == default_model_folder
    preload = TokenizerPreload(None)
    tokens = Tokens(default_model_folder, 64, preload)
    assert tokens.tokenizer is not None and preload.take(default_model_folder) == (tokens.tokenizer,
                                                                                  tokens.stream_tokenizer)
    # the streams' copy (decoded on the event loop) is another object that decodes alike
    assert tokens.stream_tokenizer is not tokens.tokenizer
    assert tokens.stream_tokenizer.decode([100, 200, 300]) == tokens.tokenizer.decode([100, 200, 300])
    assert preload.take(tmp_path) is None  # another folder: Tokens loads its own
    assert tokens.tokenizer("hello").input_ids == Tokens(default_model_folder, 64).tokenizer("hello").input_ids


def test_a_model_not_known_yet_preloads_nothing(tmp_path):
    gguf = tmp_path / "never-converted.gguf"
    gguf.write_bytes(b"GGUF" + bytes(64))
    assert cached_model_folder(str(gguf)) is None  # converting it is the engine's job
    assert cached_model_folder(str(tmp_path / "missing")) is None
    assert TokenizerPreload(str(gguf)).take(tmp_path) is None
