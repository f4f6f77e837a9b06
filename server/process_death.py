"""A child process that dies with its parent: the engine process and the extra API processes never outlive
the server that started them (an engine left behind would hold device memory)."""
from __future__ import annotations

import ctypes
import os
import signal


def die_with_parent(parent: int) -> None:
    """Linux: the kernel sends SIGKILL to this process when `parent` dies (kill -9 included), even mid-step."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before prctl
        os._exit(1)


__all__ = ["die_with_parent"]
