/* test_kernels.c — every fast CPU kernel against its reference in kernels/ref, on shapes that
 * cross tile boundaries (attention tiles are 64 queries x 256 keys). */
#include "harness.h"
#include "backend/cpu_backend.h"
#include "kernels/cpu/cpu.h"
#include "kernels/cpu/gemm.h"
#include "kernels/ref/ref.h"
#include "core/core.h"
#include "tensor/tensor.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* The kernel set under test (each set this CPU runs, in turn). */
static const mdt_kernel_ops *g_k;

static float *rnd(mdt_rng *r, long n, double scale) {
    float *p = malloc(sizeof(float) * (size_t)n);
    for (long i = 0; i < n; i++)
        p[i] = (float)(scale * mdt_rng_normal(r));
    return p;
}

/* k's linear on weights wk (w itself, or a form of it) against the reference on w [N, K], with
 * and without bias, x [M, ldx] strided, y [M, ldy] strided. */
static void expect_linear(const mdt_kernel_ops *k, const float *x, long ldx, const float *wk,
                          const float *w, const float *b, long M, long K, long N, long ldy) {
    float *xc = malloc(sizeof(float) * M * K), *y = malloc(sizeof(float) * M * ldy),
          *yr = malloc(sizeof(float) * M * N), *yc = malloc(sizeof(float) * M * N);
    for (long i = 0; i < M; i++)
        memcpy(xc + i * K, x + i * ldx, sizeof(float) * K);
    for (int with_bias = 0; with_bias < 2; with_bias++) {
        k->linear(x, ldx, wk, NULL, with_bias ? b : NULL, y, ldy, M, K, N);
        mdt_ref_linear(xc, w, with_bias ? b : NULL, yr, M, K, N);
        for (long i = 0; i < M; i++)
            memcpy(yc + i * N, y + i * ldy, sizeof(float) * N);
        EXPECT_CLOSE(yc, yr, M * N, 1e-5);
    }
    free(xc), free(y), free(yr), free(yc);
}

static void check_linear(mdt_rng *r, long M, long K, long N, long ldx, long ldy) {
    float *x = rnd(r, M * ldx, 1), *w = rnd(r, N * K, 0.2), *b = rnd(r, N, 1);
    expect_linear(g_k, x, ldx, w, w, b, M, K, N, ldy);
    free(x), free(w), free(b);
}

/* f32 linear against the reference: a small shape, and a wide one (N = 2100: the onednn path
 * below AVX-512 splits it into column blocks of 1024, 1024, 52) with strided x and y, K = 0 (bias
 * only), and one-row products. */
static void test_linear(mdt_rng *r) {
    check_linear(r, 37, 53, 29, 60, 31);
    check_linear(r, 5, 40, 2100, 41, 2103);
    check_linear(r, 3, 0, 9, 1, 9);
    /* one row (the row product, AVX2 and wider): K tails of 11 and 5 lanes, N not a multiple of
     * the 4 rows a pass, K below one vector */
    check_linear(r, 1, 1003, 77, 1003, 77);
    check_linear(r, 1, 5, 3, 5, 3);
    check_linear(r, 1, 64, 4, 64, 4);
}

/* The onednn path's two forms of an f32 GEMM on [N, K] weights (gemm.h: mdt_cpu_gemm_set_swap):
 * forced, the weights-on-the-left form runs (counted) and equals the reference with bias, strided
 * x and y, alpha and C accumulated (beta 1), at shapes on both sides of the shape rule; by the rule
 * (gemm.c), each shape takes the form its kernels' table says (AVX-512 or AVX2), the openblas
 * path never. */
