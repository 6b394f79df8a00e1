/*
 * cpu.c — the fast CPU kernels of cpu.h. Every GEMM goes through the GEMM seam (gemm.h: OpenBLAS
 * or oneDNN, one thread per rank); the elementwise passes are fused loops the compiler vectorises
 * (AVX-512 intrinsics for exp-heavy passes); attention streams key tiles with an online softmax
 * (running max m, denominator l, rescaled accumulator) and does its two products per tile through
 * the seam, in f32 or with bf16 operands.
 *
 * Compiled once per instruction set (the Makefile sets MDT_CPU_ISA and -march: x86-64, AVX2 +
 * FMA, AVX-512), each build exporting one kernel set (cpu.h, the table of kernels/ops.h);
 * cpu_dispatch.c picks the widest the CPU runs at first use. Every function here is static: the
 * table is the only way in. Nothing here counts FLOPs (the backend's front table does).
 */
#include "cpu.h"
#include "cpu_isa.h"
#include "gemm.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

/* exp(x) for float, within ~2 ulp over the whole float range: Cody-Waite reduction by ln 2 and a
 * degree-6 polynomial (the Cephes expf coefficients). Branch-free and call-free so that the
 * loops using it vectorise (libm's expf/tanhf are scalar calls and dominated GELU and softmax).
 * Inputs below -87.3 return ~1e-38 instead of 0 — harmless everywhere it is used here. NaN
 * returns NaN; the exponent is built in unsigned arithmetic from a clamped, NaN-free argument,
 * so no float gives undefined behaviour (no float-to-int overflow, no shift of a negative). */
static inline float fast_expf(float x) {
    const int nan = x != x;
    float xc = nan ? 0.0f : x;
    xc = xc < -87.3f ? -87.3f : (xc > 88.7f ? 88.7f : xc);
    const float n = floorf(xc * 1.44269504088896341f + 0.5f); /* in [-126, 128] */
    const float r = (xc - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return nan ? x : p * scale;
}

#if MDT_CPU_ISA == 3
#include <immintrin.h>

/* fast_expf on 16 lanes: the same reduction and polynomial, 2^n by vscalefps (which saturates
 * to 0 or Inf by itself); x is clamped below at -100 (exp < 1e-43: 0 after scaling), NaN stays
 * NaN (vmaxps returns its second operand when either is NaN). */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-100.0f), x);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

#endif

/* Puts the bias in every row of y [M, N] and returns sgemm's beta: 1 with a bias, else 0. */
static float bias_rows(float *y, int64_t ldy, const float *b, int64_t M, int64_t N) {
    if (!b)
        return 0.0f;
    for (int64_t i = 0; i < M; i++)
        memcpy(y + i * ldy, b, sizeof(float) * (size_t)N);
    return 1.0f;
}

static void k_bf16_widen(float *dst, const uint16_t *src, int64_t n) {
    for (int64_t i = 0; i < n; i++) { /* vectorises: zero-extend, shift, store */
        const uint32_t u = (uint32_t)src[i] << 16;
        memcpy(dst + i, &u, sizeof u);
    }
}

/* bf16 of each float, rounded to nearest even; NaN stays NaN (quiet), Inf stays Inf. */
static void k_to_bf16_rows(uint16_t *dst, int64_t ldd, const float *src, int64_t lds, int64_t M,
                           int64_t n) {
    for (int64_t i = 0; i < M; i++) {
        uint16_t *d = dst + i * ldd;
        const float *x = src + i * lds;
        for (int64_t j = 0; j < n; j++) { /* vectorises: integer ops and one select */
            uint32_t u;
            memcpy(&u, x + j, sizeof u);
            const uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
            const int nan = (u & 0x7fffffffu) > 0x7f800000u;
            d[j] = (uint16_t)(nan ? (u >> 16) | 0x40u : r);
        }
    }
}

/* Panel budgets of mdt_cpu_linear_bf16, in floats: few rows keep a panel in L2 (256 KiB); many
 * rows widen the whole matrix when it takes <= 64 MiB (one sgemm, x packed once), else K blocks
 * of >= 512 (sgemm's own K blocks are smaller, so x is still packed about once). */
