"""The HTTP layer: it translates between OpenAI-shaped HTTP and the engine, and keeps no engine state.

Importing this package is cheap (no torch, no FastAPI) so the CLI can read ServerSettings for --help.
"""
