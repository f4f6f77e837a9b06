"""The engine's named commands: what the API process may ask of the engine process, one method each.

Each method says where it runs: ENGINE methods run on the engine thread between two steps, so they
never interleave with a step or with each other (admission, aborts, sleep transitions); THREAD
methods block (a grammar compile, a disk read, a weight transfer waiting on a trainer) and run on a
command thread of the engine process, stepping onto the engine thread (`on_engine`) only for the
moment they change engine state. A method may return a Future: the reply waits for it (a sleep
with mode=wait answers once its drain has ended).
"""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

from server.engine.core import EngineCore
from server.wire.errors import ConflictError, InvalidRequestError
from server.wire.outputs import RequestOutput
from server.wire.params import SamplingParams, StructuredOutputs
from server.wire.sleep_state import AWAKE, SleepReport
from server.wire.tags import WEIGHTS
from server.model.checkpoint_read import read_checkpoint

ENGINE = "engine"
THREAD = "thread"

OnEngine = Callable[[Callable[[EngineCore], Any]], Any]


def runs_on(where: str) -> Callable:
    def mark(fn: Callable) -> Callable:
        fn.runs_on = where  # type: ignore[attr-defined]
        return fn
    return mark


class EngineCommands:
    def __init__(self, core: EngineCore, on_engine: OnEngine, emit: Callable[[RequestOutput], None],
                 transfers: Any = None):
        self.core = core
        self.on_engine = on_engine   # run fn(core) on the engine thread and return its result (THREAD methods)
        self.emit = emit             # every request's outputs go here (on the engine thread)
        self.transfers = transfers   # a WeightTransferService, with --weight-transfer-config in dev mode

    def lookup(self, name: str) -> tuple[str, Callable]:
        fn = getattr(self, name, None)
        where = getattr(fn, "runs_on", None)
        if where is None:
            raise InvalidRequestError(f"the engine has no command {name!r}")
        return where, fn  # type: ignore[return-value]

    # -- requests ----------------------------------------------------------------------------------

    @runs_on(ENGINE)
    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None,
            params: SamplingParams) -> None:
        self.core.add_request(request_id, prompt, prompt_token_ids, params, self.emit)

    @runs_on(ENGINE)
    def abort(self, request_id: str) -> bool:
        return self.core.abort_request(request_id)

    @runs_on(ENGINE)
    def abort_all(self) -> int:
        return self.core.abort_all()

    @runs_on(THREAD)
    def compile_grammar(self, spec: StructuredOutputs, param: str) -> None:
        """Compile (or find cached) off the engine thread; the add that follows finds it in the cache."""
        self.core.grammars.compile(spec, param)

    # -- sleep mode (the state machine is the core's SleepController) -------------------------------

    @runs_on(ENGINE)
    def sleep(self, level: int, tags: list[str] | None, mode: str, clear_cache: bool) -> SleepReport | Future:
        """abort and keep apply before the next step; wait first lets the requests in flight finish."""
        done: Future = Future()

        def on_done(report: SleepReport | None, error: BaseException | None) -> None:
            if error is not None:
                done.set_exception(error)
            else:
                done.set_result(report)

        report = self.core.sleep_control.begin_sleep(level, tags, mode, clear_cache, on_done=on_done)
        return report if report is not None else done

    @runs_on(ENGINE)
    def wake_up(self, tags: list[str] | None) -> SleepReport:
        return self.core.sleep_control.wake_up(tags)

    @runs_on(ENGINE)
    def resume(self) -> SleepReport:
        return self.core.sleep_control.resume()

    @runs_on(ENGINE)
    def reset_prefix_cache(self) -> None:
        self.core.reset_prefix_cache()

    @runs_on(ENGINE)
    def start_profile(self) -> None:
        self.core.start_profile()

    @runs_on(ENGINE)
    def stop_profile(self) -> dict:
        return self.core.stop_profile()

    @runs_on(ENGINE)
    def snapshot(self) -> dict:
        """Sleep state, engine stats and pool stats, read consistently between two steps."""
        core = self.core
        ranks = [s.as_dict() for s in core.pool.stats_per_rank()]  # one per tensor-parallel rank
        return {"state": core.sleep_state.as_dict(), "stats": asdict(core.stats()), "pool": ranks[0], "ranks": ranks}

    # -- weights -----------------------------------------------------------------------------------

    @runs_on(THREAD)
    def load_weights(self, path: str | None, weight_version: str | None) -> dict:
        """/update_weights {"path"}: the files are read on this command thread (a file that blocks, a
        FIFO or a hung mount, holds up this one call, never the engine thread); the engine thread
        only checks names and shapes and copies from memory. No path: the served checkpoint again."""
        core = self.core
        if not path and core.config.load_format == "dummy":  # no file to read: the seeded random weights
            return self.on_engine(lambda c: c.update_weights(weight_version=weight_version))
        if core.sleep_state.tag_states.get(WEIGHTS, AWAKE) != AWAKE:
            raise ConflictError("the weights are asleep; wake them first with POST /wake_up?tags=weights")
        folder = Path(path).expanduser() if path else core.model_path
        named = read_checkpoint(folder)
        return self.on_engine(lambda c: c.update_weights(named_tensors=named.items(), weight_version=weight_version,
                                                         read_from=str(folder), served=not path))

    def _transfers(self) -> Any:
        if self.transfers is None:
            raise InvalidRequestError("this server has no weight-transfer engine; start it with "
                                      "--weight-transfer-config '{\"backend\": \"nccl\"}' (or ipc; gloo / shm on CPU)",
                                      None, "weight_transfer_not_configured")
        return self.transfers

    @runs_on(THREAD)
    def transfer_init(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                      packed: bool | None = None) -> dict:
        return self._transfers().init(master_address, master_port, rank_offset, world_size, packed)

    # start, update and finish decide on the engine thread and answer from it; the receive itself
    # blocks on the service's transfer thread (an update answers when its future resolves).

    @runs_on(ENGINE)
    def transfer_start(self) -> dict:
        return self._transfers().start()

    @runs_on(ENGINE)
    def transfer_update(self, update_info: dict) -> Future:
        return self._transfers().update(update_info)

    @runs_on(ENGINE)
    def transfer_finish(self, weight_version: str | None) -> dict | Future:
        return self._transfers().finish(weight_version)

    @runs_on(THREAD)
    def update_from_tensor(self, serialized: str, weight_version: str | None) -> dict:
        if self.core.device.type != "cuda":
            raise InvalidRequestError("update_weights_from_tensor carries CUDA IPC tensors; on CPU use the shm "
                                      "backend through /update_weights", "serialized_named_tensors")
        return self._transfers().update_from_tensor(serialized, weight_version)