enum { BF16_FEW_PANEL = 65536, BF16_MANY_PANEL = 16 << 20, BF16_MIN_KB = 512 };

static int64_t bf16_few_rows(int64_t K, int64_t N, int64_t ws_floats) { /* rows per panel */
    const int64_t budget = ws_floats < BF16_FEW_PANEL ? ws_floats : BF16_FEW_PANEL;
    const int64_t nb = budget / (K > 0 ? K : 1);
    return nb < 1 ? 1 : (nb > N ? N : nb);
}

static int64_t bf16_many_kb(int64_t K, int64_t N, int64_t ws_floats) { /* K block */
    if (N * K <= ws_floats)
        return K;
    int64_t kb = ws_floats / N;
    if (kb > 256)
        kb &= ~(int64_t)255;
    return kb < 1 ? 1 : kb;
}

static int64_t k_linear_bf16_ws_floats(int64_t K, int64_t N) {
    int64_t kb = N * K <= BF16_MANY_PANEL ? K : (BF16_MANY_PANEL / N) & ~(int64_t)255;
    kb = kb < BF16_MIN_KB ? BF16_MIN_KB : kb;
    kb = kb > K ? K : kb;
    const int64_t few = bf16_few_rows(K, N, BF16_FEW_PANEL) * K, many = N * kb;
    return few > many ? few : many;
}

static void k_linear_bf16(const float *x, int64_t ldx, const uint16_t *wh, const float *b, float *y,
                          int64_t ldy, int64_t M, int64_t K, int64_t N, float *ws,
                          int64_t ws_floats) {
    if (M == 0 || N == 0)
        return;
    const float beta = bias_rows(y, ldy, b, M, N);
    if (M < MDT_CPU_BF16_FEW_ROWS) {
        const int64_t nb = bf16_few_rows(K, N, ws_floats);
        for (int64_t n0 = 0; n0 < N; n0 += nb) {
            const int64_t nn = N - n0 < nb ? N - n0 : nb;
            k_bf16_widen(ws, wh + n0 * K, nn * K); // [nn, K]
            mdt_cpu_gemm_run(0, 1, M, nn, K, 1.0f, x, ldx, ws, K, beta, y + n0, ldy);
        }
    } else {
        const int64_t kb = bf16_many_kb(K, N, ws_floats);
        for (int64_t k0 = 0; k0 < K; k0 += kb) {
            const int64_t kk = K - k0 < kb ? K - k0 : kb;
            for (int64_t n = 0; n < N; n++) // ws [N, kk] = wh[:, k0:k0+kk]
                k_bf16_widen(ws + n * kk, wh + n * K + k0, kk);
            mdt_cpu_gemm_run(0, 1, M, N, kk, 1.0f, x + k0, ldx, ws, kk, k0 > 0 ? 1.0f : beta, y,
                             ldy);
        }
    }
}

#if MDT_CPU_ISA >= 2
#if MDT_CPU_ISA == 2
#include <immintrin.h>

/* The sum of 8 lanes in registers: lanes i + (i + 4), then + 2, + 1 (_mm512_reduce_add_ps's
 * order on half the lanes). */
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif
/* One row: y [N] = w [N, K] . x [K] (+ b), four weight rows a pass (the last pass repeats row
 * N - 1 for the missing ones and drops them), two accumulators a row, the K tail masked. A
 * one-row product is bound by reading the weights (the adaLN and embedder projections of every
 * forward: 1 x 1024 . 1024 x 6144 is 24 MiB for 12.6 MFLOP), and the GEMM libraries read them
 * slower than four plain streams do: on a Zen 4 core 13.0 GB/s (oneDNN's AVX-512 f32 matmul),
 * 19.5 (its AVX2 one), 5.3 (OpenBLAS) against 20.4 here (docs/perf.md, 2026-12-05). Each sum
 * runs in k order per lane, then the lanes pairwise in registers: a fixed order, the same on every
 * rank. */