static void test_linear_forms(mdt_rng *r) {
    const int onednn = strcmp(mdt_cpu_gemm(), "onednn") == 0;
    const int wide = mdt_cpu_gemm_bf16_operands_possible(); /* oneDNN at AVX-512 or wider */
    enum { NS = 9 };
    const long shapes[NS][4] = {/* M, K, N, y's columns past N */
                                {32, 1024, 512, 5},  {100, 2048, 520, 5}, {200, 1024, 512, 5},
                                {20, 2048, 512, 5},  {48, 512, 600, 5},   {40, 1024, 3072, 5},
                                {12, 1024, 4096, 5}, {96, 1024, 1024, 0}, {96, 1024, 1024, 3}};
    const int by_rule[2][NS] = {{1, 0, 0, 1, 0, 0, 1, 0, 0},  /* AVX2 kernels */
                                {1, 1, 0, 1, 0, 1, 0, 0, 1}}; /* AVX-512 kernels */
    for (int i = 0; i < NS; i++) {
        const long M = shapes[i][0], K = shapes[i][1], N = shapes[i][2], ldx = K + 3,
                   ldy = N + shapes[i][3];
        float *x = rnd(r, M * ldx, 1), *w = rnd(r, N * K, 0.05), *b = rnd(r, N, 1);
        float *xc = malloc(sizeof(float) * M * K), *y = malloc(sizeof(float) * M * ldy),
              *yr = malloc(sizeof(float) * M * N), *yc = malloc(sizeof(float) * M * N);
        for (long m = 0; m < M; m++)
            memcpy(xc + m * K, x + m * ldx, sizeof(float) * K);
        mdt_ref_linear(xc, w, b, yr, M, K, N);
        for (int mode = -1; mode <= 1; mode++) {
            mdt_cpu_gemm_set_swap(mode);
            const int64_t before = mdt_cpu_gemm_swapped();
            g_k->linear(x, ldx, w, NULL, b, y, ldy, M, K, N);
            const int64_t ran = mdt_cpu_gemm_swapped() - before;
            const int want = onednn && (mode == 1 || (mode == -1 && by_rule[wide][i]));
            EXPECT(ran == want,
                   "[%ld x %ld] . [%ld x %ld] (mode %d, %s): %lld swapped GEMMs, want %d", M, K, K,
                   N, mode, mdt_cpu_gemm(), (long long)ran, want);
            for (long m = 0; m < M; m++)
                memcpy(yc + m * N, y + m * ldy, sizeof(float) * N);
            EXPECT_CLOSE(yc, yr, M * N, 1e-5);
        }
        /* C = 0.5 x . w^T + C, the form attention's products use (mdt_cpu_gemm_run) */
        for (long m = 0; m < M; m++)
            for (long n = 0; n < ldy; n++)
                y[m * ldy + n] = n < N ? yr[m * N + n] : -7.0f;
        mdt_cpu_gemm_set_swap(1);
        mdt_cpu_gemm_run(0, 1, M, N, K, 0.5f, x, ldx, w, K, 1.0f, y, ldy);
        mdt_ref_linear(xc, w, NULL, yc, M, K, N);
        long pad = 0;
        for (long m = 0; m < M; m++) {
            for (long n = 0; n < N; n++)
                yc[m * N + n] = yr[m * N + n] + 0.5f * yc[m * N + n];
            for (long n = N; n < ldy; n++)
                pad += y[m * ldy + n] != -7.0f;
            memmove(y + m * N, y + m * ldy, sizeof(float) * N);
        }
        EXPECT(pad == 0, "the swapped form wrote %ld elements past N", pad);
        EXPECT_CLOSE(y, yc, M * N, 1e-5);
        mdt_cpu_gemm_set_swap(-1);
        free(x), free(w), free(b), free(xc), free(y), free(yr), free(yc);
    }
}

/* Prepacked f32 weights (gemm.h, cpu_backend.h): where the path packs (oneDNN's AVX-512 f32
 * kernels), the CPU backend's linear on packed weights equals the reference at shapes with N and K
 * off the blocks (and M = 1, strided x and y, with and without bias), unpacking gives the weights
 * back bit for bit, and a linear on a pointer inside packed weights (a row view) is refused with
 * zeros, not read as plain rows (negative control). Where the path does not pack, packing is
 * refused with a clear error. */
static void test_linear_packed(mdt_rng *r) {
    const int wide = strcmp(mdt_cpu_gemm(), "onednn") == 0 && mdt_cpu_gemm_bf16_operands_possible();
    const mdt_kernel_ops *k = mdt_cpu_backend_kernels();
    const long shapes[][3] = {{96, 1024, 1024}, {37, 200, 130}, {1, 1003, 77}, {5, 40, 300}};
    int packed = 0;
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        const long M = shapes[s][0], K = shapes[s][1], N = shapes[s][2], ldx = K + 5, ldy = N + 3;
        const int64_t pf = mdt_cpu_backend_packed_floats(N, K);
        float *w = rnd(r, N * K, 0.1);
        if (pf <= 0) {
            float dst[16];
            EXPECT(!wide || N * K < 4096, "[%ld, %ld] weights not packed on a packing path", N, K);
            EXPECT_ERR(mdt_cpu_backend_pack(w, dst, N, K), MDT_E_UNSUPPORTED, "not packed");
            free(w);
            continue;
        }
        packed++;
        EXPECT(pf >= N * K, "packed layout of %lld floats for [%ld, %ld]", (long long)pf, N, K);
        float *wp = malloc(sizeof(float) * (size_t)pf), *wu = malloc(sizeof(float) * N * K);
        float *x = rnd(r, M * ldx, 1), *b = rnd(r, N, 1), *y = malloc(sizeof(float) * M * ldy);
        EXPECT_OK(mdt_cpu_backend_pack(w, wp, N, K));
        EXPECT_OK(mdt_cpu_backend_unpack(wp, wu, N, K));
        EXPECT(memcmp(w, wu, sizeof(float) * N * K) == 0, "[%ld, %ld]: unpacked = the weights", N,
               K);
        expect_linear(k, x, ldx, wp, w, b, M, K, N, ldy);
        EXPECT_OK(mdt_cpu_backend_check());
        /* a view 64 floats in: refused, zeros */
        k->linear(x, ldx, wp + 64, NULL, NULL, y, ldy, M, K, N - 1);
        long nonzero = 0;
        for (long m = 0; m < M; m++)
            for (long n = 0; n < N - 1; n++)
                nonzero += y[m * ldy + n] != 0.0f;
        EXPECT(nonzero == 0, "a linear inside packed weights wrote %ld values", nonzero);
        EXPECT_ERR(mdt_cpu_backend_check(), MDT_E_INVALID, "packed weights", "row view");
        /* forgotten: the same memory is plain weights again */
        mdt_cpu_backend_packed_forget(wp);
        memcpy(wp, w, sizeof(float) * N * K);
        expect_linear(k, x, ldx, wp, w, b, M, K, N, ldy);
        free(w), free(wp), free(wu), free(x), free(b), free(y);
    }
    EXPECT(packed == 0 || wide, "weights packed on a path that does not pack (%s)", mdt_cpu_gemm());
    EXPECT(!wide || packed >= 2, "oneDNN AVX-512 f32 path: %d of 4 shapes packed", packed);
    mdt_cpu_backend_set_pack(0);
    EXPECT(mdt_cpu_backend_packed_floats(1024, 1024) == 0, "packing off: nothing packs");
    mdt_cpu_backend_set_pack(1);
}

