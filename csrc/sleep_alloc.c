/*
 * sleep_alloc: the device side of sleepserve's sleepable memory pool.
 *
 * Every allocation is its own virtual address range (cuMemAddressReserve) backed by one physical
 * handle (cuMemCreate + cuMemMap + cuMemSetAccess). Because the range is reserved separately from
 * the physical memory, the physical memory can be released and later re-created at the same
 * address: that is what lets tensors, views and captured CUDA graphs survive a sleep.
 *
 * Two audiences:
 *   - torch, through CUDAPluggableAllocator: sleep_malloc / sleep_free. They never call into
 *     Python (docs/architecture.md, invariant 6); each allocation is recorded in a C registry under the tag the
 *     calling thread set beforehand.
 *   - allocator/cumem.py, through ctypes: set the tag, list allocations, unmap/re-map listed
 *     allocations or whole tags in batches (re-mapping all or nothing), and read how long each
 *     kind of driver call took (sa_stats). A batch synchronizes the device once, not per
 *     allocation; sa_unmap_ptrs can skip even that when the caller knows the memory is idle (a
 *     sleep releases each allocation as soon as the event after its backup copy fired).
 *     Batches run in the calling thread: worker threads were measured on an H200 (driver 580)
 *     and made every driver call slower, the driver serializing them (docs/results/pool-findings.md).
 *
 * libcuda is opened with dlopen so this file builds where only the CUDA headers exist; the entry
 * points are resolved with cuGetProcAddress at pinned ABI versions, so the prototypes we call
 * through always match the typedefs we compiled against, whatever the driver version.
 *
 * Errors: every CUresult is checked. Functions for Python return a negative value on failure and
 * leave a message in a thread-local buffer (sa_last_error). sleep_malloc returns NULL (torch turns
 * that into an out-of-memory error) and leaves the message the same way.
 */
#define _GNU_SOURCE
#include <cuda.h>
#include <cudaTypedefs.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <time.h>

#define SA_EXPORT __attribute__((visibility("default")))
#define SA_ABI_VERSION 4
#define SA_TAG_MAX 96
#define SA_MAX_DEVICES 64

/* ------------------------------------------------------------------ errors */

static __thread char tl_error[1024];

static void set_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void set_error(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(tl_error, sizeof tl_error, fmt, ap);
  va_end(ap);
}

/* ------------------------------------------------------------------ timing */

/* Cumulative calls, nanoseconds and bytes of every driver call that costs time, and the longest
 * single call since sa_stats_reset_max, so Python can see where a sleep or a wake spends it
 * (sa_stats); a clock read costs ~20 ns against calls of tens of microseconds. */
enum { OP_RESERVE, OP_CREATE, OP_MAP, OP_ACCESS, OP_UNMAP, OP_RELEASE, OP_SYNC, OP_ADDRFREE, OP_COUNT };
static uint64_t op_calls[OP_COUNT], op_ns[OP_COUNT], op_bytes[OP_COUNT], op_max_ns[OP_COUNT];

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static CUresult account(int op, size_t bytes, uint64_t start, CUresult r) {
  uint64_t ns = now_ns() - start;
  __atomic_fetch_add(&op_calls[op], 1, __ATOMIC_RELAXED);
  __atomic_fetch_add(&op_ns[op], ns, __ATOMIC_RELAXED);
  uint64_t max = __atomic_load_n(&op_max_ns[op], __ATOMIC_RELAXED);
  while (ns > max && !__atomic_compare_exchange_n(&op_max_ns[op], &max, ns, 1, __ATOMIC_RELAXED,
                                                  __ATOMIC_RELAXED)) {
  }
  __atomic_fetch_add(&op_bytes[op], (uint64_t)bytes, __ATOMIC_RELAXED);
  return r;
}

/* ------------------------------------------------------------------ driver */

static struct {
  void *lib;
  PFN_cuInit_v2000 Init;
  PFN_cuDeviceGet_v2000 DeviceGet;
  PFN_cuDevicePrimaryCtxRetain_v7000 DevicePrimaryCtxRetain;
  PFN_cuCtxPushCurrent_v4000 CtxPushCurrent;
  PFN_cuCtxPopCurrent_v4000 CtxPopCurrent;
  PFN_cuCtxSynchronize_v2000 CtxSynchronize;
  PFN_cuMemAddressReserve_v10020 MemAddressReserve;
  PFN_cuMemAddressFree_v10020 MemAddressFree;
  PFN_cuMemCreate_v10020 MemCreate;
  PFN_cuMemRelease_v10020 MemRelease;
  PFN_cuMemMap_v10020 MemMap;
  PFN_cuMemUnmap_v10020 MemUnmap;
  PFN_cuMemSetAccess_v10020 MemSetAccess;
  PFN_cuMemGetAllocationGranularity_v10020 MemGetAllocationGranularity;
  PFN_cuGetErrorName_v6000 GetErrorName;
  PFN_cuGetErrorString_v6000 GetErrorString;
  PFN_cuThreadExchangeStreamCaptureMode_v10010 ThreadExchangeStreamCaptureMode;
} drv;

