"""Weights that are not numbers are never served: every tensor an update writes is checked on the device.

A trainer's diverged step sends NaN or Inf; served, it gives empty texts and NaN log-probs with
`weights_valid: true`. Each landed tensor gets one reduction, queued on the device after the copy:
its minimum and maximum in one pass (torch.aminmax), which are finite exactly when every element is
(NaN propagates through both, +Inf is the maximum, -Inf the minimum). Exact, in the tensor's own dtype
(a sum could overflow on finite values), and with no temporary the size of the tensor, as
`isfinite(t).all()` would make (a 0.5 GiB bool mask for an 8B model's embedding); on the CPU it runs
at twice a float32 sum's time where a float64 sum took 20x. The results stay on the device until
`bad`, which reads them all in one host sync, once, before the update is declared complete
(bench/finite_check.py measures the cost).

Where an update copies a tensor device to device (an IPC or staged NCCL receive), `copy` does the copy and
the check in one pass (a Triton kernel that flags NaN/Inf while it copies): the check reads nothing the copy
does not. Run as a second pass after an 8B IPC push it was 18-23% of the push (12 ms of ~65).
"""
from __future__ import annotations

import torch

from server.wire.errors import NonFiniteWeightsError

__all__ = ["FiniteCheck", "NonFiniteWeightsError", "nonfinite_message"]


def nonfinite_message(names: list[str] | tuple[str, ...]) -> str:
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    return (f"the update holds NaN or Inf in {shown}; nothing is served from these weights: they are invalid "
            "(503 weights_invalid) until a good update (a diverged training step? check the trainer's loss)")


class FiniteCheck:
    """Collects one device-side verdict per landed tensor; `bad` syncs once and names the bad ones."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        # Per dtype (torch.stack wants one): the names, and each one's minimum and maximum in turn.
        self._groups: dict[torch.dtype, tuple[list[str], list[torch.Tensor]]] = {}
        # Tensors checked while copied: the names, and each one's flag (int32, nonzero: not finite).
        self._flagged: tuple[list[str], list[torch.Tensor]] = ([], [])

    @torch.no_grad()
    def add(self, name: str, tensor: torch.Tensor) -> None:
        """After `tensor` landed, in its stream's order (the current stream: where the copy was queued)."""
        if self.enabled and tensor.numel():
            names, values = self._groups.setdefault(tensor.dtype, ([], []))
            names.append(name)
            values.extend(torch.aminmax(tensor.detach()))

    @torch.no_grad()
    def copy(self, name: str, dst: torch.Tensor, src: torch.Tensor) -> None:
        """dst.copy_(src) and the check of what landed, in one pass where both are on the same CUDA device,
        contiguous and of one 16- or 32-bit float dtype; else the copy, then `add`."""
        if (self.enabled and dst.is_cuda and src.device == dst.device and dst.dtype == src.dtype
                and dst.dtype in FLAGGED_DTYPES and dst.is_contiguous() and src.is_contiguous()
                and dst.shape == src.shape and dst.numel()):
            self._flagged[0].append(name)
            self._flagged[1].append(copy_and_flag(dst, src))
            return
        dst.copy_(src, non_blocking=True)
        self.add(name, dst)

    def bad(self) -> list[str]:
        """The names whose tensors hold NaN or Inf: one device->host read for all of them."""
        names, verdicts = [], []
        for group, values in self._groups.values():
            names += group
            verdicts.append(~torch.isfinite(torch.stack(values)).view(-1, 2).all(1))
        if self._flagged[0]:
            names += self._flagged[0]
            verdicts.append(torch.cat(self._flagged[1]) != 0)
        self._groups, self._flagged = {}, ([], [])
        if not names:
            return []
        # One read: the verdicts are on the model's device (a tensor elsewhere is moved there first).
        device = verdicts[0].device
        return [n for n, bad in zip(names, torch.cat([v.to(device) for v in verdicts]).tolist()) if bad]

    def verify(self) -> None:
        bad = self.bad()
        if bad:
            raise NonFiniteWeightsError(nonfinite_message(bad), tuple(bad))


FLAGGED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def copy_and_flag(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """Queue dst <- src on the current stream; returns a [1] int32 flag, nonzero if src held NaN or Inf."""
    from server.model.finite_kernel import copy_and_flag_kernel

    n = dst.numel()
    flag = torch.zeros(1, dtype=torch.int32, device=dst.device)
    per_program = COPY_BLOCK * COPY_ITERS
    copy_and_flag_kernel[((n + per_program - 1) // per_program,)](
        src.view(-1), dst.view(-1), n, flag, BLOCK=COPY_BLOCK, ITERS=COPY_ITERS, num_warps=4)
    return flag


# A program copies COPY_ITERS blocks of COPY_BLOCK elements (16-byte loads a thread at 16 bits) and sets the
# flag only when it saw a bad value: no atomic in the common case.
COPY_BLOCK = 2048
COPY_ITERS = 4
