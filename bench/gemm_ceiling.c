/*
 * gemm_ceiling.c — how far an f32 GEMM of our own could go on this core, against the GEMM path
 * in use (gemm.h: oneDNN on AVX2), at a Flux forward's shapes. Answers "why not our own GEMM"
 * with numbers, in three rates per shape:
 *   path      mdt_cpu_gemm_linear_f32, i.e. the forward's linear, weights W [N, K] (transposed B);
 *   own       a textbook BLIS-style GEMM: a 6 x 16 AVX2 micro-kernel (12 accumulators), A packed
 *             per K block, each 16-column panel of W transposed into an L1 buffer just before
 *             use, the next panel prefetched while the current one is multiplied;
 *   prepacked the same with W's panels packed once beforehand (what a weight format of our own
 *             would give: no per-call packing at all).
 * plus the micro-kernel alone with both operands hot in L1: the ceiling of the design (about the
 * FMA peak that build/bench/bench_sgemm prints). Each shape cycles through 12 distinct weight
 * matrices, more than a 32 MiB L3 holds at the large shapes, so weights come from memory as in a
 * forward; the three variants alternate within each repeat, medians reported. The own GEMM's
 * output is checked against the path's (max abs difference printed).
 * AVX2 + FMA only; benchmarks only (never in make test).
 * usage: build/bench/gemm_ceiling [repeats]
 */
#include "bench_stats.h"
#include "core/core.h"
#include "kernels/cpu/gemm.h"

#include <immintrin.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { MR = 6, NR = 16, KC = 256, MC = 192, NW = 12, MAXREP = 64 };

/* bp [kc, 16] = the 16 rows n0.. of W [N, ldw] over columns k0..k0+kc, transposed; rows past
 * nr are zeros. Full panels go through 8 x 8 register transposes. */
__attribute__((target("avx2,fma"))) static void
pack_w(float *bp, const float *W, int64_t ldw, int64_t n0, int64_t nr, int64_t k0, int64_t kc) {
    int64_t k = 0;
    if (nr == NR)
        for (; k + 8 <= kc; k += 8)
            for (int h = 0; h < 2; h++) {
                __m256 r[8], t[8], s[8];
                for (int j = 0; j < 8; j++)
                    r[j] = _mm256_loadu_ps(W + (n0 + h * 8 + j) * ldw + k0 + k);
                for (int j = 0; j < 8; j += 2)
                    t[j] = _mm256_unpacklo_ps(r[j], r[j + 1]),
                    t[j + 1] = _mm256_unpackhi_ps(r[j], r[j + 1]);
                for (int j = 0; j < 8; j += 4) {
                    s[j] = _mm256_shuffle_ps(t[j], t[j + 2], 0x44);
                    s[j + 1] = _mm256_shuffle_ps(t[j], t[j + 2], 0xEE);
                    s[j + 2] = _mm256_shuffle_ps(t[j + 1], t[j + 3], 0x44);
                    s[j + 3] = _mm256_shuffle_ps(t[j + 1], t[j + 3], 0xEE);
                }
                for (int j = 0; j < 4; j++) {
                    _mm256_store_ps(bp + (k + j) * NR + h * 8,
                                    _mm256_permute2f128_ps(s[j], s[j + 4], 0x20));
                    _mm256_store_ps(bp + (k + j + 4) * NR + h * 8,
                                    _mm256_permute2f128_ps(s[j], s[j + 4], 0x31));
                }
            }
    for (; k < kc; k++)
        for (int j = 0; j < NR; j++)
            bp[k * NR + j] = j < nr ? W[(n0 + j) * ldw + k0 + k] : 0.0f;
}

/* ap [kc, 6] = rows m0..m0+mr of A over columns k0..k0+kc, transposed; rows past mr are zeros. */
static void pack_a(float *ap, const float *A, int64_t lda, int64_t m0, int64_t mr, int64_t k0,
                   int64_t kc) {
    for (int64_t k = 0; k < kc; k++)
        for (int i = 0; i < MR; i++)
            ap[k * MR + i] = i < mr ? A[(m0 + i) * lda + k0 + k] : 0.0f;
}