static pthread_once_t drv_once = PTHREAD_ONCE_INIT;
static int drv_status = -1; /* 0 once every entry point resolved */
static char drv_error[512];

static void load_driver_once(void) {
  drv.lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
  if (!drv.lib) {
    snprintf(drv_error, sizeof drv_error,
             "cannot load libcuda.so.1 (%s): the CUDA backend needs an NVIDIA driver; "
             "use the CPU backend on machines without a GPU",
             dlerror());
    return;
  }
  PFN_cuGetProcAddress_v12000 get_proc =
      (PFN_cuGetProcAddress_v12000)dlsym(drv.lib, "cuGetProcAddress_v2");
  if (!get_proc) {
    snprintf(drv_error, sizeof drv_error,
             "libcuda.so.1 has no cuGetProcAddress_v2: the driver is older than CUDA 12; "
             "upgrade the NVIDIA driver");
    return;
  }
#define RESOLVE(field, name, version)                                                        \
  do {                                                                                       \
    void *fn = NULL;                                                                         \
    CUdriverProcAddressQueryResult found = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;             \
    CUresult r = get_proc(name, &fn, version, CU_GET_PROC_ADDRESS_DEFAULT, &found);          \
    if (r != CUDA_SUCCESS || fn == NULL) {                                                   \
      snprintf(drv_error, sizeof drv_error,                                                  \
               "libcuda.so.1 lacks %s (ABI %d): result %d, status %d; upgrade the driver", \
               name, version, (int)r, (int)found);                                           \
      return;                                                                                \
    }                                                                                        \
    memcpy(&drv.field, &fn, sizeof fn);                                                      \
  } while (0)
  RESOLVE(Init, "cuInit", 2000);
  RESOLVE(DeviceGet, "cuDeviceGet", 2000);
  RESOLVE(DevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", 7000);
  RESOLVE(CtxPushCurrent, "cuCtxPushCurrent", 4000);
  RESOLVE(CtxPopCurrent, "cuCtxPopCurrent", 4000);
  RESOLVE(CtxSynchronize, "cuCtxSynchronize", 2000);
  RESOLVE(MemAddressReserve, "cuMemAddressReserve", 10020);
  RESOLVE(MemAddressFree, "cuMemAddressFree", 10020);
  RESOLVE(MemCreate, "cuMemCreate", 10020);
  RESOLVE(MemRelease, "cuMemRelease", 10020);
  RESOLVE(MemMap, "cuMemMap", 10020);
  RESOLVE(MemUnmap, "cuMemUnmap", 10020);
  RESOLVE(MemSetAccess, "cuMemSetAccess", 10020);
  RESOLVE(MemGetAllocationGranularity, "cuMemGetAllocationGranularity", 10020);
  RESOLVE(GetErrorName, "cuGetErrorName", 6000);
  RESOLVE(GetErrorString, "cuGetErrorString", 6000);
  RESOLVE(ThreadExchangeStreamCaptureMode, "cuThreadExchangeStreamCaptureMode", 10010);
#undef RESOLVE
  CUresult r = drv.Init(0);
  if (r != CUDA_SUCCESS) {
    snprintf(drv_error, sizeof drv_error, "cuInit(0) failed with CUresult %d", (int)r);
    return;
  }
  drv_status = 0;
}

static int load_driver(void) {
  pthread_once(&drv_once, load_driver_once);
  if (drv_status != 0) {
    set_error("%s", drv_error);
    return -1;
  }
  return 0;
}

/* Records "what failed: CU_ERROR_NAME (description)" and returns -1 when r is an error. */
static int cu_check(CUresult r, const char *what) {
  if (r == CUDA_SUCCESS) return 0;
  const char *name = NULL, *desc = NULL;
  if (drv.GetErrorName) drv.GetErrorName(r, &name);
  if (drv.GetErrorString) drv.GetErrorString(r, &desc);
  set_error("%s failed: %s (%s)", what, name ? name : "unknown CUresult",
            desc ? desc : "no description");
  return -1;
}

/* Timed forms of the driver calls whose cost we report. */
static CUresult t_reserve(CUdeviceptr *ptr, size_t size, size_t align) {
  uint64_t t = now_ns();
  return account(OP_RESERVE, size, t, drv.MemAddressReserve(ptr, size, align, 0, 0));
}
static CUresult t_addrfree(CUdeviceptr ptr, size_t size) {
  uint64_t t = now_ns();
  return account(OP_ADDRFREE, size, t, drv.MemAddressFree(ptr, size));
}
static CUresult t_create(CUmemGenericAllocationHandle *h, size_t size, const CUmemAllocationProp *prop) {
  uint64_t t = now_ns();
  return account(OP_CREATE, size, t, drv.MemCreate(h, size, prop, 0));
}
static CUresult t_map(CUdeviceptr ptr, size_t size, CUmemGenericAllocationHandle h) {
  uint64_t t = now_ns();
  return account(OP_MAP, size, t, drv.MemMap(ptr, size, 0, h, 0));
}
static CUresult t_access(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc) {
  uint64_t t = now_ns();
  return account(OP_ACCESS, size, t, drv.MemSetAccess(ptr, size, desc, 1));
}
static CUresult t_unmap(CUdeviceptr ptr, size_t size) {
  uint64_t t = now_ns();
  return account(OP_UNMAP, size, t, drv.MemUnmap(ptr, size));
}
static CUresult t_release(CUmemGenericAllocationHandle h, size_t size) {
  uint64_t t = now_ns();
  return account(OP_RELEASE, size, t, drv.MemRelease(h));
}
static CUresult t_sync(void) {
  uint64_t t = now_ns();
  return account(OP_SYNC, 0, t, drv.CtxSynchronize());
}

/* ------------------------------------------------------------------ contexts */

/* Each call pushes the device's primary context (the one torch uses) for its own duration, so
 * synchronizing and mapping always act on the right device, whichever context the calling thread
 * had current. The primary contexts are retained once and kept for the process lifetime. */
static CUcontext primary_ctx[SA_MAX_DEVICES];
static pthread_mutex_t ctx_lock = PTHREAD_MUTEX_INITIALIZER;

static int ctx_push(int device) {
  if (device < 0 || device >= SA_MAX_DEVICES) {
    set_error("device index %d out of range [0, %d)", device, SA_MAX_DEVICES);
    return -1;
  }
  pthread_mutex_lock(&ctx_lock);
  if (primary_ctx[device] == NULL) {
    CUdevice dev;
    char what[64];
    snprintf(what, sizeof what, "cuDeviceGet(%d)", device);
    if (cu_check(drv.DeviceGet(&dev, device), what) != 0) {
      pthread_mutex_unlock(&ctx_lock);
      return -1;
    }
    snprintf(what, sizeof what, "cuDevicePrimaryCtxRetain(%d)", device);
    if (cu_check(drv.DevicePrimaryCtxRetain(&primary_ctx[device], dev), what) != 0) {
      primary_ctx[device] = NULL;
      pthread_mutex_unlock(&ctx_lock);
      return -1;
    }
  }
  CUcontext ctx = primary_ctx[device];
  pthread_mutex_unlock(&ctx_lock);
  return cu_check(drv.CtxPushCurrent(ctx), "cuCtxPushCurrent");
}

static void ctx_pop(void) {
  CUcontext ignored;
  drv.CtxPopCurrent(&ignored);
}

/* Allocations can happen while a CUDA graph is being captured (the graph's private pool is ours).
 * In the default "global" capture mode the VMM calls count as potentially unsafe and would
 * invalidate the capture, so the calling thread switches to relaxed mode around them. */
static CUstreamCaptureMode capture_mode_relax(void) {
  CUstreamCaptureMode mode = CU_STREAM_CAPTURE_MODE_RELAXED;
  drv.ThreadExchangeStreamCaptureMode(&mode);
  return mode;
}

static void capture_mode_restore(CUstreamCaptureMode mode) {
  drv.ThreadExchangeStreamCaptureMode(&mode);
}

/* ------------------------------------------------------------------ physical memory */

static size_t granularity_cache[SA_MAX_DEVICES];

static void device_prop(int device, CUmemAllocationProp *prop) {
  memset(prop, 0, sizeof *prop);
  prop->type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop->location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop->location.id = device;
}

static int granularity(int device, size_t *out) {
  if (device < 0 || device >= SA_MAX_DEVICES) {
    set_error("device index %d out of range [0, %d)", device, SA_MAX_DEVICES);
    return -1;
  }
  size_t g = __atomic_load_n(&granularity_cache[device], __ATOMIC_ACQUIRE);
  if (g == 0) {
    CUmemAllocationProp prop;
    device_prop(device, &prop);
    if (cu_check(drv.MemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
                 "cuMemGetAllocationGranularity") != 0)
      return -1;
    __atomic_store_n(&granularity_cache[device], g, __ATOMIC_RELEASE);
  }
  *out = g;
  return 0;
}

static void format_bytes(char *buf, size_t n, size_t bytes) {
  if (bytes >= ((size_t)1 << 30))
    snprintf(buf, n, "%.2f GiB", (double)bytes / (double)((size_t)1 << 30));
  else
    snprintf(buf, n, "%.1f MiB", (double)bytes / (double)((size_t)1 << 20));
}

/* Create physical memory for [ptr, ptr+size) on device, map it and grant read/write access.
 * On failure nothing stays allocated or mapped. The caller holds the device context. */
static int map_physical(int device, CUdeviceptr ptr, size_t size,
                        CUmemGenericAllocationHandle *handle_out) {
  CUmemAllocationProp prop;
  device_prop(device, &prop);
  char what[128], amount[32];
  format_bytes(amount, sizeof amount, size);
  CUmemGenericAllocationHandle handle;
  snprintf(what, sizeof what, "cuMemCreate(%s on device %d)", amount, device);
  if (cu_check(t_create(&handle, size, &prop), what) != 0) return -1;
  snprintf(what, sizeof what, "cuMemMap(%s at 0x%llx)", amount, (unsigned long long)ptr);
  if (cu_check(t_map(ptr, size, handle), what) != 0) {
    t_release(handle, size);
    return -1;
  }
  CUmemAccessDesc access;
  memset(&access, 0, sizeof access);
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  snprintf(what, sizeof what, "cuMemSetAccess(%s at 0x%llx)", amount, (unsigned long long)ptr);
  if (cu_check(t_access(ptr, size, &access), what) != 0) {
    t_unmap(ptr, size);
    t_release(handle, size);
    return -1;
  }
  *handle_out = handle;
  return 0;
}

/* Unmap [ptr, ptr+size) and release its physical memory. The caller holds the device context
 * and has synchronized the device. */
static int unmap_physical(CUdeviceptr ptr, size_t size, CUmemGenericAllocationHandle handle) {
  char what[96];
  snprintf(what, sizeof what, "cuMemUnmap(0x%llx, %zu bytes)", (unsigned long long)ptr, size);
  if (cu_check(t_unmap(ptr, size), what) != 0) return -1;
  return cu_check(t_release(handle, size), "cuMemRelease");
}

/* ------------------------------------------------------------------ registry */

typedef struct {
  CUdeviceptr ptr;
  size_t size; /* reserved = mapped size, a multiple of the granularity */
  CUmemGenericAllocationHandle handle; /* meaningful only while mapped */
  int device;
  int mapped;
  int mapped_by_this_call; /* scratch for map_all's rollback */
  int piece; /* a piece of a reservation (sa_reserve): never freed by torch, its VA is not its own */
  char tag[SA_TAG_MAX];
} sa_entry;

/* The record Python reads; allocator/cumem.py mirrors this layout. */
typedef struct {
  uint64_t ptr;
  uint64_t size;
  int32_t device;
  int32_t mapped;
  char tag[SA_TAG_MAX];
} sa_info;

static pthread_mutex_t reg_lock = PTHREAD_MUTEX_INITIALIZER;
static sa_entry *reg = NULL;
static size_t reg_len = 0, reg_cap = 0;

/* The tag new allocations get: the calling thread's (set by pool.use), else the capture tag (set
 * by pool.graph_pool, for allocations a CUDA graph capture routes to our pool), else "". */
static __thread char tl_tag[SA_TAG_MAX];
static char capture_tag[SA_TAG_MAX];

static long reg_find(CUdeviceptr ptr) { /* caller holds reg_lock */
  for (size_t i = 0; i < reg_len; i++)
    if (reg[i].ptr == ptr) return (long)i;
  return -1;
}

static int reg_append(const sa_entry *e) { /* caller holds reg_lock */
  if (reg_len == reg_cap) {
    size_t cap = reg_cap ? reg_cap * 2 : 256;
    sa_entry *grown = realloc(reg, cap * sizeof *grown);
    if (!grown) {
      set_error("out of host memory growing the allocation registry to %zu entries", cap);
      return -1;
    }
    reg = grown;
    reg_cap = cap;
  }
  reg[reg_len++] = *e;
  return 0;
}

static void reg_remove(size_t i) { /* caller holds reg_lock; order is irrelevant */
  reg[i] = reg[--reg_len];
}

static void copy_tag(char *dst, const char *src) {
  size_t n = src ? strlen(src) : 0;
  if (n >= SA_TAG_MAX) n = SA_TAG_MAX - 1;
  if (n) memcpy(dst, src, n);
  dst[n] = '\0';
}

static void to_info(const sa_entry *e, sa_info *out) {
  out->ptr = (uint64_t)e->ptr;
  out->size = (uint64_t)e->size;
  out->device = e->device;
  out->mapped = e->mapped;
  memcpy(out->tag, e->tag, SA_TAG_MAX);
}

/* ------------------------------------------------------------------ torch entry points */

SA_EXPORT void *sleep_malloc(ssize_t size, int device, CUstream stream) {
  (void)stream; /* physical memory is not stream-ordered; torch orders block reuse itself */
  if (load_driver() != 0) return NULL;
  size_t gran;
  if (granularity(device, &gran) != 0) return NULL;
  size_t bytes = size > 0 ? ((size_t)size + gran - 1) / gran * gran : gran;

  sa_entry e;
  memset(&e, 0, sizeof e);
  e.size = bytes;
  e.device = device;
  e.mapped = 1;
  if (tl_tag[0]) {
    copy_tag(e.tag, tl_tag);
  } else {
    pthread_mutex_lock(&reg_lock);
    copy_tag(e.tag, capture_tag);
    pthread_mutex_unlock(&reg_lock);
  }

  CUstreamCaptureMode mode = capture_mode_relax();
  void *result = NULL;
  if (ctx_push(device) != 0) goto out;
  char what[96], amount[32];
  format_bytes(amount, sizeof amount, bytes);
  snprintf(what, sizeof what, "cuMemAddressReserve(%s)", amount);
  if (cu_check(t_reserve(&e.ptr, bytes, gran), what) != 0) goto pop;
  if (map_physical(device, e.ptr, bytes, &e.handle) != 0) {
    t_addrfree(e.ptr, bytes);
    goto pop;
  }
  pthread_mutex_lock(&reg_lock);
  int added = reg_append(&e);
  pthread_mutex_unlock(&reg_lock);
  if (added != 0) {
    unmap_physical(e.ptr, bytes, e.handle);
    t_addrfree(e.ptr, bytes);
    goto pop;
  }
  result = (void *)e.ptr;
pop:
  ctx_pop();
out:
  capture_mode_restore(mode);
  return result;
}

SA_EXPORT void sleep_free(void *ptr, ssize_t size, int device, CUstream stream) {
  (void)size;
  (void)stream;
  if (ptr == NULL || load_driver() != 0) return;
  pthread_mutex_lock(&reg_lock);
  long i = reg_find((CUdeviceptr)ptr);
  sa_entry e;
  if (i >= 0) {
    e = reg[i];
    reg_remove((size_t)i); /* before the VA is freed, so a racing malloc reusing it stays ours */
  }
  pthread_mutex_unlock(&reg_lock);
  if (i < 0) {
    set_error("sleep_free(%p, device %d): not an allocation of this pool", ptr, device);
    fprintf(stderr, "sleepserve allocator: %s\n", tl_error);
    return;
  }
  if (ctx_push(e.device) != 0) {
    fprintf(stderr, "sleepserve allocator: leaking %zu bytes at %p: %s\n", e.size, ptr, tl_error);
    return;
  }
  /* torch returns a segment once no block in it is in use on the host side, but kernels that used
   * it may still be running: unmapping under them would fault. */
  int ok = cu_check(t_sync(), "cuCtxSynchronize before freeing") == 0;
  if (ok && e.mapped) ok = unmap_physical(e.ptr, e.size, e.handle) == 0;
  if (ok) ok = cu_check(t_addrfree(e.ptr, e.size), "cuMemAddressFree") == 0;
  if (!ok) fprintf(stderr, "sleepserve allocator: freeing %p: %s\n", ptr, tl_error);
  ctx_pop();
}

/* ------------------------------------------------------------------ Python API */

SA_EXPORT int sa_abi_version(void) { return SA_ABI_VERSION; }
SA_EXPORT int sa_tag_max(void) { return SA_TAG_MAX; }
SA_EXPORT const char *sa_last_error(void) { return tl_error; }

/* 0 when libcuda loaded and every entry point resolved; -1 and an error otherwise. */
SA_EXPORT int sa_init(void) { return load_driver(); }

SA_EXPORT int sa_set_thread_tag(const char *tag) {
  if (tag && strlen(tag) >= SA_TAG_MAX) {
    set_error("tag '%s' is longer than %d bytes", tag, SA_TAG_MAX - 1);
    return -1;
  }
  copy_tag(tl_tag, tag);
  return 0;
}

SA_EXPORT const char *sa_thread_tag(void) { return tl_tag; }

SA_EXPORT int sa_set_capture_tag(const char *tag) {
  if (tag && strlen(tag) >= SA_TAG_MAX) {
    set_error("tag '%s' is longer than %d bytes", tag, SA_TAG_MAX - 1);
    return -1;
  }
  pthread_mutex_lock(&reg_lock);
  copy_tag(capture_tag, tag);
  pthread_mutex_unlock(&reg_lock);
  return 0;
}

/* Copies up to cap records whose tag starts with prefix (NULL or "" = all) into out.
 * Returns how many match, which may exceed cap: call again with a larger buffer. */
SA_EXPORT int64_t sa_list(const char *prefix, sa_info *out, int64_t cap) {
  size_t plen = prefix ? strlen(prefix) : 0;
  int64_t n = 0;
  pthread_mutex_lock(&reg_lock);
  for (size_t i = 0; i < reg_len; i++) {
    if (plen && strncmp(reg[i].tag, prefix, plen) != 0) continue;
    if (n < cap) to_info(&reg[i], &out[n]);
    n++;
  }
  pthread_mutex_unlock(&reg_lock);
  return n;
}

/* Finds the allocation containing addr. Returns 1 and fills out, or 0 when none does. */
SA_EXPORT int sa_lookup(uint64_t addr, sa_info *out) {
  int found = 0;
  pthread_mutex_lock(&reg_lock);
  for (size_t i = 0; i < reg_len; i++) {
    if (addr >= reg[i].ptr && addr < reg[i].ptr + reg[i].size) {
      to_info(&reg[i], out);
      found = 1;
      break;
    }
  }
  pthread_mutex_unlock(&reg_lock);
  return found;
}

/* ------------------------------------------------------------------ timing, for Python */

/* Fills out[4*op + {0,1,2,3}] with the calls, nanoseconds, bytes and longest call of each timed
 * driver call (order: reserve, create, map, access, unmap, release, sync, address free) and
 * returns how many values exist, which may exceed cap. */
SA_EXPORT int sa_stats(uint64_t *out, int cap) {
  for (int op = 0; op < OP_COUNT; op++) {
    uint64_t v[4] = {__atomic_load_n(&op_calls[op], __ATOMIC_RELAXED),
                     __atomic_load_n(&op_ns[op], __ATOMIC_RELAXED),
                     __atomic_load_n(&op_bytes[op], __ATOMIC_RELAXED),
                     __atomic_load_n(&op_max_ns[op], __ATOMIC_RELAXED)};
    for (int k = 0; k < 4; k++)
      if (out && 4 * op + k < cap) out[4 * op + k] = v[k];
  }
  return 4 * OP_COUNT;
}

SA_EXPORT void sa_stats_reset_max(void) {
  for (int op = 0; op < OP_COUNT; op++) __atomic_store_n(&op_max_ns[op], 0, __ATOMIC_RELAXED);
}

/* ------------------------------------------------------------------ reservations */

/* A reservation is one virtual range whose physical memory comes in pieces, each a registry entry
 * of its own (so every batch below maps, unmaps and lists it like any allocation). It is how the
 * KV cache maps back in chunks of blocks: a tensor spans the whole range, and a chunk is one piece
 * (the cache is block-major, so a chunk's blocks of every layer are one contiguous range). torch
 * never sees these: Python wraps the range in a tensor and frees it with sa_free_reservation. */
typedef struct {
  CUdeviceptr ptr;
  size_t size;
  int device;
} sa_reservation;

#define SA_MAX_RESERVATIONS 64
static sa_reservation reservations[SA_MAX_RESERVATIONS];
static int n_reservations = 0; /* guarded by reg_lock */

SA_EXPORT int64_t sa_granularity(int device) {
  if (load_driver() != 0) return -1;
  size_t g;
  if (ctx_push(device) != 0) return -1;
  int rc = granularity(device, &g);
  ctx_pop();
  return rc == 0 ? (int64_t)g : -1;
}

/* Reserves size bytes (a multiple of the granularity) of virtual addresses on device, with no
 * physical memory. Returns the address, or 0 with an error. */
SA_EXPORT uint64_t sa_reserve(uint64_t size, int device) {
  if (load_driver() != 0) return 0;
  size_t gran;
  if (ctx_push(device) != 0) return 0;
  CUdeviceptr ptr = 0;
  int ok = granularity(device, &gran) == 0;
  if (ok && (size == 0 || size % gran != 0)) {
    set_error("sa_reserve: %llu bytes is not a positive multiple of the granularity %zu",
              (unsigned long long)size, gran);
    ok = 0;
  }
  if (ok) ok = cu_check(t_reserve(&ptr, size, gran), "cuMemAddressReserve") == 0;
  ctx_pop();
  if (!ok) return 0;
  pthread_mutex_lock(&reg_lock);
  if (n_reservations == SA_MAX_RESERVATIONS) {
    pthread_mutex_unlock(&reg_lock);
    set_error("more than %d reservations", SA_MAX_RESERVATIONS);
    if (ctx_push(device) == 0) {
      t_addrfree(ptr, size);
      ctx_pop();
    }
    return 0;
  }
  reservations[n_reservations++] = (sa_reservation){ptr, size, device};
  pthread_mutex_unlock(&reg_lock);
  return (uint64_t)ptr;
}

static int find_reservation(CUdeviceptr ptr, size_t size) { /* caller holds reg_lock */
  for (int i = 0; i < n_reservations; i++)
    if (ptr >= reservations[i].ptr && ptr + size <= reservations[i].ptr + reservations[i].size) return i;
  return -1;
}

/* Creates and maps physical memory for [ptr, ptr+size), which must lie inside a reservation, and
 * records it as a piece under tag. Returns 0, or -1 with an error (nothing left mapped). */
SA_EXPORT int sa_add_piece(uint64_t ptr, uint64_t size, const char *tag) {
  if (load_driver() != 0) return -1;
  if (tag && strlen(tag) >= SA_TAG_MAX) {
    set_error("tag '%s' is longer than %d bytes", tag, SA_TAG_MAX - 1);
    return -1;
  }
  pthread_mutex_lock(&reg_lock);
  int r = find_reservation((CUdeviceptr)ptr, size);
  int device = r >= 0 ? reservations[r].device : -1;
  pthread_mutex_unlock(&reg_lock);
  if (r < 0) {
    set_error("sa_add_piece: [0x%llx, +%llu) is not inside a reservation", (unsigned long long)ptr,
              (unsigned long long)size);
    return -1;
  }
  sa_entry e;
  memset(&e, 0, sizeof e);
  e.ptr = (CUdeviceptr)ptr;
  e.size = size;
  e.device = device;
  e.mapped = 1;
  e.piece = 1;
  copy_tag(e.tag, tag);
  CUstreamCaptureMode mode = capture_mode_relax();
  int rc = ctx_push(device);
  if (rc == 0) {
    rc = map_physical(device, e.ptr, size, &e.handle);
    if (rc == 0) {
      pthread_mutex_lock(&reg_lock);
      rc = reg_append(&e);
      pthread_mutex_unlock(&reg_lock);
      if (rc != 0) unmap_physical(e.ptr, size, e.handle);
    }
    ctx_pop();
  }
  capture_mode_restore(mode);
  return rc;
}

/* Unmaps every piece of the reservation at ptr (after a synchronization), forgets them and frees
 * the virtual range. Returns 0, or -1 with the first error. */
SA_EXPORT int sa_free_reservation(uint64_t ptr) {
  if (load_driver() != 0) return -1;
  pthread_mutex_lock(&reg_lock);
  int r = find_reservation((CUdeviceptr)ptr, 1);
  if (r < 0 || reservations[r].ptr != (CUdeviceptr)ptr) {
    pthread_mutex_unlock(&reg_lock);
    set_error("sa_free_reservation: 0x%llx is not a reservation", (unsigned long long)ptr);
    return -1;
  }
  sa_reservation res = reservations[r];
  reservations[r] = reservations[--n_reservations];
  int pushed = ctx_push(res.device) == 0;
  int failed = !pushed || cu_check(t_sync(), "cuCtxSynchronize before freeing") != 0;
  if (!failed) {
    for (size_t i = 0; i < reg_len;) {
      sa_entry *e = &reg[i];
      if (e->piece && e->ptr >= res.ptr && e->ptr < res.ptr + res.size) {
        if (e->mapped && unmap_physical(e->ptr, e->size, e->handle) != 0) failed = 1;
        reg_remove(i);
      } else {
        i++;
      }
    }
    if (cu_check(t_addrfree(res.ptr, res.size), "cuMemAddressFree") != 0) failed = 1;
  }
  if (pushed) ctx_pop();
  pthread_mutex_unlock(&reg_lock);
  return failed ? -1 : 0;
}

/* ------------------------------------------------------------------ batches */

enum { BATCH_UNMAP, BATCH_MAP };

/* Maps or unmaps items in the calling thread, pushing each one's device context. Unmapping keeps
 * going past a failure so as much as possible is released; mapping stops at the first one (the
 * caller rolls back). Returns 0, or -1 with the first error. The caller holds reg_lock. */
static int run_batch(int op, sa_entry **items, size_t n) {
  char first_error[sizeof tl_error];
  int failed = 0, device = -1;
  CUstreamCaptureMode mode = capture_mode_relax();
  for (size_t i = 0; i < n && !(failed && op == BATCH_MAP); i++) {
    sa_entry *e = items[i];
    int rc = 0;
    if (e->device != device) {
      if (device >= 0) ctx_pop();
      device = ctx_push(e->device) == 0 ? e->device : -1;
      rc = device < 0 ? -1 : 0;
    }
    if (rc == 0 && op == BATCH_MAP) {
      rc = map_physical(e->device, e->ptr, e->size, &e->handle);
      if (rc == 0) e->mapped = e->mapped_by_this_call = 1;
    } else if (rc == 0) {
      rc = unmap_physical(e->ptr, e->size, e->handle);
      if (rc == 0) e->mapped = 0;
    }
    if (rc != 0 && !failed) {
      memcpy(first_error, tl_error, sizeof first_error);
      failed = 1;
    }
  }
  if (device >= 0) ctx_pop();
  capture_mode_restore(mode);
  if (failed) memcpy(tl_error, first_error, sizeof tl_error);
  return failed ? -1 : 0;
}

static int64_t total_size(sa_entry **items, size_t n, int mapped) {
  int64_t sum = 0;
  for (size_t i = 0; i < n; i++)
    if (items[i]->mapped == mapped) sum += (int64_t)items[i]->size;
  return sum;
}

/* Maps every item (all unmapped), all or nothing: on failure the ones this call mapped are
 * released again (nothing ran on them yet: no synchronization needed) and -1 is returned with the
 * error of the failing one. Returns the bytes mapped otherwise. The caller holds reg_lock. */
static int64_t map_all(sa_entry **items, size_t n) {
  int64_t mapped = -1;
  for (size_t i = 0; i < n; i++) items[i]->mapped_by_this_call = 0;
  if (run_batch(BATCH_MAP, items, n) == 0) {
    mapped = total_size(items, n, 1);
  } else {
    char error[sizeof tl_error];
    memcpy(error, tl_error, sizeof error);
    size_t undo = 0;
    for (size_t i = 0; i < n; i++)
      if (items[i]->mapped_by_this_call) items[undo++] = items[i];
    run_batch(BATCH_UNMAP, items, undo);
    memcpy(tl_error, error, sizeof tl_error);
  }
  for (size_t i = 0; i < n; i++) items[i]->mapped_by_this_call = 0;
  return mapped;
}

/* One cuCtxSynchronize per device that is marked. */
static int sync_devices(const unsigned char devices[SA_MAX_DEVICES]) {
  for (int d = 0; d < SA_MAX_DEVICES; d++) {
    if (!devices[d]) continue;
    if (ctx_push(d) != 0) return -1;
    char what[64];
    snprintf(what, sizeof what, "cuCtxSynchronize(device %d) before unmapping", d);
    int rc = cu_check(t_sync(), what);
    ctx_pop();
    if (rc != 0) return -1;
  }
  return 0;
}

/* Room for n entry pointers (at least one), or NULL with an error. */
static sa_entry **new_items(size_t n) {
  sa_entry **items = malloc((n ? n : 1) * sizeof *items);
  if (!items) set_error("out of host memory listing %zu allocations", n);
  return items;
}

static int tag_listed(const char *tag, const char *const *tags, int ntags) {
  for (int k = 0; k < ntags; k++)
    if (tags[k] && strcmp(tag, tags[k]) == 0) return 1;
  return 0;
}

/* The registry entries of the listed tags whose mapped state is `mapped`, and the devices they
 * live on. Caller holds reg_lock and frees the array. NULL (with an error) when out of memory. */
static sa_entry **collect_tags(const char *const *tags, int ntags, int mapped, size_t *n_out,
                               unsigned char devices[SA_MAX_DEVICES]) {
  sa_entry **items = new_items(reg_len);
  if (!items) return NULL;
  size_t n = 0;
  for (size_t i = 0; i < reg_len; i++) {
    sa_entry *e = &reg[i];
    if (e->mapped != mapped || !tag_listed(e->tag, tags, ntags)) continue;
    items[n++] = e;
    devices[e->device] = 1;
  }
  *n_out = n;
  return items;
}

/* The registry entries of the listed addresses whose mapped state is `mapped` (the others are
 * skipped), and the devices they live on. Caller holds reg_lock and frees the array. NULL with an
 * error, before anything is touched, when an address is not an allocation of this pool. */
static sa_entry **collect_ptrs(const uint64_t *ptrs, int64_t count, int mapped, size_t *n_out,
                               unsigned char devices[SA_MAX_DEVICES], const char *what) {
  sa_entry **items = new_items((size_t)count);
  if (!items) return NULL;
  size_t n = 0;
  for (int64_t k = 0; k < count; k++) {
    long i = reg_find((CUdeviceptr)ptrs[k]);
    if (i < 0) {
      set_error("%s: 0x%llx is not an allocation of this pool", what, (unsigned long long)ptrs[k]);
      free(items);
      return NULL;
    }
    if (reg[i].mapped != mapped) continue;
    items[n++] = &reg[i];
    devices[reg[i].device] = 1;
  }
  *n_out = n;
  return items;
}

/* What a batch acts on: every allocation of some tags (tags != NULL), or listed addresses. */
typedef struct {
  const char *const *tags;
  int ntags;
  const uint64_t *ptrs;
  int64_t count;
} sa_selection;

/* Unmaps and releases the selected allocations that are mapped, after one synchronization of
 * their devices unless synchronize == 0 (BATCH_UNMAP), or re-creates and maps those that are
 * not, all or nothing (BATCH_MAP). Returns the bytes released or mapped, or -1 with the error. */
static int64_t apply(int op, const sa_selection *sel, int synchronize) {
  if (load_driver() != 0) return -1;
  unsigned char devices[SA_MAX_DEVICES] = {0};
  size_t n = 0;
  int64_t bytes = -1;
  int mapped = op == BATCH_UNMAP; /* the state of the allocations the batch changes */
  pthread_mutex_lock(&reg_lock);
  sa_entry **items = sel->tags ? collect_tags(sel->tags, sel->ntags, mapped, &n, devices)
                               : collect_ptrs(sel->ptrs, sel->count, mapped, &n, devices,
                                              op == BATCH_MAP ? "map" : "unmap");
  if (items && op == BATCH_MAP)
    bytes = map_all(items, n);
  else if (items && (!synchronize || sync_devices(devices) == 0))
    bytes = run_batch(BATCH_UNMAP, items, n) == 0 ? total_size(items, n, 0) : -1;
  pthread_mutex_unlock(&reg_lock);
  free(items);
  return bytes;
}

/* Unmaps and releases every mapped allocation of the listed tags after one synchronization of
 * their devices. Keeps going past a failure so as much as possible is released; returns the
 * bytes released, or -1 (with the first error) when any allocation could not be unmapped. */
SA_EXPORT int64_t sa_unmap_tags(const char *const *tags, int ntags) {
  if (!tags || ntags < 0) return -1;
  sa_selection sel = {tags, ntags, NULL, 0};
  return apply(BATCH_UNMAP, &sel, 1);
}

/* Re-creates and maps every unmapped allocation of the listed tags, all or nothing: on failure
 * the ones mapped by this call are released again and -1 is returned with the error of the
 * failing one. */
SA_EXPORT int64_t sa_map_tags(const char *const *tags, int ntags) {
  if (!tags || ntags < 0) return -1;
  sa_selection sel = {tags, ntags, NULL, 0};
  return apply(BATCH_MAP, &sel, 0);
}

/* Unmaps and releases the listed allocations (those still mapped). With synchronize == 0 the
 * caller guarantees that no device work uses them any more (their backup copies completed):
 * that is what lets a sleep release each allocation as soon as its own copy is done, while the
 * copies of the others still run. Returns the bytes released or -1 with the first error; an
 * address that is not an allocation of this pool fails the call before anything is unmapped. */
SA_EXPORT int64_t sa_unmap_ptrs(const uint64_t *ptrs, int64_t count, int synchronize) {
  if ((!ptrs && count > 0) || count < 0) return -1;
  sa_selection sel = {NULL, 0, ptrs, count};
  return apply(BATCH_UNMAP, &sel, synchronize);
}

/* Re-creates and maps the listed allocations (those still unmapped), all or nothing like
 * sa_map_tags. Lets a wake map one group and start its copies while it maps the next. Returns
 * the bytes mapped or -1; an address that is not an allocation of this pool fails the call before
 * anything is mapped. */
SA_EXPORT int64_t sa_map_ptrs(const uint64_t *ptrs, int64_t count) {
  if ((!ptrs && count > 0) || count < 0) return -1;
  sa_selection sel = {NULL, 0, ptrs, count};
  return apply(BATCH_MAP, &sel, 0);
}
