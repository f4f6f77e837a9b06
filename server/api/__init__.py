"""The API process: HTTP routes (OpenAI's and vLLM's), the engine client, held requests and output streams,
metrics. It translates between OpenAI-shaped HTTP and the engine, keeps no engine state, and never imports
torch or the engine: it talks to the engine process through server.wire only.

Importing this package is cheap (no FastAPI) so the CLI can read ServerSettings for --help.
"""