static void gemv_f32(const float *x, const float *w, const float *b, float *y, int64_t K,
                     int64_t N) {
#if MDT_CPU_ISA == 3
    enum { L = 16 };
    typedef __m512 vec;
#define V_ZERO() _mm512_setzero_ps()
#define V_LOAD(p) _mm512_loadu_ps(p)
#define V_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define V_ADD(a, b) _mm512_add_ps(a, b)
#define V_TAIL(p, n) _mm512_maskz_loadu_ps((__mmask16)((1u << (n)) - 1u), p)
#define V_SUM(v) _mm512_reduce_add_ps(v) /* lanes i + (i + 8), then + 4, + 2, + 1 */
#else
    enum { L = 8 };
    typedef __m256 vec;
    static const int32_t k_mask[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
#define V_ZERO() _mm256_setzero_ps()
#define V_LOAD(p) _mm256_loadu_ps(p)
#define V_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define V_ADD(a, b) _mm256_add_ps(a, b)
#define V_TAIL(p, n) _mm256_maskload_ps(p, _mm256_loadu_si256((const __m256i *)(k_mask + 8 - (n))))
#define V_SUM(v) hsum8(v)
#endif
    for (int64_t n = 0; n < N; n += 4) {
        const float *r[4];
        vec a[4], c[4];
        for (int j = 0; j < 4; j++)
            r[j] = w + (n + j < N ? n + j : N - 1) * K, a[j] = c[j] = V_ZERO();
        int64_t k = 0;
        for (; k + 2 * L <= K; k += 2 * L) {
            const vec x0 = V_LOAD(x + k), x1 = V_LOAD(x + k + L);
            for (int j = 0; j < 4; j++)
                a[j] = V_FMA(V_LOAD(r[j] + k), x0, a[j]),
                c[j] = V_FMA(V_LOAD(r[j] + k + L), x1, c[j]);
        }
        for (; k < K; k += L) { /* at most two more: one whole, one masked */
            const int64_t t = K - k < L ? K - k : L;
            const vec x0 = t == L ? V_LOAD(x + k) : V_TAIL(x + k, t);
            for (int j = 0; j < 4; j++)
                a[j] = V_FMA(t == L ? V_LOAD(r[j] + k) : V_TAIL(r[j] + k, t), x0, a[j]);
        }
        for (int j = 0; j < 4 && n + j < N; j++) {
            const float sum = V_SUM(V_ADD(a[j], c[j]));
            y[n + j] = b ? sum + b[n + j] : sum;
        }
    }
#undef V_ZERO
#undef V_LOAD
#undef V_FMA
#undef V_ADD
#undef V_TAIL
#undef V_SUM
}
#endif

/* fp32 weights only: bf16 weights take the CPU backend's linear (scratch, operand rounding). */
static void k_linear(const float *x, int64_t ldx, const float *w, const uint16_t *wh,
                     const float *b, float *y, int64_t ldy, int64_t M, int64_t K, int64_t N) {
    (void)wh;
    mdt_cpu_gemm_linear_f32(x, ldx, w, b, y, ldy, M, K, N); /* either GEMM path (gemm.h) */
}

/* Row reductions in one fixed order on every instruction set: 32 lane sums (lane l takes
 * elements l, l + 32, ...), then folded pairwise (16, 8, 4, 2, 1). The lanes let the compiler
 * keep the sums in vector registers; a running scalar sum is one dependent add per element (a
 * LayerNorm row of 1024 took ~8k cycles on its two sums, replicated on every TP rank). */
enum { SUM_LANES = 32 };
static inline float lanes_fold(float *s) {
    for (int w = SUM_LANES / 2; w > 0; w /= 2)
        for (int l = 0; l < w; l++)
            s[l] += s[l + w];
    return s[0];
}
static float row_sum(const float *x, int64_t n) {
    float s[SUM_LANES] = {0};
    int64_t c = 0;
    for (; c + SUM_LANES <= n; c += SUM_LANES)
        for (int l = 0; l < SUM_LANES; l++)
            s[l] += x[c + l];
    for (int l = 0; c + l < n; l++)
        s[l] += x[c + l];
    return lanes_fold(s);
}
/* sum over the row of (x - mean)^2; mean 0 gives the sum of squares exactly */
static float row_sumsq(const float *x, int64_t n, float mean) {
    float s[SUM_LANES] = {0};
    int64_t c = 0;
    for (; c + SUM_LANES <= n; c += SUM_LANES)
        for (int l = 0; l < SUM_LANES; l++) {
            const float d = x[c + l] - mean;
            s[l] += d * d;
        }
    for (int l = 0; c + l < n; l++) {
        const float d = x[c + l] - mean;
        s[l] += d * d;
    }
    return lanes_fold(s);
}

static void k_layernorm_modulate(const float *x, float *y, int64_t M, int64_t C, float eps,
                                 const float *shift, const float *scale) {
    for (int64_t i = 0; i < M; i++) {
        const float *xr = x + i * C;
        float *yr = y + i * C;
        const float mean = row_sum(xr, C) / (float)C;
        const float inv = 1.0f / sqrtf(row_sumsq(xr, C, mean) / (float)C + eps);
        if (shift && scale)
            for (int64_t c = 0; c < C; c++)
                yr[c] = (xr[c] - mean) * inv * (1.0f + scale[c]) + shift[c];
        else
            for (int64_t c = 0; c < C; c++)
                yr[c] = (xr[c] - mean) * inv;
    }
}

static void k_heads_prepare(const float *src, int64_t ld, int64_t S, int64_t H, int64_t D,
                            const float *norm_w, float eps, const float *cos_t, const float *sin_t,
                            int64_t rot, mdt_rope_kind kind, float *dst, int64_t Sdst, int64_t s0) {
    for (int64_t s = 0; s < S; s++)
        for (int64_t h = 0; h < H; h++) {
            const float *x = src + s * ld + h * D;
            float *o = dst + (h * Sdst + s0 + s) * D;
            if (norm_w) {
                const float inv = 1.0f / sqrtf(row_sumsq(x, D, 0.0f) / (float)D + eps);
                for (int64_t d = 0; d < D; d++)
                    o[d] = x[d] * inv * norm_w[d];
            } else {
                memcpy(o, x, sizeof(float) * (size_t)D);
            }
            if (!cos_t)
                continue;
            const float *c = cos_t + s * rot, *sn = sin_t + s * rot;
            if (kind == MDT_ROPE_INTERLEAVED) {
                for (int64_t m = 0; m + 1 < rot; m += 2) {
                    float re = o[m], im = o[m + 1];
                    o[m] = re * c[m] - im * sn[m];
                    o[m + 1] = im * c[m + 1] + re * sn[m + 1];
                }
            } else {
                const int64_t half = rot / 2;
                for (int64_t m = 0; m < half; m++) {
                    float x1 = o[m], x2 = o[m + half];
                    o[m] = x1 * c[m] - x2 * sn[m];
                    o[m + half] = x2 * c[m + half] + x1 * sn[m + half];
                }
            }
        }
}

static void k_rmsnorm(const float *x, const float *w, float *y, int64_t M, int64_t C, float eps) {
    for (int64_t i = 0; i < M; i++) {
        const float *xr = x + i * C;
        float *yr = y + i * C;
        const float inv = 1.0f / sqrtf(row_sumsq(xr, C, 0.0f) / (float)C + eps);
        if (w)
            for (int64_t c = 0; c < C; c++)
                yr[c] = xr[c] * inv * w[c];
        else
            for (int64_t c = 0; c < C; c++)
                yr[c] = xr[c] * inv;
    }
}

static void k_modulate_rows(float *y, int64_t M, int64_t C, const float *table, int64_t ld,
                            const int64_t *idx, int64_t shift_off, int64_t scale_off) {
    for (int64_t i = 0; i < M; i++) {
        const float *sh = table + idx[i] * ld + shift_off, *sc = table + idx[i] * ld + scale_off;
        float *yr = y + i * C;
        for (int64_t c = 0; c < C; c++)
            yr[c] = yr[c] * (1.0f + sc[c]) + sh[c];
    }
}

static void k_gate_residual_rows(float *x, const float *y, int64_t ldy, const float *table,
                                 int64_t ld, const int64_t *idx, int64_t gate_off, int64_t M,
                                 int64_t C) {
    for (int64_t i = 0; i < M; i++) {
        const float *g = table + idx[i] * ld + gate_off;
        for (int64_t c = 0; c < C; c++)
            x[i * C + c] += g[c] * y[i * ldy + c];
    }
}

static void k_swiglu(const float *in, float *out, int64_t M, int64_t n) {
    for (int64_t i = 0; i < M; i++) {
        const float *v = in + i * 2 * n, *g = v + n;
        float *o = out + i * n;
        for (int64_t j = 0; j < n; j++)
            o[j] = v[j] * (g[j] / (1.0f + fast_expf(-g[j])));
    }
}

static void k_gelu_tanh(float *x, int64_t n) {
    int64_t i = 0;
#if MDT_CPU_ISA == 3 /* the same formula on 16 lanes */
    for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i), v3 = _mm512_mul_ps(_mm512_mul_ps(v, v), v);
        const __m512 u2 = _mm512_mul_ps(_mm512_set1_ps(2.0f * 0.7978845608028654f),
                                        _mm512_fmadd_ps(_mm512_set1_ps(0.044715f), v3, v));
        const __m512 t =
            _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(u2)));
        _mm512_storeu_ps(x + i, _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), v),
                                              _mm512_sub_ps(_mm512_set1_ps(2.0f), t)));
    }
