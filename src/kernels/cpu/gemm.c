/*
 * gemm.c — see gemm.h. The onednn path keeps one matmul primitive per GEMM shape (a forward has
 * a dozen shapes; creating a primitive costs ~1 ms, executing one a few microseconds), runs it on
 * one thread (one rank, one core) and gives it a user scratchpad from this file's buffer so that
 * oneDNN allocates nothing per call and the bytes are accounted (mdt_alloc).
 *
 * Signals wait while a oneDNN primitive runs: oneDNN's generated f32 GEMM kernels (2.6, as
 * Debian ships it, up to the fix of March 2026: issue #4845, PR #4855) point rsp into their heap
 * workspace, so a signal handled on the thread then writes its frame into the heap. `meshdit
 * serve` stopped by SIGTERM during a forward went on computing, answering and freeing over a
 * corrupted heap (ASan caught it once in ~12 stops). Every asynchronous signal is blocked on the
 * calling thread for the call and arrives the moment it ends (two rt_sigprocmask calls, 1.5 us on
 * a KVM guest: 0.15% of a 96-row forward's 307 GEMMs, bench/gemm_shapes.py); faults (SEGV, BUS,
 * FPE, ILL, TRAP) stay deliverable.
 */
#define _POSIX_C_SOURCE 200809L
#include "gemm.h"

#include "cpu.h"

#include <cblas.h>
#include <dnnl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* libgomp's, which libdnnl uses for its threads (Debian builds it with the OpenMP runtime). */
extern void omp_set_num_threads(int n);
/* OpenBLAS's kernel name ("Haswell", "SkylakeX", "Prescott" when it does not know the CPU). */
extern char *openblas_get_corename(void);

typedef struct {
    const char *name;   /* MESHDIT_CPU_GEMM value */
    dnnl_cpu_isa_t cap; /* oneDNN cap (onednn paths) */
    const char *cpu[2]; /* what __builtin_cpu_supports must all say (NULL: nothing) */
} gemm_path;

static const gemm_path k_paths[] = {
    {"openblas", dnnl_cpu_isa_all, {NULL, NULL}},
    {"onednn", dnnl_cpu_isa_all, {NULL, NULL}},
    {"onednn-amx", dnnl_cpu_isa_avx512_core_amx, {"amx-bf16", "avx512bf16"}},
    {"onednn-avx512bf16", dnnl_cpu_isa_avx512_core_bf16, {"avx512bf16", "avx512bw"}},
    {"onednn-avx512", dnnl_cpu_isa_avx512_core, {"avx512bw", "avx512vl"}},
    {"onednn-avx2", dnnl_cpu_isa_avx2, {"avx2", "fma"}},
};
enum { N_PATHS = sizeof k_paths / sizeof k_paths[0] };

static int g_onednn = -1; /* -1: not chosen yet */
static int g_bf16ops;     /* bf16 weights mean bf16 operands (set with the path) */
static int g_bf16able;    /* bf16 operands are possible on this path */
static char g_bf16why[256];
static int g_wide;      /* oneDNN runs its AVX-512 kernels (or wider): the f32 shape rules below */
static int g_swap = -1; /* small-row f32 GEMMs with the weights on the left: -1 by the shape
                         * rule, 0 never, 1 every f32 GEMM on [N, K] weights (tests, benches) */
static int64_t g_swapped; /* GEMMs run in that form since the process began */
static int g_cap_set;     /* oneDNN's cap is set (it can be set once per process) */
static dnnl_cpu_isa_t g_cap = dnnl_cpu_isa_all;
static char g_err[200];

#if defined(__x86_64__)
#include <cpuid.h>
/* CPUID leaf 7 (sub-leaf `sub`) register `reg` (0 eax .. 3 edx) bit `bit`: the bf16 and AMX bits,
 * which clang 14's __builtin_cpu_supports does not know. */
static int cpuid7(unsigned sub, int reg, int bit) {
    unsigned r[4] = {0, 0, 0, 0};
    if (!__get_cpuid_count(7, sub, &r[0], &r[1], &r[2], &r[3]))
        return 0;
    return (int)((r[reg] >> bit) & 1u);
}
#endif

static int has(const char *feature) {
#if defined(__x86_64__)
    /* avx512f also says the OS saves the AVX-512 state; the bf16 bits need it */
    const int avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
    if (strcmp(feature, "amx-bf16") == 0) /* AMX-BF16 and AMX-TILE: leaf 7.0 edx bits 22, 24 */
        return avx512 && cpuid7(0, 3, 22) && cpuid7(0, 3, 24);
    if (strcmp(feature, "avx512bf16") == 0) /* AVX512-BF16: leaf 7.1 eax bit 5 */
        return avx512 && cpuid7(1, 0, 5);
    if (strcmp(feature, "avx512bw") == 0)
        return avx512;
    if (strcmp(feature, "avx512vl") == 0)
        return avx512 && __builtin_cpu_supports("avx512vl");
    if (strcmp(feature, "avx2") == 0)
        return __builtin_cpu_supports("avx2");
    if (strcmp(feature, "fma") == 0)
        return __builtin_cpu_supports("fma");
#endif
    (void)feature;
    return 0;
}

