/*
 * plugin.cu — the CUDA backend plugin: built by nvcc into libmeshdit_cuda.so with the other
 * parts of kernels/cuda (memory, elementwise, GEMM, attention) and comm/nccl.cu, and opened at
 * run time by backend.c; it exports the tables of kernels/ops.h through MDT_BACKEND_ENTRY (and
 * the collectives of comm/device_comm.h through nccl.cu's entry), nothing else. Holds the state
 * the parts share (cuda_common.cuh).
 */
#include "cuda_common.cuh"

namespace mdt_cuda {

cudaStream_t g_stream, g_comm;
cublasHandle_t g_blas;
int g_failed;
char g_err[512];
int64_t g_peak;
int g_dev;

void fail(const char *fmt, ...) {
    if (g_failed)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_err, sizeof g_err, fmt, ap);
    va_end(ap);
    g_failed = 1;
}

int ck(cudaError_t e, const char *what) {
    if (e == cudaSuccess)
        return 0;
    fail("%s: %s", what, cudaGetErrorString(e));
    return -1;
}

void launched(const char *what) { ck(cudaGetLastError(), what); }

} // namespace mdt_cuda

static mdt_device_ops k_dev;
static mdt_kernel_ops k_kern;
static mdt_backend_plugin k_plugin;

extern "C" __attribute__((visibility("default"))) const mdt_backend_plugin *mdt_cuda_backend(void) {
    mdt_cuda::fill_memory(&k_dev);
    k_kern.name = "cuda";
    mdt_cuda::fill_elementwise(&k_dev, &k_kern);
    mdt_cuda::fill_gemm(&k_kern);
    mdt_cuda::fill_attention(&k_kern);
    k_plugin.abi = MDT_BACKEND_ABI, k_plugin.name = "cuda";
    k_plugin.dev = &k_dev, k_plugin.kernels = &k_kern;
    return &k_plugin;
}
