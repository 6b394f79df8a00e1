/*
 * cuda_common.cuh — private to the CUDA plugin (kernels/cuda and comm/nccl.cu): the state every
 * part shares (the compute and communication streams, cuBLAS, the first recorded failure), the
 * failure helpers and the launch-shape helpers. Everything lives in namespace mdt_cuda and is
 * hidden in the shared object (-fvisibility=hidden): the entry points of plugin.cu and
 * comm/nccl.cu are its only exports.
 *
 * Every op is queued on one compute stream (g_stream); the ring exchange runs on a second stream
 * (g_comm) ordered against it with events. Errors of launches are recorded (first one wins) and
 * reported by check(); the plugin never aborts.
 */
#ifndef MDT_KERNELS_CUDA_COMMON_CUH
#define MDT_KERNELS_CUDA_COMMON_CUH

#include "kernels/ops.h"

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

namespace mdt_cuda {

extern cudaStream_t g_stream, g_comm;
extern cublasHandle_t g_blas;
extern int g_failed;
extern char g_err[512];
extern int64_t g_peak;
extern __nv_bfloat16 *g_xh; /* bf16 copy of a GEMM's activations (gemm.cu) */
extern size_t g_xh_n;
extern __nv_bfloat16 *g_kv; /* bf16 K and transposed V of the current attention call */
extern size_t g_kv_n;
extern int g_dev;

/* Records the first failure (printf format); later ones are dropped. */
void fail(const char *fmt, ...);
/* 0, or -1 with the failure recorded as "what: CUDA's message". */
int ck(cudaError_t e, const char *what);
/* Records a failed launch. */
void launched(const char *what);
/* Notes the device memory in use for mem_peak (memory.cu). */
void note_peak(void);

static inline unsigned blocks_for(int64_t n, int threads) {
    int64_t b = (n + threads - 1) / threads;
    return (unsigned)(b < 1 ? 1 : (b > 65535 * 16 ? 65535 * 16 : b));
}

/* Row-wise kernels run on a 2-D grid: x covers the columns of a row, y (and a loop) the rows, so
 * no element index is ever divided (64-bit division costs more than the memory traffic). */
static inline dim3 rows_grid(int64_t M, int64_t N, int threads) {
    const int64_t gx = (N + threads - 1) / threads;
    return dim3((unsigned)(gx < 1 ? 1 : gx), (unsigned)(M < 1 ? 1 : (M < 65535 ? M : 65535)));
}
#define FOR_ROWS(M) for (int64_t r = blockIdx.y; r < (M); r += gridDim.y)
#define COL() ((int64_t)blockIdx.x * blockDim.x + threadIdx.x)

/* Shared between parts (elementwise.cu): dst[M, K] = bf16(src rows ld apart); y += b per row. */
__global__ void k_to_bf16(__nv_bfloat16 *dst, const float *src, int64_t ld, int64_t M, int64_t K);
void be_add_bias(float *y, int64_t ldy, const float *b, int64_t M, int64_t N);

/* Each part fills its slots of the tables (plugin.cu calls them). */
void fill_memory(mdt_device_ops *d);
void fill_elementwise(mdt_device_ops *d, mdt_kernel_ops *k);
void fill_gemm(mdt_kernel_ops *k);
void fill_attention(mdt_kernel_ops *k);

} // namespace mdt_cuda

#endif /* MDT_KERNELS_CUDA_COMMON_CUH */
