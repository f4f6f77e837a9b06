"""Tensor parallelism below the engine core: rank 0 runs in the engine's process, ranks 1..N-1 in
worker processes it starts. See docs/architecture.md, "Tensor parallelism"."""
