/*
 * memory.cu — the CUDA plugin's lifecycle (device start, check, shutdown, description) and memory
 * (device and page-locked host buffers, copies, peak use): the slots of mdt_device_ops.
 */
#include "cuda_common.cuh"

namespace mdt_cuda {

/* ---------------- lifecycle and memory ---------------- */

static int be_init(int ordinal, char *err, size_t errlen) {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0) {
        snprintf(err, errlen, "no CUDA device (cudaGetDeviceCount: %s)",
                 e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
        return -1;
    }
    g_dev = ordinal % n;
    if ((e = cudaSetDevice(g_dev)) != cudaSuccess ||
        (e = cudaStreamCreateWithFlags(&g_stream, cudaStreamNonBlocking)) != cudaSuccess ||
        (e = cudaStreamCreateWithFlags(&g_comm, cudaStreamNonBlocking)) != cudaSuccess) {
        snprintf(err, errlen, "CUDA device %d: %s", g_dev, cudaGetErrorString(e));
        return -1;
    }
    if (cublasCreate(&g_blas) != CUBLAS_STATUS_SUCCESS ||
        cublasSetStream(g_blas, g_stream) != CUBLAS_STATUS_SUCCESS) {
        snprintf(err, errlen, "cuBLAS could not start on device %d", g_dev);
        return -1;
    }
    /* fp32 GEMMs stay fp32 (no TF32): the f32 path is checked at 1e-4 against the CPU */
    cublasSetMathMode(g_blas, CUBLAS_DEFAULT_MATH);
    return 0;
}

static int be_check(char *err, size_t errlen) {
    ck(cudaStreamSynchronize(g_comm), "comm stream");
    ck(cudaStreamSynchronize(g_stream), "compute stream");
    if (g_failed) {
        snprintf(err, errlen, "%s", g_err);
        return -1;
    }
    return 0;
}

static void be_shutdown(void) {
    if (g_blas)
        cublasDestroy(g_blas);
    cudaFree(g_xh);
    g_blas = NULL, g_xh = NULL, g_xh_n = 0;
    cudaFree(g_kv);
    g_kv = NULL, g_kv_n = 0;
}

static int be_device_count(void) {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

static void be_describe(char *buf, size_t n) {
    cudaDeviceProp p;
    if (cudaGetDeviceProperties(&p, g_dev) != cudaSuccess) {
        snprintf(buf, n, "CUDA device %d", g_dev);
        return;
    }
    snprintf(buf, n, "%s (sm_%d%d, %d SMs, %.1f GiB)", p.name, p.major, p.minor,
             p.multiProcessorCount, (double)p.totalGlobalMem / 1073741824.0);
}

static int be_is_device(const void *p) {
    cudaPointerAttributes a;
    if (!p || cudaPointerGetAttributes(&a, p) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
}

void note_peak(void) {
    size_t fr = 0, tot = 0;
    if (cudaMemGetInfo(&fr, &tot) == cudaSuccess && (int64_t)(tot - fr) > g_peak)
        g_peak = (int64_t)(tot - fr);
}

static void *be_alloc(size_t bytes) {
    void *p = NULL;
    if (cudaMalloc(&p, bytes ? bytes : 1) != cudaSuccess) {
        cudaGetLastError(); /* an out-of-memory is reported by the caller, not sticky here */
        return NULL;
    }
    note_peak();
    return p;
}

static void be_free(void *p) {
    if (p)
        ck(cudaFree(p), "cudaFree");
}

static void *be_host_alloc(size_t bytes) {
    void *p = NULL;
    if (cudaMallocHost(&p, bytes ? bytes : 1) != cudaSuccess) {
        cudaGetLastError();
        return NULL;
    }
    return p;
}

static void be_host_free(void *p) {
    if (p)
        ck(cudaFreeHost(p), "cudaFreeHost");
}

static void be_to_device(void *dst, const void *src, size_t bytes) {
    if (!bytes)
        return;
    ck(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, g_stream), "host-to-device copy");
    ck(cudaStreamSynchronize(g_stream), "host-to-device copy");
}

static void be_to_device_async(void *dst, const void *src, size_t bytes) {
    if (bytes)
        ck(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, g_stream),
           "host-to-device copy");
}

static void be_to_host(void *dst, const void *src, size_t bytes) {
    if (!bytes)
        return;
    ck(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, g_stream), "device-to-host copy");
    ck(cudaStreamSynchronize(g_stream), "device-to-host copy");
}

static int64_t be_mem_peak(void) { return g_peak; }

void fill_memory(mdt_device_ops *o) {
    o->init = be_init, o->check = be_check, o->shutdown = be_shutdown, o->describe = be_describe;
    o->device_count = be_device_count;
    o->is_device = be_is_device, o->alloc = be_alloc, o->free = be_free;
    o->host_alloc = be_host_alloc, o->host_free = be_host_free;
    o->to_device = be_to_device, o->to_device_async = be_to_device_async, o->to_host = be_to_host;
    o->mem_peak = be_mem_peak;
}

} // namespace mdt_cuda