static const gemm_path *find(const char *name) {
    for (int i = 0; i < N_PATHS; i++)
        if (strcmp(k_paths[i].name, name) == 0)
            return &k_paths[i];
    return NULL;
}

static int runs(const gemm_path *p) {
    for (int i = 0; i < 2; i++)
        if (p->cpu[i] && !has(p->cpu[i]))
            return 0;
    return 1;
}

/* auto: onednn wherever oneDNN's AVX2 kernels run (gemm.h says why), else openblas. */
static const gemm_path *auto_path(void) {
    return find(has("avx2") && has("fma") ? "onednn" : "openblas");
}

static mdt_status apply(const gemm_path *p) {
    if (p == &k_paths[0]) {
        g_onednn = 0, g_bf16ops = g_bf16able = g_wide = 0;
        return MDT_OK;
    }
    if (g_cap_set && p->cap != dnnl_cpu_isa_all && p->cap != g_cap)
        return MDT_FAIL(
            MDT_E_UNSUPPORTED,
            "CPU GEMM '%s': oneDNN's instruction-set cap is already set in this process", p->name);
    if (!g_cap_set) {
        if (p->cap != dnnl_cpu_isa_all && dnnl_set_max_cpu_isa(p->cap) != dnnl_success)
            return MDT_FAIL(MDT_E_UNSUPPORTED, "CPU GEMM '%s': oneDNN refused the cap", p->name);
        g_cap_set = 1, g_cap = p->cap;
        omp_set_num_threads(1); /* one thread per rank, like OpenBLAS */
    }
    g_onednn = 1;
    /* oneDNN 2.6 multiplies bf16 from AVX-512 on (natively from AVX512-BF16); below it refuses.
     * Asked once here (the cap is set by now), not on every GEMM. */
    g_bf16ops = g_bf16able = g_wide = dnnl_get_effective_cpu_isa() >= dnnl_cpu_isa_avx512_core;
    return MDT_OK;
}

static void pick(void) {
    if (g_onednn >= 0)
        return;
    const char *env = getenv("MESHDIT_CPU_GEMM");
    const gemm_path *p = env && *env && strcmp(env, "auto") != 0 ? find(env) : auto_path();
    if (!p || !runs(p)) { /* the CLI refuses this before any work */
        mdt_log(MDT_LOG_WARN, "MESHDIT_CPU_GEMM=%s: not a GEMM path this CPU runs; using auto",
                env);
        p = auto_path();
    }
    if (apply(p) != MDT_OK)
        g_onednn = 0, g_bf16ops = g_bf16able = 0;
}

const char *mdt_cpu_gemm(void) {
    pick();
    return g_onednn ? "onednn" : "openblas";
}

int mdt_cpu_gemm_bf16_operands(void) {
    pick();
    return g_bf16ops;
}

int mdt_cpu_gemm_bf16_operands_possible(void) {
    pick();
    return g_bf16able;
}

void mdt_cpu_gemm_set_bf16_operands(int on, const char *why) {
    pick();
    g_bf16ops = on && g_bf16able;
    snprintf(g_bf16why, sizeof g_bf16why, "%s", why ? why : "");
}

const char *mdt_cpu_gemm_bf16_why(void) { return g_bf16why; }

static const char *isa_name(dnnl_cpu_isa_t isa) {
    switch (isa) {
    case dnnl_cpu_isa_avx512_core_amx: return "avx512_core_amx";
    case dnnl_cpu_isa_avx512_core_bf16: return "avx512_core_bf16";
    case dnnl_cpu_isa_avx512_core_vnni: return "avx512_core_vnni";
    case dnnl_cpu_isa_avx512_core: return "avx512_core";
    case dnnl_cpu_isa_avx2_vnni: return "avx2_vnni";
    case dnnl_cpu_isa_avx2: return "avx2";
    default: return "sse41/avx";
    }
}

void mdt_cpu_gemm_describe(char *buf, int64_t n) {
    pick();
    if (g_onednn) {
        const dnnl_version_t *v = dnnl_version();
        snprintf(buf, (size_t)n, "onednn %d.%d (%s)", v->major, v->minor,
                 isa_name(dnnl_get_effective_cpu_isa()));
    } else {
        snprintf(buf, (size_t)n, "openblas (%s)", openblas_get_corename());
    }
}

int mdt_cpu_gemm_available(const char *name) {
    const gemm_path *p = !name ? NULL : strcmp(name, "auto") == 0 ? auto_path() : find(name);
    return p && runs(p) && (!g_cap_set || p->cap == dnnl_cpu_isa_all || p->cap == g_cap);
}

