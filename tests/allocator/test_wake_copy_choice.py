"""How a CUDA wake copies its backups host to device (allocator/backup.py): SLEEPSERVE_WAKE_COPY's values, and the
rule Copier.calibrate applies to the two rates it measures (its measurement itself is a GPU test:
tests/gpu/test_pool_gpu.py)."""
from __future__ import annotations

import pytest

from allocator.backup import KERNEL_SHARE, WAKE_COPY_ENV, kernel_reads_fast_enough, wake_copy_mode
from allocator.types import PoolError


@pytest.mark.parametrize("value, mode", [(None, "auto"), ("", "auto"), ("auto", "auto"), (" Kernel ", "kernel"),
                                         ("engine", "engine")])
def test_the_wake_copy_mode_defaults_to_auto(monkeypatch, value, mode):
    if value is None:
        monkeypatch.delenv(WAKE_COPY_ENV, raising=False)
    else:
        monkeypatch.setenv(WAKE_COPY_ENV, value)
    assert wake_copy_mode() == mode


def test_an_unknown_wake_copy_mode_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(WAKE_COPY_ENV, "dma")
    with pytest.raises(PoolError, match="SLEEPSERVE_WAKE_COPY='dma'.*auto"):
        wake_copy_mode()


def test_the_kernel_is_kept_unless_it_reads_clearly_slower_than_the_engines():
    """The two hosts measured: the H200's quiet rates (51.3 against 55.4 GB/s) keep the kernel, whose reads do not
    slow down after a big release; the H100 host whose wakes reached 0.61 of raw pinned (34.4 against 55.0) takes
    the engines."""
    assert kernel_reads_fast_enough(51.3, 55.4)
    assert not kernel_reads_fast_enough(34.4, 55.0)
    assert kernel_reads_fast_enough(KERNEL_SHARE * 50.0, 50.0) and not kernel_reads_fast_enough(44.0, 50.0)