/* bf16 weights. openblas path: both panel paths (few rows: N panels; many rows: whole matrix,
 * then K blocks forced by a small scratch), strided x and y, with and without bias, against the
 * reference on the same bf16 values; the product is fp32 on exactly widened weights (= f32 linear
 * on them). onednn path: bf16 operands — equal to the reference on bf16-rounded x (fp32
 * accumulation order only), and measurably not the fp32-operand product (x really is rounded). */
static void test_linear_bf16(mdt_rng *r) {
    const long K = 200, N = 67, ldx = 211, ldy = 70;
    const long Ms[] = {1, 5, 31, 32, 77};
    const int ops = mdt_cpu_gemm_bf16_operands();
    float *w = rnd(r, N * K, 0.2), *wf = malloc(sizeof(float) * N * K), *b = rnd(r, N, 1);
    uint16_t *wh = malloc(sizeof(uint16_t) * N * K);
    for (long i = 0; i < N * K; i++)
        wh[i] = mdt_f32_to_bf16(w[i]);
    mdt_cpu_kernel_set_get()->bf16_widen(wf, wh, N * K);
    long widen_bad = 0;
    for (long i = 0; i < N * K; i++)
        widen_bad += wf[i] != mdt_bf16_to_f32(wh[i]);
    EXPECT(widen_bad == 0, "widening differs from mdt_bf16_to_f32 at %ld elements", widen_bad);
    const long need = mdt_cpu_backend_linear_bf16_ws_floats(77, K, N);
    EXPECT(need >= (ops ? 77 * K / 2 : N * K), "scratch for a small matrix holds it whole (%ld)",
           need);
    for (int m = 0; m < 5; m++)
        for (int small = 0; small < 2 - ops; small++) {
            const long M = Ms[m], wsn = small ? N * 48 : need; /* 48: K blocks 48,48,48,48,8 */
            float *x = rnd(r, M * ldx, 1), *xc = malloc(sizeof(float) * M * K),
                  *y = malloc(sizeof(float) * M * ldy), *yr = malloc(sizeof(float) * M * N),
                  *yc = malloc(sizeof(float) * M * N), *yf = malloc(sizeof(float) * M * ldy),
                  *yfc = malloc(sizeof(float) * M * N), *ws = malloc(sizeof(float) * wsn);
            for (long i = 0; i < M; i++)
                memcpy(xc + i * K, x + i * ldx, sizeof(float) * K);
            for (int with_bias = 0; with_bias < 2; with_bias++) {
                mdt_cpu_backend_linear_bf16(x, ldx, wh, with_bias ? b : NULL, y, ldy, M, K, N, ws,
                                            wsn);
                g_k->linear(x, ldx, wf, NULL, with_bias ? b : NULL, yf, ldy, M, K, N);
                if (ops) /* the reference on the operands the onednn path multiplies */
                    mdt_ref_round_bf16(xc, M * K);
                mdt_ref_linear_bf16(xc, wh, with_bias ? b : NULL, yr, M, K, N);
                for (long i = 0; i < M; i++) {
                    memcpy(yc + i * N, y + i * ldy, sizeof(float) * N);
                    memcpy(yfc + i * N, yf + i * ldy, sizeof(float) * N);
                }
                EXPECT(t_rel_err(yc, yr, M * N, 1e-30) <= 1e-5,
                       "bf16 linear (%s) M=%ld scratch %ld bias %d vs reference: %.3e",
                       mdt_cpu_gemm(), M, wsn, with_bias, t_rel_err(yc, yr, M * N, 1e-30));
                const double ef = t_rel_err(yc, yfc, M * N, 1e-30);
                if (ops)
                    EXPECT(ef > 1e-5 && ef < 2e-2,
                           "bf16 operands M=%ld: rounded (not fp32) and close to the fp32-operand "
                           "product: %.3e",
                           M, ef);
                else
                    EXPECT(ef <= 1e-5,
                           "bf16 linear M=%ld vs f32 linear on the widened weights: %.3e", M, ef);
            }
            free(x), free(xc), free(y), free(yr), free(yc), free(yf), free(yfc), free(ws);
            const char *ge = mdt_cpu_gemm_error();
            EXPECT(!ge, "GEMM failure: %s", ge ? ge : "");
        }
    /* a wide weight (N = 2100: column blocks on the onednn path) with bias, strided y */
    {
        const long Mw = 3, Kw = 32, Nw = 2100, ldyw = 2111;
        float *xw = rnd(r, Mw * Kw, 1), *bw = rnd(r, Nw, 1), *ww = rnd(r, Nw * Kw, 0.2);
        float *yw = malloc(sizeof(float) * Mw * ldyw), *yrw = malloc(sizeof(float) * Mw * Nw),
              *ycw = malloc(sizeof(float) * Mw * Nw),
              *wsw =
                  malloc(sizeof(float) * (size_t)mdt_cpu_backend_linear_bf16_ws_floats(Mw, Kw, Nw));
        uint16_t *whw = malloc(sizeof(uint16_t) * Nw * Kw);
        for (long i = 0; i < Nw * Kw; i++)
            whw[i] = mdt_f32_to_bf16(ww[i]);
        mdt_cpu_backend_linear_bf16(xw, Kw, whw, bw, yw, ldyw, Mw, Kw, Nw, wsw,
                                    mdt_cpu_backend_linear_bf16_ws_floats(Mw, Kw, Nw));
        if (ops)
            mdt_ref_round_bf16(xw, Mw * Kw);
        mdt_ref_linear_bf16(xw, whw, bw, yrw, Mw, Kw, Nw);
        for (long i = 0; i < Mw; i++)
            memcpy(ycw + i * Nw, yw + i * ldyw, sizeof(float) * Nw);
        EXPECT(t_rel_err(ycw, yrw, Mw * Nw, 1e-30) <= 1e-5, "wide bf16 linear (%s): %.3e",
               mdt_cpu_gemm(), t_rel_err(ycw, yrw, Mw * Nw, 1e-30));
        free(xw), free(bw), free(ww), free(yw), free(yrw), free(ycw), free(wsw), free(whw);
    }
    /* a scratch too small for the rounded x is a reported failure with zeros, not a wrong sum */
    if (ops) {
        float x[4 * 200], y[4 * 67], ws[10];
        for (int i = 0; i < 4 * 200; i++)
            x[i] = 1.0f;
        for (int i = 0; i < 4 * 67; i++)
            y[i] = 5.0f;
        mdt_cpu_backend_linear_bf16(x, K, wh, NULL, y, N, 4, K, N, ws, 10);
        const char *e = mdt_cpu_gemm_error();
        EXPECT(e && strstr(e, "scratch") && y[0] == 0.0f && y[4 * 67 - 1] == 0.0f,
               "short bf16 scratch: error '%s', y[0] = %g", e ? e : "(none)", y[0]);
    }
    free(w), free(wf), free(b), free(wh);
}