#endif
    for (; i < n; i++) {
        float v = x[i];
        const float u = 0.7978845608028654f * (v + 0.044715f * v * v * v);
        /* 1 + tanh(u) = 2 - 2 / (1 + exp(2u)) */
        x[i] = 0.5f * v * (2.0f - 2.0f / (1.0f + fast_expf(2.0f * u)));
    }
}

static void k_silu(float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        x[i] = x[i] / (1.0f + fast_expf(-x[i]));
}

static void k_gate_residual(float *x, const float *y, int64_t ldy, const float *gate, int64_t M,
                            int64_t C) {
    for (int64_t i = 0; i < M; i++)
        for (int64_t c = 0; c < C; c++)
            x[i * C + c] += gate[c] * y[i * ldy + c];
}

/* Attention tiles by operand type: f32, bf16. */
static const int64_t k_attn_bq[2] = {MDT_ATTN_BQ, MDT_ATTN_BQ16};
static const int64_t k_attn_bk[2] = {MDT_ATTN_BK, MDT_ATTN_BK16};

static int64_t k_attention_ws_floats(int64_t Sk, int64_t D, int bf16) {
    bf16 = bf16 && mdt_cpu_gemm_bf16_operands(); /* bf16 operands need the onednn path */
    /* scores [BQ, BK] + accumulator [BQ, D] + running max and denominator [BQ] each; bf16
     * operands add P [BQ, BK], the Q tile [BQ, D] and one head's K and V [Sk, D] in halves
     * (rounded once per head, not once per query tile) */
    const int64_t BQ = k_attn_bq[bf16 != 0], BK = k_attn_bk[bf16 != 0];
    const int64_t f32 = BQ * BK + BQ * D + 2 * BQ;
    const int64_t halves = BQ * BK + BQ * D + 2 * Sk * D;
    return f32 + (bf16 ? (halves + 1) / 2 + 8 : 0);
}

