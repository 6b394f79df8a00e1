/*
 * elementwise.cu — the CUDA plugin's data movement and fused elementwise kernels (copies, fills,
 * adds, bf16 conversion, rotary tables, activations, norms and modulation, attention operand
 * preparation).
 */
#include "cuda_common.cuh"

namespace mdt_cuda {

/* ---------------- data movement and elementwise kernels ---------------- */


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

void be_add_bias(float *y, int64_t ldy, const float *b, int64_t M, int64_t N) {
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
                             const float *sin_t, int64_t rot, mdt_rope_kind kind, float *dst,
                             int64_t Sdst, int64_t s0) {
    const int half_rope = kind == MDT_ROPE_HALF;
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

void fill_elementwise(mdt_device_ops *d, mdt_kernel_ops *o) {
    d->to_bf16 = be_to_bf16;
    o->copy2d = be_copy2d, o->copy_rows = be_copy_rows, o->fill = be_fill, o->add = be_add;
    o->add_bias = be_add_bias, o->angle_table = be_angle_table;
    o->layernorm_modulate = be_layernorm_modulate, o->heads_prepare = be_heads_prepare;
    o->rmsnorm = be_rmsnorm, o->modulate_rows = be_modulate_rows;
    o->gate_residual_rows = be_gate_residual_rows, o->gate_residual = be_gate_residual;
    o->swiglu = be_swiglu, o->gelu_rows = be_gelu_rows, o->silu = be_silu;
}

} // namespace mdt_cuda
