/*
 * backend_cuda.cu — the CUDA backend: device memory, cuBLAS GEMMs (fp32, and bf16 weights with
 * fp32 accumulation), fused elementwise kernels, two attention kernels (fp32 with warp-per-row
 * online softmax; bf16 tensor-core flash attention via WMMA with fp32 accumulation and fp32
 * softmax) and NCCL collectives. Built by nvcc into libmeshdit_cuda.so and opened at run time by
 * backend.c; it fills the ops table of backend/ops.h and nothing else is exported. NCCL is opened
 * with dlopen on first use (libnccl.so.2), so the plugin loads on machines without it and the
 * collectives then fall back to the host-staged MPI path.
 *
 * Every op is queued on one compute stream (g_stream); the ring exchange runs on a second stream
 * (g_comm) ordered against it with events. Errors of launches are recorded (first one wins) and
 * reported by check(); the library never aborts.
 */
#include "backend/ops.h"

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <dlfcn.h>
#include <math.h>
#include <stdlib.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

using namespace nvcuda;

static cudaStream_t g_stream, g_comm;
static cublasHandle_t g_blas;
static int g_failed;
static char g_err[512];
static int64_t g_peak;
static __nv_bfloat16 *g_xh; /* bf16 copy of a GEMM's activations */
static __nv_bfloat16 *g_kv; /* bf16 K and transposed V of the current attention call */
static size_t g_kv_n;
static size_t g_xh_n;
static int g_dev;

static void fail(const char *fmt, ...) {
    if (g_failed)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_err, sizeof g_err, fmt, ap);
    va_end(ap);
    g_failed = 1;
}

static int ck(cudaError_t e, const char *what) {
    if (e == cudaSuccess)
        return 0;
    fail("%s: %s", what, cudaGetErrorString(e));
    return -1;
}

static void launched(const char *what) { ck(cudaGetLastError(), what); }

static unsigned blocks_for(int64_t n, int threads) {
    int64_t b = (n + threads - 1) / threads;
    return (unsigned)(b < 1 ? 1 : (b > 65535 * 16 ? 65535 * 16 : b));
}

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

static void note_peak(void) {
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

/* ---------------- data movement and elementwise kernels ---------------- */

/* Row-wise kernels run on a 2-D grid: x covers the columns of a row, y (and a loop) the rows, so
 * no element index is ever divided (64-bit division costs more than the memory traffic). */
static dim3 rows_grid(int64_t M, int64_t N, int threads) {
    const int64_t gx = (N + threads - 1) / threads;
    return dim3((unsigned)(gx < 1 ? 1 : gx), (unsigned)(M < 1 ? 1 : (M < 65535 ? M : 65535)));
}
#define FOR_ROWS(M) for (int64_t r = blockIdx.y; r < (M); r += gridDim.y)
#define COL() ((int64_t)blockIdx.x * blockDim.x + threadIdx.x)

static void be_copy2d(float *dst, int64_t ldd, const float *src, int64_t lds, int64_t rows,
                      int64_t cols) {
    if (rows == 1)
        ck(cudaMemcpyAsync(dst, src, sizeof(float) * cols, cudaMemcpyDeviceToDevice, g_stream),
           "copy");
    else
        ck(cudaMemcpy2DAsync(dst, sizeof(float) * ldd, src, sizeof(float) * lds,
                             sizeof(float) * cols, rows, cudaMemcpyDeviceToDevice, g_stream),
           "copy2d");
}

__global__ void k_copy_rows(float *dst, int64_t ldd, const int64_t *drow, const float *src,
                            int64_t lds, const int64_t *srow, int64_t n, int64_t w) {
    for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
        const float *s = src + (srow ? srow[i] : i) * lds;
        float *d = dst + (drow ? drow[i] : i) * ldd;
        for (int64_t c = threadIdx.x; c < w; c += blockDim.x)
            d[c] = s[c];
    }
}

static void be_copy_rows(float *dst, int64_t ldd, const int64_t *drow, const float *src,
                         int64_t lds, const int64_t *srow, int64_t n, int64_t w) {
    k_copy_rows<<<(unsigned)(n < 65535 ? n : 65535), 128, 0, g_stream>>>(dst, ldd, drow, src, lds,
                                                                         srow, n, w);
    launched("copy_rows");
}

__global__ void k_fill(float *x, int64_t n, float v) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        x[i] = v;
}

static void be_fill(float *x, int64_t n, float v) {
    k_fill<<<blocks_for(n, 256), 256, 0, g_stream>>>(x, n, v);
    launched("fill");
}

__global__ void k_add(float *y, const float *x, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        y[i] += x[i];
}

static void be_add(float *y, const float *x, int64_t n) {
    k_add<<<blocks_for(n, 256), 256, 0, g_stream>>>(y, x, n);
    launched("add");
}

__global__ void k_add_bias(float *y, int64_t ldy, const float *b, int64_t M, int64_t N) {
    const int64_t c = COL();
    if (c < N)
        FOR_ROWS(M) y[r * ldy + c] += b[c];
}

static void be_add_bias(float *y, int64_t ldy, const float *b, int64_t M, int64_t N) {
    k_add_bias<<<rows_grid(M, N, 256), 256, 0, g_stream>>>(y, ldy, b, M, N);
    launched("add_bias");
}

__global__ void k_to_bf16(__nv_bfloat16 *dst, const float *src, int64_t ld, int64_t M, int64_t K) {
    const int64_t c = COL();
    if (c < K)
        FOR_ROWS(M) dst[r * K + c] = __float2bfloat16_rn(src[r * ld + c]);
}

static void be_to_bf16(uint16_t *dst, const float *src, int64_t n) {
    for (int64_t off = 0; off < n; off += (int64_t)1 << 30) { /* one row of at most 2^30 */
        const int64_t len = n - off < ((int64_t)1 << 30) ? n - off : ((int64_t)1 << 30);
        k_to_bf16<<<rows_grid(1, len, 256), 256, 0, g_stream>>>((__nv_bfloat16 *)dst + off,
                                                                src + off, len, 1, len);
    }
    launched("to_bf16");
}

__global__ void k_angle_table(const float *pos, int64_t ldpos, int64_t S, int64_t ncols,
                              const int32_t *col_axis, const double *col_freq, int dbl,
                              float *cos_t, float *sin_t) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < S * ncols;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t s = i / ncols, c = i % ncols;
        const float p = pos[s * ldpos + col_axis[c]];
        if (dbl) {
            const double a = (double)p * col_freq[c];
            cos_t[i] = (float)cos(a), sin_t[i] = (float)sin(a);
        } else {
            const float a = p * (float)col_freq[c];
            cos_t[i] = cosf(a), sin_t[i] = sinf(a);
        }
    }
}

