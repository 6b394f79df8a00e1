/*
 * coll_overlap.c — can a TP all-reduce travel while the GEMM that produces it runs, on this host's
 * MPI without an async progress thread? Every rank runs a rowwise linear's GEMM [M, K] . [N, K]^T
 * and the all-reduce of its [M, N] output four ways, alternating within each repetition:
 *   gemm     the GEMM alone (no communication: the floor);
 *   cut      the GEMM cut into `chunks` row blocks, no communication (what the cut costs);
 *   serial   the GEMM, then mdt_allreduce_sum (what mdt_dit_row_linear does);
 *   chunks   the GEMM cut into `chunks` row blocks; after each block a non-blocking two-member
 *            ring all-reduce of its rows starts (the same two steps as mesh.c's ring), and every
 *            started one is moved along (MPI_Testall, the add between the steps) after each
 *            later block; the last ones are waited for at the end.
 * The weights are prepacked where the GEMM path keeps them so (as the CPU backend does).
 * Prints each rank's medians and what the communication adds over the GEMM alone, per way.
 * Two ranks only (the bench's ring is the two-member one). docs/perf.md, 2026-12-07.
 * usage: mpiexec -n 2 build/bench/coll_overlap [M=1280] [K=2560] [chunks=4] [reps=20]
 */
#include "bench_stats.h"
#include "comm/mesh.h"
#include "kernels/cpu/gemm.h"

#include <string.h>

enum { MAX_CHUNKS = 64 };

/* One chunk's all-reduce in flight: full [2, half] in place, tmp [half] the peer's half. */
typedef struct nb_allreduce {
    float *full, *tmp;
    int64_t half;
    int phase; /* 1: halves crossing, 2: summed halves crossing, 0: done */
    int tag;
    MPI_Request rq[2];
} nb_allreduce;

static void nb_post(nb_allreduce *r, MPI_Comm comm, int me, const float *send, float *recv) {
    const int peer = 1 - me;
    MPI_Irecv(recv, (int)r->half, MPI_FLOAT, peer, r->tag + r->phase, comm, &r->rq[0]);
    MPI_Isend(send, (int)r->half, MPI_FLOAT, peer, r->tag + r->phase, comm, &r->rq[1]);
}

static void nb_start(nb_allreduce *r, MPI_Comm comm, int me) {
    r->phase = 1; /* send my half, take the peer's copy of the other half into tmp */
    nb_post(r, comm, me, r->full + me * r->half, r->tmp);
}

/* Moves r along; 1 when it is done. */
static int nb_progress(nb_allreduce *r, MPI_Comm comm, int me) {
    int done = 0;
    MPI_Status st[2];
    if (r->phase == 0)
        return 1;
    MPI_Testall(2, r->rq, &done, st);
    if (!done)
        return 0;
    if (r->phase == 1) {
        float *acc = r->full + (1 - me) * r->half; // [half] the half I own summed
        for (int64_t i = 0; i < r->half; i++)
            acc[i] += r->tmp[i];
        r->phase = 2; /* pass my summed half on, take the peer's into mine */
        nb_post(r, comm, me, acc, r->full + me * r->half);
        return 0;
    }
    r->phase = 0;
    return 1;
}

