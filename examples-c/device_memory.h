/*
 * Tiny buffer helpers for the ep examples: device memory through the CUDA
 * driver API when the context runs on the GPU backend, plain host memory on
 * the host backend. The driver is loaded with dlopen("libcuda.so.1") and its
 * few entry points are declared by hand, so no CUDA header or toolkit is
 * needed to build the examples. Link with -ldl.
 *
 * Usage:
 *   dm_t dm;
 *   dm_init(&dm, backend == EP_BACKEND_GPU, device);
 *   void *d = dm_alloc(&dm, bytes);
 *   dm_to_device(&dm, d, host, bytes);  ... ep calls ...
 *   dm_sync(&dm); dm_to_host(&dm, host, d, bytes);
 *   dm_free(&dm, d);
 * Every helper returns 0 on success; on failure it prints why to stderr.
 */
#ifndef EP_EXAMPLES_DEVICE_MEMORY_H
#define EP_EXAMPLES_DEVICE_MEMORY_H

#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* CUDA driver API types, declared by hand (see cuda.h). */
typedef int dm_cu_result;
typedef int dm_cu_device;
typedef void *dm_cu_context;
typedef unsigned long long dm_cu_deviceptr;

typedef struct dm_t {
    int gpu; /* 1: device memory through the driver; 0: host memory */
    void *lib;
    dm_cu_context ctx;
    dm_cu_result (*cuInit)(unsigned int flags);
    dm_cu_result (*cuDeviceGet)(dm_cu_device *device, int ordinal);
    dm_cu_result (*cuDevicePrimaryCtxRetain)(dm_cu_context *ctx, dm_cu_device device);
    dm_cu_result (*cuCtxSetCurrent)(dm_cu_context ctx);
    dm_cu_result (*cuMemAlloc)(dm_cu_deviceptr *ptr, size_t bytes);
    dm_cu_result (*cuMemFree)(dm_cu_deviceptr ptr);
    dm_cu_result (*cuMemcpyHtoD)(dm_cu_deviceptr dst, const void *src, size_t bytes);
    dm_cu_result (*cuMemcpyDtoH)(void *dst, dm_cu_deviceptr src, size_t bytes);
    dm_cu_result (*cuCtxSynchronize)(void);
} dm_t;

/* Loads one driver symbol into *slot (a function pointer); 0 on success.
 * memcpy, because ISO C has no cast from void * to a function pointer. */
static inline int dm_sym_(dm_t *dm, void *slot, size_t slot_size, const char *name) {
    void *sym = dlsym(dm->lib, name);
    if (sym == NULL) {
        fprintf(stderr, "device_memory: libcuda.so.1 lacks %s\n", name);
        return -1;
    }
    memcpy(slot, &sym, slot_size);
    return 0;
}

static inline int dm_check_(dm_cu_result res, const char *what) {
    if (res != 0) {
        fprintf(stderr, "device_memory: %s failed with CUDA error %d\n", what, res);
        return -1;
    }
    return 0;
}

/* Prepares `dm` for host memory (gpu = 0) or for memory of CUDA device
 * `device` (gpu != 0): loads the driver and makes the device's primary
 * context current on the calling thread. */
