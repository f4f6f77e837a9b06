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
 *     Python (DESIGN invariant 6); each allocation is recorded in a C registry under the tag the
 *     calling thread set beforehand.
 *   - allocator/cumem.py, through ctypes: set the tag, list allocations, unmap/re-map one
 *     allocation or a whole tag.
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

#define SA_EXPORT __attribute__((visibility("default")))
#define SA_ABI_VERSION 1
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
  if (cu_check(drv.MemCreate(&handle, size, &prop, 0), what) != 0) return -1;
  snprintf(what, sizeof what, "cuMemMap(%s at 0x%llx)", amount, (unsigned long long)ptr);
  if (cu_check(drv.MemMap(ptr, size, 0, handle, 0), what) != 0) {
    drv.MemRelease(handle);
    return -1;
  }
  CUmemAccessDesc access;
  memset(&access, 0, sizeof access);
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  snprintf(what, sizeof what, "cuMemSetAccess(%s at 0x%llx)", amount, (unsigned long long)ptr);
  if (cu_check(drv.MemSetAccess(ptr, size, &access, 1), what) != 0) {
    drv.MemUnmap(ptr, size);
    drv.MemRelease(handle);
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
  if (cu_check(drv.MemUnmap(ptr, size), what) != 0) return -1;
  return cu_check(drv.MemRelease(handle), "cuMemRelease");
}

/* ------------------------------------------------------------------ registry */

