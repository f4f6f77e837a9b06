"""The engine: owns the model runner, the scheduler and the requests; its SleepController owns the
sleep state machine.

Single-threaded by design: the engine process (process.py) and the in-process LLM (server/llm.py)
drive it from one thread each, so every transition here is serialized.

With async scheduling (config.async_scheduling, vLLM's --async-scheduling) a step leaves its batch in
flight on the device: step() launches step t+1 and then records step t (tokens, stops, text, outputs)
while the device computes t+1. When every sequence of t goes on decoding, t+1 is scheduled before t's
tokens reach the host (Scheduler.schedule_ahead) and takes its input ids from the device tensor t's
sampler wrote; a sequence that stops at t has computed one token too many in t+1, which is dropped
(its blocks were freed at t: the device writes into them only before any later step reuses them, in
stream order). Otherwise (admissions, prefill chunks, grammars, penalties, preemption) t is recorded
first and t+1 scheduled from the host's state, still launched before step() returns. Anything that
changes what a step reads or writes (sleep, pause, weight updates, the prefix cache) calls drain() first.
"""
from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterable

import torch

from allocator import MemoryPool
from server.config import PROFILER_DIR_ENV, EngineConfig, profiler_dir
from server.wire.detokenizer import prefix_stable
from server.wire.errors import EngineUnavailableError, InvalidRequestError, NonFiniteWeightsError
from server.engine.kv_cache import BlockManager, usable_blocks
from server.wire.stats import EngineStats, KVPlan
from server.wire.outputs import RequestOutput
from server.wire.params import RequestOutputKind, SamplingParams
from server.wire.prompt_check import check_prompt_ids
from server.engine.runner import Launched, ModelRunner
from server.engine.scheduler import Scheduler, StepUpdate
from server.engine.step_types import ScheduledBatch
from server.engine.sequence import Request, Sequence
from server.engine.sleep_controller import SleepController
from server.wire.sleep_state import SleepState
from server.engine.step_profiler import StepProfiler
from server.engine.structured import GrammarCompiler
from server.model.config import ModelConfig
from server.model.loader import (check_checkpoint, checkpoint_shapes, describe, parameter_names,
                                 safetensors_files)
from server.model.tokenizer import render_chat

log = logging.getLogger("sleepserve.engine")


