"""The model: Llama-family decoders in plain PyTorch (llama.py, ops.py) with Triton kernels for CUDA
(fused_ops.py and the attention kernels), rotary tables, tensor-parallel sharding and weight loading."""
