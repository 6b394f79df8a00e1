/*
 * cpu_dispatch.c — cpu.h's functions, each a call through the kernel table of the instruction
 * set in use. The table is picked once, at first use: MESHDIT_CPU_ISA if it names one this CPU
 * runs, else the widest the CPU supports (AVX-512 > AVX2 + FMA > x86-64 baseline), so one binary
 * runs on any x86-64 and uses the vector width each machine has.
 */
#include "cpu.h"
#include "cpu_isa.h"
#include "gemm.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

static const mdt_cpu_kernels *g_kern;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

/* The tables of this build, widest first. */
static const mdt_cpu_kernels *const k_tables[] = {
#if defined(__x86_64__)
    &mdt_cpu_kernels_avx512,
    &mdt_cpu_kernels_avx2,
    &mdt_cpu_kernels_x86_64,
#else
    &mdt_cpu_kernels_generic,
#endif
};
enum { N_TABLES = sizeof k_tables / sizeof k_tables[0] };

static int cpu_runs(const mdt_cpu_kernels *t) {
#if defined(__x86_64__) /* (libgcc's constructor has read CPUID by the time this runs) */
    if (strcmp(t->isa, "avx512") == 0) /* what -march=x86-64-v4 may emit */
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
               __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
               __builtin_cpu_supports("bmi2");
    /* what -march=x86-64-v3 may emit; its F16C, MOVBE and LZCNT come with these on every CPU,
     * and clang 14 cannot ask for them */
    if (strcmp(t->isa, "avx2") == 0)
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
               __builtin_cpu_supports("bmi") && __builtin_cpu_supports("bmi2");
#endif
    (void)t;
    return 1; /* the baseline of the build's target */
}

static const mdt_cpu_kernels *find(const char *name) {
    for (int i = 0; i < N_TABLES; i++)
        if (strcmp(k_tables[i]->isa, name) == 0)
            return k_tables[i];
    return NULL;
}

static const mdt_cpu_kernels *widest(void) {
    for (int i = 0; i < N_TABLES; i++)
        if (cpu_runs(k_tables[i]))
            return k_tables[i];
    return k_tables[N_TABLES - 1];
}

/* The set `name` names ("auto": the widest this CPU runs), or NULL. */
static const mdt_cpu_kernels *lookup(const char *name) {
    return !name ? NULL : strcmp(name, "auto") == 0 ? widest() : find(name);
}

static void pick_auto(void) { g_kern = widest(); }

static void pick(void) {
    const char *env = getenv("MESHDIT_CPU_ISA");
    const mdt_cpu_kernels *t = env && *env ? lookup(env) : widest();
    if (!t || !cpu_runs(t)) { /* the CLI refuses this before any work */
        mdt_log(MDT_LOG_WARN, "MESHDIT_CPU_ISA=%s: not a kernel set this CPU runs; using auto",
                env);
        t = widest();
    }
    g_kern = t;
}

static const mdt_cpu_kernels *kern(void) {
    pthread_once(&g_once, pick);
    return g_kern;
}

const char *mdt_cpu_isa(void) { return kern()->isa; }

int mdt_cpu_isa_available(const char *name) {
    const mdt_cpu_kernels *t = name ? find(name) : NULL;
    return t && cpu_runs(t);
}

mdt_status mdt_cpu_isa_select(const char *name) {
    char have[64] = "";
    pthread_once(&g_once, pick_auto); /* the environment is not consulted once a set is chosen */
    const mdt_cpu_kernels *t = lookup(name);
    if (t && cpu_runs(t)) {
        g_kern = t;
        return MDT_OK;
    }
    for (int i = 0; i < N_TABLES; i++)
        if (cpu_runs(k_tables[i])) {
            strncat(have, have[0] ? ", " : "", sizeof have - strlen(have) - 1);
            strncat(have, k_tables[i]->isa, sizeof have - strlen(have) - 1);
        }
    return MDT_FAIL(MDT_E_UNSUPPORTED, "CPU kernels '%s': %s; this machine runs: %s (or auto)",
                    name ? name : "(null)",
                    t ? "this CPU lacks the instructions" : "no such kernel set", have);
}

void mdt_cpu_linear(const float *x, int64_t ldx, const float *w, const float *b, float *y,
                    int64_t ldy, int64_t M, int64_t K, int64_t N) {
    mdt_cpu_gemm_linear_f32(x, ldx, w, b, y, ldy, M, K, N); /* either GEMM path (gemm.h) */
}

void mdt_cpu_linear_bf16(const float *x, int64_t ldx, const uint16_t *wh, const float *b, float *y,
                         int64_t ldy, int64_t M, int64_t K, int64_t N, float *ws,
                         int64_t ws_floats) {
    if (mdt_cpu_gemm_bf16_operands())
        mdt_cpu_gemm_linear_bf16(x, ldx, wh, b, y, ldy, M, K, N, (uint16_t *)(void *)ws,
                                 ws_floats * 2);
    else
        kern()->linear_bf16(x, ldx, wh, b, y, ldy, M, K, N, ws, ws_floats);
}