/* C [mr, nr] (+)= ap [kc, 6]^T . bp [kc, 16] (acc: add to C). */
__attribute__((target("avx2,fma"))) static void
ukr(int64_t kc, const float *ap, const float *bp, float *C, int64_t ldc, int mr, int nr, int acc) {
    __m256 c[MR][2];
    for (int i = 0; i < MR; i++)
        c[i][0] = c[i][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < kc; k++, ap += MR, bp += NR) {
        const __m256 b0 = _mm256_load_ps(bp), b1 = _mm256_load_ps(bp + 8);
        for (int i = 0; i < MR; i++) {
            const __m256 a = _mm256_broadcast_ss(ap + i);
            c[i][0] = _mm256_fmadd_ps(a, b0, c[i][0]);
            c[i][1] = _mm256_fmadd_ps(a, b1, c[i][1]);
        }
    }
    float t[MR * NR] __attribute__((aligned(32)));
    for (int i = 0; i < MR; i++) {
        if (mr == MR && nr == NR) {
            for (int h = 0; h < 2; h++) {
                float *o = C + i * ldc + h * 8;
                _mm256_storeu_ps(o, acc ? _mm256_add_ps(_mm256_loadu_ps(o), c[i][h]) : c[i][h]);
            }
            continue;
        }
        _mm256_store_ps(t + i * NR, c[i][0]);
        _mm256_store_ps(t + i * NR + 8, c[i][1]);
    }
    if (mr == MR && nr == NR)
        return;
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++)
            C[i * ldc + j] = (acc ? C[i * ldc + j] : 0.0f) + t[i * NR + j];
}

/* C [M, N] = A [M, K] . W [N, K]^T; packed: W's panels as pack_all made them (else NULL). */
static void own_gemm(int64_t M, int64_t N, int64_t K, const float *A, const float *W,
                     const float *packed, float *C, float *ap, float *bp) {
    const int64_t np = (N + NR - 1) / NR;
    for (int64_t m0 = 0; m0 < M; m0 += MC) {
        const int64_t mc = M - m0 < MC ? M - m0 : MC;
        const int64_t tiles = (mc + MR - 1) / MR;
        for (int64_t k0 = 0; k0 < K; k0 += KC) {
            const int64_t kc = K - k0 < KC ? K - k0 : KC, lpr = (kc + 15) / 16; /* lines a row */
            for (int64_t i = 0; i < mc; i += MR)
                pack_a(ap + i * kc, A, K, m0 + i, mc - i < MR ? mc - i : MR, k0, kc);
            for (int64_t p = 0; p < np; p++) {
                const int64_t nr = N - p * NR < NR ? N - p * NR : NR;
                const float *b = packed ? packed + p * K * NR + k0 * NR : bp;
                if (!packed)
                    pack_w(bp, W, K, p * NR, nr, k0, kc);
                const int64_t lines = NR * lpr, per = (lines + tiles - 1) / tiles;
                for (int64_t t = 0; t < tiles; t++) {
                    for (int64_t l = t * per;
                         !packed && p + 1 < np && l < (t + 1) * per && l < lines;
                         l++) /* the next panel's rows, spread over this panel's tiles */
                        _mm_prefetch(
                            (const char *)(W + ((p + 1) * NR + l / lpr) * K + k0 + (l % lpr) * 16),
                            _MM_HINT_T0);
                    const int64_t i = t * MR;
                    ukr(kc, ap + i * kc, b, C + (m0 + i) * N + p * NR, N,
                        (int)(mc - i < MR ? mc - i : MR), (int)nr, k0 > 0);
                }
            }
        }
    }
}

/* packed [ceil(N/16), K, 16]: every panel of W [N, K] over the whole K. */
static void pack_all(float *packed, const float *W, int64_t N, int64_t K) {
    for (int64_t p = 0; p * NR < N; p++)
        pack_w(packed + p * K * NR, W, K, p * NR, N - p * NR < NR ? N - p * NR : NR, 0, K);
}

/* The micro-kernel alone on hot operands: GFLOP/s. */
static double ukr_rate(void) {
    float *ap = aligned_alloc(64, sizeof(float) * KC * MR * 4); // [4][KC, 6]
    float *bp = aligned_alloc(64, sizeof(float) * KC * NR);     // [KC, 16]
    float *c = aligned_alloc(64, sizeof(float) * MR * NR);      // [6, 16]
    for (int i = 0; i < KC * MR * 4; i++)
        ap[i] = 1e-3f * (float)(i % 7);
    for (int i = 0; i < KC * NR; i++)
        bp[i] = 1e-3f * (float)(i % 5);
    memset(c, 0, sizeof(float) * MR * NR);
    double best = 0;
    const long n = 100000;
    for (int rep = 0; rep < 5; rep++) {
        const double t0 = mdt_now();
        for (long i = 0; i < n; i++)
            ukr(KC, ap + (i & 3) * KC * MR, bp, c, NR, MR, NR, 1);
        const double r = 2.0 * MR * NR * KC * (double)n / (mdt_now() - t0) * 1e-9;
        best = r > best ? r : best;
    }
    const int ok = isfinite(c[5]);
    free(ap), free(bp), free(c);
    return ok ? best : 0.0;
}

