/*
 * test_failures.c — failure agreement under mpiexec -n 2 (tp=2): a rank that fails while
 * loading makes every rank fail with that rank's message; damaged data that only one rank reads
 * (a NaN in rank 1's half of a colwise weight) is caught by that rank and reported by all; a
 * layout whose weights cannot fit --max-memory is refused before loading, with the numbers.
 *
 * usage: mpiexec -n 2 build/tests/mpi/test_failures DATA_DIR
 */
#define _POSIX_C_SOURCE 200809L
#include "core/testhooks.h"
#include "harness.h"
#include "models/model.h"

#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int g_rank;

/* the test seam's injection: rank 1 fails mid-load */
static mdt_status fail_load_on_1(const char *phase, int world_rank) {
    if (strcmp(phase, "load") == 0 && world_rank == 1)
        return MDT_FAIL(MDT_E_IO, "injected failure during %s (test hook)", phase);
    return MDT_OK;
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
    if (argc != 2) {
        MPI_Finalize();
        return 2;
    }
    char src[512], dir[256] = "/tmp/mdt_damaged_XXXXXX", cmd[2048];
    snprintf(src, sizeof src, "%s/flux_guidance", argv[1]);
    mdt_mesh *mesh = NULL;
    EXPECT_OK(mdt_mesh_create_comm(MPI_COMM_WORLD, &(mdt_layout){1, 2, 1, 1, NULL}, &mesh));
    mdt_load_params lp = mdt_load_params_default();
    mdt_model *m = NULL;
    lp.checkpoint_dir = src, lp.mesh = mesh;

    /* 1. injected failure on rank 1 mid-load: every rank fails with rank 1's message */
    mdt_test_hooks_set(&(mdt_test_hooks){.at_point = fail_load_on_1});
    EXPECT_ERR(mdt_model_load(&lp, &m), MDT_E_IO, "rank 1: injected failure during load");
    mdt_test_hooks_set(NULL);
    EXPECT(m == NULL, "no model after a failed load");

    /* 2. a NaN where only TP rank 1 reads (row 100 of a 128-row colwise weight) */
    if (g_rank == 0) {
        if (!mkdtemp(dir))
            dir[0] = 0;
        snprintf(cmd, sizeof cmd,
                 "cp '%s'/config.json '%s'/diffusion_pytorch_model.safetensors '%s'/", src, src,
                 dir);
        EXPECT(system(cmd) == 0, "copy checkpoint");
        char path[600];
        snprintf(path, sizeof path, "%s/diffusion_pytorch_model.safetensors", dir);
        mdt_st_file *f = NULL;
        EXPECT_OK(mdt_st_open(path, &f));
        const mdt_st_entry *e =
            f ? mdt_st_find(f, "transformer_blocks.0.ff.net.0.proj.weight") : NULL;
        EXPECT(e && e->shape[0] == 128, "damaged tensor found");
        if (e) {
            const float nan = NAN;
            int fd = open(path, O_WRONLY);
            EXPECT(fd >= 0 && pwrite(fd, &nan, 4, f->data_start + e->begin + 100 * 32 * 4) == 4,
                   "write NaN");
            close(fd);
        }
        mdt_st_close(f);
    }
    MPI_Bcast(dir, sizeof dir, MPI_CHAR, 0, MPI_COMM_WORLD);
    lp.checkpoint_dir = dir;
    EXPECT_ERR(mdt_model_load(&lp, &m), MDT_E_FORMAT,
               "rank 1:", "transformer_blocks.0.ff.net.0.proj.weight", "non-finite");
    /* the same checkpoint read whole by one rank fails too (negative control for the slice) */
    lp.mesh = NULL;
    EXPECT_ERR(mdt_model_load(&lp, &m), MDT_E_FORMAT, "non-finite");

    /* 3. --max-memory: tp=2 needs ~300 KiB here; allow 200 KiB -> refused, tp=4 suggested */
    lp.checkpoint_dir = src, lp.mesh = mesh, lp.max_weight_bytes = 200 * 1024;
    EXPECT_ERR(mdt_model_load(&lp, &m), MDT_E_NOMEM, "tp=2 needs", "--max-memory", "tp=4 would");
    lp.max_weight_bytes = 400 * 1024;
    EXPECT_OK(mdt_model_load(&lp, &m));
    mdt_model_free(m);

    MPI_Barrier(MPI_COMM_WORLD);
    if (g_rank == 0 && dir[0]) {
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
        if (system(cmd) != 0)
            fprintf(stderr, "could not remove %s\n", dir);
    }
    mdt_mesh_free(mesh);
    int fails = t_fail, any = 0;
    MPI_Allreduce(&fails, &any, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    t_fail = any;
    if (g_rank != 0)
        t_pass = 0;
    MPI_Finalize();
    if (g_rank != 0)
        return any ? 1 : 0;
    TEST_END();
}
