"""`sleepserve serve [MODEL] [flags]` and `sleepserve prepare [MODEL]`.

Every flag can also come from SLEEPSERVE_<FLAG> (e.g. --dev-mode: SLEEPSERVE_DEV_MODE=1,
--api-key: SLEEPSERVE_API_KEY); the command line wins over the environment. Nothing heavy is
imported until the arguments are read, so `--help` answers at once (no torch, no FastAPI).
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from server.api.servers import AUTO, api_server_count, auto_api_server_count
from server.logging_setup import LEVELS

ENV_PREFIX = "SLEEPSERVE_"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(f"must be at least 1, got {value}")
    return value


def port_number(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise ValueError(f"must be a port number from 0 to 65535, got {value}")
    return value


def seconds(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 3600:
        raise ValueError(f"must be a number of seconds from 0 to 3600, got {text}")
    return value


def boolean(text: str) -> bool:
    low = text.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError("must be 1/true/yes/on or 0/false/no/off")


@dataclass(frozen=True)
class Option:
    flag: str
    help: str
    default: Any = None
    type: Callable[[str], Any] = str
    choices: tuple[str, ...] | None = None
    negation: str | None = None       # a boolean flag's opposite, so the command line can undo the env
    metavar: str | None = None

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.dest.upper()

    @property
    def is_bool(self) -> bool:
        return self.type is boolean


SERVE_OPTIONS: tuple[Option, ...] = (
    Option("--host", "address to listen on (0.0.0.0 for every interface)", "127.0.0.1"),
    Option("--port", "port to listen on", 8000, port_number),
    Option("--device", "where the model runs (auto: CUDA when present)", "auto",
           choices=("auto", "cpu", "cuda")),
    Option("--dtype", "weight and activation dtype (auto: float32 on CPU, the checkpoint's 16-bit type on CUDA)",
           "auto", choices=("auto", "float32", "bfloat16", "float16")),
    Option("--max-model-len", "context length in tokens, prompt plus output (default: the model's)", None,
           positive_int, metavar="N"),
    Option("--max-num-seqs", "most sequences in one batch", 256, positive_int, metavar="N"),
    Option("--max-num-batched-tokens", "most tokens in one step (default: 512 on CPU, 8192 on CUDA)", None,
           positive_int, metavar="N"),
    Option("--block-size", "tokens per KV-cache block", 16, positive_int, choices=None, metavar="N"),
    Option("--kv-cache-memory", "KV-cache size, e.g. 4GiB or 512MiB (default: 1 GiB on CPU; on CUDA what "
           "--gpu-memory-utilization leaves)", None, metavar="SIZE"),
    Option("--gpu-memory-utilization", "fraction of the GPU's memory the server may use", 0.9, float,
           metavar="F"),
    Option("--load-format", "auto: read the checkpoint; dummy: random weights of the model's shape", "auto",
           choices=("auto", "dummy")),
    Option("--served-model-name", "the name clients pass as `model` (default: the model folder's name)",
           None, metavar="NAME"),
    Option("--api-key", "require `Authorization: Bearer KEY` on /v1/* (a flag shows in the process list: "
           "prefer the environment or --api-key-file)", None, metavar="KEY"),
    Option("--api-key-file", "read --api-key from this file (surrounding whitespace dropped)", None, metavar="FILE"),
    Option("--admin-api-key", "key for the dev-mode routes (default: --api-key)", None, metavar="KEY"),
    Option("--admin-api-key-file", "read --admin-api-key from this file", None, metavar="FILE"),
    Option("--allowed-hosts", "comma-separated Host/Origin names the dev routes accept besides loopback names "
           "and --host (* for any)", None, metavar="NAMES"),
    Option("--no-docs", "do not serve /docs, /redoc and /openapi.json (they need the API key when one is set)",
           False, boolean, negation="--docs"),
    Option("--api-server-count", "API processes in front of the engine: each parses and answers its share of the "
           "requests (one handles ~1,000 short requests/s); more help large bursts and many streams. auto: one per "
           "two cores beyond the engine's two, 1 to 4", "auto", api_server_count, metavar="N|auto"),
    Option("--shutdown-grace-period", "seconds requests in flight may run on after SIGTERM; then they end "
           "with finish_reason abort", 10.0, seconds, metavar="S"),
    Option("--dev-mode", "mount the sleep-mode routes (/sleep, /wake_up, /update_weights, ...)", False, boolean,
           negation="--no-dev-mode"),
    Option("--weight-transfer-config", 'weight transfer without disk, as vLLM\'s flag: JSON such as '
           '\'{"backend": "nccl"}\' (nccl, ipc; gloo, shm on CPU); needs --dev-mode', None, metavar="JSON"),
    Option("--tensor-parallel-size", "ranks of tensor parallelism: one process per GPU (gloo on CPU), started by the "
           "server; rank 0 is the server's own process", 1, positive_int, metavar="N"),
    Option("--tp-all-reduce", "with --tensor-parallel-size > 1 on CUDA, what the model's all-reduces run on: nccl, "
           "symm (one-shot over NVLink on symmetric memory for decode-sized messages, NCCL for larger ones) or auto "
           "(nccl: symm was not faster inside the model on the H200s); CPU always uses gloo", "auto",
           choices=("auto", "nccl", "symm")),
    Option("--tp-launch", "how the tensor-parallel ranks start: spawn (the server starts them on this machine) or "
           "torchrun (torchrun started one server command per rank, on one host or several; needs SLEEPSERVE_TP_KEY)",
           "spawn", choices=("spawn", "torchrun")),
    Option("--tp-release-comm-on-sleep", "with --tensor-parallel-size > 1, a level-1/2 sleep destroys every rank's "
           "device communicator (NCCL's buffers: ~840 MiB per H200 rank) and the wake creates a new one and "
           "re-captures the decode CUDA graphs (the wake takes longer)", False, boolean,
           negation="--no-tp-release-comm-on-sleep"),
    Option("--tp-comm-suspend", "with --tensor-parallel-size > 1, where the NCCL in use has ncclCommSuspend "
           "(>= 2.29.7; SLEEPSERVE_NCCL_SO names the libnccl): auto, a level-1/2 sleep suspends every rank's "
           "communicator (its device memory goes, the decode graphs stay) and the wake resumes it, taking precedence "
           "over --tp-release-comm-on-sleep; off, as if it had none", "auto", choices=("auto", "off")),
    Option("--enforce-eager", "never capture CUDA graphs", False, boolean, negation="--no-enforce-eager"),
    Option("--enable-return-routed-experts", "mixture-of-experts models: record the experts each token was routed "
           "to, returned to requests that set return_routed_experts (docs/moe.md)", False, boolean,
           negation="--no-enable-return-routed-experts"),
    Option("--async-scheduling", "schedule and launch the next step while the device runs this one, and finish "
           "this one's outputs meanwhile (at tensor parallelism too: rank 0 broadcasts the sampled tokens)", True, boolean,
           negation="--no-async-scheduling"),
    Option("--batch-invariant", "every reduction in an order fixed whatever the batch: a request's tokens and "
           "log-probs are bitwise the same alone or among any others, and equal to its prompt_logprobs when "
           "re-scored (docs/batch-invariance.md); off unless set here or by VLLM_BATCH_INVARIANT=1", None, boolean,
           negation="--no-batch-invariant"),
    Option("--stream-interval", "a streamed request gets a chunk every N engine steps (N tokens a choice; its first "
           "tokens and its end at once): fewer chunks for the API process and the clients to handle at high "
           "concurrency, at N steps of latency between chunks", 1, positive_int, metavar="N"),
    Option("--no-prefix-caching", "do not reuse the KV of shared prompt prefixes", False, boolean,
           negation="--prefix-caching"),
    Option("--no-check-weights-finite", "do not check that every weight update's tensors are finite (by default "
           "the device checks what lands, in the copy itself where there is one, and refuses NaN or Inf with 400, "
           "leaving the weights invalid until a good update)", False, boolean, negation="--check-weights-finite"),
    Option("--offload-dir", "CPU device: folder for offloaded weights while asleep (default: the temp folder)",
           None, metavar="DIR"),
    Option("--prepare-backups", "allocate the host backup of level-1 sleep right after start-up, in the "
           "background, so the first sleep is as fast as the next: on, off, or auto (on where backups are kept "
           "between cycles (CUDA) and take at most half of the host memory free at start-up)", "auto",
           choices=("auto", "on", "off")),
    Option("--kv-wake-chunk", "after a sleep that discarded the KV cache, a wake maps this much of it before it "
           "returns and the rest in the background, in chunks 4x larger each (requests wait for the blocks they "
           "need); 0 maps the whole cache first", "2GiB", metavar="SIZE"),
    Option("--while-asleep", "what a request that arrives while paused or asleep gets: hold (wait, bounded by the "
           "next two flags, then be served) or reject (503 with Retry-After at once)", "hold",
           choices=("hold", "reject")),
    Option("--max-held-requests", "most requests held while paused or asleep; more get 503", 1024, int,
           metavar="N"),
    Option("--held-request-timeout", "seconds a request may be held before it gets 503", 600.0, float,
           metavar="S"),
    Option("--seed", "seed of the global random state (requests with `seed` are reproducible regardless)",
           0, int, metavar="N"),
    Option("--log-level", "log verbosity", "info", choices=LEVELS),
)
_EXCLUSIVE = ("kv_cache_memory", "gpu_memory_utilization")


def _add_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_mutually_exclusive_group()
    for opt in SERVE_OPTIONS:
        target = group if opt.dest in _EXCLUSIVE else parser
        shown = "" if opt.default is None or opt.is_bool else f" (default: {opt.default})"
        help_text = f"{opt.help}{shown} [env {opt.env}]"
        if opt.is_bool:
            target.add_argument(opt.flag, dest=opt.dest, action="store_const", const=True, default=None,
                                help=help_text)
            if opt.negation:
                target.add_argument(opt.negation, dest=opt.dest, action="store_const", const=False,
                                    default=None, help=f"undo {opt.flag}")
        else:
            target.add_argument(opt.flag, dest=opt.dest, type=_argparse_type(opt), choices=opt.choices,
                                default=None, metavar=opt.metavar, help=help_text)


def _argparse_type(opt: Option) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return opt.type(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{text!r} {e}" if "must" in str(e) else f"invalid value {text!r}")
    convert.__name__ = getattr(opt.type, "__name__", "value")
    return convert


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sleepserve", description="OpenAI-compatible LLM server whose memory can sleep and wake.",
        epilog="Every flag can also be set as SLEEPSERVE_<FLAG> in the environment; the command line wins.")
    sub = parser.add_subparsers(dest="command", metavar="{serve,prepare}")
    serve = sub.add_parser("serve", help="serve a model over HTTP",
                           description="Serve MODEL (a Hugging Face folder or a .gguf file; default: the "
                                       "embedded SmolLM2-135M-Instruct) over an OpenAI-compatible HTTP API.")
    serve.set_defaults(parser=serve)  # so errors about values print serve's usage
    serve.add_argument("model", nargs="?", default=None, metavar="MODEL",
                       help=f"model folder or .gguf file (default: the embedded model) [env {ENV_PREFIX}MODEL]")
    _add_options(serve)
    prepare = sub.add_parser("prepare", help="convert and cache a model, then print its folder",
                             description="Convert MODEL (default: the embedded model) into the cache once, so "
                                         "later starts load fast; prints the folder (Docker runs it at build).")
    prepare.add_argument("model", nargs="?", default=None, metavar="MODEL")
    prepare.add_argument("--log-level", default="warning", choices=LEVELS)
    return parser


def resolve_options(args: argparse.Namespace, env: dict[str, str],
                    parser: argparse.ArgumentParser) -> dict[str, Any]:
    """Command line, else SLEEPSERVE_<FLAG>, else the default."""
    values: dict[str, Any] = {"model": args.model if args.model is not None else env.get(ENV_PREFIX + "MODEL")}
    from_cli = {o.dest for o in SERVE_OPTIONS if getattr(args, o.dest) is not None}
    for opt in SERVE_OPTIONS:
        value = getattr(args, opt.dest)
        raw = env.get(opt.env)
        # The two KV-size flags exclude each other: one given on the command line hides the other's env.
        other_on_cli = opt.dest in _EXCLUSIVE and any(d in from_cli for d in _EXCLUSIVE if d != opt.dest)
        if value is None and raw is not None and not other_on_cli:
            try:
                value = opt.type(raw)
            except ValueError as e:
                parser.error(f"{opt.env}={raw!r}: {e}")
            if opt.choices and value not in opt.choices:
                parser.error(f"{opt.env}={raw!r}: choose from {', '.join(opt.choices)}")
        values[opt.dest] = opt.default if value is None else value
    if not from_cli & set(_EXCLUSIVE) and all(env.get(ENV_PREFIX + d.upper()) for d in _EXCLUSIVE):
        parser.error(f"{ENV_PREFIX}KV_CACHE_MEMORY and {ENV_PREFIX}GPU_MEMORY_UTILIZATION are both set; "
                     "keep one")
    return values


def _weight_transfer(text: str | None) -> Any:
    from server.weight_transfer.config import WeightTransferConfig  # torch-free
    try:
        return WeightTransferConfig.parse(text)
    except ValueError as e:
        raise SystemExit(f"sleepserve serve: error: {e}") from None


def split_options(values: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """(ServerSettings, EngineConfig keyword arguments)."""
    from server.api.settings import ServerSettings

    settings = ServerSettings(
        host=values["host"], port=values["port"],
        api_key=_key(values, "api_key"), admin_api_key=_key(values, "admin_api_key"),
        dev_mode=values["dev_mode"], log_level=values["log_level"],
        allowed_hosts=tuple(h.strip() for h in (values["allowed_hosts"] or "").split(",") if h.strip()),
        docs=not values["no_docs"], shutdown_grace_period=values["shutdown_grace_period"],
        api_server_count=(auto_api_server_count() if values["api_server_count"] == AUTO
                          else values["api_server_count"]),
        weight_transfer_config=_weight_transfer(values["weight_transfer_config"]))
    engine = {
        "model": values["model"] or None, "device": values["device"], "dtype": values["dtype"],
        "max_model_len": values["max_model_len"], "max_num_seqs": values["max_num_seqs"],
        "max_num_batched_tokens": values["max_num_batched_tokens"], "block_size": values["block_size"],
        "kv_cache_memory": values["kv_cache_memory"], "gpu_memory_utilization": values["gpu_memory_utilization"],
        "load_format": values["load_format"], "served_model_name": values["served_model_name"],
        "enable_prefix_caching": not values["no_prefix_caching"], "enforce_eager": values["enforce_eager"],
        "enable_return_routed_experts": values["enable_return_routed_experts"],
        "async_scheduling": values["async_scheduling"], "stream_interval": values["stream_interval"],
        "batch_invariant": values["batch_invariant"],
        "seed": values["seed"], "tensor_parallel_size": values["tensor_parallel_size"],
        "tp_all_reduce": values["tp_all_reduce"], "tp_launch": values["tp_launch"],
        "tp_release_comm_on_sleep": values["tp_release_comm_on_sleep"], "tp_comm_suspend": values["tp_comm_suspend"],
        "offload_dir": values["offload_dir"], "prepare_backups": values["prepare_backups"],
        "kv_wake_chunk": values["kv_wake_chunk"], "check_weights_finite": not values["no_check_weights_finite"],
        "while_asleep": values["while_asleep"],
        "max_held_requests": values["max_held_requests"], "held_request_timeout": values["held_request_timeout"],
    }
    return settings, engine


def _key(values: dict[str, Any], dest: str) -> str | None:
    """A key from its flag or its file; never echoed in an error."""
    path = values.get(dest + "_file")
    if path and values.get(dest):
        raise ValueError(f"--{dest.replace('_', '-')} and --{dest.replace('_', '-')}-file are both set; keep one")
    if not path:
        return values.get(dest) or None
    try:
        with open(path, encoding="utf-8") as f:
            key = f.read(1 << 16).strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read the key file {path}: {getattr(e, 'strerror', None) or e}") from None
    if not key:
        raise ValueError(f"the key file {path} is empty")
    return key


def check_exposure(settings: Any) -> None:
    """Dev routes on an address others can reach need a key: anyone who connects could sleep the server."""
    from server.api.guard import is_loopback

    if settings.dev_mode and not settings.effective_admin_key and not is_loopback(settings.host):
        raise ValueError(f"--dev-mode on {settings.host} (not a loopback address) needs --admin-api-key or "
                         "--api-key (or their _FILE / SLEEPSERVE_* forms): without one, anyone who can connect "
                         "could put the server to sleep or load other weights")


def _serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        settings, engine_kwargs = split_options(resolve_options(args, dict(os.environ), parser))
        check_exposure(settings)
    except ValueError as e:
        parser.error(str(e))
    # The engine process starts now, so that its imports run while this process makes its own (under torchrun
    # every rank but 0 joins rank 0's engine instead: rank 0 starts its own once it knows which it is).
    spawned = None
    if engine_kwargs.get("tp_launch", "spawn") != "torchrun":
        from server.api.spawn import spawn_engine

        spawned = spawn_engine(settings.api_server_count)
    try:
        from server.api.app import serve  # heavy: torch, transformers, FastAPI
        from server.config import EngineConfig

        try:
            config = EngineConfig(**engine_kwargs)
        except ValueError as e:
            parser.error(str(e))
    except BaseException:  # a usage error (parser.error exits) or Ctrl-C: the engine never gets its Start
        if spawned is not None:
            spawned.kill()
        raise
    if config.tp_launch == "torchrun":
        from server.engine.parallel.launch import torchrun_place

        try:
            place = torchrun_place(config.tensor_parallel_size)
        except ValueError as e:
            parser.error(str(e))
        if place.rank:  # every rank but 0 joins rank 0's engine as a worker; only rank 0 serves HTTP
            from server.engine.parallel.worker import join_torchrun

            return join_torchrun(place)
    return serve(settings, config, spawned)


def _prepare(args: argparse.Namespace) -> int:
    from server.logging_setup import configure_logging
    from server.model.default_model import ModelNotFoundError
    from server.model.source import resolve_model

    configure_logging(args.log_level)
    model = args.model if args.model is not None else os.environ.get(ENV_PREFIX + "MODEL")
    try:
        folder = resolve_model(model or None).folder
    except (ModelNotFoundError, OSError, ValueError) as e:
        print(f"sleepserve prepare: error: {e}", file=sys.stderr)
        return 1
    print(folder)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        return _serve(args, args.parser)
    if args.command == "prepare":
        return _prepare(args)
    parser.print_help()
    return 2


def run() -> None:
    sys.exit(main())


if __name__ == "__main__":
    run()
