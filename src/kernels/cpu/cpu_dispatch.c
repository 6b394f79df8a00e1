/*
 * cpu_dispatch.c — picks the kernel set (cpu.h) of the instruction set in use; callers then call
 * through its table. The set is picked once, at first use: MESHDIT_CPU_ISA if it names one this CPU
 * runs, else the widest the CPU supports (AVX-512 > AVX2 + FMA > x86-64 baseline), so one binary
 * runs on any x86-64 and uses the vector width each machine has.
 */
#include "cpu.h"
#include "cpu_isa.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

static const mdt_cpu_kernel_set *g_kern;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

/* The tables of this build, widest first. */
static const mdt_cpu_kernel_set *const k_tables[] = {
#if defined(__x86_64__)
    &mdt_cpu_kernels_avx512,
    &mdt_cpu_kernels_avx2,
    &mdt_cpu_kernels_x86_64,
#else
    &mdt_cpu_kernels_generic,
#endif
};
enum { N_TABLES = sizeof k_tables / sizeof k_tables[0] };

static int cpu_runs(const mdt_cpu_kernel_set *t) {
#if defined(__x86_64__) /* (libgcc's constructor has read CPUID by the time this runs) */
    if (strcmp(t->k.name, "avx512") == 0) /* what -march=x86-64-v4 may emit */
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
               __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
               __builtin_cpu_supports("bmi2");
    /* what -march=x86-64-v3 may emit; its F16C, MOVBE and LZCNT come with these on every CPU,
     * and clang 14 cannot ask for them */
    if (strcmp(t->k.name, "avx2") == 0)
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
               __builtin_cpu_supports("bmi") && __builtin_cpu_supports("bmi2");
#endif
    (void)t;
    return 1; /* the baseline of the build's target */
}

static const mdt_cpu_kernel_set *find(const char *name) {
    for (int i = 0; i < N_TABLES; i++)
        if (strcmp(k_tables[i]->k.name, name) == 0)
            return k_tables[i];
    return NULL;
}

static const mdt_cpu_kernel_set *widest(void) {
    for (int i = 0; i < N_TABLES; i++)
        if (cpu_runs(k_tables[i]))
            return k_tables[i];
    return k_tables[N_TABLES - 1];
}

/* The set `name` names ("auto": the widest this CPU runs), or NULL. */
static const mdt_cpu_kernel_set *lookup(const char *name) {
    return !name ? NULL : strcmp(name, "auto") == 0 ? widest() : find(name);
}

static void pick_auto(void) { g_kern = widest(); }

static void pick(void) {
    const char *env = getenv("MESHDIT_CPU_ISA");
    const mdt_cpu_kernel_set *t = env && *env ? lookup(env) : widest();
    if (!t || !cpu_runs(t)) { /* the CLI refuses this before any work */
        mdt_log(MDT_LOG_WARN, "MESHDIT_CPU_ISA=%s: not a kernel set this CPU runs; using auto",
                env);
        t = widest();
    }
    g_kern = t;
}

static const mdt_cpu_kernel_set *kern(void) {
    pthread_once(&g_once, pick);
    return g_kern;
}

const mdt_cpu_kernel_set *mdt_cpu_kernel_set_get(void) { return kern(); }
const mdt_kernel_ops *mdt_cpu_kernels(void) { return &kern()->k; }
const char *mdt_cpu_isa(void) { return kern()->k.name; }

int mdt_cpu_isa_available(const char *name) {
    const mdt_cpu_kernel_set *t = name ? find(name) : NULL;
    return t && cpu_runs(t);
}

mdt_status mdt_cpu_isa_select(const char *name) {
    char have[64] = "";
    pthread_once(&g_once, pick_auto); /* the environment is not consulted once a set is chosen */
    const mdt_cpu_kernel_set *t = lookup(name);
    if (t && cpu_runs(t)) {
        g_kern = t;
        return MDT_OK;
    }
    for (int i = 0; i < N_TABLES; i++)
        if (cpu_runs(k_tables[i])) {
            strncat(have, have[0] ? ", " : "", sizeof have - strlen(have) - 1);
            strncat(have, k_tables[i]->k.name, sizeof have - strlen(have) - 1);
        }
    return MDT_FAIL(MDT_E_UNSUPPORTED, "CPU kernels '%s': %s; this machine runs: %s (or auto)",
                    name ? name : "(null)",
                    t ? "this CPU lacks the instructions" : "no such kernel set", have);
}