mdt_status mdt_cpu_gemm_select(const char *name) {
    const gemm_path *p = !name ? NULL : strcmp(name, "auto") == 0 ? auto_path() : find(name);
    if (p && runs(p))
        return apply(p);
    char have[160] = "";
    for (int i = 0; i < N_PATHS; i++)
        if (runs(&k_paths[i])) {
            strncat(have, have[0] ? ", " : "", sizeof have - strlen(have) - 1);
            strncat(have, k_paths[i].name, sizeof have - strlen(have) - 1);
        }
    return MDT_FAIL(MDT_E_UNSUPPORTED, "CPU GEMM '%s': %s; this machine runs: %s (or auto)",
                    name ? name : "(null)",
                    p ? "this CPU lacks the instructions" : "no such GEMM path", have);
}

const char *mdt_cpu_gemm_error(void) {
    static char out[sizeof g_err];
    if (!g_err[0])
        return NULL;
    memcpy(out, g_err, sizeof out);
    g_err[0] = '\0';
    return out;
}

/* ---- oneDNN ---- */

typedef struct {
    int bf16, transb, beta1, bias; /* bias: a [N] f32 row added to every output row */
    int packed;                    /* B is [N, K] weights in their packed layout (ldb unused) */
    int64_t M, N, K, lda, ldb, ldc;
    float alpha;
} gemm_key;

typedef struct {
    gemm_key key;
    dnnl_primitive_t prim;
    dnnl_memory_t a, b, c, bias, scratch;
    size_t scratch_bytes;
} gemm_prim;

enum { CACHE = 64 };
/* Output columns per oneDNN call when B is [N, K] (weights): oneDNN 2.6's AMX matmul runs
 * [1280, 1024] x [1024, 4096] at ~380 GFLOP/s but each [., 1024] block of it at ~600. Its AVX2
 * f32 kernels gain a little from the blocks too at few rows (24-96 rows x 1024 . 1024 x 4096:
 * 1.03-1.11x), its AVX-512 f32 kernels lose (0.82x at 96 rows; level at 1280): bf16 GEMMs and
 * f32 below AVX-512 are split, f32 at AVX-512 is not (docs/perf.md, 2026-12-05). */
enum { GEMM_NB = 1024 };
static gemm_prim g_cache[CACHE];
static int g_ncache, g_next_evict;
static dnnl_engine_t g_engine;
static dnnl_stream_t g_stream;
/* the signals held while a primitive runs (file comment), set before g_engine is made */
static sigset_t g_held;
static void *g_scratch;
static size_t g_scratch_bytes;
static float *g_ct; /* the swapped form's product, [N, M] */
static int64_t g_ct_floats;

/* g_ct with room for n floats (grown, never shrunk until mdt_cpu_gemm_release); NULL if it
 * could not be had. */
static float *ct_room(int64_t n) {
    if (g_ct_floats < n) {
        float *p = mdt_alloc(sizeof(float) * (size_t)n);
        if (!p)
            return NULL;
        mdt_free(g_ct);
        g_ct = p, g_ct_floats = n;
    }
    return g_ct;
}

static int fail(const char *what, dnnl_status_t s, const gemm_key *k) {
    if (!g_err[0])
        snprintf(g_err, sizeof g_err,
                 "oneDNN %s failed (status %d) for a %s GEMM [%lld x %lld] . [%lld x %lld]", what,
                 (int)s, k->bf16 ? "bf16" : "f32", (long long)k->M, (long long)k->K,
                 (long long)k->K, (long long)k->N);
    return -1;
}

static void prim_free(gemm_prim *g) {
    dnnl_primitive_destroy(g->prim);
    dnnl_memory_destroy(g->a);
    dnnl_memory_destroy(g->b);
    dnnl_memory_destroy(g->c);
    dnnl_memory_destroy(g->bias);
    dnnl_memory_destroy(g->scratch);
    memset(g, 0, sizeof *g);
}

static int key_eq(const gemm_key *a, const gemm_key *b) {
    return a->bf16 == b->bf16 && a->transb == b->transb && a->beta1 == b->beta1 &&
           a->bias == b->bias && a->packed == b->packed && a->M == b->M && a->N == b->N &&
           a->K == b->K && a->lda == b->lda && a->ldb == b->ldb && a->ldc == b->ldc &&
           a->alpha == b->alpha;
}

/* oneDNN's engine and stream, made on first need (and the signals held, file comment). */
static dnnl_status_t engine_up(void) {
    dnnl_status_t s = dnnl_success;
    if (g_engine)
        return s;
    sigfillset(&g_held);
    static const int k_faults[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGTRAP};
    for (size_t i = 0; i < sizeof k_faults / sizeof k_faults[0]; i++)
        sigdelset(&g_held, k_faults[i]);
    if ((s = dnnl_engine_create(&g_engine, dnnl_cpu, 0)) != dnnl_success)
        return s;
    if ((s = dnnl_stream_create(&g_stream, g_engine, dnnl_stream_default_flags)) != dnnl_success) {
        dnnl_engine_destroy(g_engine);
        g_engine = NULL;
    }
    return s;
}

