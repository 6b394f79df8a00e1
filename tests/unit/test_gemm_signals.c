/* test_gemm_signals.c — a signal handled while the onednn path multiplies runs on the thread's
 * own stack and leaves the GEMM's output unchanged. oneDNN 2.6's generated f32 GEMM kernels point
 * rsp into their heap workspace (oneDNN issue #4845): without gemm.c's signal mask the kernel
 * writes each signal frame into the heap, which glibc reports as "corrupted size vs. prev_size"
 * or this test as handlers running off the stack. A second thread sends SIGUSR1 to the one
 * multiplying every 100 us for the whole loop; the handler notes where its frame lies. */
#define _GNU_SOURCE /* pthread_getattr_np */
#include "harness.h"
#include "core/core.h"
#include "kernels/cpu/gemm.h"

#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static uintptr_t g_lo, g_hi; /* the multiplying thread's stack */
static atomic_int g_delivered, g_off_stack, g_done;
static pthread_t g_worker;

static void on_usr1(int sig) {
    (void)sig;
    const uintptr_t frame = (uintptr_t)__builtin_frame_address(0);
    atomic_fetch_add(&g_delivered, 1);
    if (frame < g_lo || frame >= g_hi)
        atomic_fetch_add(&g_off_stack, 1);
}

static void *kicker(void *unused) {
    (void)unused;
    const struct timespec gap = {0, 100000};
    while (!atomic_load(&g_done)) {
        pthread_kill(g_worker, SIGUSR1);
        nanosleep(&gap, NULL);
    }
    return NULL;
}

int main(void) {
    if (!mdt_cpu_gemm_available("onednn")) {
        printf("gemm_signals: skipped: no onednn path on this CPU\n");
        return 0;
    }
    EXPECT_OK(mdt_cpu_gemm_select("onednn"));
    pthread_attr_t at;
    void *lo = NULL;
    size_t sz = 0;
    EXPECT(pthread_getattr_np(pthread_self(), &at) == 0 &&
               pthread_attr_getstack(&at, &lo, &sz) == 0,
           "this thread's stack");
    pthread_attr_destroy(&at);
    g_lo = (uintptr_t)lo, g_hi = (uintptr_t)lo + sz, g_worker = pthread_self();

    /* a double block's shape at 96 tokens (the cache bench's): the AVX2 and AVX-512 f32 kernels */
    enum { M = 96, K = 1024, N = 1024, ITERS = 200 };
    mdt_rng r;
    mdt_rng_seed(&r, 7);
    float *x = malloc(sizeof(float) * M * K), *w = malloc(sizeof(float) * N * K);  // [M, K], [N, K]
    float *y0 = malloc(sizeof(float) * M * N), *y = malloc(sizeof(float) * M * N); // [M, N]
    for (long i = 0; i < (long)M * K; i++)
        x[i] = (float)mdt_rng_normal(&r);
    for (long i = 0; i < (long)N * K; i++)
        w[i] = (float)(0.05 * mdt_rng_normal(&r));
    mdt_cpu_gemm_linear_f32(x, K, w, NULL, y0, N, M, K, N); // y0 [M, N] = x . w^T, no signals

    struct sigaction sa, prev;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_usr1;
    sigemptyset(&sa.sa_mask);
    EXPECT(sigaction(SIGUSR1, &sa, &prev) == 0, "SIGUSR1 handler");
    pthread_t t;
    EXPECT(pthread_create(&t, NULL, kicker, NULL) == 0, "signal thread");
    int differ = 0;
    for (int it = 0; it < ITERS; it++) {
        mdt_cpu_gemm_linear_f32(x, K, w, NULL, y, N, M, K, N); // y [M, N], signals arriving
        differ += t_rel_err(y, y0, (long)M * N, 1e-30) != 0;   /* bit-equal, NaN a difference */
    }
    atomic_store(&g_done, 1);
    pthread_join(t, NULL);
    sigaction(SIGUSR1, &prev, NULL);

    const int delivered = atomic_load(&g_delivered), off = atomic_load(&g_off_stack);
    printf("gemm_signals: %s, %d GEMMs, %d signals handled, %d off the stack, %d outputs changed\n",
           mdt_cpu_gemm(), ITERS, delivered, off, differ);
    EXPECT(delivered >= ITERS / 4, "only %d signals reached the multiplying thread", delivered);
    EXPECT(off == 0, "%d of %d signal frames were not on the thread's stack (rsp in the heap)", off,
           delivered);
    EXPECT(differ == 0, "%d of %d GEMMs under signals differ from the one without", differ, ITERS);
    EXPECT(mdt_cpu_gemm_error() == NULL, "GEMM error");
    free(x), free(w), free(y0), free(y);
    TEST_END();
}