static void be_angle_table(const float *pos, int64_t ldpos, int64_t S, int64_t ncols,
                           const int32_t *col_axis, const double *col_freq, int dbl, float *cos_t,
                           float *sin_t) {
    k_angle_table<<<blocks_for(S * ncols, 256), 256, 0, g_stream>>>(pos, ldpos, S, ncols, col_axis,
                                                                     col_freq, dbl, cos_t, sin_t);
    launched("angle_table");
}

__device__ __forceinline__ float silu_f(float x) { return x / (1.0f + expf(-x)); }
__device__ __forceinline__ float gelu_f(float v) {
    const float u = 0.7978845608028654f * (v + 0.044715f * v * v * v);
    return 0.5f * v * (1.0f + tanhf(u));
}

__global__ void k_silu(float *x, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        x[i] = silu_f(x[i]);
}

static void be_silu(float *x, int64_t n) {
    k_silu<<<blocks_for(n, 256), 256, 0, g_stream>>>(x, n);
    launched("silu");
}

__global__ void k_gelu_rows(float *x, int64_t ld, int64_t M, int64_t n) {
    const int64_t c = COL();
    if (c < n)
        FOR_ROWS(M) x[r * ld + c] = gelu_f(x[r * ld + c]);
}

static void be_gelu_rows(float *x, int64_t ld, int64_t M, int64_t n) {
    k_gelu_rows<<<rows_grid(M, n, 256), 256, 0, g_stream>>>(x, ld, M, n);
    launched("gelu");
}

__global__ void k_swiglu(const float *in, float *out, int64_t M, int64_t n) {
    const int64_t j = COL();
    if (j < n)
        FOR_ROWS(M) out[r * n + j] = in[r * 2 * n + j] * silu_f(in[r * 2 * n + n + j]);
}

static void be_swiglu(const float *in, float *out, int64_t M, int64_t n) {
    k_swiglu<<<rows_grid(M, n, 256), 256, 0, g_stream>>>(in, out, M, n);
    launched("swiglu");
}

__global__ void k_gate_residual(float *x, const float *y, int64_t ldy, const float *gate,
                                int64_t M, int64_t C) {
    const int64_t c = COL();
    if (c < C)
        FOR_ROWS(M) x[r * C + c] += gate[c] * y[r * ldy + c];
}

static void be_gate_residual(float *x, const float *y, int64_t ldy, const float *gate, int64_t M,
                             int64_t C) {
    k_gate_residual<<<rows_grid(M, C, 256), 256, 0, g_stream>>>(x, y, ldy, gate, M, C);
    launched("gate_residual");
}

__global__ void k_gate_residual_rows(float *x, const float *y, int64_t ldy, const float *table,
                                     int64_t ld, const int64_t *idx, int64_t gate_off, int64_t M,
                                     int64_t C) {
    const int64_t c = COL();
    if (c < C)
        FOR_ROWS(M) x[r * C + c] += table[idx[r] * ld + gate_off + c] * y[r * ldy + c];
}

static void be_gate_residual_rows(float *x, const float *y, int64_t ldy, const float *table,
                                  int64_t ld, const int64_t *idx, int64_t gate_off, int64_t M,
                                  int64_t C) {
    k_gate_residual_rows<<<rows_grid(M, C, 256), 256, 0, g_stream>>>(x, y, ldy, table, ld, idx,
                                                                      gate_off, M, C);
    launched("gate_residual_rows");
}

__global__ void k_modulate_rows(float *y, int64_t M, int64_t C, const float *table, int64_t ld,
                                const int64_t *idx, int64_t shift_off, int64_t scale_off) {
    const int64_t c = COL();
    if (c < C)
        FOR_ROWS(M) {
            const float *t = table + idx[r] * ld;
            y[r * C + c] = y[r * C + c] * (1.0f + t[scale_off + c]) + t[shift_off + c];
        }
}

static void be_modulate_rows(float *y, int64_t M, int64_t C, const float *table, int64_t ld,
                             const int64_t *idx, int64_t shift_off, int64_t scale_off) {
    k_modulate_rows<<<rows_grid(M, C, 256), 256, 0, g_stream>>>(y, M, C, table, ld, idx,
                                                                 shift_off, scale_off);
    launched("modulate_rows");
}

/* Block-wide sum of one float per thread (blockDim.x a multiple of 32, at most 1024). */
__device__ float block_sum(float v) {
    __shared__ float part[32];
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    const int w = threadIdx.x / 32, l = threadIdx.x % 32;
    __syncthreads(); /* part[] may still be read by a previous call */
    if (l == 0)
        part[w] = v;
    __syncthreads();
    float t = 0.0f;
    for (int i = 0; i < (int)(blockDim.x / 32); i++)
        t += part[i];
    return t;
}

/* LayerNorm (no affine) then optional modulation; one block per row. */
__global__ void k_layernorm_modulate(const float *x, float *y, int64_t C, float eps,
                                     const float *shift, const float *scale) {
    const float *xr = x + blockIdx.x * C;
    float *yr = y + blockIdx.x * C;
    float s = 0.0f;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x)
        s += xr[c];
    const float mean = block_sum(s) / (float)C;
    float v = 0.0f;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x)
        v += (xr[c] - mean) * (xr[c] - mean);
    const float inv = rsqrtf(block_sum(v) / (float)C + eps);
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
        float o = (xr[c] - mean) * inv;
        yr[c] = shift && scale ? o * (1.0f + scale[c]) + shift[c] : o;
    }
}

static void be_layernorm_modulate(const float *x, float *y, int64_t M, int64_t C, float eps,
                                  const float *shift, const float *scale) {
    k_layernorm_modulate<<<(unsigned)M, 256, 0, g_stream>>>(x, y, C, eps, shift, scale);
    launched("layernorm_modulate");
}

__global__ void k_rmsnorm(const float *x, const float *w, float *y, int64_t C, float eps) {
    const float *xr = x + blockIdx.x * C;
    float *yr = y + blockIdx.x * C;
    float s = 0.0f;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x)
        s += xr[c] * xr[c];
    const float inv = rsqrtf(block_sum(s) / (float)C + eps);
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x)
        yr[c] = w ? xr[c] * inv * w[c] : xr[c] * inv;
}

static void be_rmsnorm(const float *x, const float *w, float *y, int64_t M, int64_t C, float eps) {
    k_rmsnorm<<<(unsigned)M, 256, 0, g_stream>>>(x, w, y, C, eps);
    launched("rmsnorm");
}