static void test_norms(mdt_rng *r, long C) { /* C: whole 32-lane blocks, a tail, or both */
    const long M = 19;
    float *x = rnd(r, M * C, 3), *shift = rnd(r, C, 1), *scale = rnd(r, C, 1);
    float *y = malloc(sizeof(float) * M * C), *yr = malloc(sizeof(float) * M * C);
    for (long i = 0; i < M * C; i++)
        x[i] += 5.0f; /* a mean far from zero: catches one-pass variance */
    g_k->layernorm_modulate(x, y, M, C, 1e-6f, NULL, NULL);
    mdt_ref_layernorm(x, yr, M, C, 1e-6f);
    EXPECT_CLOSE(y, yr, M * C, 1e-5);
    g_k->layernorm_modulate(x, y, M, C, 1e-6f, shift, scale);
    mdt_ref_modulate(yr, shift, scale, M, C);
    EXPECT_CLOSE(y, yr, M * C, 1e-5);
    free(x), free(shift), free(scale), free(y), free(yr);
}

static void test_heads_prepare(mdt_rng *r) {
    const long S = 13, H = 3, D = 16, ld = 50, Sdst = 20, s0 = 5;
    float *src = rnd(r, S * ld, 2), *w = rnd(r, D, 1), *cs = rnd(r, S * D, 1),
          *sn = rnd(r, S * D, 1);
    float *dst = calloc((size_t)(H * Sdst * D), sizeof(float));
    float *ref = malloc(sizeof(float) * S * H * D), *tmp = malloc(sizeof(float) * S * H * D);
    for (long s = 0; s < S; s++)
        memcpy(tmp + s * H * D, src + s * ld, sizeof(float) * H * D); /* [S, H, D] */
    mdt_ref_rmsnorm(tmp, w, ref, S * H, D, 1e-6f);
    mdt_ref_rope_interleaved(ref, cs, sn, S, H, D);
    g_k->heads_prepare(src, ld, S, H, D, w, 1e-6f, cs, sn, D, MDT_ROPE_INTERLEAVED, dst, Sdst, s0);
    float *got = malloc(sizeof(float) * S * H * D);
    for (long s = 0; s < S; s++)
        for (long h = 0; h < H; h++)
            memcpy(got + (s * H + h) * D, dst + (h * Sdst + s0 + s) * D, sizeof(float) * D);
    EXPECT_CLOSE(got, ref, S * H * D, 1e-5);
    /* rows outside [s0, s0 + S) are untouched */
    int clean = 1;
    for (long h = 0; h < H; h++)
        for (long i = 0; i < s0 * D; i++)
            clean &= dst[h * Sdst * D + i] == 0.0f;
    EXPECT(clean, "heads_prepare wrote outside its rows");
    /* plain copy (v): no norm, no rope */
    g_k->heads_prepare(src, ld, S, H, D, NULL, 0, NULL, NULL, 0, MDT_ROPE_INTERLEAVED, dst, Sdst,
                       0);
    EXPECT(dst[(2 * Sdst + 3) * D + 7] == src[3 * ld + 2 * D + 7], "plain head copy");
    free(src), free(w), free(cs), free(sn), free(dst), free(ref), free(tmp), free(got);
}