/* Runs primitive p on the calling thread with the asynchronous signals held (file comment). */
static dnnl_status_t execute(dnnl_primitive_t p, int nargs, const dnnl_exec_arg_t *args) {
    sigset_t old;
    const int masked = pthread_sigmask(SIG_BLOCK, &g_held, &old) == 0;
    dnnl_status_t s = dnnl_primitive_execute(p, g_stream, nargs, args);
    if (s == dnnl_success)
        s = dnnl_stream_wait(g_stream);
    if (masked)
        pthread_sigmask(SIG_SETMASK, &old, NULL);
    return s;
}

static int packed_md(int64_t N, int64_t K, dnnl_memory_desc_t *out);

/* The primitive for key k: from the cache, else created (its memories bound to NULL handles). */
static gemm_prim *prim_get(const gemm_key *k) {
    for (int i = 0; i < g_ncache; i++)
        if (key_eq(&g_cache[i].key, k))
            return &g_cache[i];
    dnnl_status_t s;
    if ((s = engine_up()) != dnnl_success)
        return fail("engine creation", s, k), NULL;
    const dnnl_data_type_t dt = k->bf16 ? dnnl_bf16 : dnnl_f32;
    dnnl_memory_desc_t amd, bmd, cmd, smd, biasmd;
    const dnnl_dims_t ad = {k->M, k->K}, bd = {k->K, k->N}, cd = {k->M, k->N};
    const dnnl_dims_t as = {k->lda, 1}, cs = {k->ldc, 1};
    const dnnl_dims_t bs_t = {1, k->ldb}, bs_n = {k->ldb, 1};
    dnnl_memory_desc_init_by_strides(&amd, 2, ad, dt, as);
    if (k->packed ? packed_md(k->N, k->K, &bmd) != 0
                  : dnnl_memory_desc_init_by_strides(&bmd, 2, bd, dt, k->transb ? bs_t : bs_n) !=
                        dnnl_success)
        return fail("weights layout", dnnl_invalid_arguments, k), NULL;
    dnnl_memory_desc_init_by_strides(&cmd, 2, cd, dnnl_f32, cs);
    const dnnl_dims_t biasd = {1, k->N};
    dnnl_memory_desc_init_by_tag(&biasmd, 2, biasd, dnnl_f32, dnnl_ab);
    dnnl_matmul_desc_t md;
    if ((s = dnnl_matmul_desc_init(&md, &amd, &bmd, k->bias ? &biasmd : NULL, &cmd)) !=
        dnnl_success)
        return fail("matmul description", s, k), NULL;
    dnnl_primitive_attr_t attr;
    dnnl_post_ops_t po = NULL;
    dnnl_primitive_attr_create(&attr);
    dnnl_primitive_attr_set_scratchpad_mode(attr, dnnl_scratchpad_mode_user);
    if (k->alpha != 1.0f)
        dnnl_primitive_attr_set_output_scales(attr, 1, 0, &k->alpha);
    if (k->beta1) {
        dnnl_post_ops_create(&po);
        dnnl_post_ops_append_sum(po, 1.0f);
        dnnl_primitive_attr_set_post_ops(attr, po);
    }
    dnnl_primitive_desc_t pd;
    s = dnnl_primitive_desc_create(&pd, &md, attr, g_engine, NULL);
    dnnl_primitive_attr_destroy(attr);
    if (po)
        dnnl_post_ops_destroy(po);
    if (s != dnnl_success)
        return fail("matmul primitive", s, k), NULL;
    int slot = g_ncache;
    if (slot == CACHE) { /* full: replace entries in turn */
        slot = g_next_evict;
        g_next_evict = (g_next_evict + 1) % CACHE;
        prim_free(&g_cache[slot]);
    }
    gemm_prim *g = &g_cache[slot];
    const char *impl = NULL;
    if (k->packed &&
        dnnl_primitive_desc_query(pd, dnnl_query_impl_info_str, 0, &impl) == dnnl_success && impl &&
        strncmp(impl, "brg", 3) != 0) {
        static int warned; /* correct, but far slower than the layout was chosen for */
        if (!warned++)
            mdt_log(MDT_LOG_WARN,
                    "oneDNN runs a packed-weights GEMM [%lld x %lld] . [%lld x %lld] "
                    "with %s; MESHDIT_CPU_PACK=off keeps weights plain",
                    (long long)k->M, (long long)k->K, (long long)k->K, (long long)k->N, impl);
    }
    smd = *dnnl_primitive_desc_query_md(pd, dnnl_query_scratchpad_md, 0);
    g->scratch_bytes = dnnl_memory_desc_get_size(&smd);
    s = dnnl_primitive_create(&g->prim, pd);
    dnnl_primitive_desc_destroy(pd);
    if (s != dnnl_success)
        return fail("matmul primitive", s, k), NULL;
    if (dnnl_memory_create(&g->a, &amd, g_engine, DNNL_MEMORY_NONE) != dnnl_success ||
        dnnl_memory_create(&g->b, &bmd, g_engine, DNNL_MEMORY_NONE) != dnnl_success ||
        dnnl_memory_create(&g->c, &cmd, g_engine, DNNL_MEMORY_NONE) != dnnl_success ||
        dnnl_memory_create(&g->bias, &biasmd, g_engine, DNNL_MEMORY_NONE) != dnnl_success ||
        dnnl_memory_create(&g->scratch, &smd, g_engine, DNNL_MEMORY_NONE) != dnnl_success) {
        prim_free(g); /* the slot is empty (zero key) and stays counted: harmless */
        return fail("memory object", dnnl_out_of_memory, k), NULL;
    }
    g->key = *k;
    if (slot == g_ncache)
        g_ncache++;
    return g;
}