#if MDT_CPU_ISA == 3
/* The max of row[0:n] and m, 16 lanes, masked tail. */
static float row_max(const float *row, int64_t n, float m) {
    __m512 v = _mm512_set1_ps(m);
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 k = n - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - j)) - 1u);
        v = _mm512_max_ps(v, _mm512_mask_loadu_ps(v, k, row + j));
    }
    return _mm512_reduce_max_ps(v);
}

/* row[0:n] <- exp(row - m) (or, with pb, pb[0:n] <- bf16 of it, nearest even); returns the sum
 * of the f32 values. One pass, masked tail. */
static float exp_row(float *row, int64_t n, float m, uint16_t *pb) {
    const __m512 vm = _mm512_set1_ps(m);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 k = n - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - j)) - 1u);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, row + j), vm));
        acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(k, e));
        if (!pb) {
            _mm512_mask_storeu_ps(row + j, k, e);
            continue;
        }
        const __m512i u = _mm512_castps_si512(e);
        const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
        __m512i h = _mm512_srli_epi32(
            _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
        const __mmask16 nan = _mm512_cmp_ps_mask(e, e, _CMP_UNORD_Q);
        h = _mm512_mask_or_epi32(h, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
        _mm256_mask_storeu_epi16(pb + j, k, _mm512_cvtepi32_epi16(h));
    }
    return _mm512_reduce_add_ps(acc);
}
#else
/* The max of row[0:n] and m (a float reduction the compiler may not reorder: eight lanes). */
static float row_max(const float *row, int64_t n, float m) {
    float lm[8];
    int64_t j = 0;
    for (int l = 0; l < 8; l++)
        lm[l] = m;
    for (; j + 8 <= n; j += 8)
        for (int l = 0; l < 8; l++)
            lm[l] = row[j + l] > lm[l] ? row[j + l] : lm[l];
    for (int l = 0; l < 8; l++)
        m = lm[l] > m ? lm[l] : m;
    for (; j < n; j++)
        m = row[j] > m ? row[j] : m;
    return m;
}