/* One warp per (token, head): optional RMSNorm over D, optional RoPE, written head-major. */
__global__ void k_heads_prepare(const float *src, int64_t ld, int64_t S, int64_t H, int64_t D,
                                const float *norm_w, float eps, const float *cos_t,
                                const float *sin_t, int64_t rot, int half_rope, float *dst,
                                int64_t Sdst, int64_t s0) {
    extern __shared__ float sh[];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int64_t item = (int64_t)blockIdx.x * (blockDim.x / 32) + warp;
    if (item >= S * H)
        return;
    const int64_t s = item / H, h = item % H;
    float *v = sh + warp * D;
    const float *x = src + s * ld + h * D;
    float ss = 0.0f;
    for (int64_t d = lane; d < D; d += 32) {
        v[d] = x[d];
        ss += v[d] * v[d];
    }
    for (int o = 16; o > 0; o >>= 1)
        ss += __shfl_xor_sync(0xffffffffu, ss, o);
    const float inv = norm_w ? rsqrtf(ss / (float)D + eps) : 1.0f;
    __syncwarp();
    if (norm_w)
        for (int64_t d = lane; d < D; d += 32)
            v[d] = v[d] * inv * norm_w[d];
    __syncwarp();
    float *o = dst + (h * Sdst + s0 + s) * D;
    const float *c = cos_t ? cos_t + s * rot : NULL, *sn = sin_t ? sin_t + s * rot : NULL;
    for (int64_t d = lane; d < D; d += 32) {
        float r = v[d];
        if (c && d < rot) {
            if (!half_rope) {
                const int64_t m = d & ~(int64_t)1;
                r = (d & 1) ? v[m + 1] * c[d] + v[m] * sn[d] : v[m] * c[d] - v[m + 1] * sn[d];
            } else {
                const int64_t hf = rot / 2;
                r = d < hf ? v[d] * c[d] - v[d + hf] * sn[d] : v[d] * c[d] + v[d - hf] * sn[d];
            }
        }
        o[d] = r;
    }
}

static void be_heads_prepare(const float *src, int64_t ld, int64_t S, int64_t H, int64_t D,
                             const float *norm_w, float eps, const float *cos_t,
                             const float *sin_t, int64_t rot, int half_rope, float *dst,
                             int64_t Sdst, int64_t s0) {
    const int warps = 4;
    const int64_t items = S * H;
    const size_t shm = sizeof(float) * (size_t)(warps * D);
    if (shm > 48 * 1024) {
        fail("heads_prepare: head dim %lld is too large", (long long)D);
        return;
    }
    k_heads_prepare<<<(unsigned)((items + warps - 1) / warps), 32 * warps, shm, g_stream>>>(
        src, ld, S, H, D, norm_w, eps, cos_t, sin_t, rot, half_rope, dst, Sdst, s0);
    launched("heads_prepare");
}

/* ---------------- GEMM ---------------- */

/* y[M, N] = x[M, K] w[N, K]^T (+ b): column-major y^T = w^T... i.e. C(N x M) = op(W) X. */
static void be_linear(const float *x, int64_t ldx, const float *w, const uint16_t *wh,
                      const float *b, float *y, int64_t ldy, int64_t M, int64_t K, int64_t N) {
    const float one = 1.0f, zero = 0.0f;
    cublasStatus_t st;
    if (wh) {
        const size_t need = (size_t)(M * K);
        if (need > g_xh_n) {
            cudaFree(g_xh);
            g_xh = NULL, g_xh_n = 0;
            if (ck(cudaMalloc(&g_xh, need * 2), "bf16 activation scratch"))
                return;
            g_xh_n = need;
            note_peak();
        }
        k_to_bf16<<<rows_grid(M, K, 256), 256, 0, g_stream>>>(g_xh, x, ldx, M, K);
        launched("linear: to bf16");
        st = cublasGemmEx(g_blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)N, (int)M, (int)K, &one, wh,
                          CUDA_R_16BF, (int)K, g_xh, CUDA_R_16BF, (int)K, &zero, y, CUDA_R_32F,
                          (int)ldy, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    } else {
        st = cublasSgemm(g_blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)N, (int)M, (int)K, &one, w, (int)K,
                         x, (int)ldx, &zero, y, (int)ldy);
    }
    if (st != CUBLAS_STATUS_SUCCESS)
        fail("cuBLAS GEMM (M=%lld K=%lld N=%lld) failed with status %d", (long long)M,
             (long long)K, (long long)N, (int)st);
    if (b)
        be_add_bias(y, ldy, b, M, N);
}

/* ---------------- attention ---------------- */

/* fp32: one warp per query row (lanes split D), key tiles of ATT_BK rows in shared memory. */
#define ATT_BK 32
#define ATT_ROWS 8
template <int NT>
__global__ void k_attn_f32(const float *q, const float *k, const float *v, float *out,
                           int64_t ld_out, float *lse, int64_t Sq, int64_t Sk, int64_t skv,
                           int64_t D, float scale) {
    extern __shared__ float kv[]; /* [ATT_BK][D] keys, then [ATT_BK][D] values */
    const int h = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int64_t row = (int64_t)blockIdx.x * ATT_ROWS + warp;
    const float *qh = q + (int64_t)h * Sq * D, *kh = k + (int64_t)h * Sk * D,
                *vh = v + (int64_t)h * Sk * D;
    float qr[NT], acc[NT];
    for (int t = 0; t < NT; t++) {
        const int64_t d = lane + 32 * t;
        qr[t] = row < Sq && d < D ? qh[row * D + d] * scale : 0.0f;
        acc[t] = 0.0f;
    }
    float m = -INFINITY, l = 0.0f;
    for (int64_t j0 = 0; j0 < skv; j0 += ATT_BK) {
        const int64_t nj = skv - j0 < ATT_BK ? skv - j0 : ATT_BK;
        __syncthreads();
        for (int64_t i = threadIdx.x; i < nj * D; i += blockDim.x) {
            kv[i] = kh[j0 * D + i];
            kv[ATT_BK * D + i] = vh[j0 * D + i];
        }
        __syncthreads();
        if (row >= Sq)
            continue;
        for (int64_t j = 0; j < nj; j++) {
            float s = 0.0f;
            for (int t = 0; t < NT; t++) {
                const int64_t d = lane + 32 * t;
                s += d < D ? qr[t] * kv[j * D + d] : 0.0f;
            }
            for (int o = 16; o > 0; o >>= 1)
                s += __shfl_xor_sync(0xffffffffu, s, o);
            const float mn = fmaxf(m, s), al = expf(m - mn), p = expf(s - mn);
            l = l * al + p;
            for (int t = 0; t < NT; t++) {
                const int64_t d = lane + 32 * t;
                acc[t] = acc[t] * al + (d < D ? p * kv[ATT_BK * D + j * D + d] : 0.0f);
            }
            m = mn;
        }
    }
    if (row >= Sq)
        return;
    const float il = l > 0.0f ? 1.0f / l : 0.0f;
    for (int t = 0; t < NT; t++) {
        const int64_t d = lane + 32 * t;
        if (d < D)
            out[row * ld_out + (int64_t)h * D + d] = acc[t] * il;
    }
    if (lse && lane == 0)
        lse[(int64_t)h * Sq + row] = l > 0.0f ? m + logf(l) : -INFINITY;
}