/* y [m, N] = x [m, K] . w^T through the path the linears use (prepacked weights when wp). */
static void linear(const float *x, const float *w, const float *wp, float *y, int64_t m, int64_t K,
                   int64_t N) {
    if (wp)
        mdt_cpu_gemm_linear_packed(x, K, wp, NULL, y, N, m, K, N); // [m, N]
    else
        mdt_cpu_gemm_linear_f32(x, K, w, NULL, y, N, m, K, N); // [m, N]
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, size;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    const int64_t M = argc > 1 ? atol(argv[1]) : 1280, K = argc > 2 ? atol(argv[2]) : 2560;
    const int nc = argc > 3 ? atoi(argv[3]) : 4, reps = argc > 4 ? atoi(argv[4]) : 20;
    const int64_t N = 1024;
    mdt_mesh *tp = NULL;
    if (size != 2 || M < 1 || K < 1 || nc < 1 || nc > MAX_CHUNKS || M % nc || reps < 1 ||
        mdt_mesh_create_comm(MPI_COMM_WORLD, &(mdt_layout){1, size, 1, 1, NULL}, &tp) != MDT_OK) {
        if (rank == 0)
            fprintf(stderr, "usage: mpiexec -n 2 coll_overlap [M >= 1] [K >= 1] [chunks dividing "
                            "M, <= 64] [reps >= 1]\n");
        MPI_Finalize();
        return 2;
    }
    MPI_Comm comm = mdt_mesh_comm(tp, MDT_GROUP_TP);
    const int64_t mc = M / nc;             /* rows per chunk; N even, so each chunk halves */
    float *a = mdt_bench_filled(M * K, 1); // [M, K]
    float *b = mdt_bench_filled(N * K, 2); // [N, K]
    float *c = calloc((size_t)(M * N), sizeof(float)); // [M, N]
    float *ref = malloc(sizeof(float) * (size_t)(M * N));
    float *tmp = malloc(sizeof(float) * (size_t)(M * N / 2)); // [chunks, mc N / 2]
    const int64_t npk = mdt_cpu_gemm_packed_floats(N, K);
    float *wp = npk > 0 ? malloc(sizeof(float) * (size_t)npk) : NULL; // packed [N, K]
    if (wp && b && mdt_cpu_gemm_pack(b, wp, N, K) != 0)
        free(wp), wp = NULL;
    double *t[4];
    for (int w = 0; w < 4; w++)
        t[w] = malloc(sizeof(double) * (size_t)reps);
    int ok = a && b && c && ref && tmp && t[0] && t[1] && t[2] && t[3], same = 1;
    for (int r = -2; ok && r < reps; r++) { /* two warm-up rounds */
        for (int w = 0; w < 4 && ok; w++) {
            MPI_Barrier(comm);
            const double t0 = MPI_Wtime();
            if (w == 0 || w == 2) {
                linear(a, b, wp, c, M, K, N); // [M, N]
                if (w == 2)
                    ok = mdt_allreduce_sum(tp, MDT_GROUP_TP, c, M * N) == MDT_OK;
            } else if (w == 1) {
                for (int i = 0; i < nc; i++)
                    linear(a + i * mc * K, b, wp, c + i * mc * N, mc, K, N); // [mc, N]
            } else {
                nb_allreduce q[MAX_CHUNKS];
                for (int i = 0; i < nc; i++) {
                    float *ci = c + i * mc * N;                  // [mc, N]
                    linear(a + i * mc * K, b, wp, ci, mc, K, N); // [mc, N]
                    q[i] = (nb_allreduce){ci,          tmp + i * mc * N / 2,
                                          mc * N / 2,  0,
                                          100 + 4 * i, {MPI_REQUEST_NULL, MPI_REQUEST_NULL}};
                    nb_start(&q[i], comm, rank);
                    for (int j = 0; j < i; j++)
                        nb_progress(&q[j], comm, rank);
                }
                for (int left = nc; left > 0;) {
                    left = 0;
                    for (int j = 0; j < nc; j++)
                        left += !nb_progress(&q[j], comm, rank);
                }
            }
            const double dt = MPI_Wtime() - t0;
            if (r >= 0)
                t[w][r] = dt;
            if (w == 2 && r == -2)
                memcpy(ref, c, sizeof(float) * (size_t)(M * N));
            if (w == 3 && r == -2) /* the chunked sums: the same bits as the whole all-reduce */
                same = memcmp(ref, c, sizeof(float) * (size_t)(M * N)) == 0;
        }
    }
    if (ok) {
        const double g = mdt_bench_median(t[0], reps), u = mdt_bench_median(t[1], reps),
                     s = mdt_bench_median(t[2], reps), o = mdt_bench_median(t[3], reps);
        printf("rank %d: [%lld x %lld] . [%lld x %lld]^T%s, all-reduce %.1f MiB, medians of %d: "
               "GEMM %.3f ms, cut in %d %.3f; serial %.3f (+%.3f); overlapped %.3f (+%.3f over "
               "the cut)%s\n",
               rank, (long long)M, (long long)K, (long long)N, (long long)K, wp ? " prepacked" : "",
               (double)(M * N) * 4 / 1048576.0, reps, g * 1e3, nc, u * 1e3, s * 1e3, (s - g) * 1e3,
               o * 1e3, (o - u) * 1e3, same ? "" : "  CHUNKED SUMS DIFFER");
    } else {
        fprintf(stderr, "rank %d: %s\n", rank, c ? mdt_last_error() : "out of memory");
    }
    free(a), free(b), free(c), free(ref), free(tmp), free(wp);
    for (int w = 0; w < 4; w++)
        free(t[w]);
    mdt_mesh_free(tp);
    MPI_Finalize();
    return ok && same ? 0 : 1;
}