static float exp_row(float *row, int64_t n, float m, uint16_t *pb) {
    float ls[8] = {0, 0, 0, 0, 0, 0, 0, 0}, sum = 0.0f;
    int64_t j;
    for (j = 0; j < n; j++)
        row[j] = fast_expf(row[j] - m);
    for (j = 0; j + 8 <= n; j += 8)
        for (int l = 0; l < 8; l++)
            ls[l] += row[j + l];
    for (; j < n; j++)
        sum += row[j];
    for (int l = 0; l < 8; l++)
        sum += ls[l];
    if (pb)
        k_to_bf16_rows(pb, n, row, n, 1, n);
    return sum;
}
#endif

/* Online softmax of one score tile row block: rescales acc and den by the new running max and
 * leaves exp(score - max) in sc, or its bf16 rounding in pb [bq, BK] (pb != NULL). */
static void softmax_tile(float *sc, uint16_t *pb, int64_t ld, float *acc, float *mx, float *den,
                         int64_t bq, int64_t bk, int64_t D) {
    for (int64_t i = 0; i < bq; i++) {
        float *row = sc + i * ld;
        const float m = row_max(row, bk, mx[i]), corr = fast_expf(mx[i] - m);
        const float sum = exp_row(row, bk, m, pb ? pb + i * ld : NULL);
        den[i] = den[i] * corr + sum;
        mx[i] = m;
        if (corr != 1.0f)
            for (int64_t d = 0; d < D; d++)
                acc[i * D + d] *= corr;
    }
}

