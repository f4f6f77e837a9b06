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

REPO = Path(__file__).resolve().parents[2]

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
    for name in ("sleep_malloc", "sleep_free", "sa_map_tags", "sa_unmap_tags", "sa_map_ptrs", "sa_unmap_ptrs",
                 "sa_list", "sa_lookup", "sa_granularity", "sa_reserve", "sa_add_piece", "sa_free_reservation"):
        assert getattr(lib, name)  # AttributeError when not exported
    for name in ("sa_set_workers", "sa_retag", "sa_map_tag", "sa_map"):  # removed: no caller
        assert not hasattr(lib, name), name
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
    with pytest.raises(PoolError, match="longer than 95 bytes"):
        lib.set_capture_tag("y" * 96)


@needs_toolchain
@pytest.mark.skipif(ctypes.util.find_library("cuda") is not None, reason="a CUDA driver is installed here")
def test_missing_driver_is_reported_with_what_to_do(strict_library):
    lib = CuMemLibrary(strict_library)
    with pytest.raises(PoolError, match="cannot load libcuda.so.1.*CPU backend"):
        lib.init()
    with pytest.raises(PoolError, match="libcuda"):
        lib.unmap_tags(["pool9/weights"])


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


# A stand-in for libcuda.so.1 with just the entry points csrc resolves: physical memory is a
# counter with a settable capacity, so the registry's batch and rollback logic runs and can be
# checked here, without a GPU.
FAKE_LIBCUDA = r"""
#include <cuda.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static size_t capacity = (size_t)1 << 50, used = 0;
static long handles = 0, mappings = 0;
static unsigned long long next_va = 0x100000000000ULL;
size_t fake_used(void) { return used; }
long fake_handles(void) { return handles; }
long fake_mappings(void) { return mappings; }
void fake_set_capacity(size_t c) { capacity = c; }
static CUresult f_init(unsigned int f) { (void)f; return CUDA_SUCCESS; }
static CUresult f_device_get(CUdevice *d, int o) { *d = o; return CUDA_SUCCESS; }
static CUresult f_retain(CUcontext *c, CUdevice d) { *c = (CUcontext)(uintptr_t)(0x1000 + d); return CUDA_SUCCESS; }
static CUresult f_push(CUcontext c) { (void)c; return CUDA_SUCCESS; }
static CUresult f_pop(CUcontext *c) { if (c) *c = NULL; return CUDA_SUCCESS; }
static CUresult f_sync(void) { return CUDA_SUCCESS; }
static CUresult f_reserve(CUdeviceptr *p, size_t size, size_t align, CUdeviceptr a, unsigned long long f) {
  (void)a; (void)f;
  pthread_mutex_lock(&mu); *p = next_va; next_va += size + align; pthread_mutex_unlock(&mu);
  return CUDA_SUCCESS;
}
static CUresult f_addr_free(CUdeviceptr p, size_t s) { (void)p; (void)s; return CUDA_SUCCESS; }
static CUresult f_create(CUmemGenericAllocationHandle *h, size_t size, const CUmemAllocationProp *p,
                         unsigned long long f) {
  (void)p; (void)f;
  CUresult r = CUDA_SUCCESS;
  pthread_mutex_lock(&mu);
  if (used + size > capacity) r = CUDA_ERROR_OUT_OF_MEMORY;
  else { used += size; handles++; *h = (CUmemGenericAllocationHandle)size; }
  pthread_mutex_unlock(&mu);
  return r;
}
static CUresult f_release(CUmemGenericAllocationHandle h) {
  pthread_mutex_lock(&mu); used -= (size_t)h; handles--; pthread_mutex_unlock(&mu);
  return CUDA_SUCCESS;
}
static CUresult f_map(CUdeviceptr p, size_t s, size_t o, CUmemGenericAllocationHandle h, unsigned long long f) {
  (void)p; (void)s; (void)o; (void)h; (void)f;
  pthread_mutex_lock(&mu); mappings++; pthread_mutex_unlock(&mu);
  return CUDA_SUCCESS;
}
static CUresult f_unmap(CUdeviceptr p, size_t s) {
  (void)p; (void)s;
  pthread_mutex_lock(&mu); mappings--; pthread_mutex_unlock(&mu);
  return CUDA_SUCCESS;
}
static CUresult f_access(CUdeviceptr p, size_t s, const CUmemAccessDesc *d, size_t n) {
  (void)p; (void)s; (void)d; (void)n; return CUDA_SUCCESS;
}
static CUresult f_granularity(size_t *g, const CUmemAllocationProp *p, CUmemAllocationGranularity_flags o) {
  (void)p; (void)o; *g = (size_t)2 << 20; return CUDA_SUCCESS;
}
static CUresult f_error_name(CUresult r, const char **s) {
  *s = r == CUDA_ERROR_OUT_OF_MEMORY ? "CUDA_ERROR_OUT_OF_MEMORY" : "CUDA_ERROR_UNKNOWN"; return CUDA_SUCCESS;
}
static CUresult f_error_string(CUresult r, const char **s) { (void)r; *s = "fake"; return CUDA_SUCCESS; }
static CUresult f_capture_mode(CUstreamCaptureMode *m) { (void)m; return CUDA_SUCCESS; }
static const struct { const char *name; void *fn; } table[] = {
  {"cuInit", (void *)f_init}, {"cuDeviceGet", (void *)f_device_get},
  {"cuDevicePrimaryCtxRetain", (void *)f_retain}, {"cuCtxPushCurrent", (void *)f_push},
  {"cuCtxPopCurrent", (void *)f_pop}, {"cuCtxSynchronize", (void *)f_sync},
  {"cuMemAddressReserve", (void *)f_reserve}, {"cuMemAddressFree", (void *)f_addr_free},
  {"cuMemCreate", (void *)f_create}, {"cuMemRelease", (void *)f_release}, {"cuMemMap", (void *)f_map},
  {"cuMemUnmap", (void *)f_unmap}, {"cuMemSetAccess", (void *)f_access},
  {"cuMemGetAllocationGranularity", (void *)f_granularity}, {"cuGetErrorName", (void *)f_error_name},
  {"cuGetErrorString", (void *)f_error_string},
  {"cuThreadExchangeStreamCaptureMode", (void *)f_capture_mode},
};
CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, cuuint64_t flags,
                             CUdriverProcAddressQueryResult *status) {
  (void)version; (void)flags;
  for (size_t i = 0; i < sizeof table / sizeof table[0]; i++)
    if (strcmp(symbol, table[i].name) == 0) {
      *pfn = table[i].fn;
      if (status) *status = CU_GET_PROC_ADDRESS_SUCCESS;
      return CUDA_SUCCESS;
    }
  if (status) *status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
  return CUDA_ERROR_NOT_FOUND;
}
"""