static void zero_c(float *C, int64_t ldc, int64_t M, int64_t N) {
    for (int64_t i = 0; i < M; i++)
        memset(C + i * ldc, 0, sizeof(float) * (size_t)N);
}

static void onednn_run(const gemm_key *k, const void *A, const void *B, const float *bias,
                       float *C) {
    gemm_prim *g = prim_get(k);
    if (g && g->scratch_bytes > g_scratch_bytes) {
        void *p = mdt_alloc(g->scratch_bytes);
        if (!p) {
            fail("scratchpad allocation", dnnl_out_of_memory, k);
            g = NULL;
        } else {
            mdt_free(g_scratch);
            g_scratch = p, g_scratch_bytes = g->scratch_bytes;
        }
    }
    if (!g) {
        zero_c(C, k->ldc, k->M, k->N);
        return;
    }
    dnnl_memory_set_data_handle(g->a, (void *)(uintptr_t)A);
    dnnl_memory_set_data_handle(g->b, (void *)(uintptr_t)B);
    dnnl_memory_set_data_handle(g->c, C);
    dnnl_memory_set_data_handle(g->bias, (void *)(uintptr_t)bias);
    dnnl_memory_set_data_handle(g->scratch, g->scratch_bytes ? g_scratch : NULL);
    const dnnl_exec_arg_t args[] = {{DNNL_ARG_SRC, g->a},
                                    {DNNL_ARG_WEIGHTS, g->b},
                                    {DNNL_ARG_DST, g->c},
                                    {DNNL_ARG_SCRATCHPAD, g->scratch},
                                    {DNNL_ARG_BIAS, g->bias}};
    const dnnl_status_t s = execute(g->prim, k->bias ? 5 : 4, args);
    if (s != dnnl_success) {
        fail("matmul execution", s, k);
        zero_c(C, k->ldc, k->M, k->N);
    }
}

void mdt_cpu_gemm_release(void) {
    mdt_free(g_scratch);
    mdt_free(g_ct);
    g_scratch = NULL, g_scratch_bytes = 0, g_ct = NULL, g_ct_floats = 0;
}

/* ---- few rows: the weights on the left ----
 * y [M, N] = x [M, K] . W [N, K]^T as the product's transpose, Ct [N, M] = W . x^T, then Ct
 * transposed into y with the bias (and C) added. oneDNN packs its right operand on every call:
 * W (K N floats) in the usual form, x (K M floats) in this one, so where M is small against N the
 * packing falls out of the call and W streams through as rows. Measured on a Zen 4 core
 * (docs/perf.md 2026-12-05), weights cold, against the usual form:
 *   oneDNN 2.6's AVX-512 f32 kernels: K >= 2048 gains at every M in 4..128 (1.02-1.66x, most
 *   at 12-32 rows), K = 1024 at 32..64 rows only (1.07-1.20x; 16, 24 and 80 rows lose, 0.89x,
 *   0.55-0.60x and 0.87-0.92x), and at 32..128 rows where y is strided (ldc > N, as a single
 *   block's MLP columns of [attention | MLP]: the usual form slows by 12-30% there, this one
 *   not at all; 96 x 1024 . 1024 x 4096 into 5120 columns: 81.6 against 100.3 GFLOP/s); the
 *   same products bit for bit at every shape measured with a dense y (a strided y changes the
 *   usual form's kernel, and the two then round apart by ~1e-6);
 *   its AVX2 kernels (capped to them): K >= 2048 gains at 8..48 rows (1.08-1.45x), K = 1024 at
 *   8..16 rows (1.15-1.37x) and at 24..32 rows where N <= 1024 (1.09-1.14x; level or losing at
 *   N >= 3072 and from 40 rows); the products differ in rounding (~2e-6 of the largest output),
 *   by a fixed rule, so every run of a shape rounds the same.
 * The product is the same GEMM (alpha and the reduction unchanged); the bias and C are added in
 * the transpose, one fp32 addition each as the primitive's. */
