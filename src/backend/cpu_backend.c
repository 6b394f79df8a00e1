/*
 * cpu_backend.c — see cpu_backend.h. The bf16 scratch is grown by mdt_backend_reserve_linear at
 * load time; a forward that finds it short grows it, and if that fails the failure is kept for
 * mdt_backend_check, like an asynchronous device error.
 */
#include "cpu_backend.h"

#include "kernels/cpu/cpu.h"
#include "kernels/cpu/gemm.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int g_bf16;
static float *g_lin_ws;
static int64_t g_lin_ws_n;
static char g_err[160];
/* mdt_k_shared_begin's input, rounded to bf16 once (g_sh_h [M, K]) */
static struct {
    const float *x;
    int64_t ldx, M, K;
} g_sh;
static uint16_t *g_sh_h;
static int64_t g_sh_n;
static int g_sh_depth; /* nested begins on the same x */

static int lin_ws_grow(int64_t floats) {
    if (floats <= g_lin_ws_n)
        return 0;
    float *p = mdt_alloc(sizeof(float) * (size_t)floats);
    if (!p)
        return -1;
    mdt_free(g_lin_ws);
    g_lin_ws = p, g_lin_ws_n = floats;
    return 0;
}

void mdt_cpu_backend_release(void) {
    mdt_free(g_lin_ws);
    g_lin_ws = NULL, g_lin_ws_n = 0;
    mdt_free(g_sh_h);
    g_sh_h = NULL, g_sh_n = 0, g_sh.x = NULL;
    mdt_cpu_gemm_release();
}

void mdt_cpu_backend_start(int bf16) {
    g_bf16 = bf16, g_err[0] = '\0';
    mdt_cpu_backend_release();
}

int64_t mdt_cpu_backend_scratch_bytes(void) { return g_lin_ws_n * 4; }

mdt_status mdt_cpu_backend_measure_bf16(int *operands, double *t_ops, double *t_widen, int *asked) {
    *operands = 0, *t_ops = *t_widen = 0, *asked = 0;
    const char *env = getenv("MESHDIT_CPU_BF16");
    const int possible = mdt_cpu_gemm_bf16_operands_possible();
    if (env && *env && strcmp(env, "auto") != 0) {
        if (strcmp(env, "operands") != 0 && strcmp(env, "widen") != 0)
            return MDT_FAIL(MDT_E_INVALID,
                            "MESHDIT_CPU_BF16='%s': operands, widen or auto (the default)", env);
        if (strcmp(env, "operands") == 0 && !possible)
            return MDT_FAIL(MDT_E_UNSUPPORTED,
                            "MESHDIT_CPU_BF16=operands: this CPU GEMM path (%s) has no bf16 "
                            "GEMM; bf16 weights are widened to f32 here",
                            mdt_cpu_gemm());
        *operands = strcmp(env, "operands") == 0, *asked = 1;
        return MDT_OK;
    }
    if (!possible)
        return MDT_OK;
    enum { M = 256, K = 1024, N = 1024 };
    const int prev = mdt_cpu_gemm_bf16_operands();
    float *x = mdt_alloc(sizeof(float) * M * K), *y = mdt_alloc(sizeof(float) * M * N);
    uint16_t *wh = mdt_alloc(sizeof(uint16_t) * N * K);
    int64_t wsf = 0;
    for (int op = 0; op < 2; op++) {
        mdt_cpu_gemm_set_bf16_operands(op, NULL);
        const int64_t need = mdt_cpu_backend_linear_bf16_ws_floats(M, K, N);
        wsf = need > wsf ? need : wsf;
    }
    float *ws = mdt_alloc(sizeof(float) * (size_t)wsf);
    mdt_status st = MDT_OK;
    if (!x || !y || !wh || !ws)
        st = MDT_FAIL(MDT_E_NOMEM, "out of memory for the bf16 path's measurement");
    for (int64_t i = 0; st == MDT_OK && i < (int64_t)M * K; i++)
        x[i] = (float)((i * 7919) % 2003) / 2003.0f - 0.5f;
    for (int64_t r = 0; st == MDT_OK && r < N; r += M) { /* M rows of weights at a time, in y */
        for (int64_t i = 0; i < (int64_t)M * K; i++)     /* (K = N: y holds M x K) */
            y[i] = (float)(((r * K + i) * 104729) % 1999) / 1999.0f - 0.5f;
        mdt_cpu_kernel_set_get()->to_bf16_rows(wh + r * K, K, y, K, M, K);
    }
    double best[2] = {1e30, 1e30};
    for (int round = 0; st == MDT_OK && round < 4; round++) /* round 0 warms both up */
        for (int op = 0; op < 2; op++) {
            mdt_cpu_gemm_set_bf16_operands(op, NULL);
            const double t0 = mdt_now();
            mdt_cpu_backend_linear_bf16(x, K, wh, NULL, y, N, M, K, N, ws, wsf);
            const double t = mdt_now() - t0;
            if (round > 0 && t < best[op])
                best[op] = t;
        }
    mdt_cpu_gemm_set_bf16_operands(prev, NULL);
    mdt_free(x), mdt_free(y), mdt_free(wh), mdt_free(ws);
    if (st == MDT_OK)
        *t_widen = best[0], *t_ops = best[1], *operands = best[1] < best[0];
    return st;
}