FAKE_DRIVER_SCRIPT = r"""
import ctypes, sys
from pathlib import Path
from allocator import PoolError
from allocator.cumem import CuMemLibrary
MiB, GiB = 1 << 20, 1 << 30
lib = CuMemLibrary(Path(sys.argv[1]))
lib.init()
fake = ctypes.CDLL("libcuda.so.1")
fake.fake_used.restype = ctypes.c_size_t
fake.fake_set_capacity.argtypes = [ctypes.c_size_t]
raw = lib._lib
raw.sleep_malloc.restype = ctypes.c_void_p
raw.sleep_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
raw.sleep_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
lib.set_thread_tag("p/w")
w = [raw.sleep_malloc(32 * MiB, 0, None) for _ in range(10)]
lib.set_thread_tag("p/kv")
kv = [raw.sleep_malloc(GiB, 0, None) for _ in range(4)]
lib.set_thread_tag(None)
total = 10 * 32 * MiB + 4 * GiB
tags = ["p/w", "p/kv"]

def state():
    return fake.fake_used(), fake.fake_handles(), fake.fake_mappings()

def mapped():
    return {a.ptr for a in lib.list("p/") if a.mapped}

assert state() == (total, 14, 14), state()
assert lib.unmap_tags(tags) == total and state() == (0, 0, 0)
assert lib.unmap_tags(tags) == 0  # already released: a no-op
assert lib.map_tags(tags) == total and state() == (total, 14, 14)
lib.unmap_tags(tags)
fake.fake_set_capacity(total - GiB)  # room for all but one KV allocation
try:
    lib.map_tags(tags)
    raise AssertionError("map_tags should have failed")
except PoolError as err:
    assert "OUT_OF_MEMORY" in str(err) and "p/w" not in str(err).split(":")[0], err
assert state() == (0, 0, 0) and mapped() == set(), (state(), mapped())  # rolled back
fake.fake_set_capacity(1 << 50)
assert lib.map_tags(tags) == total
assert lib.unmap_ptrs(w[:3], synchronize=False) == 3 * 32 * MiB
assert mapped() == set(w[3:]) | set(kv)
try:
    lib.unmap_ptrs([w[3], 0x1000])
    raise AssertionError("unmap_ptrs should have failed")
except PoolError as err:
    assert "not an allocation of this pool" in str(err)
assert w[3] in mapped()  # nothing was released by the refused call
assert lib.map_tags(["p/w"]) == 3 * 32 * MiB and state() == (total, 14, 14)
lib.unmap_tags(tags)
assert lib.map_ptrs(w[:2]) == 2 * 32 * MiB and mapped() == set(w[:2])
try:
    lib.map_ptrs([w[2], 0x1000])
    raise AssertionError("map_ptrs should have failed")
except PoolError as err:
    assert "not an allocation of this pool" in str(err)
fake.fake_set_capacity(2 * 32 * MiB + GiB + 32 * MiB)  # one KV and one weight fit, not two KV
try:
    lib.map_ptrs([w[2]] + kv[:2])
    raise AssertionError("map_ptrs should have failed")
except PoolError as err:
    assert "OUT_OF_MEMORY" in str(err)
assert mapped() == set(w[:2]) and fake.fake_used() == 2 * 32 * MiB  # this call's maps undone
fake.fake_set_capacity(1 << 50)
assert lib.map_tags(tags) == total - 2 * 32 * MiB and state() == (total, 14, 14)
stats = lib.driver_stats(reset_max=True)
assert stats["create"][0] >= 14 and stats["unmap"][0] == stats["release"][0], stats
assert stats["sync"][0] > 0 and stats["create"][2] >= total and stats["create"][3] > 0
assert lib.driver_stats()["create"][3] == 0  # the longest call counts from the reset
for p in w + kv:
    raw.sleep_free(p, 0, 0, None)
assert state() == (0, 0, 0) and lib.list() == []
print("ok")
"""


@needs_toolchain
@pytest.mark.skipif(ctypes.util.find_library("cuda") is not None, reason="a CUDA driver is installed here")
def test_batches_and_rollback_against_a_fake_driver(strict_library, tmp_path):
    toolchain = build.find_toolchain()
    source = tmp_path / "fake_libcuda.c"
    source.write_text(FAKE_LIBCUDA)
    fake = tmp_path / "libcuda.so.1"
    subprocess.run([toolchain.compiler, "-O1", "-std=c11", "-fPIC", "-shared", "-Wall", "-Wextra", "-Werror",
                    f"-I{toolchain.cuda_include}", "-Wl,-soname,libcuda.so.1", "-o", str(fake), str(source),
                    "-lpthread"], check=True, capture_output=True, text=True)
    env = dict(os.environ, LD_LIBRARY_PATH=f"{tmp_path}:{os.environ.get('LD_LIBRARY_PATH', '')}")
    run = subprocess.run([sys.executable, "-c", FAKE_DRIVER_SCRIPT, str(strict_library)], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout + run.stderr
