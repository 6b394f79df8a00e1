/*
 * attention.cu — the CUDA plugin's attention kernels: fp32 with warp-per-row online softmax;
 * bf16 tensor-core flash attention (mma.sync, and the WMMA kernel kept as a cross-check) with
 * fp32 accumulation and fp32 softmax; and the log-sum-exp merge of ring partials.
 */
#include "cuda_common.cuh"

#include <mma.h>

using namespace nvcuda;

namespace mdt_cuda {

__nv_bfloat16 *g_kv;
size_t g_kv_n;

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

/* No scratch from the caller: the bf16 K/V copies are the plugin's own (g_kv). */
static int64_t be_attention_ws_floats(int64_t Sk, int64_t D, int bf16) {
    (void)Sk, (void)D, (void)bf16;
    return 0;
}

static void be_attention(const float *q, const float *k, const float *v, float *out,
                         int64_t ld_out, float *lse, int64_t H, int64_t Sq, int64_t Sk,
                         int64_t skv, int64_t D, float scale, int bf16, float *ws) {
    (void)ws;
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

void fill_attention(mdt_kernel_ops *o) {
    o->attention_ws_floats = be_attention_ws_floats, o->attention = be_attention;
    o->lse_merge = be_lse_merge;
}

} // namespace mdt_cuda
