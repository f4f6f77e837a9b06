"""The engine: owns the model runner, the scheduler, the requests and the sleep state machine.

Synchronous and single-threaded by design: the async engine (engine.py) and the in-process LLM
(server/llm.py) drive it from one thread each, so every transition here is serialized.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterable

import torch

from allocator import create_pool
from server.config import EngineConfig
from server.engine.errors import ConflictError, EngineUnavailableError, InvalidRequestError
from server.engine.kv_cache import BlockManager, usable_blocks
from server.engine.memory_plan import plan_kv_cache
from server.engine.outputs import RequestOutput
from server.engine.params import SamplingParams
from server.engine.runner import ModelRunner, Sampled
from server.engine.scheduler import ScheduledBatch, Scheduler
from server.engine.sequence import Request, Sequence
from server.engine.structured import GrammarCompiler
from server.engine.sleep_plan import TAGS, SleepPlan, check_tags, refusal
from server.engine.weight_session import WeightSession
from server.model.config import ModelConfig
from server.model.loader import (WeightLoadError, build_model, check_checkpoint, checkpoint_shapes, copy_weights,
                                 describe, init_dummy_weights, iter_checkpoint, load_checkpoint, parameter_names,
                                 resolve_model, safetensors_files)
from server.model.tokenizer import load_tokenizer, render_chat

log = logging.getLogger("sleepserve.engine")


@dataclass
class EngineStats:
    running: int
    waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    preemptions: int


class EngineCore:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = config.torch_device()
        source = resolve_model(config.model)
        self.model_path: Path = source.folder
        self.model_config = ModelConfig.from_folder(source.folder)
        self.served_model_name = config.served_model_name or source.name
        self.dtype = config.torch_dtype(self.device, self.model_config.torch_dtype)
        self.tokenizer = load_tokenizer(source.folder)
        self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size)
        self.eos_ids = frozenset(self.model_config.eos_token_ids) | frozenset(
            [self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else [])
        torch.manual_seed(config.seed)

        position_limit = self.model_config.max_position_embeddings
        if self.model_config.sliding_window:
            position_limit = min(position_limit, self.model_config.sliding_window)
        if config.max_model_len and config.max_model_len > position_limit:
            raise ValueError(f"--max-model-len {config.max_model_len} exceeds the model's {position_limit} positions")
        positions = config.max_model_len or position_limit

        self.pool = create_pool(self.device, backup_dir=config.offload_dir)
        t0 = time.perf_counter()
        self.model = build_model(self.model_config, self.pool, self.dtype, positions)
        if config.load_format == "dummy":
            init_dummy_weights(self.model, config.seed)
            self.weight_version: str | None = "dummy"
        else:
            load_checkpoint(self.model, self.model_path)
            self.weight_version = "initial"
        self.load_seconds = time.perf_counter() - t0
        if config.enable_sleep_mode:
            self.pool.check_backup_space(["weights"])  # level 1 offloads them: say now if they cannot fit

        plan = plan_kv_cache(config, self.model, self.pool, self.dtype)
        self.max_model_len = min(positions, plan.capacity_tokens)
        if config.max_model_len and config.max_model_len > plan.capacity_tokens:
            raise ValueError(
                f"the KV cache holds {plan.capacity_tokens} tokens, fewer than --max-model-len {config.max_model_len}; "
                "give it more memory (--kv-cache-memory / --gpu-memory-utilization) or lower --max-model-len")
        self.kv_plan = plan
        self.runner = ModelRunner(self.model, self.pool, plan.num_blocks, config.block_size, self.dtype)
        self.blocks = BlockManager(plan.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, config.batched_tokens(self.device))
        self.runner.finish_setup(enforce_eager=config.enforce_eager, max_num_seqs=config.max_num_seqs)

        self.requests: dict[str, Request] = {}
        self._next_seq_id = 0
        # The sleep state machine. Memory state per tag lives in the pool; this is the policy.
        self.sleep_level: int | None = None   # level of the last sleep while anything sleeps or is paused
        self.paused = False
        self.draining = False
        self.weights_valid = True
        self._weights_reloaded: set[str] = set()
        # Weights arriving in pieces (server/engine/weight_session.py): the open session, whether a
        # transfer thread is writing into the weights right now (no step may run), completed updates.
        self.weight_session: WeightSession | None = None
        self.transfer_active = False
        self.weight_updates = 0

    # -- requests ------------------------------------------------------------------------------

    def encode(self, prompt: str) -> list[int]:
        return self.tokenizer(prompt).input_ids

    def encode_chat(self, messages: list[dict], **kwargs) -> list[int]:
        # The template already wrote the special tokens (BOS and turn markers): add none twice.
        return self.tokenizer(self.chat_prompt(messages, **kwargs), add_special_tokens=False).input_ids

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        return render_chat(self.tokenizer, messages, add_generation_prompt, **kwargs)

    def check_can_serve(self) -> None:
        """Raise EngineUnavailableError unless new generation can be accepted now."""
        refused = refusal(self.sleep_state())
        if refused:
            raise EngineUnavailableError(refused[1])

    def add_request(self, request_id: str, prompt: str | None = None, prompt_token_ids: list[int] | None = None,
                    params: SamplingParams | None = None,
                    on_output: Callable[[RequestOutput], None] | None = None) -> Request:
        self.check_can_serve()
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        ids, params = self.check_prompt(prompt, prompt_token_ids, params or SamplingParams())
        req = Request(request_id, prompt, ids, params, on_output=on_output)
        for i in range(params.n):
            gen = None
            if params.seed is not None:
                gen = torch.Generator(device=self.device).manual_seed((params.seed + i) % (1 << 64))
            seq = Sequence(self._next_seq_id, req, i, gen)
            self._next_seq_id += 1
            req.seqs.append(seq)
            self.scheduler.add(seq)
        self.requests[request_id] = req
        return req

    def check_prompt(self, prompt: str | None, prompt_token_ids: list[int] | None,
                     params: SamplingParams) -> tuple[list[int], SamplingParams]:
        """The prompt's token ids and the params to run it with (max_tokens resolved, grammar compiled),
        or InvalidRequestError. Changes nothing, so a batch can check every prompt before adding any."""
        params.validate(self.model_config.vocab_size)
        if params.structured_outputs is not None and params.grammar is None:
            # The server compiled it already (off this thread); the in-process LLM compiles here.
            params = replace(params, grammar=self.grammars.compile(params.structured_outputs))
        if prompt_token_ids is None:
            if prompt is None or prompt == "":
                raise InvalidRequestError("the prompt is empty; send at least one token of text", param="prompt")
            prompt_token_ids = self.encode(prompt)
        ids = [int(t) for t in prompt_token_ids]
        if not ids:
            raise InvalidRequestError("the prompt is empty; send at least one token", param="prompt")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})", param="prompt")
        limit = self.max_model_len
        if len(ids) >= limit:
            raise InvalidRequestError(
                f"the prompt has {len(ids)} tokens, but this model's context is {limit} tokens "
                "(prompt plus at least one generated token); shorten the prompt", param="prompt",
                code="context_length_exceeded")
        if params.max_tokens is None:
            params = replace(params, max_tokens=limit - len(ids))
        elif len(ids) + params.max_tokens > limit:
            raise InvalidRequestError(
                f"this model's context is {limit} tokens; the prompt has {len(ids)} and max_tokens asks for "
                f"{params.max_tokens} more; lower max_tokens to at most {limit - len(ids)}", param="max_tokens",
                code="context_length_exceeded")
        return ids, params

    def abort_request(self, request_id: str) -> bool:
        req = self.requests.get(request_id)
        if req is None:
            return False
        self._finish_request(req, aborted=True)
        return True

    def abort_all(self) -> int:
        reqs = list(self.requests.values())
        for req in reqs:
            self._finish_request(req, aborted=True)
        return len(reqs)

    def _finish_request(self, req: Request, aborted: bool) -> None:
        for seq in req.seqs:
            if not seq.finished:
                if aborted:
                    seq.abort()
                self.scheduler.finish(seq)
        self.requests.pop(req.request_id, None)
        if aborted:
            self._emit(req)

    def _emit(self, req: Request) -> RequestOutput:
        out = req.output()
        if req.on_output is not None:
            req.on_output(out)
        return out

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def can_step(self) -> bool:
        return (self.scheduler.has_work and not self.paused and self.weights_valid
                and not self.transfer_active and not self.pool.sleeping_tags())

    def step(self) -> list[RequestOutput]:
        """Schedule one batch, run it, and return an output for each request it advanced."""
        if not self.can_step:
            return []
        batch = self.scheduler.schedule()
        if not batch:
            return []
        sampled, scored = self.runner.execute(batch, self.eos_ids, self.tokenizer)
        return self.postprocess(batch, sampled, scored)

    def postprocess(self, batch: ScheduledBatch, sampled: list[Sampled],
                    scored: Iterable[tuple[Request, list]] = ()) -> list[RequestOutput]:
        """Record what a step computed: the KV progress (the scheduler's), prompt log-probs, the
        sampled tokens, the requests that finished. Returns an output for each request advanced."""
        self.scheduler.advance(batch)
        for req, entries in scored:
            req.prompt_logprobs.extend(entries)  # type: ignore[union-attr]
        now = time.monotonic()
        touched: dict[str, Request] = {}
        for seq, token, logprobs in sampled:
            req = seq.request
            seq.append(token, logprobs, self.eos_ids, self.max_model_len, self.tokenizer)
            if req.first_token_time is None:
                req.first_token_time = now
            if seq.finish_reason is not None:
                self.scheduler.finish(seq)
            touched[req.request_id] = req
        outputs = []
        for req in touched.values():
            if req.finished:
                self.requests.pop(req.request_id, None)
            outputs.append(self._emit(req))
        return outputs

    def stats(self) -> EngineStats:
        s = self.blocks.stats
        return EngineStats(
            running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
            kv_blocks_total=usable_blocks(self.blocks.num_blocks), kv_blocks_used=self.blocks.num_used,
            prefix_cache_queried_tokens=s.queried_tokens, prefix_cache_hit_tokens=s.hit_tokens,
            preemptions=self.scheduler.num_preemptions)

    def reset_prefix_cache(self) -> None:
        self.blocks.reset_prefix_cache()

    # -- sleep state machine ---------------------------------------------------------------------

    @property
    def is_sleeping(self) -> bool:
        return bool(self.pool.sleeping_tags()) or self.sleep_level == 0

    def sleep_state(self) -> dict:
        return {
            "is_sleeping": self.is_sleeping,
            "level": self.sleep_level,
            "sleeping_tags": sorted(self.pool.sleeping_tags()),
            "tag_states": {t: self.pool.tag_state(t) for t in TAGS},
            "paused": self.paused,
            "draining": self.draining,
            "weights_valid": self.weights_valid,
            "weight_version": self.weight_version,
        }

    def plan_sleep(self, level: int, tags: list[str] | None, mode: str) -> SleepPlan:
        if not self.config.enable_sleep_mode:
            raise ConflictError("sleep mode is disabled for this engine (enable_sleep_mode=False)")
        if self.draining:
            raise ConflictError("a sleep is already in progress (draining requests); wait for it to finish")
        if self.transfer_active:
            raise ConflictError("a weight transfer is writing the weights; sleep after it returns")
        plan = SleepPlan.make(level, tags, mode)
        if plan.level == 0:
            if self.paused:
                raise ConflictError("the server is already paused; POST /resume or /wake_up first")
            return plan
        # Only tags that hold memory can sleep (no CUDA graphs on CPU, say).
        held = set(self.pool.stats().tags)
        want = {t: "offloaded" for t in plan.offload if t in held}
        want.update({t: "discarded" for t in plan.discard if t in held})
        asleep = self.pool.sleeping_tags()
        clashes = [f"{t} is {asleep[t]}, level {level} would have it {want[t]}"
                   for t in want if t in asleep and asleep[t] != want[t]]
        if clashes:
            raise ConflictError(f"already asleep in another way ({'; '.join(clashes)}); "
                                "wake those tags first with POST /wake_up")
        if want and all(t in asleep for t in want):
            raise ConflictError(f"{', '.join(sorted(want))} already asleep at level {self.sleep_level}; nothing to do")
        return plan

    def begin_drain(self) -> None:
        """mode=wait: refuse new requests; the driver keeps stepping until none are left, then sleeps."""
        self.draining = True

    def sleep(self, plan: SleepPlan) -> dict:
        """Apply a sleep plan. Returns once the memory is really released (the pool synchronizes)."""
        self.draining = False
        t0 = time.perf_counter()
        aborted = 0
        if plan.mode in ("abort", "wait"):
            aborted = self.abort_all()
        elif "kv_cache" in plan.discard or "weights" in plan.discard:
            # mode=keep: the KV is about to go, so every running sequence will recompute it after wake.
            self.scheduler.preempt_all()
        if plan.level == 0:
            self.paused = True
            if self.sleep_level is None:  # a pause on top of a sleep keeps the sleep's level
                self.sleep_level = 0
            return {"level": 0, "aborted": aborted, "seconds": time.perf_counter() - t0}
        if "kv_cache" in plan.discard:
            self.blocks.reset_prefix_cache()  # the KV those hashes point to is about to vanish
        if "weights" in plan.discard and self.pool.tag_state("weights") == "awake":
            self.weights_valid = False
            self._weights_reloaded = set()
            self.weight_session = None  # what a session wrote is gone with the memory
        report = self.pool.sleep(offload_tags=plan.offload, discard_tags=plan.discard)
        self.sleep_level = max(self.sleep_level or 0, plan.level)
        return {"level": plan.level, "aborted": aborted, "offloaded": list(plan.offload),
                "discarded": list(plan.discard), "bytes_offloaded": report.bytes_offloaded,
                "bytes_discarded": report.bytes_discarded, "seconds": time.perf_counter() - t0}

    def wake_up(self, tags: list[str] | None = None) -> dict:
        tags = check_tags(tags)
        asleep = self.pool.sleeping_tags()
        if not asleep and not self.paused:
            raise ConflictError("the server is awake; there is nothing to wake")
        t0 = time.perf_counter()
        report = self.pool.wake_up(tags)
        if tags is None:
            self.paused = False  # a full wake also ends a level-0 pause
        if not self.pool.sleeping_tags() and not self.paused:
            self.sleep_level = None
        return {"woke": sorted(t for t in asleep if tags is None or t in tags),
                "already_awake": sorted(t for t in (tags or []) if t not in asleep),
                "bytes_restored": report.bytes_restored, "seconds": time.perf_counter() - t0,
                "weights_valid": self.weights_valid}

    def resume(self) -> None:
        if self.pool.sleeping_tags():
            raise ConflictError("the server is asleep; wake it with POST /wake_up instead of /resume")
        self.paused = False
        self.sleep_level = None

    # -- weights ---------------------------------------------------------------------------------

    def update_weights(self, path: str | None = None,
                       named_tensors: Iterable[tuple[str, torch.Tensor]] | None = None,
                       weight_version: str | None = None, read_from: str | None = None,
                       served: bool = False) -> dict:
        """Load weights into the existing tensors, in place: addresses and CUDA graphs stay valid.
        Everything is checked before the first byte is copied. read_from: named_tensors were read
        from this checkpoint (the HTTP route reads files off the engine thread), `served` when it is
        the served one; they are then checked and reported as a path would be."""
        if self.pool.tag_state("weights") != "awake":
            raise ConflictError("the weights are asleep; wake them first with POST /wake_up?tags=weights")
        if self.scheduler.running and self.weights_valid:
            raise ConflictError("requests are running; pause or sleep the server before updating weights")
        if self.transfer_active:
            raise ConflictError("a weight transfer is writing the weights; update after it returns")
        t0 = time.perf_counter()
        if named_tensors is not None:
            named = dict(named_tensors)
            whole = read_from is not None and (not self.weights_valid or served)
            check_checkpoint(self.model, describe(named), require_all=whole)
            loaded = copy_weights(self.model, named.items())
            source = read_from or "tensors"
        elif path is None and self.config.load_format == "dummy":
            # "Reload the served checkpoint" of a dummy model: the same seeded random weights.
            init_dummy_weights(self.model, self.config.seed)
            loaded, source = parameter_names(self.model), "dummy"
        else:
            folder = Path(path).expanduser() if path else self.model_path
            files = safetensors_files(folder)
            shapes = checkpoint_shapes(files)
            check_checkpoint(self.model, shapes, require_all=not self.weights_valid or path is None)
            loaded = copy_weights(self.model, iter_checkpoint(files))
            source = str(folder)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if not self.weights_valid:
            self._weights_reloaded |= loaded
            missing = parameter_names(self.model) - self._weights_reloaded
            if not missing:
                self.weights_valid = True
        # KV computed with the old weights must never be reused.
        self.blocks.reset_prefix_cache()
        if weight_version is not None:
            self.weight_version = weight_version
        elif (named_tensors is not None and not served) or path:
            self.weight_version = None
        return {"source": source, "tensors": len(loaded), "weights_valid": self.weights_valid,
                "weight_version": self.weight_version, "seconds": time.perf_counter() - t0}

    def close(self) -> None:
        self.abort_all()
        self.pool.close()


__all__ = ["EngineCore", "EngineStats", "WeightLoadError"]
