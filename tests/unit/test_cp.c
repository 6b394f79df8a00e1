/*
 * test_cp.c — the CP executor (models/cp.h) against the plan it runs: chunks cut along the
 * plan's dim (uneven lengths, any element size), nothing split or gathered that the plan does
 * not declare, and a forward that skips a declared split or gather refused (the negative
 * controls of "the plan inspect prints is the plan that executes"). No MPI: a mesh struct with
 * a CP group of 2 stands in; gathers that would communicate are not run here (tests/mpi do).
 */
#include "core/testhooks.h"
#include "harness.h"
#include "models/cp.h"

#include <string.h>

static const mdt_cp_plan k_plan = {
    .nsplit = 2,
    .split = {{"x", 1, NULL}, {"idx", 0, NULL}},
    .ngather = 2,
    .gather = {{"out", 1, NULL}, {"picked", 1, "idx"}},
};

int main(void) {
    mdt_arena a;
    mdt_arena_init(&a);
    mdt_mesh mesh;
    memset(&mesh, 0, sizeof mesh);
    mesh.cp_size = 2, mesh.cp_index = 1;
    mdt_cp cp;

    /* x [2, 5, 3] split on dim 1 into chunks of 3 and 2 rows: chunk 1 is rows 3..4 of each batch */
    float x[2 * 5 * 3];
    for (int i = 0; i < 30; i++)
        x[i] = (float)i;
    mdt_cp_begin(&cp, &k_plan, &mesh);
    EXPECT(cp.P == 2 && cp.chunk == 1 && cp.mesh == &mesh, "P = ring x ulysses from the mesh");
    const void *loc = NULL;
    int64_t s0 = -1, n = -1;
    EXPECT_OK(mdt_cp_take(&cp, "x", x, sizeof(float), 3, (int64_t[]){2, 5, 3}, &a, &loc, &s0, &n));
    EXPECT(s0 == 3 && n == 2, "chunk 1 of 5 rows over 2 is [3, 5) (got %lld + %lld)", (long long)s0,
           (long long)n);
    const float *lx = loc;
    int ok = lx != NULL;
    for (int b = 0; ok && b < 2; b++)
        for (int r = 0; r < 2; r++)
            for (int c = 0; c < 3; c++)
                ok &= lx[(b * 2 + r) * 3 + c] == x[(b * 5 + 3 + r) * 3 + c];
    EXPECT(ok, "chunk rows of every batch element, in order");

    /* int64 [5] on dim 0: chunk 1 is [3, 5) */
    const int64_t idx[5] = {10, 11, 12, 13, 14};
    EXPECT_OK(mdt_cp_take(&cp, "idx", idx, sizeof(int64_t), 1, (int64_t[]){5}, &a, &loc, &s0, &n));
    EXPECT(n == 2 && ((const int64_t *)loc)[0] == 13 && ((const int64_t *)loc)[1] == 14,
           "8-byte elements cut the same way");

    /* what the plan does not declare is refused */
    EXPECT_ERR(mdt_cp_take(&cp, "y", x, 4, 3, (int64_t[]){2, 5, 3}, &a, &loc, &s0, &n),
               MDT_E_INVALID, "'y'", "does not declare");
    EXPECT_ERR(mdt_cp_take(&cp, "x", x, 4, 1, (int64_t[]){30}, &a, &loc, &s0, &n), MDT_E_INVALID,
               "'x'");
    mdt_tensor_set *in = NULL, *outs = NULL;
    mdt_tensor *o5 = NULL, *o4 = NULL;
    EXPECT_OK(mdt_tensor_set_create(&in));
    EXPECT_OK(mdt_tensor_set_create(&outs));
    EXPECT_OK(mdt_tensor_set_add(outs, "o5", MDT_F32, 3, (int64_t[]){1, 5, 1}, &o5));
    EXPECT_OK(mdt_tensor_set_add(outs, "o4", MDT_F32, 3, (int64_t[]){1, 4, 1}, &o4));
    EXPECT_ERR(mdt_cp_give(&cp, "nope", &a, &a, in, 5, x, o5), MDT_E_INVALID, "'nope'",
               "does not declare");
    EXPECT_ERR(mdt_cp_give(&cp, "out", &a, &a, in, 5, x, o4), MDT_E_INVALID, "'out'", "[B, 5, O]");
    /* a `by` gather reads its index input itself: missing, or out of [0, S), is refused */
    EXPECT_ERR(mdt_cp_give(&cp, "picked", &a, &a, in, 5, x, o4), MDT_E_INVALID, "'idx'", "missing");
    mdt_tensor *ix = NULL;
    EXPECT_OK(mdt_tensor_set_add(in, "idx", MDT_I64, 1, (int64_t[]){4}, &ix));
    if (ix)
        ((int64_t *)ix->data)[2] = 5;
    EXPECT_ERR(mdt_cp_give(&cp, "picked", &a, &a, in, 5, x, o4), MDT_E_INVALID, "'idx'",
               "outside [0, 5)");
    mdt_tensor_set_free(in);
    mdt_tensor_set_free(outs);

    /* every split taken but nothing gathered: the forward did not run the plan */
    EXPECT_ERR(mdt_cp_end(&cp), MDT_E_INVALID, "'out'", "did not gather");
    mdt_cp_begin(&cp, &k_plan, &mesh);
    EXPECT_OK(mdt_cp_take(&cp, "x", x, sizeof(float), 3, (int64_t[]){2, 5, 3}, &a, &loc, &s0, &n));
    EXPECT_ERR(mdt_cp_end(&cp), MDT_E_INVALID, "'idx'", "did not split");

    /* one rank: the whole sequence, the input itself, nothing owed */
    mdt_cp_begin(&cp, &k_plan, NULL);
    EXPECT_OK(mdt_cp_take(&cp, "x", x, sizeof(float), 3, (int64_t[]){2, 5, 3}, &a, &loc, &s0, &n));
    EXPECT(cp.P == 1 && loc == x && s0 == 0 && n == 5, "P = 1: no copy, all rows");
    EXPECT_OK(mdt_cp_end(&cp));
    /* one rank: a plain gather copies, a `by` gather picks the rows its index input names */
    EXPECT_OK(mdt_cp_take(&cp, "idx", idx, sizeof(int64_t), 1, (int64_t[]){5}, &a, &loc, &s0, &n));
    mdt_tensor_set *in1 = NULL, *o1 = NULL;
    mdt_tensor *ix1 = NULL, *oall = NULL, *opick = NULL;
    EXPECT_OK(mdt_tensor_set_create(&in1));
    EXPECT_OK(mdt_tensor_set_create(&o1));
    EXPECT_OK(mdt_tensor_set_add(in1, "idx", MDT_I64, 1, (int64_t[]){3}, &ix1));
    EXPECT_OK(mdt_tensor_set_add(o1, "out", MDT_F32, 3, (int64_t[]){2, 5, 3}, &oall));
    EXPECT_OK(mdt_tensor_set_add(o1, "picked", MDT_F32, 3, (int64_t[]){2, 3, 3}, &opick));
    const int64_t pick[3] = {4, 0, 2};
    if (ix1 && oall && opick) {
        memcpy(ix1->data, pick, sizeof pick);
        EXPECT_OK(mdt_cp_give(&cp, "out", &a, &a, in1, 5, x, oall));
        EXPECT_OK(mdt_cp_give(&cp, "picked", &a, &a, in1, 5, x, opick));
        const float *po = opick->data, *pa = oall->data;
        int good = 1;
        for (int b = 0; b < 2; b++)
            for (int j = 0; j < 3; j++)
                for (int c = 0; c < 3; c++)
                    good &= po[(b * 3 + j) * 3 + c] == x[(b * 5 + pick[j]) * 3 + c];
        for (int i = 0; i < 30; i++)
            good &= pa[i] == x[i];
        EXPECT(good, "gathered rows: all of them, and the picked ones in index order");
    }
    mdt_tensor_set_free(in1);
    mdt_tensor_set_free(o1);
    float full[30];
    EXPECT_OK(mdt_cp_gather_rows(NULL, &a, 1, 2, 5, 3, x, full));
    int same = 1;
    for (int i = 0; i < 30; i++)
        same &= full[i] == x[i];
    EXPECT(same, "a gather over one chunk copies");

    /* the test seam's upstream bug: a mesh, but no split */
    mdt_test_hooks_set(&(mdt_test_hooks){.skip_cp_split = 1});
    mdt_cp_begin(&cp, &k_plan, &mesh);
    EXPECT(cp.P == 1 && cp.mesh == NULL, "skip_cp_split: every rank computes the whole sequence");
    mdt_test_hooks_set(NULL);
    mdt_cp_begin(&cp, &k_plan, &mesh);
    EXPECT(cp.P == 2, "hooks removed: the split is back");

    mdt_arena_release(&a);
    TEST_END();
}
