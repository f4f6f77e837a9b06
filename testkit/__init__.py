"""Helpers that tests/ and bench/ (and scripts/, examples/) share, in a package that is neither: the
real server started as a subprocess (http_server), model folders of common shapes with random weights
(models), device-memory probes (footprint, cuda_pool), paged-attention cases for the kernels
(kernel_cases) and the OpenAPI fuzz run (fuzz). Not installed with the server (pyproject's packages
are allocator and server); run from the repository root, which is on sys.path."""
