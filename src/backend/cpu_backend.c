/*
 * cpu_backend.c — see cpu_backend.h. The bf16 scratch is grown by mdt_backend_reserve_linear at
 * load time; a forward that finds it short grows it, and if that fails the failure is kept for
 * mdt_backend_check, like an asynchronous device error.
 */
#include "cpu_backend.h"

#include "kernels/cpu/cpu.h"
#include "kernels/cpu/gemm.h"

#include <stdio.h>

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