static int swap_rule(const gemm_key *k) {
    if (k->bf16 || !k->transb || g_swap == 0 || k->M < 2)
        return 0;
    if (g_swap == 1)
        return 1;
    const int64_t M = k->M, N = k->N, K = k->K;
    if (N < 512 || K < 1024)
        return 0;
    if (g_wide) /* a strided output (ldc > N) costs the usual form, not this one */
        return (K >= 2048 && M <= 128) || (M >= 32 && M <= (k->ldc != N ? 128 : 64));
    return M >= 8 && (M <= 16 || (K >= 2048 && M <= 48) || (M <= 32 && N <= 1024));
}

/* The swapped form of k into C (see above); 0 if its scratch could not be had (the caller then
 * runs the usual form). */
static int run_swapped(const gemm_key *k, const void *A, const void *B, const float *bias,
                       float *C) {
    const int64_t M = k->M, N = k->N, ldc = k->ldc;
    if (!ct_room(M * N))
        return 0;
    const gemm_key ks = {.transb = 1,
                         .M = N,
                         .N = M,
                         .K = k->K,
                         .lda = k->ldb,
                         .ldb = k->lda,
                         .ldc = M,
                         .alpha = k->alpha};
    char prev[sizeof g_err];
    memcpy(prev, g_err, sizeof prev);
    onednn_run(&ks, B, A, NULL, g_ct); // Ct [N, M] = W [N, K] . x [M, K]^T
    if (!prev[0] && g_err[0])          /* name the caller's shape, not the transpose's */
        snprintf(g_err, sizeof g_err, "oneDNN failed for an f32 GEMM [%lld x %lld] . [%lld x %lld]",
                 (long long)M, (long long)k->K, (long long)k->K, (long long)N);
    enum { NB = 16 };
    for (int64_t n0 = 0; n0 < N; n0 += NB) { /* y [M, N] (+)= Ct^T (+ bias), 16 columns a pass */
        const int64_t n1 = n0 + NB < N ? n0 + NB : N;
        for (int64_t i = 0; i < M; i++) {
            float *y = C + i * ldc;
            for (int64_t n = n0; n < n1; n++) {
                const float v = g_ct[n * M + i] + (bias ? bias[n] : 0.0f);
                y[n] = k->beta1 ? y[n] + v : v;
            }
        }
    }
    g_swapped++;
    return 1;
}

void mdt_cpu_gemm_set_swap(int mode) { g_swap = mode < 0 ? -1 : mode > 0; }

int64_t mdt_cpu_gemm_swapped(void) { return g_swapped; }

/* mdt_cpu_gemm_run with an optional bias row (the onednn path adds it inside the primitive; the
 * openblas path puts it in C first and accumulates onto it: the same single fp32 addition). */
static void gemm(int bf16, int transb, int64_t M, int64_t N, int64_t K, float alpha, const void *A,
                 int64_t lda, const void *B, int64_t ldb, const float *bias, float beta, float *C,
                 int64_t ldc) {
    if (M <= 0 || N <= 0)
        return;
    pick();
    if (bias && (!g_onednn || beta != 0.0f || K <= 0)) {
        for (int64_t i = 0; i < M; i++)
            memcpy(C + i * ldc, bias, sizeof(float) * (size_t)N);
        bias = NULL, beta = 1.0f;
    }
    if (!g_onednn && !bf16) {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, transb ? CblasTrans : CblasNoTrans, (int)M, (int)N,
                    (int)K, alpha, A, (int)lda, B, (int)ldb, beta, C, (int)ldc);
        return;
    }
    const gemm_key k = {.bf16 = bf16 != 0,
                        .transb = transb != 0,
                        .beta1 = beta != 0.0f,
                        .bias = bias != NULL,
                        .M = M,
                        .N = N,
                        .K = K,
                        .lda = lda,
                        .ldb = ldb,
                        .ldc = ldc,
                        .alpha = alpha};
    if (!g_onednn) { /* a bf16 GEMM needs the onednn path: a caller's bug, reported */
        if (!g_err[0])
            snprintf(g_err, sizeof g_err, "a bf16 GEMM on the openblas path");
        zero_c(C, ldc, M, N);
        return;
    }
    if (K <= 0) { /* oneDNN refuses empty reductions: C = beta * C */
        if (beta == 0.0f)
            zero_c(C, ldc, M, N);
        return;
    }
    if (swap_rule(&k) && run_swapped(&k, A, B, bias, C))
        return;
    if (N >= 2 * GEMM_NB && transb && (bf16 || !g_wide)) { /* column blocks (GEMM_NB) */
        gemm_key kb = k;
        const size_t el = bf16 ? 2 : 4;
        for (int64_t n0 = 0; n0 < N; n0 += GEMM_NB) {
            kb.N = N - n0 < GEMM_NB ? N - n0 : GEMM_NB;
            onednn_run(&kb, A, (const char *)B + (size_t)(n0 * ldb) * el, bias ? bias + n0 : NULL,
                       C + n0);
        }
        return;
    }
    onednn_run(&k, A, B, bias, C);
}