static void shape(int64_t M, int64_t N, int64_t K, int reps, float *ap, float *bp) {
    float *A = malloc(sizeof(float) * (size_t)(M * K));  // [M, K]
    float *C1 = malloc(sizeof(float) * (size_t)(M * N)); // [M, N]
    float *C2 = malloc(sizeof(float) * (size_t)(M * N)); // [M, N]
    float *W[NW], *P[NW];
    mdt_rng r;
    mdt_rng_seed(&r, 7);
    for (int64_t i = 0; i < M * K; i++)
        A[i] = (float)mdt_rng_normal(&r);
    for (int w = 0; w < NW; w++) {
        W[w] = malloc(sizeof(float) * (size_t)(N * K));                               // [N, K]
        P[w] = aligned_alloc(64, sizeof(float) * (size_t)(((N + 15) / 16) * 16 * K)); // panels
        for (int64_t i = 0; i < N * K; i++)
            W[w][i] = (float)mdt_rng_normal(&r) * 0.03f;
        pack_all(P[w], W[w], N, K);
    }
    double t[3][MAXREP], diff = 0;
    for (int rep = -1; rep < reps; rep++) { /* -1: warm-up; the three variants alternate */
        for (int v = 0; v < 3; v++) {
            const double t0 = mdt_now();
            for (int w = 0; w < NW; w++) {
                if (v == 0)
                    mdt_cpu_gemm_linear_f32(A, K, W[w], NULL, C1, N, M, K, N);
                else
                    own_gemm(M, N, K, A, W[w], v == 2 ? P[w] : NULL, C2, ap, bp);
            }
            if (rep >= 0)
                t[v][rep] = (mdt_now() - t0) / NW;
        }
        for (int64_t i = 0; i < M * N; i++)
            diff = fmax(diff, fabs((double)C1[i] - (double)C2[i]));
    }
    const double fl = 2.0 * (double)(M * N * K) * 1e-9;
    const double path = fl / mdt_bench_median(t[0], reps), own = fl / mdt_bench_median(t[1], reps),
                 pre = fl / mdt_bench_median(t[2], reps);
    printf("| %lld x %lld . %lld x %lld | %.1f | %.1f (%.2fx) | %.1f (%.2fx) | %.1e |\n",
           (long long)M, (long long)K, (long long)K, (long long)N, path, own, own / path, pre,
           pre / path, diff);
    for (int w = 0; w < NW; w++)
        free(W[w]), free(P[w]);
    free(A), free(C1), free(C2);
}

int main(int argc, char **argv) {
    int reps = argc > 1 ? atoi(argv[1]) : 5;
    reps = reps < 1 ? 1 : reps > MAXREP ? MAXREP : reps;
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) {
        printf("gemm_ceiling: needs AVX2 + FMA\n");
        return 0;
    }
    char gd[96];
    mdt_cpu_gemm_describe(gd, sizeof gd);
    printf("gemm path: %s; micro-kernel %d x %d, hot in L1: %.1f GFLOP/s\n", gd, MR, NR,
           ukr_rate());
    printf("| M x K . K x N | path GFLOP/s | own | own, weights prepacked | max abs diff |\n"
           "|---|---|---|---|---|\n");
    float *ap = aligned_alloc(64, sizeof(float) * KC * (MC + MR)); // [MC, KC] in row panels
    float *bp = aligned_alloc(64, sizeof(float) * KC * NR);        // [KC, 16]
    const int64_t shapes[][3] = {{32, 1024, 1024},   {64, 1024, 1024},  {96, 1024, 1024},
                                 {96, 4096, 1024},   {96, 1024, 4096},  {1280, 1024, 1024},
                                 {1280, 1024, 5120}, {1024, 4096, 1024}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
        shape(shapes[s][0], shapes[s][1], shapes[s][2], reps, ap, bp);
    free(ap), free(bp);
    return 0;
}
