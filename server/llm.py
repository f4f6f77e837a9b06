"""The in-process API for code that embeds the engine (RLHF frameworks do):

    from server import LLM, SamplingParams
    llm = LLM(model=None, device="cpu")
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
    print(outs[0].outputs[0].text)
"""
from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Iterable, Sequence as Seq

import torch

from server.config import EngineConfig
from server.engine.build import build_engine
from server.wire.outputs import RequestOutput
from server.wire.params import RequestOutputKind, SamplingParams
from server.wire.sleep_state import SleepReport
from server.heap import freeze_startup_heap


class LLM:
    def __init__(self, model: str | None = None, *, enable_sleep_mode: bool = True, **config):
        self.engine = build_engine(EngineConfig(model=model, enable_sleep_mode=enable_sleep_mode, **config))
        # As the server's processes do (server/heap.py): the engine's start-up objects (and the caller's,
        # alive now) leave the collector's full walks, which cost ~25 ms a step at batch 256 on the CI
        # host's in-process engine (bench/step_host_cost.py, gc_ms) as they stopped its thread.
        freeze_startup_heap("in-process engine")
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: str | Seq[str] | Seq[list[int]],
                 params: SamplingParams | Seq[SamplingParams] | None = None) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids), batched; outputs in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        plist = list(params) if isinstance(params, (list, tuple)) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(plist)} sampling params")
        # Only the final outputs are returned: the engine builds nothing per step (vLLM's LLM does the same).
        plist = [replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in plist]
        ids = []
        try:
            for prompt, p in zip(prompts, plist):
                rid = f"llm-{next(self._ids)}"
                if isinstance(prompt, str):
                    self.engine.add_request(rid, prompt=prompt, params=p)
                else:
                    self.engine.add_request(rid, prompt_token_ids=list(prompt), params=p)
                ids.append(rid)
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return self._run(ids)

    def chat(self, messages: list[dict] | list[list[dict]], params: SamplingParams | None = None,
             **template_kwargs) -> list[RequestOutput]:
        """One conversation (a list of messages) or several; the tokenizer's chat template applies."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.engine.encode_chat(c, **template_kwargs) for c in convs]  # type: ignore[arg-type]
        return self.generate(prompts, params)

    def _run(self, ids: list[str]) -> list[RequestOutput]:
        wanted = set(ids)
        done: dict[str, RequestOutput] = {}
        while wanted - done.keys():
            if not self.engine.can_step:
                raise RuntimeError(f"the engine cannot make progress: {self.engine.sleep_state}")
            for out in self.engine.step():
                if out.finished and out.request_id in wanted:
                    done[out.request_id] = out
        return [done[i] for i in ids]

    # -- sleep mode ------------------------------------------------------------------------------

    def sleep(self, level: int = 1, tags: list[str] | None = None, mode: str = "abort") -> SleepReport:
        return self.engine.sleep_control.sleep(level, tags, mode, step=self.engine.step)

    def pause(self, mode: str = "abort", clear_cache: bool = True) -> SleepReport:
        return self.engine.sleep_control.sleep(0, None, mode, clear_cache, step=self.engine.step)

    def resume(self) -> SleepReport:
        return self.engine.sleep_control.resume()

    def wake_up(self, tags: list[str] | None = None) -> SleepReport:
        return self.engine.sleep_control.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.engine.sleep_state.is_sleeping

    def update_weights(self, path: str | None = None,
                       named_tensors: Iterable[tuple[str, torch.Tensor]] | None = None,
                       weight_version: str | None = None) -> dict:
        return self.engine.update_weights(path=path, named_tensors=named_tensors, weight_version=weight_version)

    def reset_prefix_cache(self) -> None:
        self.engine.reset_prefix_cache()

    def start_profile(self) -> None:
        """torch.profiler over the steps (VLLM_TORCH_PROFILER_DIR set before the LLM was built)."""
        self.engine.start_profile()

    def stop_profile(self) -> dict:
        """Stop and write the trace: {"trace": its path, "seconds", "device_busy_share"}."""
        return self.engine.stop_profile()

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
