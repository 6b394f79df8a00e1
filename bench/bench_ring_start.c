/*
 * bench_ring_start.c — does how two ranks start a ring step change its rate? One ring step
 * (mdt_ring_start / mdt_ring_wait) of N floats over a ring of the whole world, timed 8 times
 * after each kind of start: a blocking MPI_Barrier, the watchdog's mdt_mesh_barrier (an
 * MPI_Ibarrier and a test loop: ranks leave up to a nap apart), and a blocking barrier after which
 * rank 1 starts a fixed delay late. Prints every time (the slowest rank's), the best and the
 * median. Across the shaped links of scripts/netns-cluster two flows started ~0.1-1 ms apart
 * often run at half the link's rate (docs/perf.md, 2026-12-02).
 *
 * usage: mpiexec -n 2 build/bench/bench_ring_start [floats=1300000]
 */
#define _POSIX_C_SOURCE 200809L
#include "comm/mesh.h"
#include "core/core.h"

#include <stdio.h>
#include <stdlib.h>
#include <time.h>

enum { TIMES = 8 };

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, size;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    const int64_t n = argc > 1 ? atoll(argv[1]) : 1300000; /* the medium Flux ring block */
    float *a = calloc((size_t)n, 4), *b = calloc((size_t)n, 4);
    mdt_mesh *ring = NULL;
    if (!a || !b ||
        mdt_mesh_create_comm(MPI_COMM_WORLD, &(mdt_layout){1, 1, size, 1, NULL}, &ring) != MDT_OK) {
        fprintf(stderr, "bench_ring_start: %s\n", mdt_last_error());
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    /* start kinds: -2 blocking barrier, -1 watchdog barrier, >= 0 rank 1 this many us late */
    const long starts[] = {-2, -1, 20, 100, 1000, 10000};
    for (size_t k = 0; k < sizeof starts / sizeof *starts; k++) {
        double t[TIMES];
        for (int it = 0; it < TIMES; it++) {
            if (starts[k] == -1)
                mdt_mesh_barrier(ring, "bench");
            else
                MPI_Barrier(MPI_COMM_WORLD);
            if (starts[k] > 0 && rank == 1) {
                const struct timespec d = {starts[k] / 1000000, (starts[k] % 1000000) * 1000};
                nanosleep(&d, NULL);
            }
            const double t0 = MPI_Wtime();
            mdt_ring_req rq;
            if (mdt_ring_start(ring, MDT_GROUP_RING, a, b, n, &rq) != MDT_OK ||
                mdt_ring_wait(ring, &rq) != MDT_OK) {
                fprintf(stderr, "bench_ring_start: %s\n", mdt_last_error());
                MPI_Abort(MPI_COMM_WORLD, 1);
            }
            const double mine = MPI_Wtime() - t0;
            MPI_Allreduce(&mine, &t[it], 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
        }
        if (rank == 0) {
            if (starts[k] == -2)
                printf("%-26s", "after MPI_Barrier");
            else if (starts[k] == -1)
                printf("%-26s", "after mdt_mesh_barrier");
            else
                printf("rank 1 %6ld us late      ", starts[k]);
            for (int it = 0; it < TIMES; it++)
                printf(" %.3f", t[it]);
            double best = t[0];
            for (int it = 1; it < TIMES; it++)
                best = t[it] < best ? t[it] : best;
            printf("  best %.3f s (%.2f MB/s), median %.3f s\n", best, (double)n * 4 / best * 1e-6,
                   mdt_median(t, TIMES));
        }
    }
    mdt_mesh_free(ring);
    free(a), free(b);
    MPI_Finalize();
    return 0;
}
