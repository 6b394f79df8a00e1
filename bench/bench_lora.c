/*
 * bench_lora.c — what a LoRA costs on the mesh, per rank: the checkpoint's load, then a rank-R
 * adapter on every linear of the model read (its slices) and fused, fused again over a fused
 * model (the base re-read), unfused (re-read, and from kept copies), and the forward with the
 * fused adapter against the base forward, alternating. Prints one line per measure, rank 0's
 * and the slowest rank's.
 * usage: mpiexec -n T build/bench/bench_lora CKPT_DIR [rank 64] [img_tokens 1024] [txt 256]
 *        [repeats 5]
 * (CKPT_DIR: e.g. `meshdit gen --model flux --preset medium --dtype bf16 --out DIR`)
 */
#define _POSIX_C_SOURCE 200809L
#include "models/lora.h"

#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int g_rank;

static void report(const char *what, double mine) {
    double mx;
    MPI_Allreduce(&mine, &mx, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    if (g_rank == 0)
        printf("%-44s rank 0 %9.4f s   slowest rank %9.4f s\n", what, mine, mx);
}

/* A random rank-r adapter on every linear weight of m (stored bf16, as published ones are). */
static void write_adapter(const mdt_model *m, int64_t rank, const char *path) {
    const size_t cap = 2 * (size_t)m->table.n;
    mdt_tensor *ts = calloc(cap, sizeof *ts);
    const mdt_tensor **tp = calloc(cap, sizeof(const mdt_tensor *));
    char **names = calloc(cap, sizeof(char *));
    mdt_rng rng;
    mdt_rng_seed(&rng, 5);
    int n = 0;
    for (int i = 0; i < m->table.n; i++) {
        const mdt_weight_spec *w = &m->table.specs[i];
        if (!m->table.lin[i] || w->stored_ndim)
            continue;
        const int64_t r = rank < w->shape[0] && rank < w->shape[1] ? rank : 1;
        for (int f = 0; f < 2; f++) {
            names[n] = malloc(256);
            snprintf(names[n], 256, "transformer.%.*s.lora_%c.weight", (int)strlen(w->name) - 7,
                     w->name, f ? 'B' : 'A');
            ts[n] = (mdt_tensor){.dtype = MDT_BF16, .ndim = 2};
            ts[n].shape[0] = f ? w->shape[0] : r, ts[n].shape[1] = f ? r : w->shape[1];
            const int64_t ne = ts[n].shape[0] * ts[n].shape[1];
            float *v = malloc(sizeof(float) * (size_t)ne);
            for (int64_t j = 0; j < ne; j++)
                v[j] = (float)(0.01 * mdt_rng_normal(&rng));
            ts[n].data = malloc(2 * (size_t)ne);
            mdt_convert_from_f32(MDT_BF16, v, ts[n].data, ne);
            free(v);
            tp[n] = &ts[n];
            n++;
        }
    }
    if (mdt_st_write(path, n, (const char *const *)names, tp, NULL) != MDT_OK)
        fprintf(stderr, "bench_lora: %s\n", mdt_last_error());
    for (int i = 0; i < n; i++)
        free(ts[i].data), free(names[i]);
    free(ts), free(tp), free(names);
}

static double fwd_s(mdt_model *m, const mdt_tensor_set *in) {
    mdt_tensor_set *out = NULL;
    mdt_tensor_set_create(&out);
    MPI_Barrier(MPI_COMM_WORLD);
    const double t0 = mdt_now();
    if (mdt_model_forward(m, in, out) != MDT_OK)
        fprintf(stderr, "bench_lora: %s\n", mdt_last_error());
    const double s = mdt_now() - t0;
    mdt_tensor_set_free(out);
    return s;
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int world;
    MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    if (argc < 2) {
        if (g_rank == 0)
            fprintf(stderr, "usage: bench_lora CKPT_DIR [rank] [img] [txt] [repeats]\n");
        MPI_Finalize();
        return 2;
    }
    const int64_t rank = argc > 2 ? atoll(argv[2]) : 64;
    const int64_t img = argc > 3 ? atoll(argv[3]) : 1024, txt = argc > 4 ? atoll(argv[4]) : 256;
    const int reps = argc > 5 ? atoi(argv[5]) : 5;
    mdt_mesh *mesh = NULL;
    mdt_model *m = NULL;
    if (mdt_mesh_create_comm(MPI_COMM_WORLD, &(mdt_layout){1, world, 1, 1, NULL}, &mesh) != MDT_OK)
        return 1;
    mdt_load_params lp = mdt_load_params_default();
    lp.checkpoint_dir = argv[1], lp.mesh = mesh;
    MPI_Barrier(MPI_COMM_WORLD);
    double t0 = mdt_now();
    if (mdt_model_load(&lp, &m) != MDT_OK) {
        fprintf(stderr, "bench_lora: %s\n", mdt_last_error());
        return 1;
    }
    const double load_s = mdt_now() - t0;
    report("checkpoint load (shard-on-read)", load_s);
    char path[256];
    snprintf(path, sizeof path, "/tmp/bench_lora_%d.safetensors", (int)getppid());
    if (g_rank == 0)
        write_adapter(m, rank, path);
    MPI_Barrier(MPI_COMM_WORLD);
    const char *names[] = {"a"};
    const double one[] = {1.0}, half[] = {0.5};
    double fs, bs;
    int64_t rb, cb;
    t0 = mdt_now();
    mdt_status st = mdt_model_lora_load(m, "a", path);
    const double lload_s = mdt_now() - t0;
    report("adapter load (this rank's slices)", lload_s);
    t0 = mdt_now();
    st = st ? st : mdt_model_set_adapters(m, 1, names, one);
    const double fuse_s = mdt_now() - t0;
    report("fuse from the base", fuse_s);
    mdt_lora_info li;
    mdt_model_lora_info(m, 0, &li);
    if (g_rank == 0)
        printf("adapter: %d linear weights, rank %lld, %.1f MiB of factors on rank 0; load + fuse "
               "= %.1f%% of the checkpoint's load on rank 0\n",
               li.targets, (long long)li.rank_max, (double)li.bytes / 1048576.0,
               100.0 * (lload_s + fuse_s) / load_s);
    t0 = mdt_now();
    st = st ? st : mdt_model_set_adapters(m, 1, names, half);
    mdt_model_lora_costs(m, &fs, &bs, &rb, &cb);
    report("fuse again (base re-read from checkpoint)", mdt_now() - t0);
    report("  of which re-reading the base", bs);
    t0 = mdt_now();
    st = st ? st : mdt_model_set_adapters(m, 0, NULL, NULL);
    report("unfuse (re-read from checkpoint)", mdt_now() - t0);
    st = st ? st : mdt_model_set_lora_base(m, MDT_LORA_BASE_COPY);
    t0 = mdt_now();
    st = st ? st : mdt_model_set_adapters(m, 1, names, one);
    report("fuse, keeping copies", mdt_now() - t0);
    mdt_model_lora_costs(m, &fs, &bs, &rb, &cb);
    if (g_rank == 0)
        printf("copies kept on rank 0: %.1f MiB (resident weights %.1f MiB)\n",
               (double)cb / 1048576.0, (double)mdt_model_weight_bytes(m) / 1048576.0);
    t0 = mdt_now();
    st = st ? st : mdt_model_set_adapters(m, 1, names, half);
    report("fuse again (base from the copies)", mdt_now() - t0);
    t0 = mdt_now();
    st = st ? st : mdt_model_set_adapters(m, 0, NULL, NULL);
    report("unfuse (from the copies)", mdt_now() - t0);
    if (st)
        fprintf(stderr, "bench_lora: %s\n", mdt_last_error());
    /* step time: base and fused forwards alternating */
    mdt_tensor_set *in = NULL;
    mdt_tensor_set_create(&in);
    mdt_random_inputs p = {.seed = 1,
                           .batch = 1,
                           .img_tokens = img,
                           .txt_tokens = txt,
                           .timestep = 0.5,
                           .guidance = 3.5};
    mdt_model_make_inputs(m, &p, in);
    double *tb = calloc((size_t)reps, sizeof(double)), *tf = calloc((size_t)reps, sizeof(double));
    fwd_s(m, in); /* warm-up */
    for (int r = 0; r < reps; r++) {
        mdt_model_set_adapters(m, 0, NULL, NULL);
        tb[r] = fwd_s(m, in);
        mdt_model_set_adapters(m, 1, names, one);
        tf[r] = fwd_s(m, in);
    }
    const double mb = mdt_median(tb, reps), mf = mdt_median(tf, reps);
    if (g_rank == 0)
        printf("forward (%lld + %lld tokens), median of %d alternating: base %.4f s, fused %.4f s "
               "(%+.2f%%)\n",
               (long long)img, (long long)txt, reps, mb, mf, 100.0 * (mf - mb) / mb);
    free(tb), free(tf);
    mdt_tensor_set_free(in);
    mdt_model_free(m);
    mdt_mesh_free(mesh);
    if (g_rank == 0)
        unlink(path);
    MPI_Finalize();
    return 0;
}
