"""The C library builds warning-free, loads without a GPU, and reports a missing driver clearly."""

from __future__ import annotations

import ctypes.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from allocator import PoolError, build
from allocator.cumem import CuMemLibrary

REPO = Path(__file__).resolve().parent.parent

try:
    build.find_toolchain()
    HAVE_TOOLCHAIN = True
except build.NotBuildable:
    HAVE_TOOLCHAIN = False

needs_toolchain = pytest.mark.skipif(not HAVE_TOOLCHAIN, reason="no C compiler or CUDA headers here")


@pytest.fixture(scope="module")
def strict_library(tmp_path_factory) -> Path:
    if not HAVE_TOOLCHAIN:
        pytest.skip("no C compiler or CUDA headers here")
    out = tmp_path_factory.mktemp("lib") / "libsleep_alloc.so"
    return build.build(strict=True, output=out)  # -Wall -Wextra -Werror


@needs_toolchain
def test_strict_build_exports_the_allocator_entry_points(strict_library):
    lib = ctypes.CDLL(str(strict_library))
    for name in ("sleep_malloc", "sleep_free", "sa_map_tag", "sa_unmap_tag", "sa_list", "sa_lookup"):
        assert getattr(lib, name)  # AttributeError when not exported
    nm = subprocess.run(["nm", "-D", "--defined-only", str(strict_library)], capture_output=True, text=True)
    if nm.returncode == 0:  # no Python or torch symbol may leak in or out
        assert "Py" not in nm.stdout and "torch" not in nm.stdout


@needs_toolchain
def test_registry_works_without_a_driver(strict_library):
    lib = CuMemLibrary(strict_library)
    assert lib.thread_tag() is None
    lib.set_thread_tag("pool9/weights")
    assert lib.thread_tag() == "pool9/weights"
    lib.set_thread_tag(None)
    assert lib.thread_tag() is None
    with pytest.raises(PoolError, match="longer than 95 bytes"):
        lib.set_thread_tag("x" * 200)
    assert lib.list() == [] and lib.lookup(0x1000) is None
    with pytest.raises(PoolError, match="not an allocation of this pool"):
        lib.retag(0x1000, "pool9/weights")


@needs_toolchain
@pytest.mark.skipif(ctypes.util.find_library("cuda") is not None, reason="a CUDA driver is installed here")
def test_missing_driver_is_reported_with_what_to_do(strict_library):
    lib = CuMemLibrary(strict_library)
    with pytest.raises(PoolError, match="cannot load libcuda.so.1.*CPU backend"):
        lib.init()
    with pytest.raises(PoolError, match="libcuda"):
        lib.unmap_tag("pool9/weights")


def test_if_possible_exits_zero_without_a_compiler():
    env = dict(os.environ, PATH="/nonexistent", CC="no-such-compiler")
    run = [sys.executable, "-m", "allocator.build"]
    soft = subprocess.run([*run, "--if-possible"], cwd=REPO, env=env, capture_output=True, text=True)
    assert soft.returncode == 0 and "skipped" in soft.stdout and "C compiler" in soft.stdout
    hard = subprocess.run(run, cwd=REPO, env=env, capture_output=True, text=True)
    assert hard.returncode == 1 and "missing a C compiler" in hard.stderr


@needs_toolchain
def test_staleness_follows_the_source(tmp_path):
    lib = tmp_path / "lib.so"
    assert build.is_stale(lib)  # missing
    lib.write_bytes(b"")
    source_mtime = build.SOURCE.stat().st_mtime
    os.utime(lib, (source_mtime - 10, source_mtime - 10))
    assert build.is_stale(lib)  # older than the source
    os.utime(lib, (source_mtime + 10, source_mtime + 10))
    assert not build.is_stale(lib)