void mdt_cpu_gemm_run(int bf16, int transb, int64_t M, int64_t N, int64_t K, float alpha,
                      const void *A, int64_t lda, const void *B, int64_t ldb, float beta, float *C,
                      int64_t ldc) {
    gemm(bf16, transb, M, N, K, alpha, A, lda, B, ldb, NULL, beta, C, ldc);
}

void mdt_cpu_gemm_linear_f32(const float *x, int64_t ldx, const float *w, const float *b, float *y,
                             int64_t ldy, int64_t M, int64_t K, int64_t N) {
    if (M <= 0 || N <= 0)
        return;
    const mdt_cpu_kernel_set *set = mdt_cpu_kernel_set_get();
    if (M == 1 && K > 0 && set->gemv_f32) { /* one row: the kernel set's row product (cpu.c) */
        set->gemv_f32(x, w, b, y, K, N);    // [1, N]
        return;
    }
    gemm(0, 1, M, N, K, 1.0f, x, ldx, w, K, b, 0.0f, y, ldy);
}

void mdt_cpu_gemm_linear_bf16(const float *x, int64_t ldx, const uint16_t *wh, const float *b,
                              float *y, int64_t ldy, int64_t M, int64_t K, int64_t N, uint16_t *xh,
                              int64_t xh_halves) {
    if (M <= 0 || N <= 0)
        return;
    if (xh_halves < M * K) {
        if (!g_err[0])
            snprintf(g_err, sizeof g_err, "bf16 GEMM scratch of %lld halves for [%lld x %lld]",
                     (long long)xh_halves, (long long)M, (long long)K);
        zero_c(y, ldy, M, N);
        return;
    }
    mdt_cpu_kernel_set_get()->to_bf16_rows(xh, K, x, ldx, M, K); // xh [M, K] = bf16(x)
    mdt_cpu_gemm_linear_bf16h(xh, wh, b, y, ldy, M, K, N);
}

void mdt_cpu_gemm_linear_bf16h(const uint16_t *xh, const uint16_t *wh, const float *b, float *y,
                               int64_t ldy, int64_t M, int64_t K, int64_t N) {
    if (M <= 0 || N <= 0)
        return;
    gemm(1, 1, M, N, K, 1.0f, xh, K, wh, K, b, 0.0f, y, ldy);
}

/* ---- prepacked weights ----
 * oneDNN's f32 matmul packs its weights into a blocked layout on every call: the whole [N, K]
 * matrix read and written once more per GEMM. Weights kept in that layout since the load skip
 * it: 1.08x at a CP rank's 640 rows, 1.04-1.06x at 1280, 1.10-1.13x at 96-128 on a Zen 4 core,
 * the same products bit for bit (docs/perf.md, 2026-12-05: bench/gemm_packed). The layout is the
 * one the f32 matmul asks for (format any) at PACK_ROWS rows; a GEMM of any row count is made on
 * exactly that layout (oneDNN 2.6's brgemm kernels asked the same one from 1 to 4096 rows). Only
 * where oneDNN runs its AVX-512 kernels (g_wide: where it was measured), and only where that
 * layout is not the plain one. */
enum { PACK_ROWS = 1024, PACK_CACHE = 32 };
static struct {
    int64_t N, K;
    dnnl_memory_desc_t md;
} g_pack[PACK_CACHE];
static int g_npack, g_pack_next;

/* The packed layout of [N, K] weights (a memory descriptor of the logical [K, N]); 0 if made. */
static int packed_md(int64_t N, int64_t K, dnnl_memory_desc_t *out) {
    for (int i = 0; i < g_npack; i++)
        if (g_pack[i].N == N && g_pack[i].K == K) {
            *out = g_pack[i].md;
            return 0;
        }
    if (engine_up() != dnnl_success)
        return -1;
    dnnl_memory_desc_t src, w, dst, bias;
    const dnnl_dims_t sd = {PACK_ROWS, K}, wd = {K, N}, dd = {PACK_ROWS, N}, bd = {1, N};
    dnnl_matmul_desc_t md;
    dnnl_primitive_desc_t pd;
    if (dnnl_memory_desc_init_by_tag(&src, 2, sd, dnnl_f32, dnnl_ab) != dnnl_success ||
        dnnl_memory_desc_init_by_tag(&w, 2, wd, dnnl_f32, dnnl_format_tag_any) != dnnl_success ||
        dnnl_memory_desc_init_by_tag(&dst, 2, dd, dnnl_f32, dnnl_ab) != dnnl_success ||
        dnnl_memory_desc_init_by_tag(&bias, 2, bd, dnnl_f32, dnnl_ab) != dnnl_success ||
        dnnl_matmul_desc_init(&md, &src, &w, &bias, &dst) != dnnl_success ||
        dnnl_primitive_desc_create(&pd, &md, NULL, g_engine, NULL) != dnnl_success)
        return -1;
    *out = *dnnl_primitive_desc_query_md(pd, dnnl_query_weights_md, 0);
    dnnl_primitive_desc_destroy(pd);
    const int slot = g_npack < PACK_CACHE ? g_npack++ : g_pack_next;
    if (slot == g_pack_next && g_npack == PACK_CACHE)
        g_pack_next = (g_pack_next + 1) % PACK_CACHE;
    g_pack[slot].N = N, g_pack[slot].K = K, g_pack[slot].md = *out;
    return 0;
}