/* rotate-half partial RoPE (MiniMax-H3): rot = 12 of D = 16 channels, no norm */
static void test_rope_half(mdt_rng *r) {
    const long S = 7, H = 2, D = 16, rot = 12;
    float *src = rnd(r, S * H * D, 1), *cs = rnd(r, S * rot, 1), *sn = rnd(r, S * rot, 1);
    float *ref = malloc(sizeof(float) * S * H * D), *dst = malloc(sizeof(float) * S * H * D);
    float *got = malloc(sizeof(float) * S * H * D);
    memcpy(ref, src, sizeof(float) * S * H * D);
    mdt_ref_rope_half(ref, cs, sn, S, H, D, rot);
    g_k->heads_prepare(src, H * D, S, H, D, NULL, 0, cs, sn, rot, MDT_ROPE_HALF, dst, S, 0);
    for (long s = 0; s < S; s++)
        for (long h = 0; h < H; h++)
            memcpy(got + (s * H + h) * D, dst + (h * S + s) * D, sizeof(float) * D);
    EXPECT_CLOSE(got, ref, S * H * D, 1e-6);
    EXPECT(got[15] == src[15], "channels past rot pass through");
    /* swiglu, rmsnorm, per-row modulation and gates */
    float *in = rnd(r, S * 2 * D, 2), *o1 = malloc(sizeof(float) * S * D),
          *o2 = malloc(sizeof(float) * S * D);
    g_k->swiglu(in, o1, S, D);
    mdt_ref_swiglu(in, o2, S, D);
    EXPECT_CLOSE(o1, o2, S * D, 1e-6);
    float *w = rnd(r, D, 1);
    g_k->rmsnorm(in, w, o1, S, D, 1e-5f);
    mdt_ref_rmsnorm(in, w, o2, S, D, 1e-5f);
    EXPECT_CLOSE(o1, o2, S * D, 1e-6);
    float *table = rnd(r, 3 * 4 * D, 1); /* 3 rows of [shift | scale | gate | pad] */
    int64_t idx[7] = {2, 0, 1, 1, 2, 0, 2};
    memcpy(o1, o2, sizeof(float) * S * D);
    g_k->modulate_rows(o1, S, D, table, 4 * D, idx, 0, D);
    int ok = 1;
    for (long i = 0; i < S; i++)
        for (long c = 0; c < D; c++) {
            float want =
                o2[i * D + c] * (1.0f + table[idx[i] * 4 * D + D + c]) + table[idx[i] * 4 * D + c];
            ok &= fabsf(o1[i * D + c] - want) <= 1e-6f * (1.0f + fabsf(want));
        }
    EXPECT(ok, "modulate_rows picks each row's table entry");
    float *x = calloc((size_t)(S * D), sizeof(float));
    g_k->gate_residual_rows(x, o2, D, table, 4 * D, idx, 2 * D, S, D);
    EXPECT(x[3 * D + 5] == table[1 * 4 * D + 2 * D + 5] * o2[3 * D + 5], "gate rows");
    free(src), free(cs), free(sn), free(ref), free(dst), free(got), free(in), free(o1), free(o2);
    free(w), free(table), free(x);
}

