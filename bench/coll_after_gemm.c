/*
 * coll_after_gemm.c — what a TP all-reduce costs inside a step rather than alone: every rank runs
 * the same GEMM (the GEMM seam, one thread) and then mdt_allreduce_sum of its [M, 1024] output, in
 * a loop; each rank prints its own median GEMM and all-reduce seconds, first with the all-reduce
 * right after the GEMM (it holds the wait for the slower rank), then with a barrier between them
 * (timed on its own: the wait; the all-reduce after it is the transfer with the caches as the
 * GEMM left them). With K = 0 there is no GEMM (the all-reduce alone). docs/perf.md, 2026-12-06.
 * usage: mpiexec -n 2 build/bench/coll_after_gemm [M=1024] [K=2048] [reps=30]
 */
#include "bench_stats.h"
#include "comm/mesh.h"
#include "kernels/cpu/gemm.h"

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, size;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    const int64_t M = argc > 1 ? atol(argv[1]) : 1024, K = argc > 2 ? atol(argv[2]) : 2048;
    const int reps = argc > 3 ? atoi(argv[3]) : 30;
    const int64_t N = 1024;
    mdt_mesh *tp = NULL;
    if (M < 1 || K < 0 || reps < 1 ||
        mdt_mesh_create_comm(MPI_COMM_WORLD, &(mdt_layout){1, size, 1, 1, NULL}, &tp) != MDT_OK) {
        if (rank == 0)
            fprintf(stderr, "usage: mpiexec -n P coll_after_gemm [M >= 1] [K >= 0] [reps >= 1]\n");
        MPI_Finalize();
        return 2;
    }
    float *a = mdt_bench_filled(M * (K > 0 ? K : 1), 1); // [M, K]
    float *b = mdt_bench_filled(N * (K > 0 ? K : 1), 2); // [N, K]
    float *c = calloc((size_t)(M * N), sizeof(float));   // [M, N]
    double *tg = malloc(sizeof(double) * (size_t)reps), *ta = malloc(sizeof(double) * (size_t)reps);
    double *tb = malloc(sizeof(double) * (size_t)reps);
    int ok = a && b && c && tg && ta && tb;
    for (int barrier = 0; ok && barrier <= 1; barrier++) {
        for (int r = -2; ok && r < reps; r++) { /* two warm-up rounds */
            const double t0 = MPI_Wtime();
            if (K > 0)
                mdt_cpu_gemm_run(0, 1, M, N, K, 1.0f, a, K, b, K, 0.0f, c, N); // [M, N]
            const double t1 = MPI_Wtime();
            if (barrier)
                MPI_Barrier(MPI_COMM_WORLD);
            const double t2 = MPI_Wtime();
            ok = mdt_allreduce_sum(tp, MDT_GROUP_TP, c, M * N) == MDT_OK;
            if (r >= 0)
                tg[r] = t1 - t0, tb[r] = t2 - t1, ta[r] = MPI_Wtime() - t2;
        }
        if (!ok)
            break;
        printf("rank %d of %d: [%lld x %lld] . [%lld x %lld]^T: GEMM %.3f ms, %s the all-reduce "
               "of %.1f MiB %.3f ms (medians of %d)\n",
               rank, size, (long long)M, (long long)K, (long long)N, (long long)K,
               mdt_bench_median(tg, reps) * 1e3, barrier ? "barrier" : "then",
               (double)(M * N) * 4 / 1048576.0, mdt_bench_median(ta, reps) * 1e3, reps);
        if (barrier)
            printf("rank %d of %d: the barrier (waiting for the peer) %.3f ms\n", rank, size,
                   mdt_bench_median(tb, reps) * 1e3);
    }
    if (!ok)
        fprintf(stderr, "rank %d: %s\n", rank,
                a && b && c && tg && ta && tb ? mdt_last_error() : "out of memory");
    free(a), free(b), free(c), free(tg), free(ta), free(tb);
    mdt_mesh_free(tp);
    MPI_Finalize();
    return ok ? 0 : 1;
}