/* bf16 tensor cores (WMMA 16x16x16, fp32 accumulation): a block of 4 warps takes 64 query rows
 * (16 per warp) and streams 64-key tiles of K and V through shared memory; scores, the online
 * softmax (fp32) and the running output live in shared memory per warp. */
#define FA_BQ 64
#define FA_BK 64
template <int D>
__global__ void __launch_bounds__(128)
    k_attn_bf16(const float *q, const float *k, const float *v, float *out, int64_t ld_out,
                float *lse, int64_t Sq, int64_t Sk, int64_t skv, float scale) {
    extern __shared__ __align__(128) unsigned char smem[];
    __nv_bfloat16 *Qs = (__nv_bfloat16 *)smem;             /* [FA_BQ][D] */
    __nv_bfloat16 *Ks = Qs + FA_BQ * D;                    /* [FA_BK][D] */
    __nv_bfloat16 *Vs = Ks + FA_BK * D;                    /* [FA_BK][D] */
    float *Ss = (float *)(Vs + FA_BK * D);                 /* [4][16][FA_BK] */
    __nv_bfloat16 *Ps = (__nv_bfloat16 *)(Ss + 4 * 16 * FA_BK); /* [4][16][FA_BK] */
    float *Os = (float *)(Ps + 4 * 16 * FA_BK);            /* [4][16][D] */
    float *Ms = Os + 4 * 16 * D, *Ls = Ms + FA_BQ, *As = Ls + FA_BQ; /* [FA_BQ] each */
    const int h = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int64_t q0 = (int64_t)blockIdx.x * FA_BQ;
    const float *qh = q + (int64_t)h * Sq * D, *kh = k + (int64_t)h * Sk * D,
                *vh = v + (int64_t)h * Sk * D;
    for (int i = threadIdx.x; i < FA_BQ * D; i += blockDim.x) {
        const int64_t r = q0 + i / D;
        Qs[i] = __float2bfloat16_rn(r < Sq ? qh[r * D + i % D] : 0.0f);
    }
    for (int i = threadIdx.x; i < 4 * 16 * D; i += blockDim.x)
        Os[i] = 0.0f;
    if (threadIdx.x < FA_BQ)
        Ms[threadIdx.x] = -INFINITY, Ls[threadIdx.x] = 0.0f;
    float *S_w = Ss + warp * 16 * FA_BK, *O_w = Os + warp * 16 * D;
    __nv_bfloat16 *P_w = Ps + warp * 16 * FA_BK;
    for (int64_t j0 = 0; j0 < skv; j0 += FA_BK) {
        __syncthreads();
        for (int i = threadIdx.x; i < FA_BK * D; i += blockDim.x) {
            const int64_t r = j0 + i / D;
            const bool ok = r < skv;
            Ks[i] = __float2bfloat16_rn(ok ? kh[r * D + i % D] : 0.0f);
            Vs[i] = __float2bfloat16_rn(ok ? vh[r * D + i % D] : 0.0f);
        }
        __syncthreads();
        /* S_w [16, FA_BK] = Q_w K^T */
        for (int nt = 0; nt < FA_BK / 16; nt++) {
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> c;
            wmma::fill_fragment(c, 0.0f);
            for (int kk = 0; kk < D / 16; kk++) {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> a;
                wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> bm;
                wmma::load_matrix_sync(a, Qs + warp * 16 * D + kk * 16, D);
                wmma::load_matrix_sync(bm, Ks + nt * 16 * D + kk * 16, D);
                wmma::mma_sync(c, a, bm, c);
            }
            wmma::store_matrix_sync(S_w + nt * 16, c, FA_BK, wmma::mem_row_major);
        }
        __syncwarp();
        /* online softmax, two lanes per row (32 keys each) */
        {
            const int r = lane / 2, half = lane % 2, rr = warp * 16 + r;
            float mx = -INFINITY;
            for (int j = half * 32; j < half * 32 + 32; j++) {
                const float s = j0 + j < skv ? S_w[r * FA_BK + j] * scale : -INFINITY;
                S_w[r * FA_BK + j] = s;
                mx = fmaxf(mx, s);
            }
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            const float mo = Ms[rr], mn = fmaxf(mo, mx);
            float sum = 0.0f;
            for (int j = half * 32; j < half * 32 + 32; j++) {
                const float p = mn == -INFINITY ? 0.0f : expf(S_w[r * FA_BK + j] - mn);
                const __nv_bfloat16 pb = __float2bfloat16_rn(p);
                P_w[r * FA_BK + j] = pb;
                sum += __bfloat162float(pb); /* the denominator of exactly the weights used */
            }
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            const float al = mn == -INFINITY ? 1.0f : expf(mo - mn);
            __syncwarp();
            if (half == 0) {
                Ls[rr] = Ls[rr] * al + sum;
                Ms[rr] = mn;
                As[rr] = al;
            }
        }
        __syncwarp();
        for (int i = lane; i < 16 * D; i += 32)
            O_w[i] *= As[warp * 16 + i / D];
        __syncwarp();
        /* O_w [16, D] += P_w V */
        for (int dt = 0; dt < D / 16; dt++) {
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> c;
            wmma::load_matrix_sync(c, O_w + dt * 16, D, wmma::mem_row_major);
            for (int kk = 0; kk < FA_BK / 16; kk++) {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> a;
                wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::row_major> bm;
                wmma::load_matrix_sync(a, P_w + kk * 16, FA_BK);
                wmma::load_matrix_sync(bm, Vs + kk * 16 * D + dt * 16, D);
                wmma::mma_sync(c, a, bm, c);
            }
            wmma::store_matrix_sync(O_w + dt * 16, c, D, wmma::mem_row_major);
        }
        __syncwarp();
    }
    __syncthreads();
    for (int i = threadIdx.x; i < FA_BQ * D; i += blockDim.x) {
        const int r = i / D;
        const int64_t row = q0 + r;
        if (row < Sq) {
            const float l = Ls[r];
            out[row * ld_out + (int64_t)h * D + i % D] = l > 0.0f ? Os[i] / l : 0.0f;
        }
    }
    if (lse && threadIdx.x < FA_BQ && q0 + threadIdx.x < Sq) {
        const float l = Ls[threadIdx.x];
        lse[(int64_t)h * Sq + q0 + threadIdx.x] = l > 0.0f ? Ms[threadIdx.x] + logf(l) : -INFINITY;
    }
}