class EngineCore:
    """Built by build_engine (server/engine/build.py), which loads and sizes everything first."""

    def __init__(self, *, config: EngineConfig, device: torch.device, dtype: torch.dtype, model_path: Path,
                 model_config: ModelConfig, served_model_name: str, tokenizer, pool: MemoryPool, model: torch.nn.Module,
                 runner: ModelRunner, blocks: BlockManager, scheduler: Scheduler, kv_plan: KVPlan,
                 max_model_len: int, load_seconds: float, weight_version: str | None):
        self.config, self.device, self.dtype = config, device, dtype
        self.model_path, self.model_config, self.served_model_name = model_path, model_config, served_model_name
        self.tokenizer = tokenizer
        self.grammars = GrammarCompiler(tokenizer, model_config.vocab_size)
        self.pool = pool
        self.model = model
        self.runner = runner
        self.blocks = blocks
        self.scheduler = scheduler
        self.kv_plan = kv_plan
        self.max_model_len = max_model_len
        self.load_seconds = load_seconds
        self.requests: dict[str, Request] = {}
        self._next_seq_id = 0
        # vllm:iteration_tokens_total, as vLLM counts a step: each sequence's whole prompt at the step that
        # sampled its first token, plus every token sampled. Added up by outputs_for; the driver reads and clears it.
        self._step_tokens = 0  # tokens the steps ran since take_step_tokens (vLLM's iteration_tokens)
        # Set by wire_outputs() in the engine process: what receives each advanced request instead of
        # RequestOutputs built for its on_output.
        self._wire_sink: Callable[[Request], None] | None = None
        # Async scheduling: the step on the device whose tokens are not recorded yet (drain() records it).
        self.async_scheduling = config.async_scheduling and runner.supports_async
        if config.async_scheduling and not runner.supports_async:
            log.info("async scheduling is off: this runner cannot launch a step before the last one's tokens")
        elif self.async_scheduling:
            log.info("async scheduling on: each step is launched before the previous one is recorded")
        self._inflight: Launched | None = None
        self.steps_ahead = 0  # steps launched before the previous one's tokens reached the host (benches, tests)
        # The sleep state machine's one owner; memory state per tag lives in the pool.
        self.sleep_control = SleepController(self, config.enable_sleep_mode, weight_version)
        # torch.profiler over the steps on demand, where VLLM_TORCH_PROFILER_DIR is set (step_profiler.py).
        folder = profiler_dir()
        self.profiler = StepProfiler(folder, device) if folder is not None else None

    @property
    def eos_ids(self) -> frozenset[int]:
        """The tokens that end a sequence (the model's and the tokenizer's): the scheduler's, which checks them."""
        return self.scheduler.eos_ids

    @property
    def sleep_state(self) -> SleepState:
        return self.sleep_control.state

    @property
    def weight_version(self) -> str | None:
        return self.sleep_control.state.weight_version

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
        refused = self.sleep_state.refusal
        if refused:
            raise EngineUnavailableError(refused.message, code=refused.code)

    def add_request(self, request_id: str, prompt: str | None = None, prompt_token_ids: list[int] | None = None,
                    params: SamplingParams | None = None,
                    on_output: Callable[[RequestOutput], None] | None = None) -> Request:
        self.check_can_serve()
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        ids, params = self.check_prompt(prompt, prompt_token_ids, params or SamplingParams())
        req = Request(request_id, prompt, ids, params, on_output=on_output)
        # Text only at the end when nothing reads it before (no output per step, or the API process makes the
        # streamed text itself: text_by_api) and no stop string needs it.
        lazy = ((params.output_kind is RequestOutputKind.FINAL_ONLY or params.text_by_api) and not params.stop
                and prefix_stable(self.tokenizer))
        for i in range(params.n):
            gen = None
            if params.seed is not None:
                gen = torch.Generator(device=self.device).manual_seed((params.seed + i) % (1 << 64))
            seq = Sequence(self._next_seq_id, req, i, gen, self.tokenizer if lazy else None)
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
        routed = self.routed_experts_asked(params.return_routed_experts)
        if routed != params.return_routed_experts:
            params = replace(params, return_routed_experts=routed)
        if params.structured_outputs is not None and params.grammar is None:
            # The server compiled it already (the engine process's compile command, cached by spec);
            # the in-process LLM compiles here.
            params = replace(params, grammar=self.grammars.compile(params.structured_outputs))
        if prompt_token_ids is None:
            if prompt is None or prompt == "":
                raise InvalidRequestError("the prompt is empty; send at least one token of text", param="prompt")
            prompt_token_ids = self.encode(prompt)
        return check_prompt_ids(prompt_token_ids, params, self.model_config.vocab_size, self.max_model_len)

    def routed_experts_asked(self, asked: bool | None) -> bool:
        """return_routed_experts resolved: None follows --enable-return-routed-experts (vLLM returns them to
        every request then); yes on a dense model or without the flag is a 400 naming the field."""
        recorded = self.config.enable_return_routed_experts
        if asked is None:
            return recorded
        if asked and not self.model_config.num_experts:
            raise InvalidRequestError(f"return_routed_experts: the served model ({self.model_config.model_type}) has "
                                      "no experts", param="return_routed_experts")
        if asked and not recorded:
            raise InvalidRequestError("return_routed_experts needs the server started with "
                                      "--enable-return-routed-experts", param="return_routed_experts")
        return asked

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

    def wire_outputs(self, sink: Callable[[Request], None] | None) -> None:
        """The engine process's outputs (server/engine/process.py): each advanced request goes to sink(request),
        which encodes only what is new straight from it (channel.encode_delta), for every request whose
        on_output is set; no RequestOutput is built (its whole lists, copied at every step, cost O(length)
        per sequence). None: back to RequestOutputs."""
        self._wire_sink = sink

    def _emit(self, req: Request) -> RequestOutput | None:
        if self._wire_sink is not None:
            if req.on_output is not None:
                self._wire_sink(req)
            return None
        out = req.output()
        if req.on_output is not None:
            req.on_output(out)
        return out

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def can_step(self) -> bool:
        return (self.scheduler.has_work or self._inflight is not None) and self.sleep_state.can_run

    def preempt_all(self) -> None:
        self.drain()
        self.scheduler.preempt_all()

    # -- the step --------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """schedule -> run -> the scheduler applies the result -> an output for each request it advanced.
        With async scheduling the device runs each step while the host records the one before."""
        if self.async_scheduling:
            return self._step_async()
        schedule = self.scheduler.schedule() if self.can_step else None
        if not schedule:
            return []
        result = self.runner.execute(schedule, self.eos_ids, self.tokenizer)
        return self.outputs_for(self.scheduler.update_from_output(schedule, result))

    def _step_async(self) -> list[RequestOutput]:
        """Launch step t+1, then record step t (the one in flight) while the device computes t+1."""
        prev, self._inflight = self._inflight, None  # an error below leaves nothing in flight
        nxt = self._launch_ahead(prev) if prev is not None else None
        outputs = self._record(prev)
        if nxt is None and self.scheduler.has_work and self.sleep_state.can_run:
            nxt = self._launch(self.scheduler.schedule())
        self._inflight = nxt
        return outputs

    def _launch_ahead(self, prev: Launched) -> Launched | None:
        """When every sequence of the step in flight goes on decoding, the next step is scheduled before its
        tokens reach the host and takes its input ids from the device tensor they are sampled into; a
        sequence that stops there computes one token too many, which update_from_output drops. None when
        the next step needs the host's results first (admissions, chunks, grammars, penalties, preemption)."""
        if (prev.meta is None or not prev.meta.can_follow or not self.sleep_state.can_run
                or len(prev.hb.sample_seqs) != len(prev.batch.items)):
            return None
        ahead = self.scheduler.schedule_ahead(prev.hb.sample_seqs, prev.batch.mark == self.scheduler.removals)
        if ahead is None:
            return None
        self.steps_ahead += 1
        return self._launch(ahead[0], prev, ahead[1])

    def _launch(self, batch: ScheduledBatch, after: Launched | None = None, rows: list[int] | None = None
                ) -> Launched | None:
        if not batch:
            return None
        return self.runner.launch(batch, self.eos_ids, self.tokenizer, after, rows)

    def _record(self, launched: Launched | None) -> list[RequestOutput]:
        """Wait for a launched step's tokens and apply them (Scheduler.update_from_output)."""
        if launched is None:
            return []
        return self.outputs_for(self.scheduler.update_from_output(launched.batch, launched.collect()))

    def set_async_scheduling(self, on: bool) -> None:
        """Turn async scheduling on or off between steps (the benches compare both on one engine)."""
        self.drain()
        self.async_scheduling = on and self.runner.supports_async

    def drain(self) -> list[RequestOutput]:
        """Record the step in flight, if any (async scheduling): afterwards nothing runs on the device for
        this engine and every sequence's state is the host's. Then hand out what --stream-interval held
        back: a pause, sleep or weight update (each drains first) must not keep a stream's tokens through
        it, nor send old weights' tokens in one chunk with the new ones'. Returns the outputs it made."""
        prev, self._inflight = self._inflight, None
        outputs = self._record(prev)
        for req in list(self.requests.values()):
            if req.steps_unsent:
                req.steps_unsent = 0
                out = self._emit(req)
                if out is not None:
                    outputs.append(out)
        return outputs

    def take_step_tokens(self) -> int:
        """The tokens counted since the last call (each request's prompt at its first token, plus every sampled
        token), and the count starts again: the engine process reports them per step."""
        n, self._step_tokens = self._step_tokens, 0
        return n

    def outputs_for(self, update: StepUpdate) -> list[RequestOutput]:
        """An output for each request the step advanced: its first tokens (admission, time to first token)
        and its end at once, others every --stream-interval steps, FINAL_ONLY ones at the end only."""
        self._step_tokens += update.sampled + sum(len(update.touched[r].prompt_token_ids) * len(update.touched[r].seqs)
                                                 for r in update.first)
        outputs = []
        interval = self.config.stream_interval
        sink = self._wire_sink
        done, first = update.done, update.first
        for rid, req in update.touched.items():
            if rid in done and req.finished:
                self.requests.pop(rid, None)
            elif rid not in first:
                if req.params.output_kind is RequestOutputKind.FINAL_ONLY:
                    continue
                if interval > 1:
                    req.steps_unsent += 1
                    if req.steps_unsent < interval:
                        continue  # the next output carries this step's tokens too
            req.steps_unsent = 0
            if sink is not None:  # the engine process: the request itself to the wire (_emit, inlined: per sequence)
                if req.on_output is not None:
                    sink(req)
                continue
            out = self._emit(req)
            if out is not None:
                outputs.append(out)
        return outputs

    def stats(self) -> EngineStats:
        s = self.blocks.stats
        return EngineStats(
            running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
            kv_blocks_total=usable_blocks(self.blocks.num_blocks), kv_blocks_used=self.blocks.num_used,
            prefix_cache_queried_tokens=s.queried_tokens, prefix_cache_hit_tokens=s.hit_tokens,
            preemptions=self.scheduler.num_preemptions)

    def reset_prefix_cache(self) -> None:
        self.drain()
        self.blocks.reset_prefix_cache()

    # -- profiling (on the engine thread: torch.profiler starts and stops on one thread) -------------

    def start_profile(self) -> None:
        self._profiler().start()

    def stop_profile(self) -> dict:
        """Stop tracing and write the trace (after the step in flight, whose kernels belong to it)."""
        profiler = self._profiler()
        self.drain()
        return profiler.stop()

    def _profiler(self) -> StepProfiler:
        if self.profiler is None:
            raise InvalidRequestError(f"profiling is off: start the engine with {PROFILER_DIR_ENV} set to a folder "
                                      "for the traces", param=None, code="profiling_off")
        return self.profiler

    # -- weights ---------------------------------------------------------------------------------

    def update_weights(self, path: str | None = None,
                       named_tensors: Iterable[tuple[str, torch.Tensor]] | None = None,
                       weight_version: str | None = None, read_from: str | None = None,
                       served: bool = False) -> dict:
        """Load weights into the existing tensors, in place: addresses and CUDA graphs stay valid.
        Everything is checked before the first byte is copied. read_from: named_tensors were read
        from this checkpoint (the HTTP route reads files off the engine thread), `served` when it is
        the served one; they are then checked and reported as a path would be."""
        self.sleep_control.check_weight_update()
        self.drain()  # no step may read the weights while they change
        weights_valid = self.sleep_state.weights_valid
        t0 = time.perf_counter()
        try:
            loaded, source = self._load(path, named_tensors, read_from, served, weights_valid)
        except NonFiniteWeightsError:
            # Every tensor landed and some are not numbers: nothing is served from them until a good update.
            self.preempt_all()
            self.blocks.reset_prefix_cache()
            self.sleep_control.weights_invalidated()
            raise
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        # KV computed with the old weights must never be reused: requests kept by a pause recompute
        # theirs on the new weights, and the prefix-cache index forgets every hash.
        self.preempt_all()
        self.blocks.reset_prefix_cache()
        set_version = weight_version is not None or (named_tensors is not None and not served) or bool(path)
        self.sleep_control.weights_loaded(loaded, parameter_names(self.model), weight_version, set_version)
        state = self.sleep_state
        return {"source": source, "tensors": len(loaded), "weights_valid": state.weights_valid,
                "weight_version": state.weight_version, "seconds": time.perf_counter() - t0}

    def _load(self, path: str | None, named_tensors: Iterable[tuple[str, torch.Tensor]] | None,
              read_from: str | None, served: bool, weights_valid: bool) -> tuple[set[str], str]:
        """update_weights' copy: checked, then written in place; (the names written, where from)."""
        if named_tensors is not None:
            named = dict(named_tensors)
            whole = read_from is not None and (not weights_valid or served)
            check_checkpoint(self.model, describe(named), require_all=whole)
            loaded = self.runner.load_weights(named.items())
            source = read_from or "tensors"
        elif path is None and self.config.load_format == "dummy":
            # "Reload the served checkpoint" of a dummy model: the same seeded random weights.
            loaded, source = self.runner.load_dummy(self.config.seed), "dummy"
        else:
            folder = Path(path).expanduser() if path else self.model_path
            files = safetensors_files(folder)
            shapes = checkpoint_shapes(files)
            check_checkpoint(self.model, shapes, require_all=not weights_valid or path is None)
            loaded = self.runner.load_files(files)
            source = str(folder)
        return loaded, source

    # -- weight updates in pieces (the transfer service's engine-thread half; policy: SleepController) ---

    def open_weight_session(self) -> dict:
        return self.sleep_control.open_weight_session()

    def begin_weight_write(self) -> None:
        self.sleep_control.check_weight_update()
        self.drain()  # a step in flight (async scheduling) reads the weights: it ends before the first byte lands
        self.sleep_control.begin_weight_write()

    def end_weight_write(self, loaded: set[str], failed: bool) -> dict | None:
        """Returns the session's report when this write was a whole session of its own, else None."""
        if self.sleep_control.end_weight_write(loaded, failed):
            return self.finish_weight_session(None)
        return None

    def finish_weight_session(self, weight_version: str | None) -> dict:
        end = self.sleep_control.finish_weight_session(weight_version, parameter_names(self.model))
        if end.rewrite_buffers:
            self.model.init_buffers()
        if end.forget_kv:  # requests kept by a pause recompute their KV on the new weights
            self.preempt_all()
            self.blocks.reset_prefix_cache()
        return end.report

    def close(self) -> None:
        if self.profiler is not None and self.profiler.running:
            try:  # a trace left running is written, not lost
                log.info("profiler stopped at close: %s", self.profiler.stop())
            except Exception:
                log.warning("the running trace could not be written", exc_info=True)
        try:
            self.drain()
        except Exception:  # a dead device: the memory is released all the same
            log.warning("the step in flight failed while closing", exc_info=True)
            self._inflight = None
        self.abort_all()
        self.pool.close()


__all__ = ["EngineCore"]