static void test_activations(mdt_rng *r) {
    const long n = 1000;
    float *a = rnd(r, n, 4), *b = malloc(sizeof(float) * n);
    memcpy(b, a, sizeof(float) * n);
    g_k->gelu_rows(a, n, 1, n);
    mdt_ref_gelu_tanh(b, n);
    EXPECT_CLOSE(a, b, n, 1e-6);
    float *c = rnd(r, n, 4), *d = malloc(sizeof(float) * n);
    memcpy(d, c, sizeof(float) * n);
    g_k->silu(c, n);
    mdt_ref_silu(d, n);
    EXPECT_CLOSE(c, d, n, 1e-6);
    free(a), free(b), free(c), free(d);
}

/* Every float through the exp-based kernels: NaN stays NaN, huge finite inputs give the finite
 * limits, and nothing is undefined behaviour (the sanitizer build runs this: a NaN once reached
 * a float-to-int conversion and a shift of a negative value inside exp). */
static void test_nonfinite(void) {
    const float in[8] = {NAN, INFINITY, -INFINITY, 1e30f, -1e30f, 3e38f, -3e38f, 0.5f};
    float a[8], g[8], sw[16], so[8];
    memcpy(a, in, sizeof a), memcpy(g, in, sizeof g);
    memcpy(sw, in, sizeof in), memcpy(sw + 8, in, sizeof in);
    g_k->silu(a, 8);
    g_k->gelu_rows(g, 8, 1, 8);
    g_k->swiglu(sw, so, 1, 8);
    EXPECT(isnan(a[0]) && isnan(g[0]) && isnan(so[0]), "NaN in, NaN out: %g %g %g", a[0], g[0],
           so[0]);
    EXPECT(a[3] == 1e30f && fabsf(a[4]) == 0.0f && g[3] == 1e30f && fabsf(g[4]) == 0.0f,
           "huge finite inputs: silu %g %g, gelu %g %g", a[3], a[4], g[3], g[4]);
    /* a 16-wide body and a tail: NaN anywhere in a row of scores stays visible */
    float sc[40];
    for (int i = 0; i < 40; i++)
        sc[i] = (float)i * 0.25f;
    sc[17] = NAN;
    float q[8] = {1, 1, 1, 1, 1, 1, 1, 1}, out[8], ws[2 * MDT_ATTN_BQ * MDT_ATTN_BK + 4096];
    float k[40 * 8], v[40 * 8];
    for (int i = 0; i < 40 * 8; i++)
        k[i] = sc[i / 8], v[i] = 1.0f;
    g_k->attention(q, k, v, out, 8, NULL, 1, 1, 40, 40, 8, 1.0f, 0, ws);
    EXPECT(isnan(out[0]), "a NaN key makes the attention row NaN, not a silent number: %g", out[0]);
}

/* attention on q [H, Sq, D], k/v [H, Sk, D] vs the per-head reference; with bf16 operands (onednn
 * path) the reference runs on the bf16-rounded q, k, v: the output differs by the rounding of the
 * probabilities P (measured <= 2e-3, tolerance 5e-3), the log-sum-exp only by fp32 order. */
static void check_attention(mdt_rng *r, long H, long Sq, long Sk, long valid, long D, int bf16) {
    float *q = rnd(r, H * Sq * D, 1), *k = rnd(r, H * Sk * D, 1), *v = rnd(r, H * Sk * D, 1);
    float *out = malloc(sizeof(float) * Sq * H * D), *lse = malloc(sizeof(float) * H * Sq);
    float *ws = malloc(sizeof(float) * (size_t)g_k->attention_ws_floats(Sk, D, bf16));
    float *ro = malloc(sizeof(float) * Sq * D), *rl = malloc(sizeof(float) * Sq);
    float *go = malloc(sizeof(float) * Sq * D);
    float scale = 1.0f / sqrtf((float)D);
    g_k->attention(q, k, v, out, H * D, lse, H, Sq, Sk, valid, D, scale, bf16, ws);
    if (bf16) {
        mdt_ref_round_bf16(q, H * Sq * D);
        mdt_ref_round_bf16(k, H * Sk * D);
        mdt_ref_round_bf16(v, H * Sk * D);
    }
    for (long h = 0; h < H; h++) {
        mdt_ref_attention(q + h * Sq * D, k + h * Sk * D, v + h * Sk * D, ro, rl, Sq, valid, D,
                          scale);
        for (long i = 0; i < Sq; i++)
            memcpy(go + i * D, out + i * H * D + h * D, sizeof(float) * D);
        EXPECT_CLOSE(go, ro, Sq * D, bf16 ? 5e-3 : 2e-6);
        EXPECT_CLOSE(lse + h * Sq, rl, Sq, 2e-6);
    }
    free(q), free(k), free(v), free(out), free(lse), free(ws), free(ro), free(rl), free(go);
}