template <int D> static size_t fa_smem(void) {
    return sizeof(__nv_bfloat16) * (FA_BQ * D + 2 * FA_BK * D + 4 * 16 * FA_BK) +
           sizeof(float) * (4 * 16 * FA_BK + 4 * 16 * D + 3 * FA_BQ);
}

template <int D>
static int launch_bf16(const float *q, const float *k, const float *v, float *out, int64_t ld_out,
                       float *lse, int64_t H, int64_t Sq, int64_t Sk, int64_t skv, float scale) {
    static int configured;
    const size_t shm = fa_smem<D>();
    if (!configured) {
        if (ck(cudaFuncSetAttribute(k_attn_bf16<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    (int)shm),
               "flash attention shared memory"))
            return -1;
        configured = 1;
    }
    dim3 grid((unsigned)((Sq + FA_BQ - 1) / FA_BQ), (unsigned)H);
    k_attn_bf16<D><<<grid, 128, shm, g_stream>>>(q, k, v, out, ld_out, lse, Sq, Sk, skv, scale);
    launched("flash attention (bf16)");
    return 0;
}


/* bf16 flash attention on mma.sync (m16n8k16, fp32 accumulation), FlashAttention-2 style: a block
 * of 8 warps takes 128 query rows (16 per warp, Q held in registers as A fragments, pre-scaled by
 * scale x log2 e); 64-key tiles of K (row-major) and V (transposed, so both B operands are
 * contiguous pairs) pass through shared memory, double-buffered with cp.async so the next tile
 * loads while this one is computed; scores, the online softmax and the output stay
 * in registers: the score accumulators are re-packed in place as the A operand of P V. K and V
 * are first converted to bf16 (V transposed) into the plugin's scratch, padded to 64 keys. */
#define MA_BQ 128
#define MA_BK 64
#define MA_PAD 8

__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
                 "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *(uint32_t *)&v;
}

/* K [H, Sk, D] f32 -> Kb [H, Skp, D] bf16; V -> Vt [H, D, Skp] bf16 (keys >= Sk zero). */
__global__ void k_kv_to_bf16(const float *k, const float *v, __nv_bfloat16 *kb, __nv_bfloat16 *vt,
                             int64_t Sk, int64_t Skp, int64_t D) {
    __shared__ float tile[32][33];
    const int64_t h = blockIdx.z, j0 = (int64_t)blockIdx.x * 32, d0 = (int64_t)blockIdx.y * 32;
    const float *kh = k + h * Sk * D, *vh = v + h * Sk * D;
    for (int i = threadIdx.y; i < 32; i += blockDim.y) {
        const int64_t j = j0 + i, d = d0 + threadIdx.x;
        const bool ok = j < Sk;
        kb[(h * Skp + j) * D + d] = __float2bfloat16_rn(ok ? kh[j * D + d] : 0.0f);
        tile[i][threadIdx.x] = ok ? vh[j * D + d] : 0.0f;
    }
    __syncthreads();
    for (int i = threadIdx.y; i < 32; i += blockDim.y)
        vt[(h * D + d0 + i) * Skp + j0 + threadIdx.x] = __float2bfloat16_rn(tile[threadIdx.x][i]);
}

