/*
 * coll_shm.c — would an all-reduce through MPI-3 shared memory beat mdt_allreduce_sum on one
 * host? Every rank runs the same GEMM (the GEMM seam, one thread), then all-reduces its [M, 1024]
 * output, alternating per round between mdt_allreduce_sum (MPI point-to-point, the ring) and a
 * shared-memory sum: each rank copies its output into its slot of an MPI_Win_allocate_shared
 * window, the ranks meet at a flag barrier (C11 atomics), each sums its 1/P of the rows over all
 * slots into its own output and publishes it, and after a second barrier copies the others' sums
 * (two slot sets alternate, so a call never overwrites a slot a peer still reads). Prints each
 * rank's median GEMM and both all-reduce seconds, and on two ranks checks that both give the
 * same bits (a + b; more ranks sum in another order than the MPI ring's).
 * With K = 0 there is no GEMM (the all-reduce alone). docs/perf.md, 2026-12-06 (third session).
 * usage: mpiexec -n P build/bench/coll_shm [M=1280] [K=2048] [reps=30]
 */
#include "bench_stats.h"
#include "comm/mesh.h"
#include "kernels/cpu/gemm.h"

#include <stdatomic.h>
#include <string.h>

enum { MAX_P = 64, FLAG_BYTES = 128 };

typedef struct {
    int P, me;
    long seq, calls;
    int64_t cap;               /* floats per slot set */
    float *slot[MAX_P];        /* [2, cap] per rank */
    _Atomic long *flag[MAX_P]; /* one cache line per rank */
} shm_group;

/* Every rank has arrived at this barrier (the seq-th). */
static void shm_barrier(shm_group *g) {
    g->seq++;
    atomic_store_explicit(g->flag[g->me], g->seq, memory_order_release);
    for (int j = 0; j < g->P; j++)
        while (atomic_load_explicit(g->flag[j], memory_order_acquire) < g->seq)
            __builtin_ia32_pause();
}

