/*
 * test_allreduce.c — the TP all-reduce on both of its paths: MPI's reduce-scatter + all-gather
 * (small messages, more than two members) and the ring of point-to-point steps (two members, or
 * chunks of 64 KiB and more). Values are small integers, so every sum is exact whatever the
 * order: each member must hold exactly the sum, bit for bit the same on every member, with the
 * byte counter at 2 (P - 1) chunks; sizes not divisible by P (the padded tail, through scratch)
 * and sizes P divides (reduced in place), with the floats after the buffer untouched.
 *
 * usage: mpiexec -n P build/tests/mpi/test_allreduce   (P = 2, 3, 4: one TP group of P)
 */
#include "comm/mesh.h"
#include "harness.h"

#include <stdlib.h>

static int g_rank;

static float val(int rank, int64_t i) { return (float)((rank + 1) * (int)(i % 29) - 7); }

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int P;
    MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &P);
    mdt_mesh *mesh = NULL;
    EXPECT_OK(
        mdt_mesh_create_comm(MPI_COMM_WORLD, &(mdt_layout){1, P, 1, 1, "tp,ring,ulysses"}, &mesh));
    if (!mesh) {
        MPI_Finalize();
        return 1;
    }
    /* small (MPI's path unless P = 2), one below and at the ring's chunk threshold, large */
    const int64_t sizes[] = {1,
                             7,
                             12 * (int64_t)P,
                             1001,
                             16384 * (int64_t)P - 1,
                             16384 * (int64_t)P,
                             16384 * (int64_t)P + 5,
                             300001,
                             75000 * (int64_t)P};
    for (size_t k = 0; k < sizeof sizes / sizeof *sizes; k++) {
        const int64_t n = sizes[k], chunk = (n + P - 1) / P;
        float *x = malloc(sizeof(float) * (size_t)(n + 16)); // [n] and 16 guard floats
        float *first = malloc(sizeof(float) * (size_t)n);
        for (int64_t i = 0; i < n + 16; i++)
            x[i] = val(g_rank, i);
        const int64_t b0 = mesh->bytes_sent[MDT_COLL_ALLREDUCE];
        EXPECT_OK(mdt_allreduce_sum(mesh, MDT_GROUP_TP, x, n)); // x [n] summed over P
        int exact = 1;
        for (int64_t i = 0; i < n; i++) {
            double want = 0;
            for (int r = 0; r < P; r++)
                want += val(r, i);
            exact &= x[i] == (float)want;
        }
        EXPECT(exact, "rank %d, n %lld: the sum is not exact", g_rank, (long long)n);
        int kept = 1;
        for (int64_t i = n; i < n + 16; i++)
            kept &= x[i] == val(g_rank, i);
        EXPECT(kept, "rank %d, n %lld: floats after the buffer changed", g_rank, (long long)n);
        /* every member holds rank 0's bits */
        if (g_rank == 0)
            memcpy(first, x, sizeof(float) * (size_t)n);
        MPI_Bcast(first, (int)n, MPI_FLOAT, 0, MPI_COMM_WORLD);
        EXPECT(memcmp(first, x, sizeof(float) * (size_t)n) == 0,
               "rank %d, n %lld: result differs from rank 0's", g_rank, (long long)n);
        EXPECT(mesh->bytes_sent[MDT_COLL_ALLREDUCE] - b0 == 2 * (int64_t)(P - 1) * chunk * 4,
               "rank %d, n %lld: counted %lld bytes", g_rank, (long long)n,
               (long long)(mesh->bytes_sent[MDT_COLL_ALLREDUCE] - b0));
        free(x), free(first);
    }
    mdt_mesh_free(mesh);
    MPI_TEST_END(g_rank);
}