__device__ __forceinline__ void cp_async16(void *smem, const void *gmem) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(a), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit(void) { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait(void) {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

template <int D> struct ma_tile {
    __nv_bfloat16 k[MA_BK][D + MA_PAD]; /* keys, row-major */
    __nv_bfloat16 v[D][MA_BK + MA_PAD]; /* values, transposed */
};

/* Starts the asynchronous copy of key tile j0 into `t` (16-byte pieces, no registers). */
template <int D>
__device__ __forceinline__ void ma_load(ma_tile<D> *t, const __nv_bfloat16 *kh,
                                        const __nv_bfloat16 *vh, int64_t Skp, int64_t j0) {
    for (int i = threadIdx.x; i < MA_BK * D / 8; i += blockDim.x) {
        const int r = i / (D / 8), c = (i % (D / 8)) * 8;
        cp_async16(&t->k[r][c], &kh[(j0 + r) * D + c]);
    }
    for (int i = threadIdx.x; i < D * MA_BK / 8; i += blockDim.x) {
        const int r = i / (MA_BK / 8), c = (i % (MA_BK / 8)) * 8;
        cp_async16(&t->v[r][c], &vh[(int64_t)r * Skp + j0 + c]);
    }
    cp_async_commit();
}

template <int D>
__global__ void __launch_bounds__(256)
    k_attn_mma(const float *q, const __nv_bfloat16 *kb, const __nv_bfloat16 *vt, float *out,
               int64_t ld_out, float *lse, int64_t Sq, int64_t Skp, int64_t skv, float qscale) {
    extern __shared__ __align__(16) unsigned char ma_smem[];
    ma_tile<D> *tiles = (ma_tile<D> *)ma_smem; /* two: the next tile loads while one is used */
    const int h = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    const int64_t r0 = (int64_t)blockIdx.x * MA_BQ + warp * 16 + g, r1 = r0 + 8;
    const float *qh = q + (int64_t)h * Sq * D;
    const __nv_bfloat16 *kh = kb + (int64_t)h * Skp * D, *vh = vt + (int64_t)h * D * Skp;
    if (skv > 0)
        ma_load<D>(&tiles[0], kh, vh, Skp, 0);
    uint32_t qa[D / 16][4];
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++) {
        const int c = kk * 16 + 2 * t;
        float x[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        if (r0 < Sq)
            x[0] = qh[r0 * D + c], x[1] = qh[r0 * D + c + 1], x[4] = qh[r0 * D + c + 8],
            x[5] = qh[r0 * D + c + 9];
        if (r1 < Sq)
            x[2] = qh[r1 * D + c], x[3] = qh[r1 * D + c + 1], x[6] = qh[r1 * D + c + 8],
            x[7] = qh[r1 * D + c + 9];
        qa[kk][0] = pack_bf16(x[0] * qscale, x[1] * qscale);
        qa[kk][1] = pack_bf16(x[2] * qscale, x[3] * qscale);
        qa[kk][2] = pack_bf16(x[4] * qscale, x[5] * qscale);
        qa[kk][3] = pack_bf16(x[6] * qscale, x[7] * qscale);
    }
    float o[D / 8][4];
#pragma unroll
    for (int i = 0; i < D / 8; i++)
        o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;
    int buf = 0;
    for (int64_t j0 = 0; j0 < skv; j0 += MA_BK, buf ^= 1) {
        if (j0 + MA_BK < skv) { /* the next tile flies while this one is computed */
            ma_load<D>(&tiles[buf ^ 1], kh, vh, Skp, j0 + MA_BK);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        __nv_bfloat16(*Ks)[D + MA_PAD] = tiles[buf].k;
        __nv_bfloat16(*Vs)[MA_BK + MA_PAD] = tiles[buf].v;
    float sc[MA_BK / 8][4];
#pragma unroll
        for (int nt = 0; nt < MA_BK / 8; nt++) {
            sc[nt][0] = sc[nt][1] = sc[nt][2] = sc[nt][3] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < D / 16; kk++) {
                const uint32_t b0 = *(const uint32_t *)&Ks[nt * 8 + g][kk * 16 + 2 * t];
                const uint32_t b1 = *(const uint32_t *)&Ks[nt * 8 + g][kk * 16 + 8 + 2 * t];
                mma_bf16(sc[nt], qa[kk], b0, b1);
            }
        }
        float mx0 = m0, mx1 = m1;
#pragma unroll
        for (int nt = 0; nt < MA_BK / 8; nt++) {
            const int64_t j = j0 + nt * 8 + 2 * t;
            if (j >= skv)
                sc[nt][0] = sc[nt][2] = -INFINITY;
            if (j + 1 >= skv)
                sc[nt][1] = sc[nt][3] = -INFINITY;
            mx0 = fmaxf(mx0, fmaxf(sc[nt][0], sc[nt][1]));
            mx1 = fmaxf(mx1, fmaxf(sc[nt][2], sc[nt][3]));
        }
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
        const float a0 = m0 == -INFINITY ? 0.0f : exp2f(m0 - mx0);
        const float a1 = m1 == -INFINITY ? 0.0f : exp2f(m1 - mx1);
        m0 = mx0, m1 = mx1;
        l0 *= a0, l1 *= a1;
#pragma unroll
        for (int i = 0; i < D / 8; i++)
            o[i][0] *= a0, o[i][1] *= a0, o[i][2] *= a1, o[i][3] *= a1;
        uint32_t pa[MA_BK / 16][4];
#pragma unroll
        for (int nt = 0; nt < MA_BK / 8; nt++) {
            const float p0 = mx0 == -INFINITY ? 0.0f : exp2f(sc[nt][0] - mx0);
            const float p1 = mx0 == -INFINITY ? 0.0f : exp2f(sc[nt][1] - mx0);
            const float p2 = mx1 == -INFINITY ? 0.0f : exp2f(sc[nt][2] - mx1);
            const float p3 = mx1 == -INFINITY ? 0.0f : exp2f(sc[nt][3] - mx1);
            l0 += p0 + p1, l1 += p2 + p3;
            pa[nt / 2][(nt % 2) * 2 + 0] = pack_bf16(p0, p1);
            pa[nt / 2][(nt % 2) * 2 + 1] = pack_bf16(p2, p3);
        }
#pragma unroll
        for (int dt = 0; dt < D / 8; dt++)
#pragma unroll
            for (int kk = 0; kk < MA_BK / 16; kk++) {
                const uint32_t b0 = *(const uint32_t *)&Vs[dt * 8 + g][kk * 16 + 2 * t];
                const uint32_t b1 = *(const uint32_t *)&Vs[dt * 8 + g][kk * 16 + 8 + 2 * t];
                mma_bf16(o[dt], pa[kk], b0, b1);
            }
        __syncthreads(); /* every warp is done with this buffer before it is refilled */
    }
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    const float i0 = l0 > 0.0f ? 1.0f / l0 : 0.0f, i1 = l1 > 0.0f ? 1.0f / l1 : 0.0f;
#pragma unroll
    for (int dt = 0; dt < D / 8; dt++) {
        const int64_t c = (int64_t)h * D + dt * 8 + 2 * t;
        if (r0 < Sq)
            *(float2 *)&out[r0 * ld_out + c] = make_float2(o[dt][0] * i0, o[dt][1] * i0);
        if (r1 < Sq)
            *(float2 *)&out[r1 * ld_out + c] = make_float2(o[dt][2] * i1, o[dt][3] * i1);
    }
    if (lse && t == 0) {
        const float ln2 = 0.69314718055994531f;
        if (r0 < Sq)
            lse[(int64_t)h * Sq + r0] = l0 > 0.0f ? m0 * ln2 + logf(l0) : -INFINITY;
        if (r1 < Sq)
            lse[(int64_t)h * Sq + r1] = l1 > 0.0f ? m1 * ln2 + logf(l1) : -INFINITY;
    }
}


template <int D>
static void launch_mma(const float *q, const float *k, const float *v, float *out, int64_t ld_out,
                       float *lse, int64_t H, int64_t Sq, int64_t Sk, int64_t skv, float scale) {
    const int64_t Skp = (Sk + MA_BK - 1) / MA_BK * MA_BK;
    const size_t need = (size_t)(2 * H * Skp * D);
    if (need > g_kv_n) {
        cudaFree(g_kv);
        g_kv = NULL, g_kv_n = 0;
        if (ck(cudaMalloc(&g_kv, need * 2), "attention bf16 scratch"))
            return;
        g_kv_n = need;
        note_peak();
    }
    __nv_bfloat16 *kb = g_kv, *vt = g_kv + H * Skp * D;
    k_kv_to_bf16<<<dim3((unsigned)(Skp / 32), (unsigned)(D / 32), (unsigned)H), dim3(32, 8), 0,
                   g_stream>>>(k, v, kb, vt, Sk, Skp, D);
    launched("attention: K, V to bf16");
    const float qscale = scale * 1.4426950408889634f; /* scores in log2 units: exp2 */
    const size_t shm = 2 * sizeof(ma_tile<D>);
    static int configured;
    if (!configured) {
        if (ck(cudaFuncSetAttribute(k_attn_mma<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    (int)shm),
               "flash attention (mma) shared memory"))
            return;
        configured = 1;
    }
    dim3 grid((unsigned)((Sq + MA_BQ - 1) / MA_BQ), (unsigned)H);
    k_attn_mma<D><<<grid, 256, shm, g_stream>>>(q, kb, vt, out, ld_out, lse, Sq, Skp, skv, qscale);
    launched("flash attention (bf16 mma)");
}

template <int NT>
static void launch_f32(const float *q, const float *k, const float *v, float *out, int64_t ld_out,
                       float *lse, int64_t H, int64_t Sq, int64_t Sk, int64_t skv, int64_t D,
                       float scale) {
    const size_t shm = sizeof(float) * 2 * ATT_BK * (size_t)D;
    static int configured;
    if (!configured) {
        ck(cudaFuncSetAttribute(k_attn_f32<NT>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                (int)shm > 48 * 1024 ? (int)shm : 48 * 1024),
           "attention shared memory");
        configured = 1;
    }
    dim3 grid((unsigned)((Sq + ATT_ROWS - 1) / ATT_ROWS), (unsigned)H);
    k_attn_f32<NT><<<grid, 32 * ATT_ROWS, shm, g_stream>>>(q, k, v, out, ld_out, lse, Sq, Sk, skv,
                                                           D, scale);
    launched("attention (f32)");
}

static void be_attention(const float *q, const float *k, const float *v, float *out,
                         int64_t ld_out, float *lse, int64_t H, int64_t Sq, int64_t Sk,
                         int64_t skv, int64_t D, float scale, int bf16) {
    if (skv > Sk)
        skv = Sk;
    if (bf16 == 1 && (D == 64 || D == 128)) {
        if (D == 64)
            launch_mma<64>(q, k, v, out, ld_out, lse, H, Sq, Sk, skv, scale);
        else
            launch_mma<128>(q, k, v, out, ld_out, lse, H, Sq, Sk, skv, scale);
        return;
    }
    if (bf16 && (D == 64 || D == 128)) { /* 2: the WMMA kernel, kept as a cross-check */
        if (D == 64)
            launch_bf16<64>(q, k, v, out, ld_out, lse, H, Sq, Sk, skv, scale);
        else
            launch_bf16<128>(q, k, v, out, ld_out, lse, H, Sq, Sk, skv, scale);
        return;
    }
    if (D <= 32)
        launch_f32<1>(q, k, v, out, ld_out, lse, H, Sq, Sk, skv, D, scale);
    else if (D <= 64)
        launch_f32<2>(q, k, v, out, ld_out, lse, H, Sq, Sk, skv, D, scale);
    else if (D <= 128)
        launch_f32<4>(q, k, v, out, ld_out, lse, H, Sq, Sk, skv, D, scale);
    else if (D <= 256)
        launch_f32<8>(q, k, v, out, ld_out, lse, H, Sq, Sk, skv, D, scale);
    else
        fail("attention: head dim %lld > 256 is not supported on CUDA", (long long)D);
}

/* One warp per (head, row): merges a partial attention result into the running one. */
__global__ void k_lse_merge(float *O, int64_t ldO, float *Lr, const float *o, int64_t ldo,
                            const float *l, int64_t hn, int64_t L, int64_t D) {
    const int64_t item = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (item >= hn * L)
        return;
    const int64_t h = item / L, i = item % L;
    const float a = Lr[h * L + i], b = l[h * L + i];
    if (b == -INFINITY)
        return;
    float *Oi = O + i * ldO + h * D;
    const float *oi = o + i * ldo + h * D;
    if (a == -INFINITY) {
        for (int64_t d = lane; d < D; d += 32)
            Oi[d] = oi[d];
    } else {
        const float m = fmaxf(a, b), wa = expf(a - m), wb = expf(b - m), inv = 1.0f / (wa + wb);
        for (int64_t d = lane; d < D; d += 32)
            Oi[d] = (wa * Oi[d] + wb * oi[d]) * inv;
    }
    __syncwarp();
    if (lane == 0)
        Lr[h * L + i] = a == -INFINITY ? b : fmaxf(a, b) + logf(expf(a - fmaxf(a, b)) +
                                                                  expf(b - fmaxf(a, b)));
}

static void be_lse_merge(float *O, int64_t ldO, float *Lr, const float *o, int64_t ldo,
                         const float *l, int64_t hn, int64_t L, int64_t D) {
    const int64_t items = hn * L;
    k_lse_merge<<<(unsigned)((items + 7) / 8), 256, 0, g_stream>>>(O, ldO, Lr, o, ldo, l, hn, L,
                                                                   D);
    launched("lse_merge");
}

/* ---------------- NCCL ---------------- */

/* The few NCCL types and entry points used, declared here (their ABI is stable since NCCL 2.0)
 * so that building needs no nccl.h and running needs libnccl only when a communicator is made. */
typedef struct ncclComm *ncclComm_t;
typedef struct {
    char internal[128];
} ncclUniqueId;
typedef int ncclResult_t;
enum { ncclSuccess = 0, ncclFloat = 7, ncclSum = 0 };
static struct {
    int tried, ok;
    ncclResult_t (*GetUniqueId)(ncclUniqueId *);
    ncclResult_t (*CommInitRank)(ncclComm_t *, int, ncclUniqueId, int);
    ncclResult_t (*CommDestroy)(ncclComm_t);
    ncclResult_t (*CommUserRank)(ncclComm_t, int *);
    ncclResult_t (*ReduceScatter)(const void *, void *, size_t, int, int, ncclComm_t, cudaStream_t);
    ncclResult_t (*AllGather)(const void *, void *, size_t, int, ncclComm_t, cudaStream_t);
    ncclResult_t (*Send)(const void *, size_t, int, int, ncclComm_t, cudaStream_t);
    ncclResult_t (*Recv)(void *, size_t, int, int, ncclComm_t, cudaStream_t);
    ncclResult_t (*GroupStart)(void);
    ncclResult_t (*GroupEnd)(void);
    const char *(*GetErrorString)(ncclResult_t);
} nccl;

static int nccl_load(char *err, size_t errlen) {
    if (nccl.tried)
        return nccl.ok ? 0 : (snprintf(err, errlen, "libnccl.so.2 could not be loaded"), -1);
    nccl.tried = 1;
    void *h = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        snprintf(err, errlen, "libnccl.so.2: %s", dlerror());
        return -1;
    }
#define NCCL_SYM(f)                                                                                \
    if (!(*(void **)(&nccl.f) = dlsym(h, "nccl" #f))) {                                          \
        snprintf(err, errlen, "libnccl.so.2 has no nccl" #f);                                    \
        return -1;                                                                                 \
    }
    NCCL_SYM(GetUniqueId)
    NCCL_SYM(CommInitRank)
    NCCL_SYM(CommDestroy)
    NCCL_SYM(CommUserRank)
    NCCL_SYM(ReduceScatter)
    NCCL_SYM(AllGather)
    NCCL_SYM(Send)
    NCCL_SYM(Recv)
    NCCL_SYM(GroupStart)
    NCCL_SYM(GroupEnd)
    NCCL_SYM(GetErrorString)
#undef NCCL_SYM
    nccl.ok = 1;
    return 0;
}

typedef struct dev_comm {
    ncclComm_t comm;
    cudaEvent_t ready, done;
    float *pad; /* all-reduce buffer padded to a multiple of the group size */
    size_t pad_n;
} dev_comm;

static int nccl_ok(ncclResult_t r, const char *what) {
    if (r == ncclSuccess)
        return 0;
    fail("%s: %s", what, nccl.GetErrorString(r));
    return -1;
}

static int be_comm_id(void *id128) {
    ncclUniqueId id;
    char err[256];
    if (nccl_load(err, sizeof err) != 0 || nccl.GetUniqueId(&id) != ncclSuccess)
        return -1;
    memcpy(id128, &id, sizeof id < 128 ? sizeof id : 128);
    return 0;
}

static void *be_comm_init(int nranks, const void *id128, int rank, char *err, size_t errlen) {
    dev_comm *c = (dev_comm *)calloc(1, sizeof *c);
    ncclUniqueId id;
    memcpy(&id, id128, sizeof id);
    if (!c) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    if (nccl_load(err, errlen) != 0) {
        free(c);
        return NULL;
    }
    ncclResult_t r = nccl.CommInitRank(&c->comm, nranks, id, rank);
    if (r != ncclSuccess) {
        snprintf(err, errlen, "ncclCommInitRank: %s", nccl.GetErrorString(r));
        free(c);
        return NULL;
    }
    cudaEventCreateWithFlags(&c->ready, cudaEventDisableTiming);
    cudaEventCreateWithFlags(&c->done, cudaEventDisableTiming);
    return c;
}

static void be_comm_free(void *p) {
    dev_comm *c = (dev_comm *)p;
    if (!c)
        return;
    nccl.CommDestroy(c->comm);
    cudaEventDestroy(c->ready);
    cudaEventDestroy(c->done);
    cudaFree(c->pad);
    free(c);
}

static int be_comm_allreduce(void *p, float *buf, int64_t n, int P) {
    dev_comm *c = (dev_comm *)p;
    int rank = 0;
    const size_t chunk = (size_t)((n + P - 1) / P);
    if (chunk * P > c->pad_n) {
        cudaFree(c->pad);
        c->pad = NULL, c->pad_n = 0;
        if (ck(cudaMalloc(&c->pad, sizeof(float) * chunk * P), "all-reduce buffer"))
            return -1;
        c->pad_n = chunk * P;
    }
    nccl.CommUserRank(c->comm, &rank);
    ck(cudaMemsetAsync(c->pad, 0, sizeof(float) * chunk * P, g_stream), "all-reduce pad");
    ck(cudaMemcpyAsync(c->pad, buf, sizeof(float) * n, cudaMemcpyDeviceToDevice, g_stream),
       "all-reduce copy");
    /* each element summed by exactly one rank, then copied to all: bit-identical everywhere */
    if (nccl_ok(nccl.ReduceScatter(c->pad, c->pad + rank * chunk, chunk, ncclFloat, ncclSum,
                                  c->comm, g_stream),
                "ncclReduceScatter") ||
        nccl_ok(nccl.AllGather(c->pad + rank * chunk, c->pad, chunk, ncclFloat, c->comm, g_stream),
                "ncclAllGather"))
        return -1;
    ck(cudaMemcpyAsync(buf, c->pad, sizeof(float) * n, cudaMemcpyDeviceToDevice, g_stream),
       "all-reduce copy");
    return g_failed ? -1 : 0;
}

static int be_comm_alltoallv(void *p, int P, const float *send, const int64_t *sc,
                             const int64_t *sd, float *recv, const int64_t *rc,
                             const int64_t *rd) {
    dev_comm *c = (dev_comm *)p;
    if (nccl_ok(nccl.GroupStart(), "ncclGroupStart"))
        return -1;
    for (int i = 0; i < P; i++) {
        if (sc[i])
            nccl_ok(nccl.Send(send + sd[i], (size_t)sc[i], ncclFloat, i, c->comm, g_stream),
                    "ncclSend");
        if (rc[i])
            nccl_ok(nccl.Recv(recv + rd[i], (size_t)rc[i], ncclFloat, i, c->comm, g_stream),
                    "ncclRecv");
    }
    nccl_ok(nccl.GroupEnd(), "ncclGroupEnd");
    return g_failed ? -1 : 0;
}

static int be_comm_sendrecv(void *p, const float *send, int to, float *recv, int from, int64_t n) {
    dev_comm *c = (dev_comm *)p;
    /* the block to send was written on the compute stream: the comm stream waits for it */
    ck(cudaEventRecord(c->ready, g_stream), "ring event");
    ck(cudaStreamWaitEvent(g_comm, c->ready, 0), "ring wait");
    nccl_ok(nccl.GroupStart(), "ncclGroupStart");
    nccl_ok(nccl.Send(send, (size_t)n, ncclFloat, to, c->comm, g_comm), "ncclSend");
    nccl_ok(nccl.Recv(recv, (size_t)n, ncclFloat, from, c->comm, g_comm), "ncclRecv");
    nccl_ok(nccl.GroupEnd(), "ncclGroupEnd");
    return g_failed ? -1 : 0;
}

static int be_comm_wait(void *p) {
    dev_comm *c = (dev_comm *)p;
    ck(cudaEventRecord(c->done, g_comm), "ring event");
    ck(cudaStreamWaitEvent(g_stream, c->done, 0), "ring wait");
    return g_failed ? -1 : 0;
}

static mdt_backend_ops k_ops;

extern "C" __attribute__((visibility("default"))) const mdt_backend_ops *mdt_cuda_backend(void) {
    mdt_backend_ops *o = &k_ops;
    o->abi = MDT_BACKEND_ABI, o->name = "cuda";
    o->init = be_init, o->check = be_check, o->shutdown = be_shutdown, o->describe = be_describe;
    o->device_count = be_device_count;
    o->is_device = be_is_device, o->alloc = be_alloc, o->free = be_free;
    o->host_alloc = be_host_alloc, o->host_free = be_host_free;
    o->to_device = be_to_device, o->to_device_async = be_to_device_async, o->to_host = be_to_host;
    o->mem_peak = be_mem_peak, o->copy2d = be_copy2d, o->copy_rows = be_copy_rows;
    o->fill = be_fill, o->add = be_add, o->add_bias = be_add_bias, o->to_bf16 = be_to_bf16;
    o->angle_table = be_angle_table;
    o->linear = be_linear, o->layernorm_modulate = be_layernorm_modulate;
    o->heads_prepare = be_heads_prepare, o->rmsnorm = be_rmsnorm;
    o->modulate_rows = be_modulate_rows, o->gate_residual_rows = be_gate_residual_rows;
    o->gate_residual = be_gate_residual, o->swiglu = be_swiglu, o->gelu_rows = be_gelu_rows;
    o->silu = be_silu, o->attention = be_attention, o->lse_merge = be_lse_merge;
    o->comm_id = be_comm_id, o->comm_init = be_comm_init, o->comm_free = be_comm_free;
    o->comm_allreduce = be_comm_allreduce, o->comm_alltoallv = be_comm_alltoallv;
    o->comm_sendrecv = be_comm_sendrecv, o->comm_wait = be_comm_wait;
    return o;
}
