/*
 * test_steal.c — the hypervisor's steal in the run report under mpiexec -n 2 (tp=2): each rank
 * reads its own fake proc/stat (the test seam's proc_root), which its at_point("step") advances
 * inside every forward by a known steal (rank 0 0.25 s, rank 1 0.5 s); the report gives each
 * rank its own (`steal_seconds_last_step`) and per forward the larger (`steal_seconds`, what the
 * step waited for). Control: the same files left unchanged give zeros.
 *
 * usage: mpiexec -n 2 build/tests/mpi/test_steal DATA_DIR
 */
#define _POSIX_C_SOURCE 200809L
#include "core/testhooks.h"
#include "harness.h"
#include "models/model.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static int g_rank, g_bump, g_forwards;
static char g_root[256];

/* proc/stat with every configured vCPU's steal at g_forwards * (rank + 1) * 25 ticks: the same
 * on every CPU, so a rank the scheduler moves mid-forward reads the same steal */
static void write_stat(int world_rank) {
    char path[512];
    snprintf(path, sizeof path, "%s/proc/stat", g_root);
    FILE *fp = fopen(path, "w");
    if (!fp)
        return;
    long ncpu = sysconf(_SC_NPROCESSORS_CONF);
    ncpu = ncpu < 1 ? 1 : ncpu > 512 ? 512 : ncpu;
    const long long v = (long long)g_forwards * (world_rank + 1) * 25;
    fprintf(fp, "cpu  1 2 3 4 5 6 7 %lld 0 0\n", v * ncpu);
    for (long c = 0; c < ncpu; c++)
        fprintf(fp, "cpu%ld 1 2 3 4 5 6 7 %lld 0 0\n", c, v);
    fputs("intr 1 2 3\nctxt 4\n", fp);
    fclose(fp);
}

/* inside every forward's first block: the hypervisor took (rank + 1) * 25 ticks */
static mdt_status steal_in_step(const char *phase, int world_rank) {
    if (strcmp(phase, "step") == 0 && g_bump) {
        g_forwards++;
        write_stat(world_rank);
    }
    return MDT_OK;
}

static double num(const cJSON *o) { return cJSON_IsNumber(o) ? o->valuedouble : NAN; }

/* runs 3 forwards with the statistics; on rank 0 checks the report against a steal of `r0` and
 * `r1` seconds a forward on ranks 0 and 1 */
static void run(mdt_model *m, const mdt_tensor_set *in, double r0, double r1, const char *what) {
    mdt_sample_params sp = mdt_sample_params_default();
    sp.repeat = 3;
    mdt_tensor_set *out = NULL;
    mdt_run_stats *stats = NULL;
    char *json = NULL;
    EXPECT_OK(mdt_tensor_set_create(&out));
    EXPECT_OK(mdt_sample(m, (mdt_tensor_set *)in, &sp, out, &stats));
    EXPECT_OK(mdt_run_report_json(m, stats, 0.0, &json));
    cJSON *r = json ? cJSON_Parse(json) : NULL;
    if (g_rank == 0) {
        const cJSON *st = cJSON_GetObjectItem(r, "steal_seconds");
        const double want = r0 > r1 ? r0 : r1;
        EXPECT(cJSON_GetArraySize(st) == 3, "%s: one steal per forward", what);
        for (int i = 0; i < cJSON_GetArraySize(st); i++)
            EXPECT(fabs(num(cJSON_GetArrayItem(st, i)) - want) < 1e-9,
                   "%s: forward %d: the larger rank's steal %g, got %g", what, i, want,
                   num(cJSON_GetArrayItem(st, i)));
        const cJSON *ranks = cJSON_GetObjectItem(r, "ranks");
        EXPECT(cJSON_GetArraySize(ranks) == 2, "%s: two ranks", what);
        for (int k = 0; k < cJSON_GetArraySize(ranks); k++) {
            const cJSON *rk = cJSON_GetArrayItem(ranks, k);
            const double got = num(cJSON_GetObjectItem(rk, "steal_seconds_last_step"));
            const int rank = (int)num(cJSON_GetObjectItem(rk, "rank"));
            EXPECT(fabs(got - (rank ? r1 : r0)) < 1e-9, "%s: rank %d's own steal %g, got %g", what,
                   rank, rank ? r1 : r0, got);
        }
    }
    cJSON_Delete(r);
    free(json);
    mdt_run_stats_free(stats);
    mdt_tensor_set_free(out);
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
    if (argc != 2) {
        MPI_Finalize();
        return 2;
    }
    char dir[512], path[600];
    snprintf(dir, sizeof dir, "%s/flux_guidance", argv[1]);
    snprintf(g_root, sizeof g_root, "/tmp/mdt_steal_mpi_XXXXXX");
    if (!mkdtemp(g_root))
        g_root[0] = 0;
    snprintf(path, sizeof path, "%s/proc", g_root);
    mkdir(path, 0777);
    write_stat(g_rank);
    mdt_mesh *mesh = NULL;
    EXPECT_OK(mdt_mesh_create_comm(MPI_COMM_WORLD, &(mdt_layout){1, 2, 1, 1, NULL}, &mesh));
    mdt_load_params lp = mdt_load_params_default();
    lp.checkpoint_dir = dir, lp.mesh = mesh;
    mdt_model *m = NULL;
    mdt_tensor_set *in = NULL;
    EXPECT_OK(mdt_model_load(&lp, &m));
    snprintf(path, sizeof path, "%s/inputs.safetensors", dir);
    EXPECT_OK(mdt_tensor_set_load(path, &in));
    if (m && in) {
        mdt_test_hooks_set(&(mdt_test_hooks){.at_point = steal_in_step, .proc_root = g_root});
        const double tick = 1.0 / (double)sysconf(_SC_CLK_TCK);
        g_bump = 1;
        run(m, in, 25 * tick, 50 * tick, "stolen");
        g_bump = 0; /* control: the files stand still */
        run(m, in, 0.0, 0.0, "still");
        mdt_test_hooks_set(NULL);
    }
    mdt_tensor_set_free(in);
    mdt_model_free(m);
    mdt_mesh_free(mesh);
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_root);
    if (g_root[0] && system(cmd) != 0)
        fprintf(stderr, "could not remove %s\n", g_root);
    MPI_TEST_END(g_rank);
}
