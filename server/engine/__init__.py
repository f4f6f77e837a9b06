"""The engine process (and, under tensor parallelism, its worker processes in parallel/): the process loop
and its commands, the core's step, the scheduler and KV blocks, the model runner, sampler and CUDA graphs,
the sleep controller and weight transfers. It answers the API processes through server.wire."""