static void k_attention(const float *q, const float *k, const float *v, float *out, int64_t ld_out,
                        float *lse, int64_t H, int64_t Sq, int64_t Sk, int64_t sk_valid, int64_t D,
                        float scale, int bf16, float *ws) {
    bf16 = bf16 && mdt_cpu_gemm_bf16_operands(); /* bf16 operands need the onednn path */
    /* tiles: bf16 operands take larger ones (fewer, larger oneDNN calls; perf.md) */
    const int64_t BQ = k_attn_bq[bf16 != 0], BK = k_attn_bk[bf16 != 0];
    float *sc = ws;                                /* [BQ, BK] */
    float *acc = sc + BQ * BK;                     /* [BQ, D] */
    float *mx = acc + BQ * D;                      /* [BQ] */
    float *den = mx + BQ;                          /* [BQ] */
    uint16_t *pb = (uint16_t *)(void *)(den + BQ); /* [BQ, BK] bf16 (bf16 operands) */
    uint16_t *qb = pb + BQ * BK;                   /* [BQ, D] */
    uint16_t *kb = qb + BQ * D;                    /* [Sk, D] one head's keys */
    uint16_t *vb = kb + Sk * D;                    /* [Sk, D] and values */
    if (sk_valid > Sk)
        sk_valid = Sk;
    for (int64_t h = 0; h < H; h++) {
        const float *qh = q + h * Sq * D, *kh = k + h * Sk * D, *vh = v + h * Sk * D;
        if (bf16) {
            k_to_bf16_rows(kb, D, kh, D, sk_valid, D); // kb [sk_valid, D]
            k_to_bf16_rows(vb, D, vh, D, sk_valid, D); // vb [sk_valid, D]
        }
        for (int64_t i0 = 0; i0 < Sq; i0 += BQ) {
            int64_t bq = Sq - i0 < BQ ? Sq - i0 : BQ;
            for (int64_t i = 0; i < bq; i++)
                mx[i] = -INFINITY, den[i] = 0.0f;
            memset(acc, 0, sizeof(float) * (size_t)(bq * D));
            if (bf16)
                k_to_bf16_rows(qb, D, qh + i0 * D, D, bq, D); // qb [bq, D]
            for (int64_t j0 = 0; j0 < sk_valid; j0 += BK) {
                int64_t bk = sk_valid - j0 < BK ? sk_valid - j0 : BK;
                /* scores [bq, bk] = scale * Q_tile . K_tile^T */
                if (bf16) {
                    mdt_cpu_gemm_run(1, 1, bq, bk, D, scale, qb, D, kb + j0 * D, D, 0.0f, sc, BK);
                } else {
                    mdt_cpu_gemm_run(0, 1, bq, bk, D, scale, qh + i0 * D, D, kh + j0 * D, D, 0.0f,
                                     sc, BK);
                }
                softmax_tile(sc, bf16 ? pb : NULL, BK, acc, mx, den, bq, bk, D);
                /* acc [bq, D] += P [bq, bk] . V_tile [bk, D] */
                if (bf16) {
                    mdt_cpu_gemm_run(1, 0, bq, D, bk, 1.0f, pb, BK, vb + j0 * D, D, 1.0f, acc, D);
                } else {
                    mdt_cpu_gemm_run(0, 0, bq, D, bk, 1.0f, sc, BK, vh + j0 * D, D, 1.0f, acc, D);
                }
            }
            for (int64_t i = 0; i < bq; i++) {
                float inv = den[i] > 0.0f ? 1.0f / den[i] : 0.0f;
                float *o = out + (i0 + i) * ld_out + h * D;
                for (int64_t d = 0; d < D; d++)
                    o[d] = acc[i * D + d] * inv;
                if (lse)
                    lse[h * Sq + i0 + i] = mx[i] + logf(den[i]);
            }
        }
    }
}

static void k_copy2d(float *dst, int64_t ldd, const float *src, int64_t lds, int64_t rows,
                     int64_t cols) {
    for (int64_t r = 0; r < rows; r++)
        memcpy(dst + r * ldd, src + r * lds, sizeof(float) * (size_t)cols);
}

static void k_copy_rows(float *dst, int64_t ldd, const int64_t *drow, const float *src, int64_t lds,
                        const int64_t *srow, int64_t n, int64_t w) {
    for (int64_t i = 0; i < n; i++)
        memcpy(dst + (drow ? drow[i] : i) * ldd, src + (srow ? srow[i] : i) * lds,
               sizeof(float) * (size_t)w);
}

static void k_fill(float *x, int64_t n, float v) {
    for (int64_t i = 0; i < n; i++)
        x[i] = v;
}

static void k_add(float *y, const float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        y[i] += x[i];
}

static void k_add_bias(float *y, int64_t ldy, const float *b, int64_t M, int64_t N) {
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < N; j++)
            y[i * ldy + j] += b[j];
}