static void test_attention(mdt_rng *r) {
    for (int bf16 = 0; bf16 <= mdt_cpu_gemm_bf16_operands(); bf16++) {
        check_attention(r, 2, 5, 7, 7, 16, bf16);       /* smaller than one tile */
        check_attention(r, 3, 130, 600, 600, 16, bf16); /* partial query and key tiles */
        check_attention(r, 1, 64, 256, 256, 128, bf16); /* exactly one tile */
        check_attention(r, 2, 70, 520, 300, 32, bf16);  /* keys beyond 300 are padding: masked */
        check_attention(r, 1, 300, 530, 530, 32, bf16); /* several query tiles at either size */
    }
    /* large scores: the running max must keep exp() finite */
    float q[4 * 8], k[300 * 8], v[300 * 8], out[4 * 8], ws[2 * MDT_ATTN_BQ * MDT_ATTN_BK + 4096];
    for (int i = 0; i < 32; i++)
        q[i] = 30.0f;
    for (int i = 0; i < 2400; i++) { /* key j: every channel j/10, value j; scores 24 j */
        const int j = i / 8;
        k[i] = (float)j / 10.0f, v[i] = (float)j;
    }
    g_k->attention(q, k, v, out, 8, NULL, 1, 4, 300, 300, 8, 1.0f, 0, ws);
    int finite = 1;
    for (int i = 0; i < 32; i++)
        finite &= isfinite(out[i]);
    EXPECT(finite && fabsf(out[0] - 299.0f) < 1e-3f, "softmax saturates on the largest key: %g",
           out[0]);
}

/* The ring's merge: attention over keys [0, a) merged with attention over [a, Sk) equals attention
 * over all Sk keys (output and log-sum-exp), whatever a; a block with no valid keys changes
 * nothing. */
static void test_lse_merge(mdt_rng *r) {
    const int64_t H = 3, Sq = 70, Sk = 300, D = 32, ld = H * D;
    float *q = rnd(r, H * Sq * D, 1), *k = rnd(r, H * Sk * D, 1), *v = rnd(r, H * Sk * D, 1);
    float *ws = malloc(sizeof(float) * (size_t)g_k->attention_ws_floats(Sk, D, 0));
    float *full = malloc(sizeof(float) * Sq * ld), *lf = malloc(sizeof(float) * H * Sq);
    float *o1 = malloc(sizeof(float) * Sq * ld), *l1 = malloc(sizeof(float) * H * Sq);
    float *o2 = malloc(sizeof(float) * Sq * ld), *l2 = malloc(sizeof(float) * H * Sq);
    float *kb = malloc(sizeof(float) * H * Sk * D), *vb = malloc(sizeof(float) * H * Sk * D);
    g_k->attention(q, k, v, full, ld, lf, H, Sq, Sk, Sk, D, 0.2f, 0, ws);
    const int64_t splits[] = {1, 100, 257, 299};
    for (int c = 0; c < 4; c++) {
        const int64_t a = splits[c], b = Sk - a;
        g_k->attention(q, k, v, o1, ld, l1, H, Sq, Sk, a, D, 0.2f, 0, ws); /* keys [0, a) */
        for (int64_t h = 0; h < H; h++) /* keys [a, Sk) of every head, as their own block */
            g_k->copy2d(kb + h * b * D, 0, k + (h * Sk + a) * D, 0, 1, b * D),
                g_k->copy2d(vb + h * b * D, 0, v + (h * Sk + a) * D, 0, 1, b * D);
        g_k->attention(q, kb, vb, o2, ld, l2, H, Sq, b, b, D, 0.2f, 0, ws);
        g_k->lse_merge(o1, ld, l1, o2, ld, l2, H, Sq, D);
        EXPECT_CLOSE(o1, full, Sq * ld, 1e-5);
        EXPECT_CLOSE(l1, lf, H * Sq, 1e-5);
    }
    g_k->attention(q, k, v, o2, ld, l2, H, Sq, Sk, 0, D, 0.2f, 0, ws); /* no valid keys */
    memcpy(o1, full, sizeof(float) * Sq * ld), memcpy(l1, lf, sizeof(float) * H * Sq);
    g_k->lse_merge(o1, ld, l1, o2, ld, l2, H, Sq, D);
    const void *po = o1, *pf = full; /* bitwise: nothing may change */
    EXPECT(memcmp(po, pf, sizeof(float) * Sq * ld) == 0, "an empty block changed the output");
    free(q), free(k), free(v), free(ws), free(full), free(lf), free(o1), free(l1), free(o2);
    free(l2), free(kb), free(vb);
}