/* The plain layout of [N, K] weights, row-major (the logical [K, N] transposed); 0 if made. */
static int plain_md(int64_t N, int64_t K, dnnl_memory_desc_t *out) {
    const dnnl_dims_t wd = {K, N};
    return dnnl_memory_desc_init_by_tag(out, 2, wd, dnnl_f32, dnnl_ba) == dnnl_success ? 0 : -1;
}

int64_t mdt_cpu_gemm_packed_floats(int64_t N, int64_t K) {
    pick();
    if (!g_onednn || !g_wide || N <= 0 || K <= 0)
        return 0;
    dnnl_memory_desc_t p, plain;
    if (packed_md(N, K, &p) != 0 || plain_md(N, K, &plain) != 0 ||
        dnnl_memory_desc_equal(&p, &plain))
        return 0;
    return (int64_t)((dnnl_memory_desc_get_size(&p) + 3) / 4);
}

/* Reorders [N, K] weights between the plain row-major layout and the packed one. */
static int reorder(const float *src, float *dst, int64_t N, int64_t K, int to_packed) {
    dnnl_memory_desc_t p, plain;
    const gemm_key k = {.transb = 1, .packed = 1, .M = 0, .N = N, .K = K};
    if (packed_md(N, K, &p) != 0 || plain_md(N, K, &plain) != 0)
        return fail("weights layout", dnnl_invalid_arguments, &k);
    const dnnl_memory_desc_t *from = to_packed ? &plain : &p, *to = to_packed ? &p : &plain;
    dnnl_primitive_desc_t pd;
    dnnl_primitive_t prim;
    dnnl_memory_t a = NULL, b = NULL;
    dnnl_status_t s = dnnl_reorder_primitive_desc_create(&pd, from, g_engine, to, g_engine, NULL);
    if (s != dnnl_success)
        return fail("weights reorder", s, &k);
    s = dnnl_primitive_create(&prim, pd);
    dnnl_primitive_desc_destroy(pd);
    if (s != dnnl_success)
        return fail("weights reorder", s, &k);
    if ((s = dnnl_memory_create(&a, from, g_engine, (void *)(uintptr_t)src)) == dnnl_success &&
        (s = dnnl_memory_create(&b, to, g_engine, dst)) == dnnl_success) {
        const dnnl_exec_arg_t args[] = {{DNNL_ARG_FROM, a}, {DNNL_ARG_TO, b}};
        s = execute(prim, 2, args);
    }
    dnnl_memory_destroy(a);
    dnnl_memory_destroy(b);
    dnnl_primitive_destroy(prim);
    return s == dnnl_success ? 0 : fail("weights reorder", s, &k);
}

int mdt_cpu_gemm_pack(const float *w, float *dst, int64_t N, int64_t K) {
    return reorder(w, dst, N, K, 1);
}

int mdt_cpu_gemm_unpack(const float *src, float *w, int64_t N, int64_t K) {
    return reorder(src, w, N, K, 0);
}

void mdt_cpu_gemm_linear_packed(const float *x, int64_t ldx, const float *wp, const float *b,
                                float *y, int64_t ldy, int64_t M, int64_t K, int64_t N) {
    if (M <= 0 || N <= 0)
        return;
    pick();
    /* oneDNN 2.6 multiplies packed weights with its brgemm kernels only for dense operands (a
     * strided output, as a single block's [attention | MLP] columns, falls to its reference
     * matmul, ~170x slower): strided ones go through a dense copy (M K or M N floats, against
     * the GEMM's M N K multiply-adds) */
    const int64_t need = (ldx != K ? M * K : 0) + (ldy != N ? M * N : 0);
    if (need && !ct_room(need)) {
        const gemm_key kf = {.packed = 1, .M = M, .N = N, .K = K};
        fail("dense operand allocation", dnnl_out_of_memory, &kf);
        zero_c(y, ldy, M, N);
        return;
    }
    const float *xd = x;
    float *yd = ldy != N ? g_ct : y;
    if (ldx != K) {
        float *xc = g_ct + (ldy != N ? M * N : 0); // [M, K]
        for (int64_t i = 0; i < M; i++)
            memcpy(xc + i * K, x + i * ldx, sizeof(float) * (size_t)K);
        xd = xc;
    }
    const gemm_key k = {.transb = 1,
                        .packed = 1,
                        .bias = b != NULL,
                        .M = M,
                        .N = N,
                        .K = K,
                        .lda = K,
                        .ldc = N,
                        .alpha = 1.0f};
    onednn_run(&k, xd, wp, b, yd); // [M, N]
    if (yd != y)
        for (int64_t i = 0; i < M; i++)
            memcpy(y + i * ldy, yd + i * N, sizeof(float) * (size_t)N);
}