static inline int dm_init(dm_t *dm, int gpu, int device) {
    dm_cu_device dev = 0;
    memset(dm, 0, sizeof *dm);
    dm->gpu = gpu != 0;
    if (!dm->gpu) {
        return 0;
    }
    dm->lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (dm->lib == NULL) {
        fprintf(stderr, "device_memory: dlopen(libcuda.so.1): %s\n", dlerror());
        return -1;
    }
    if (dm_sym_(dm, &dm->cuInit, sizeof dm->cuInit, "cuInit") ||
        dm_sym_(dm, &dm->cuDeviceGet, sizeof dm->cuDeviceGet, "cuDeviceGet") ||
        dm_sym_(dm, &dm->cuDevicePrimaryCtxRetain, sizeof dm->cuDevicePrimaryCtxRetain,
                "cuDevicePrimaryCtxRetain") ||
        dm_sym_(dm, &dm->cuCtxSetCurrent, sizeof dm->cuCtxSetCurrent, "cuCtxSetCurrent") ||
        dm_sym_(dm, &dm->cuMemAlloc, sizeof dm->cuMemAlloc, "cuMemAlloc_v2") ||
        dm_sym_(dm, &dm->cuMemFree, sizeof dm->cuMemFree, "cuMemFree_v2") ||
        dm_sym_(dm, &dm->cuMemcpyHtoD, sizeof dm->cuMemcpyHtoD, "cuMemcpyHtoD_v2") ||
        dm_sym_(dm, &dm->cuMemcpyDtoH, sizeof dm->cuMemcpyDtoH, "cuMemcpyDtoH_v2") ||
        dm_sym_(dm, &dm->cuCtxSynchronize, sizeof dm->cuCtxSynchronize, "cuCtxSynchronize")) {
        return -1;
    }
    if (dm_check_(dm->cuInit(0), "cuInit") ||
        dm_check_(dm->cuDeviceGet(&dev, device), "cuDeviceGet") ||
        dm_check_(dm->cuDevicePrimaryCtxRetain(&dm->ctx, dev), "cuDevicePrimaryCtxRetain") ||
        dm_check_(dm->cuCtxSetCurrent(dm->ctx), "cuCtxSetCurrent")) {
        return -1;
    }
    return 0;
}

/* `bytes` of device (or host) memory, or NULL on failure. */
static inline void *dm_alloc(dm_t *dm, size_t bytes) {
    dm_cu_deviceptr ptr = 0;
    void *out = NULL;
    if (bytes == 0) {
        bytes = 1;
    }
    if (!dm->gpu) {
        out = malloc(bytes);
        if (out == NULL) {
            fprintf(stderr, "device_memory: malloc(%zu) failed\n", bytes);
        }
        return out;
    }
    if (dm_check_(dm->cuMemAlloc(&ptr, bytes), "cuMemAlloc_v2")) {
        return NULL;
    }
    memcpy(&out, &ptr, sizeof out);
    return out;
}

static inline void dm_free(dm_t *dm, void *ptr) {
    dm_cu_deviceptr dptr = 0;
    if (ptr == NULL) {
        return;
    }
    if (!dm->gpu) {
        free(ptr);
        return;
    }
    memcpy(&dptr, &ptr, sizeof ptr);
    (void)dm_check_(dm->cuMemFree(dptr), "cuMemFree_v2");
}

/* Copies `bytes` from host `src` to buffer `dst`. */
static inline int dm_to_device(dm_t *dm, void *dst, const void *src, size_t bytes) {
    dm_cu_deviceptr dptr = 0;
    if (bytes == 0) {
        return 0;
    }
    if (!dm->gpu) {
        memcpy(dst, src, bytes);
        return 0;
    }
    memcpy(&dptr, &dst, sizeof dst);
    return dm_check_(dm->cuMemcpyHtoD(dptr, src, bytes), "cuMemcpyHtoD_v2");
}

/* Copies `bytes` from buffer `src` to host `dst` (after the work that
 * writes `src` has completed: see dm_sync). */
static inline int dm_to_host(dm_t *dm, void *dst, const void *src, size_t bytes) {
    dm_cu_deviceptr sptr = 0;
    if (bytes == 0) {
        return 0;
    }
    if (!dm->gpu) {
        memcpy(dst, src, bytes);
        return 0;
    }
    memcpy(&sptr, &src, sizeof src);
    return dm_check_(dm->cuMemcpyDtoH(dst, sptr, bytes), "cuMemcpyDtoH_v2");
}

/* Waits for all work enqueued on the device (a no-op on the host). */
static inline int dm_sync(dm_t *dm) {
    if (!dm->gpu) {
        return 0;
    }
    return dm_check_(dm->cuCtxSynchronize(), "cuCtxSynchronize");
}

#endif /* EP_EXAMPLES_DEVICE_MEMORY_H */