typedef struct {
  CUdeviceptr ptr;
  size_t size; /* reserved = mapped size, a multiple of the granularity */
  CUmemGenericAllocationHandle handle; /* meaningful only while mapped */
  int device;
  int mapped;
  int mapped_by_this_call; /* scratch for sa_map_tag's rollback */
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
  if (cu_check(drv.MemAddressReserve(&e.ptr, bytes, gran, 0, 0), what) != 0) goto pop;
  if (map_physical(device, e.ptr, bytes, &e.handle) != 0) {
    drv.MemAddressFree(e.ptr, bytes);
    goto pop;
  }
  pthread_mutex_lock(&reg_lock);
  int added = reg_append(&e);
  pthread_mutex_unlock(&reg_lock);
  if (added != 0) {
    unmap_physical(e.ptr, bytes, e.handle);
    drv.MemAddressFree(e.ptr, bytes);
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
  int ok = cu_check(drv.CtxSynchronize(), "cuCtxSynchronize before freeing") == 0;
  if (ok && e.mapped) ok = unmap_physical(e.ptr, e.size, e.handle) == 0;
  if (ok) ok = cu_check(drv.MemAddressFree(e.ptr, e.size), "cuMemAddressFree") == 0;
  if (!ok) fprintf(stderr, "sleepserve allocator: freeing %p: %s\n", ptr, tl_error);
  ctx_pop();
}

/* ------------------------------------------------------------------ Python API */

SA_EXPORT int sa_abi_version(void) { return SA_ABI_VERSION; }
SA_EXPORT int sa_tag_max(void) { return SA_TAG_MAX; }
SA_EXPORT const char *sa_last_error(void) { return tl_error; }

/* 0 when libcuda loaded and every entry point resolved; -1 and an error otherwise. */
SA_EXPORT int sa_init(void) { return load_driver(); }

SA_EXPORT int64_t sa_granularity(int device) {
  size_t g;
  if (load_driver() != 0 || granularity(device, &g) != 0) return -1;
  return (int64_t)g;
}

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

/* Re-tags one allocation (used to attribute segments that reached the pool untagged). */
SA_EXPORT int sa_retag(uint64_t ptr, const char *tag) {
  if (!tag || strlen(tag) >= SA_TAG_MAX) {
    set_error("retag: tag missing or longer than %d bytes", SA_TAG_MAX - 1);
    return -1;
  }
  pthread_mutex_lock(&reg_lock);
  long i = reg_find((CUdeviceptr)ptr);
  if (i >= 0) copy_tag(reg[i].tag, tag);
  pthread_mutex_unlock(&reg_lock);
  if (i < 0) {
    set_error("retag: 0x%llx is not an allocation of this pool", (unsigned long long)ptr);
    return -1;
  }
  return 0;
}

/* Synchronizes every device that holds a mapped allocation of tag. Caller holds reg_lock. */
static int sync_devices_of(const char *tag) {
  unsigned char seen[SA_MAX_DEVICES] = {0};
  for (size_t i = 0; i < reg_len; i++) {
    sa_entry *e = &reg[i];
    if (!e->mapped || strcmp(e->tag, tag) != 0 || seen[e->device]) continue;
    seen[e->device] = 1;
    if (ctx_push(e->device) != 0) return -1;
    char what[64];
    snprintf(what, sizeof what, "cuCtxSynchronize(device %d) before unmapping", e->device);
    int rc = cu_check(drv.CtxSynchronize(), what);
    ctx_pop();
    if (rc != 0) return -1;
  }
  return 0;
}

static int unmap_entry(sa_entry *e) { /* caller holds reg_lock and has synchronized */
  if (!e->mapped) return 0;
  if (ctx_push(e->device) != 0) return -1;
  int rc = unmap_physical(e->ptr, e->size, e->handle);
  ctx_pop();
  if (rc == 0) e->mapped = 0;
  return rc;
}

static int map_entry(sa_entry *e) { /* caller holds reg_lock */
  if (e->mapped) return 0;
  if (ctx_push(e->device) != 0) return -1;
  int rc = map_physical(e->device, e->ptr, e->size, &e->handle);
  ctx_pop();
  if (rc == 0) e->mapped = 1;
  return rc;
}

/* Unmaps and releases every mapped allocation of tag after synchronizing its devices. Keeps going
 * past a failure so as much as possible is released; returns the bytes released, or -1 (with the
 * first error) when any allocation could not be unmapped. */
SA_EXPORT int64_t sa_unmap_tag(const char *tag) {
  if (!tag || load_driver() != 0) return -1;
  pthread_mutex_lock(&reg_lock);
  int64_t released = 0;
  int failed = sync_devices_of(tag);
  if (failed == 0) {
    char first_error[sizeof tl_error] = "";
    for (size_t i = 0; i < reg_len; i++) {
      sa_entry *e = &reg[i];
      if (!e->mapped || strcmp(e->tag, tag) != 0) continue;
      if (unmap_entry(e) == 0) {
        released += (int64_t)e->size;
      } else if (!failed) {
        failed = -1;
        memcpy(first_error, tl_error, sizeof first_error);
      }
    }
    if (failed) memcpy(tl_error, first_error, sizeof tl_error);
  }
  pthread_mutex_unlock(&reg_lock);
  return failed ? -1 : released;
}

/* Re-creates and maps every unmapped allocation of tag, all or nothing: on failure the ones
 * mapped by this call are released again and -1 is returned with the error of the failing one. */
SA_EXPORT int64_t sa_map_tag(const char *tag) {
  if (!tag || load_driver() != 0) return -1;
  pthread_mutex_lock(&reg_lock);
  CUstreamCaptureMode mode = capture_mode_relax();
  int64_t mapped = 0;
  int failed = 0;
  for (size_t i = 0; i < reg_len && !failed; i++) {
    sa_entry *e = &reg[i];
    e->mapped_by_this_call = 0;
    if (e->mapped || strcmp(e->tag, tag) != 0) continue;
    if (map_entry(e) != 0) {
      failed = 1;
    } else {
      e->mapped_by_this_call = 1;
      mapped += (int64_t)e->size;
    }
  }
  if (failed) {
    char error[sizeof tl_error];
    memcpy(error, tl_error, sizeof error);
    for (size_t i = 0; i < reg_len; i++)
      if (reg[i].mapped_by_this_call) unmap_entry(&reg[i]);
    memcpy(tl_error, error, sizeof tl_error);
    mapped = -1;
  }
  for (size_t i = 0; i < reg_len; i++) reg[i].mapped_by_this_call = 0;
  capture_mode_restore(mode);
  pthread_mutex_unlock(&reg_lock);
  return mapped;
}

/* Single-allocation versions of the two above. */
SA_EXPORT int sa_unmap(uint64_t ptr) {
  if (load_driver() != 0) return -1;
  pthread_mutex_lock(&reg_lock);
  long i = reg_find((CUdeviceptr)ptr);
  int rc = -1;
  if (i < 0) {
    set_error("unmap: 0x%llx is not an allocation of this pool", (unsigned long long)ptr);
  } else if (ctx_push(reg[i].device) == 0) {
    rc = cu_check(drv.CtxSynchronize(), "cuCtxSynchronize before unmapping");
    ctx_pop();
    if (rc == 0) rc = unmap_entry(&reg[i]);
  }
  pthread_mutex_unlock(&reg_lock);
  return rc;
}

SA_EXPORT int sa_map(uint64_t ptr) {
  if (load_driver() != 0) return -1;
  pthread_mutex_lock(&reg_lock);
  long i = reg_find((CUdeviceptr)ptr);
  int rc = -1;
  if (i < 0) {
    set_error("map: 0x%llx is not an allocation of this pool", (unsigned long long)ptr);
  } else {
    CUstreamCaptureMode mode = capture_mode_relax();
    rc = map_entry(&reg[i]);
    capture_mode_restore(mode);
  }
  pthread_mutex_unlock(&reg_lock);
  return rc;
}
