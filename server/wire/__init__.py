"""The messages between the API processes and the engine process, and the vocabulary both speak:
sampling parameters, outputs and log-probs, sleep state and tags, errors, engine stats, the framing.

Imports neither torch nor the engine: the API process loads only this, the web stack and the tokenizer.
Layers: server.api -> server.wire <- server.engine -> server.model -> allocator."""
