"""Weight transfer without disk: vLLM's weight-transfer protocol (NCCL, CUDA IPC) and its CPU
twins (gloo, shared memory), the server's receiver and a trainer-side sender."""