static void k_gelu_rows(float *x, int64_t ld, int64_t M, int64_t n) {
    for (int64_t r = 0; r < M; r++)
        k_gelu_tanh(x + r * ld, n);
}

static void k_lse_merge(float *O, int64_t ldO, float *Lr, const float *o, int64_t ldo,
                        const float *l, int64_t hn, int64_t L, int64_t D) {
    for (int64_t h = 0; h < hn; h++)
        for (int64_t i = 0; i < L; i++) {
            const float a = Lr[h * L + i], b = l[h * L + i];
            if (b == -INFINITY)
                continue;
            float *Oi = O + i * ldO + h * D;
            const float *oi = o + i * ldo + h * D;
            if (a == -INFINITY) {
                memcpy(Oi, oi, sizeof(float) * (size_t)D);
                Lr[h * L + i] = b;
                continue;
            }
            const float m = a > b ? a : b, wa = expf(a - m), wb = expf(b - m),
                        inv = 1.0f / (wa + wb);
            for (int64_t d = 0; d < D; d++)
                Oi[d] = (wa * Oi[d] + wb * oi[d]) * inv;
            Lr[h * L + i] = m + logf(wa + wb);
        }
}

static void k_angle_table(const float *pos, int64_t ldpos, int64_t S, int64_t ncols,
                          const int32_t *col_axis, const double *col_freq, int dbl, float *cos_t,
                          float *sin_t) {
    for (int64_t s = 0; s < S; s++)
        for (int64_t c = 0; c < ncols; c++) {
            const float p = pos[s * ldpos + col_axis[c]];
            if (dbl) {
                const double a = (double)p * col_freq[c];
                cos_t[s * ncols + c] = (float)cos(a), sin_t[s * ncols + c] = (float)sin(a);
            } else {
                const float a = p * (float)col_freq[c];
                cos_t[s * ncols + c] = cosf(a), sin_t[s * ncols + c] = sinf(a);
            }
        }
}

#ifndef MDT_CPU_ISA
#define MDT_CPU_ISA 0 /* a build outside the Makefile (analysers): the generic table */
#endif
#if MDT_CPU_ISA == 1
#define MDT_CPU_TABLE mdt_cpu_kernels_x86_64
#define MDT_CPU_NAME "x86-64"
#elif MDT_CPU_ISA == 2
#define MDT_CPU_TABLE mdt_cpu_kernels_avx2
#define MDT_CPU_NAME "avx2"
#elif MDT_CPU_ISA == 3
#define MDT_CPU_TABLE mdt_cpu_kernels_avx512
#define MDT_CPU_NAME "avx512"
#else
#define MDT_CPU_TABLE mdt_cpu_kernels_generic
#define MDT_CPU_NAME "generic"
#endif

const mdt_cpu_kernel_set MDT_CPU_TABLE = {
    .k =
        {
            .name = MDT_CPU_NAME,
            .copy2d = k_copy2d,
            .copy_rows = k_copy_rows,
            .fill = k_fill,
            .add = k_add,
            .add_bias = k_add_bias,
            .angle_table = k_angle_table,
            .linear = k_linear,
            .layernorm_modulate = k_layernorm_modulate,
            .heads_prepare = k_heads_prepare,
            .rmsnorm = k_rmsnorm,
            .modulate_rows = k_modulate_rows,
            .gate_residual_rows = k_gate_residual_rows,
            .gate_residual = k_gate_residual,
            .swiglu = k_swiglu,
            .gelu_rows = k_gelu_rows,
            .silu = k_silu,
            .attention_ws_floats = k_attention_ws_floats,
            .attention = k_attention,
            .lse_merge = k_lse_merge,
        },
    .linear_bf16 = k_linear_bf16,
    .linear_bf16_ws_floats = k_linear_bf16_ws_floats,
    .to_bf16_rows = k_to_bf16_rows,
    .bf16_widen = k_bf16_widen,
#if MDT_CPU_ISA >= 2
    .gemv_f32 = gemv_f32,
#endif
};
