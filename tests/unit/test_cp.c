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
    EXPECT_ERR(mdt_cp_give(&cp, "out", &a, &a, 1, 5, 1, x, idx, 5, x), MDT_E_INVALID, "'out'",
               "by index");
    EXPECT_ERR(mdt_cp_give(&cp, "picked", &a, &a, 1, 5, 1, x, NULL, 0, x), MDT_E_INVALID,
               "'picked'");

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
    float full[30];
    EXPECT_OK(mdt_cp_gather_rows(NULL, &a, 1, 2, 5, 3, x, full));
    EXPECT(memcmp(full, x, sizeof x) == 0, "a gather over one chunk copies");

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