int64_t mdt_cpu_backend_linear_bf16_ws_floats(int64_t M, int64_t K, int64_t N) {
    if (mdt_cpu_gemm_bf16_operands())
        return (M * K + 1) / 2 > 1 ? (M * K + 1) / 2 : 1;
    return mdt_cpu_kernel_set_get()->linear_bf16_ws_floats(K, N);
}

void mdt_cpu_backend_linear_bf16(const float *x, int64_t ldx, const uint16_t *wh, const float *b,
                                 float *y, int64_t ldy, int64_t M, int64_t K, int64_t N, float *ws,
                                 int64_t ws_floats) {
    if (mdt_cpu_gemm_bf16_operands())
        mdt_cpu_gemm_linear_bf16(x, ldx, wh, b, y, ldy, M, K, N, (uint16_t *)(void *)ws,
                                 ws_floats * 2);
    else
        mdt_cpu_kernel_set_get()->linear_bf16(x, ldx, wh, b, y, ldy, M, K, N, ws, ws_floats);
}

mdt_status mdt_cpu_backend_reserve_linear(int64_t K, int64_t N) {
    if (!g_bf16)
        return MDT_OK;
    const int64_t need = mdt_cpu_backend_linear_bf16_ws_floats(0, K, N); /* rows: a forward's */
    if (lin_ws_grow(need) != 0)
        return MDT_FAIL(MDT_E_NOMEM, "out of memory for %lld bytes of bf16 widening scratch",
                        (long long)need * 4);
    return MDT_OK;
}

mdt_status mdt_cpu_backend_check(void) {
    if (g_err[0]) { /* the message is formatted before the sticky error is cleared */
        const mdt_status st = MDT_FAIL(MDT_E_NOMEM, "%s", g_err);
        g_err[0] = '\0';
        return st;
    }
    const char *gemm_err = mdt_cpu_gemm_error();
    if (gemm_err)
        return MDT_FAIL(MDT_E_INVALID, "CPU GEMM: %s", gemm_err);
    return MDT_OK;
}

void mdt_cpu_backend_shared_begin(const float *x, int64_t ldx, int64_t M, int64_t K) {
    if (g_sh_depth > 0 && g_sh.x == x && g_sh.ldx == ldx && g_sh.M == M && g_sh.K == K) {
        g_sh_depth++; /* nested on the same input: already rounded */
        return;
    }
    g_sh.x = NULL, g_sh_depth = 0;
    if (!g_bf16 || !mdt_cpu_gemm_bf16_operands() || M <= 0 || K <= 0)
        return;
    if (M * K > g_sh_n) { /* grows on the first forward, then stays */
        uint16_t *p = mdt_alloc(sizeof(uint16_t) * (size_t)(M * K));
        if (!p)
            return; /* the linears round x themselves */
        mdt_free(g_sh_h);
        g_sh_h = p, g_sh_n = M * K;
    }
    mdt_cpu_kernel_set_get()->to_bf16_rows(g_sh_h, K, x, ldx, M, K); // [M, K]
    g_sh.x = x, g_sh.ldx = ldx, g_sh.M = M, g_sh.K = K, g_sh_depth = 1;
}

void mdt_cpu_backend_shared_end(void) {
    if (g_sh_depth > 0 && --g_sh_depth > 0)
        return;
    g_sh.x = NULL, g_sh_depth = 0;
}

/* The `linear` slot: fp32 weights on the GEMM seam; bf16 weights on the shared rounded input,
 * else through the scratch. */
static void cpu_linear(const float *x, int64_t ldx, const float *w, const uint16_t *wh,
                       const float *b, float *y, int64_t ldy, int64_t M, int64_t K, int64_t N) {
    if (!wh) {
        mdt_cpu_gemm_linear_f32(x, ldx, w, b, y, ldy, M, K, N);
        return;
    }
    if (g_sh.x == x && g_sh.ldx == ldx && g_sh.M == M && g_sh.K == K) {
        mdt_cpu_gemm_linear_bf16h(g_sh_h, wh, b, y, ldy, M, K, N); /* x rounded already */
        return;
    }
    if (lin_ws_grow(mdt_cpu_backend_linear_bf16_ws_floats(M, K, N)) != 0) {
        if (!g_err[0])
            snprintf(g_err, sizeof g_err,
                     "out of memory for the bf16 widening scratch of a [%lld, %lld] weight",
                     (long long)N, (long long)K);
        return;
    }
    mdt_cpu_backend_linear_bf16(x, ldx, wh, b, y, ldy, M, K, N, g_lin_ws, g_lin_ws_n);
}

static mdt_kernel_ops g_k;            /* the set below with the linear above */
static const mdt_kernel_ops *g_k_set; /* the set g_k was made from */

const mdt_kernel_ops *mdt_cpu_backend_kernels(void) {
    const mdt_kernel_ops *set = mdt_cpu_kernels();
    if (set != g_k_set) {
        g_k = *set;
        g_k.linear = cpu_linear;
        g_k_set = set;
    }
    return &g_k;
}
