"""--batch-invariant through the real server on the GPU (bf16, CUDA graphs, the official `openai` client): the
HTTP checks of tests/http/test_http_batch_invariant.py against a CUDA server instead of the CPU one. A request's
tokens and log-probs alone equal those it gets among SLEEPSERVE_BI_OTHERS concurrent others (the gpu-check stage
binv-http sets 255), greedy and seeded; echo re-scoring equals the sampled log-probs; the server says the mode
is on. The model is test_batch_invariant_gpu's: the embedded SmolLM2 where its package is installed, else
llama-tiny with random weights."""
from __future__ import annotations

import pytest

from testkit.http_server import ServerProcess
from tests.engine.test_batch_invariant import BUDGET
from tests.gpu.test_batch_invariant_gpu import model  # noqa: F401 (the fixture)
from tests.http.test_http_batch_invariant import (  # noqa: F401 (run here against the CUDA server)
    test_alone_and_among_concurrent_others_bitwise,
    test_echo_rescoring_equals_the_sampled_logprobs,
    test_the_server_says_the_mode_is_on,
)

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def server(model):  # noqa: F811 (the fixture imported above)
    folder, load_format = model
    proc = ServerProcess([folder, "--device", "cuda", "--load-format", load_format, "--batch-invariant",
                          "--max-num-batched-tokens", str(BUDGET), "--kv-cache-memory", "2GiB",
                          "--max-model-len", "1024", "--max-num-seqs", "256", "--served-model-name", "smol",
                          "--dev-mode"]).start()
    yield proc
    proc.stop()
