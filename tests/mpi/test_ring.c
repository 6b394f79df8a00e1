/*
 * test_ring.c — ring attention whose transfer is moved along while the block is attended
 * (attn.c's step_attention cuts a step into pieces: one head, a run of query rows). Two ranks
 * (ring = 2), a sequence long enough that a head is cut into several row runs and a block
 * large enough (4.5 MB) that the transport cannot deliver it in one call: the ring's output must
 * equal plain attention over the whole sequence on one rank, with uneven lengths (the padded
 * keys masked), f32 and bf16 operands, and the step must really have been cut.
 *
 * usage: mpiexec -n 2 build/tests/mpi/test_ring
 */
#define _POSIX_C_SOURCE 200809L
#include "attn/attn.h"
#include "backend/backend.h"
#include "harness.h"

#include <stdlib.h>

static int g_rank;

/* [H, S, D] head-major random values, the same on every rank */
static float *random_heads(uint64_t seed, int64_t n) {
    float *x = malloc(sizeof(float) * (size_t)n);
    mdt_rng r;
    mdt_rng_seed(&r, seed);
    for (int64_t i = 0; i < n && x; i++)
        x[i] = (float)mdt_rng_normal(&r);
    return x;
}

/* rows [s0, s0 + L) of every head of x [H, S, D] -> [H, L, D] */
static float *rows_of(const float *x, int64_t H, int64_t S, int64_t D, int64_t s0, int64_t L) {
    float *y = malloc(sizeof(float) * (size_t)(H * L * D));
    for (int64_t h = 0; h < H && y; h++)
        memcpy(y + h * L * D, x + (h * S + s0) * D, sizeof(float) * (size_t)(L * D));
    return y;
}

static void check(mdt_mesh *mesh, int bf16, double tol) {
    /* 4 heads of 128: a ring block is 2 x 4 x 1105 x 128 floats (4.5 MB); 2000 rows split
     * 1105 + 895 (uneven: the second block is padded); a query row costs 4 x kv x D FLOPs, so a
     * head's 1105 rows are cut into runs of 64-row tiles (attn.h: MDT_RING_POLL_FLOPS) */
    const int64_t H = 4, S = 2000, D = 128, S0 = 1105;
    const int64_t s0 = g_rank == 0 ? 0 : S0, L = g_rank == 0 ? S0 : S - S0;
    const float scale = 0.088f;
    EXPECT_OK(mdt_backend_select(MDT_BACKEND_CPU, 0, bf16));
    float *q = random_heads(11, H * S * D), *k = random_heads(12, H * S * D),
          *v = random_heads(13, H * S * D);                    // [H, S, D] each
    float *want = malloc(sizeof(float) * (size_t)(S * H * D)); // [S, H D]
    float *got = malloc(sizeof(float) * (size_t)(L * H * D));  // [L, H D]
    float *ql = rows_of(q, H, S, D, s0, L), *kl = rows_of(k, H, S, D, s0, L),
          *vl = rows_of(v, H, S, D, s0, L); // [H, L, D] each
    mdt_arena ar;
    mdt_arena_init(&ar);
    const mdt_attn_args whole = {.q = q,
                                 .k = k,
                                 .v = v,
                                 .out = want,
                                 .ld_out = H * D,
                                 .H = H,
                                 .Sq = S,
                                 .Sk = S,
                                 .kv = S,
                                 .D = D,
                                 .scale = scale};
    const mdt_attn_args mine = {.q = ql,
                                .k = kl,
                                .v = vl,
                                .out = got,
                                .ld_out = H * D,
                                .H = H,
                                .Sq = L,
                                .Sk = L,
                                .kv = L,
                                .D = D,
                                .scale = scale};
    EXPECT_OK(mdt_attention(NULL, &ar, &whole)); // one rank
    mdt_counters_reset();
    EXPECT_OK(mdt_attention(mesh, &ar, &mine)); // the ring
    const int64_t calls = mdt_counters_get()->attn_calls;
    double err = 0;
    for (int64_t i = 0; i < L * H * D; i++) {
        const double d = fabs((double)got[i] - (double)want[s0 * H * D + i]);
        err = d > err || d != d ? d : err;
    }
    EXPECT(err <= tol, "rank %d, %s operands: ring vs one rank max error %g (at most %g)", g_rank,
           bf16 ? "bf16" : "f32", err, tol);
    EXPECT(mdt_counters_get()->attn_query_rows == H * L &&
               mdt_counters_get()->attn_kv_rows == H * S,
           "rank %d: attended %lld query rows, %lld key rows", g_rank,
           (long long)mdt_counters_get()->attn_query_rows,
           (long long)mdt_counters_get()->attn_kv_rows);
    /* uncut, a ring of 2 makes 2 kernel calls; the first step, with the other block in flight,
     * is cut into at least one call per head and row run (every rank: 4.5 MB cannot have arrived
     * in the one test made before the cut is chosen) */
    int64_t least = 0;
    MPI_Allreduce(&calls, &least, 1, MPI_INT64_T, MPI_MIN, MPI_COMM_WORLD);
    EXPECT(least > 2 * H, "the step with a block in flight was not cut: %lld kernel calls",
           (long long)least);
    /* a self-attention call attends its own rows: other key counts are refused, not run */
    mdt_attn_args odd = mine;
    odd.kv = L - 1;
    EXPECT_ERR(mdt_attention(mesh, &ar, &odd), MDT_E_INVALID, "its own");
    mdt_arena_release(&ar);
    free(q), free(k), free(v), free(want), free(got), free(ql), free(kl), free(vl);
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
    mdt_mesh *mesh = NULL;
    EXPECT_OK(
        mdt_mesh_create_comm(MPI_COMM_WORLD, &(mdt_layout){1, 1, 2, 1, "tp,ring,ulysses"}, &mesh));
    if (!mesh) {
        MPI_Finalize();
        return 1;
    }
    check(mesh, 0, 2e-5);
    check(mesh, 1, 2e-2); /* bf16 operands where the CPU has them (the same f32 path elsewhere) */
    mdt_mesh_free(mesh);
    MPI_TEST_END(g_rank);
}