/* Rotary tables: each column's angle is its id column times its frequency, in double or float. */
static void test_angle_table(mdt_rng *r) {
    const int64_t S = 33, A = 3, N = 10;
    float *pos = rnd(r, S * A, 50), c[33 * 10], sn[33 * 10];
    int32_t ax[10];
    double fr[10];
    for (int i = 0; i < N; i++)
        ax[i] = i % A, fr[i] = 1.0 / pow(10000.0, (double)(i >> 1) / 5.0);
    for (int dbl = 0; dbl < 2; dbl++) {
        g_k->angle_table(pos, A, S, N, ax, fr, dbl, c, sn);
        double md = 0;
        for (int64_t s = 0; s < S; s++)
            for (int64_t i = 0; i < N; i++) {
                const double a = (double)pos[s * A + ax[i]] * fr[i];
                md = fmax(md, fabs(c[s * N + i] - cos(a)) + fabs(sn[s * N + i] - sin(a)));
            }
        EXPECT(md < (dbl ? 1e-6 : 1e-4), "angle table (%s): off by %.3g", dbl ? "double" : "float",
               md);
    }
    free(pos);
}

int main(void) {
    /* every kernel set this CPU runs (x86-64 baseline, AVX2, AVX-512) on every GEMM path
     * (openblas; onednn up to the cap MESHDIT_CPU_GEMM names, else oneDNN's widest), each against
     * the references; the dispatchers must report what they run */
    const char *isas[] = {"generic", "x86-64", "avx2", "avx512"};
    const char *env = getenv("MESHDIT_CPU_GEMM");
    const char *paths[] = {"openblas", env && strncmp(env, "onednn", 6) == 0 ? env : "onednn"};
    int ran = 0;
    const char *widest = NULL;
    for (int i = 0; i < 4; i++) {
        if (!mdt_cpu_isa_available(isas[i]))
            continue;
        widest = isas[i];
        for (int p = 0; p < 2; p++) {
            if (!mdt_cpu_gemm_available(paths[p]))
                continue;
            EXPECT_OK(mdt_cpu_isa_select(isas[i]));
            EXPECT_OK(mdt_cpu_gemm_select(paths[p]));
            EXPECT(strcmp(mdt_cpu_isa(), isas[i]) == 0, "selected %s, running %s", isas[i],
                   mdt_cpu_isa());
            EXPECT(strncmp(paths[p], mdt_cpu_gemm(), strlen(mdt_cpu_gemm())) == 0,
                   "selected GEMM %s, running %s", paths[p], mdt_cpu_gemm());
            char gd[96];
            mdt_cpu_gemm_describe(gd, sizeof gd);
            printf("kernels: %s, gemm %s\n", mdt_cpu_isa(), gd);
            g_k = mdt_cpu_kernels();
            EXPECT(strcmp(g_k->name, isas[i]) == 0, "table of %s is %s", isas[i], g_k->name);
            mdt_rng r;
            mdt_rng_seed(&r, 42);
            test_linear(&r);
            test_linear_forms(&r);
            test_linear_packed(&r);
            test_linear_bf16(&r);
            test_norms(&r, 37);
            test_norms(&r, 96);
            test_norms(&r, 1000);
            test_heads_prepare(&r);
            test_activations(&r);
            test_rope_half(&r);
            test_attention(&r);
            test_lse_merge(&r);
            test_angle_table(&r);
            test_nonfinite();
            ran++;
        }
    }
    EXPECT(ran >= 2, "kernel sets x GEMM paths run: %d", ran);
    EXPECT_ERR(mdt_cpu_isa_select("avx1024"), MDT_E_UNSUPPORTED, "avx1024", "no such kernel set");
    if (!mdt_cpu_isa_available("avx512"))
        EXPECT_ERR(mdt_cpu_isa_select("avx512"), MDT_E_UNSUPPORTED, "lacks the instructions");
    EXPECT_OK(mdt_cpu_isa_select("auto"));
    EXPECT(widest && strcmp(mdt_cpu_isa(), widest) == 0,
           "auto picks %s, the widest this CPU "
           "runs, not %s",
           widest ? widest : "-", mdt_cpu_isa());
    EXPECT_ERR(mdt_cpu_gemm_select("cublas"), MDT_E_UNSUPPORTED, "cublas", "no such GEMM path");
    /* oneDNN's cap is set once per process: another one is refused (or the CPU lacks it) */
    const char *other = strcmp(paths[1], "onednn-avx2") == 0 ? "onednn-avx512" : "onednn-avx2";
    const mdt_status so = mdt_cpu_gemm_select(other);
    EXPECT(so == MDT_E_UNSUPPORTED && (strstr(mdt_last_error(), "already set") ||
                                       strstr(mdt_last_error(), "lacks the instructions")),
           "a second oneDNN cap: %s", mdt_last_error());
    EXPECT_OK(mdt_cpu_gemm_select("openblas"));
    EXPECT(strcmp(mdt_cpu_gemm(), "openblas") == 0 && !mdt_cpu_gemm_bf16_operands(),
           "openblas selectable after onednn");
    TEST_END();
}
