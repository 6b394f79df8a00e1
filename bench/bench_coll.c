/*
 * bench_coll.c — bandwidth of meshdit's collectives per kind on this host (functional numbers:
 * MPI over shared memory between oversubscribed ranks, never a cluster figure). Every rank
 * forms a 1-D group of the whole world; sizes 1-64 MiB; median of 5 after a warm-up.
 * usage: mpiexec -n N build/bench/bench_coll
 */
#include "comm/mesh.h"

#include <stdio.h>
#include <stdlib.h>

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, size;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    mdt_mesh *tp = NULL, *ring = NULL, *uly = NULL;
    mdt_mesh_create_comm(MPI_COMM_WORLD, &(mdt_layout){1, size, 1, 1, NULL}, &tp);
    mdt_mesh_create_comm(MPI_COMM_WORLD, &(mdt_layout){1, 1, size, 1, NULL}, &ring);
    mdt_mesh_create_comm(MPI_COMM_WORLD, &(mdt_layout){1, 1, 1, size, NULL}, &uly);
    for (int64_t mib = 1; mib <= 64; mib *= 4) {
        const int64_t n = mib * 262144; /* floats */
        float *a = calloc((size_t)n, 4), *b = calloc((size_t)n, 4);
        int64_t cnt[4096], dsp[4096];
        for (int i = 0; i < size; i++)
            cnt[i] = n / size, dsp[i] = i * (n / size);
        const char *names[4] = {"allreduce", "alltoall", "allgather", "ring sendrecv"};
        for (int kind = 0; kind < 4; kind++) {
            double t[6];
            for (int it = 0; it < 6; it++) {
                MPI_Barrier(MPI_COMM_WORLD);
                double t0 = MPI_Wtime();
                if (kind == 0)
                    mdt_allreduce_sum(tp, MDT_GROUP_TP, a, n);
                else if (kind == 1)
                    mdt_alltoallv_floats(uly, MDT_GROUP_ULYSSES, a, cnt, dsp, b, cnt, dsp);
                else if (kind == 2)
                    mdt_allgather_floats(tp, MDT_GROUP_TP, a, b, n / size);
                else {
                    mdt_ring_req rq;
                    mdt_ring_start(ring, MDT_GROUP_RING, a, b, n, &rq);
                    mdt_ring_wait(ring, &rq);
                }
                t[it] = MPI_Wtime() - t0;
            }
            qsort(t + 1, 5, sizeof(double), cmp);
            double med = t[3], payload = (double)n * 4;
            if (rank == 0)
                printf("%-14s %3lld MiB on %d ranks: median %.4f s, algbw %.2f GB/s\n", names[kind],
                       (long long)mib, size, med, payload / med * 1e-9);
        }
        free(a), free(b);
    }
    mdt_mesh_free(tp), mdt_mesh_free(ring), mdt_mesh_free(uly);
    MPI_Finalize();
    return 0;
}