int64_t mdt_cpu_linear_bf16_ws_floats(int64_t M, int64_t K, int64_t N) {
    if (mdt_cpu_gemm_bf16_operands())
        return (M * K + 1) / 2 > 1 ? (M * K + 1) / 2 : 1;
    return kern()->linear_bf16_ws_floats(K, N);
}

void mdt_cpu_to_bf16_rows(uint16_t *dst, int64_t ldd, const float *src, int64_t lds, int64_t M,
                          int64_t n) {
    kern()->to_bf16_rows(dst, ldd, src, lds, M, n);
}

void mdt_cpu_bf16_widen(float *dst, const uint16_t *src, int64_t n) {
    kern()->bf16_widen(dst, src, n);
}

void mdt_cpu_layernorm_modulate(const float *x, float *y, int64_t M, int64_t C, float eps,
                                const float *shift, const float *scale) {
    kern()->layernorm_modulate(x, y, M, C, eps, shift, scale);
}

void mdt_cpu_heads_prepare(const float *src, int64_t ld, int64_t S, int64_t H, int64_t D,
                           const float *norm_w, float eps, const float *cos_t, const float *sin_t,
                           int64_t rot, mdt_rope_kind kind, float *dst, int64_t Sdst, int64_t s0) {
    kern()->heads_prepare(src, ld, S, H, D, norm_w, eps, cos_t, sin_t, rot, kind, dst, Sdst, s0);
}

void mdt_cpu_rmsnorm(const float *x, const float *w, float *y, int64_t M, int64_t C, float eps) {
    kern()->rmsnorm(x, w, y, M, C, eps);
}

void mdt_cpu_modulate_rows(float *y, int64_t M, int64_t C, const float *table, int64_t ld,
                           const int64_t *idx, int64_t shift_off, int64_t scale_off) {
    kern()->modulate_rows(y, M, C, table, ld, idx, shift_off, scale_off);
}

void mdt_cpu_gate_residual_rows(float *x, const float *y, int64_t ldy, const float *table,
                                int64_t ld, const int64_t *idx, int64_t gate_off, int64_t M,
                                int64_t C) {
    kern()->gate_residual_rows(x, y, ldy, table, ld, idx, gate_off, M, C);
}

void mdt_cpu_swiglu(const float *in, float *out, int64_t M, int64_t n) {
    kern()->swiglu(in, out, M, n);
}

void mdt_cpu_gelu_tanh(float *x, int64_t n) { kern()->gelu_tanh(x, n); }

void mdt_cpu_silu(float *x, int64_t n) { kern()->silu(x, n); }

void mdt_cpu_gate_residual(float *x, const float *y, int64_t ldy, const float *gate, int64_t M,
                           int64_t C) {
    kern()->gate_residual(x, y, ldy, gate, M, C);
}

void mdt_cpu_angle_table(const float *pos, int64_t ldpos, int64_t S, int64_t ncols,
                         const int32_t *col_axis, const double *col_freq, int dbl, float *cos_t,
                         float *sin_t) {
    kern()->angle_table(pos, ldpos, S, ncols, col_axis, col_freq, dbl, cos_t, sin_t);
}

void mdt_cpu_copy2d(float *dst, int64_t ldd, const float *src, int64_t lds, int64_t rows,
                    int64_t cols) {
    kern()->copy2d(dst, ldd, src, lds, rows, cols);
}

void mdt_cpu_copy_rows(float *dst, int64_t ldd, const int64_t *drow, const float *src, int64_t lds,
                       const int64_t *srow, int64_t n, int64_t w) {
    kern()->copy_rows(dst, ldd, drow, src, lds, srow, n, w);
}

void mdt_cpu_fill(float *x, int64_t n, float v) { kern()->fill(x, n, v); }

void mdt_cpu_add(float *y, const float *x, int64_t n) { kern()->add(y, x, n); }

void mdt_cpu_add_bias(float *y, int64_t ldy, const float *b, int64_t M, int64_t N) {
    kern()->add_bias(y, ldy, b, M, N);
}

void mdt_cpu_gelu_rows(float *x, int64_t ld, int64_t M, int64_t n) {
    kern()->gelu_rows(x, ld, M, n);
}

void mdt_cpu_lse_merge(float *O, int64_t ldO, float *Lr, const float *o, int64_t ldo,
                       const float *l, int64_t hn, int64_t L, int64_t D) {
    kern()->lse_merge(O, ldO, Lr, o, ldo, l, hn, L, D);
}

int64_t mdt_cpu_attention_ws_floats(int64_t Sk, int64_t D, int bf16) {
    return kern()->attention_ws_floats(Sk, D, bf16 && mdt_cpu_gemm_bf16_operands());
}

void mdt_cpu_attention(const float *q, const float *k, const float *v, float *out, int64_t ld_out,
                       float *lse, int64_t H, int64_t Sq, int64_t Sk, int64_t sk_valid, int64_t D,
                       float scale, int bf16, float *ws) {
    kern()->attention(q, k, v, out, ld_out, lse, H, Sq, Sk, sk_valid, D, scale,
                      bf16 && mdt_cpu_gemm_bf16_operands(), ws);
}