/* buf [n] summed over the ranks, in place; rank order 0, 1, ... for every element. */
static void shm_allreduce(shm_group *g, float *buf, int64_t n) {
    const int64_t set = (g->calls++ & 1) * g->cap;
    const int64_t chunk = (n + g->P - 1) / g->P, lo = g->me * chunk < n ? g->me * chunk : n;
    const int64_t hi = lo + chunk < n ? lo + chunk : n;
    float *mine = g->slot[g->me] + set; // [n] this rank's slot
    memcpy(mine, buf, sizeof(float) * (size_t)n);
    shm_barrier(g);
    for (int64_t i = lo; i < hi; i++) { /* my rows of the sum */
        float s = g->slot[0][set + i];
        for (int j = 1; j < g->P; j++)
            s += g->slot[j][set + i];
        buf[i] = s;
    }
    memcpy(mine + lo, buf + lo, sizeof(float) * (size_t)(hi - lo)); /* published */
    shm_barrier(g);
    for (int j = 0; j < g->P; j++) {
        const int64_t l = j * chunk < n ? j * chunk : n, h = l + chunk < n ? l + chunk : n;
        if (j != g->me && h > l)
            memcpy(buf + l, g->slot[j] + set + l, sizeof(float) * (size_t)(h - l));
    }
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    shm_group g = {0};
    MPI_Comm_rank(MPI_COMM_WORLD, &g.me);
    MPI_Comm_size(MPI_COMM_WORLD, &g.P);
    const int64_t M = argc > 1 ? atol(argv[1]) : 1280, K = argc > 2 ? atol(argv[2]) : 2048;
    const int reps = argc > 3 ? atoi(argv[3]) : 30;
    const int64_t N = 1024;
    MPI_Comm node;
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);
    int node_size;
    MPI_Comm_size(node, &node_size);
    mdt_mesh *tp = NULL;
    if (M < 1 || K < 0 || reps < 1 || g.P > MAX_P || node_size != g.P ||
        mdt_mesh_create_comm(MPI_COMM_WORLD, &(mdt_layout){1, g.P, 1, 1, NULL}, &tp) != MDT_OK) {
        if (g.me == 0)
            fprintf(stderr, "usage: mpiexec -n P coll_shm [M >= 1] [K >= 0] [reps >= 1], all P "
                            "ranks on one host, P <= 64\n");
        MPI_Finalize();
        return 2;
    }
    g.cap = M * N;
    MPI_Win win;
    char *base;
    MPI_Win_allocate_shared(FLAG_BYTES + (MPI_Aint)sizeof(float) * 2 * g.cap, 64, MPI_INFO_NULL,
                            node, &base, &win);
    for (int j = 0; j < g.P; j++) {
        MPI_Aint sz;
        int disp;
        char *p;
        MPI_Win_shared_query(win, j, &sz, &disp, &p);
        g.flag[j] = (_Atomic long *)(void *)p;
        g.slot[j] = (float *)(void *)(p + FLAG_BYTES);
    }
    atomic_store(g.flag[g.me], 0);
    MPI_Barrier(MPI_COMM_WORLD);
    float *a = mdt_bench_filled(M * (K > 0 ? K : 1), 1); // [M, K]
    float *b = mdt_bench_filled(N * (K > 0 ? K : 1), 2); // [N, K]
    float *c = calloc((size_t)(M * N), sizeof(float));   // [M, N]
    float *ref = calloc((size_t)(M * N), sizeof(float)); // [M, N] the MPI sum
    double *tg = malloc(sizeof(double) * (size_t)reps), *tm = malloc(sizeof(double) * (size_t)reps);
    double *ts = malloc(sizeof(double) * (size_t)reps);
    int ok = a && b && c && ref && tg && tm && ts, same = 1;
    for (int r = -2; ok && r < reps; r++) { /* two warm-up rounds */
        for (int shm = 0; ok && shm <= 1; shm++) {
            const double t0 = MPI_Wtime();
            if (K > 0)
                mdt_cpu_gemm_run(0, 1, M, N, K, 1.0f, a, K, b, K, 0.0f, c, N); // [M, N]
            else
                memcpy(c, a, sizeof(float) * (size_t)M); // [M] of [M, N]
            const double t1 = MPI_Wtime();
            if (shm)
                shm_allreduce(&g, c, M * N);
            else
                ok = mdt_allreduce_sum(tp, MDT_GROUP_TP, c, M * N) == MDT_OK;
            const double t2 = MPI_Wtime();
            if (shm && g.P == 2) /* a + b either way; more ranks sum in another order */
                same &= memcmp(c, ref, sizeof(float) * (size_t)(M * N)) == 0;
            else
                memcpy(ref, c, sizeof(float) * (size_t)(M * N));
            if (r >= 0)
                tg[r] = t1 - t0, (shm ? ts : tm)[r] = t2 - t1;
        }
    }
    if (ok)
        printf("rank %d of %d: [%lld x %lld] . [%lld x %lld]^T: GEMM %.3f ms, then the all-reduce "
               "of %.1f MiB: MPI %.3f ms, shared memory %.3f ms (medians of %d)%s\n",
               g.me, g.P, (long long)M, (long long)K, (long long)N, (long long)K,
               mdt_bench_median(tg, reps) * 1e3, (double)(M * N) * 4 / 1048576.0,
               mdt_bench_median(tm, reps) * 1e3, mdt_bench_median(ts, reps) * 1e3, reps,
               same ? "" : "; the sums DIFFER");
    else
        fprintf(stderr, "rank %d: %s\n", g.me,
                a && b && c && ref && tg && tm && ts ? mdt_last_error() : "out of memory");
    free(a), free(b), free(c), free(ref), free(tg), free(tm), free(ts);
    MPI_Win_free(&win);
    MPI_Comm_free(&node);
    mdt_mesh_free(tp);
    MPI_Finalize();
    return ok && same ? 0 : 1;
}
