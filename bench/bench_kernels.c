/*
 * bench_kernels.c — single-thread rates of meshdit's own kernels next to the machine's sgemm:
 * tiled attention (GFLOP/s at Flux-medium shapes, vs the sgemm it is built on) and the
 * checkpoint loader (GB/s from the page cache, f32 and bf16 files).
 * usage: build/bench/bench_kernels [checkpoint_dir]   (a medium checkpoint for the loader)
 */
#include "core/core.h"
#include "io/checkpoint.h"
#include "kernels/cpu/cpu.h"
#include "kernels/cpu/gemm.h"

#include <cblas.h>
#include <stdio.h>
#include <stdlib.h>

static void bench_attention(int64_t H, int64_t S, int64_t D, int reps) {
    float *q = malloc(sizeof(float) * (size_t)(H * S * D)),
          *k = malloc(sizeof(float) * (size_t)(H * S * D));
    float *v = malloc(sizeof(float) * (size_t)(H * S * D)),
          *o = malloc(sizeof(float) * (size_t)(H * S * D));
    float *ws = malloc(sizeof(float) * (size_t)mdt_cpu_kernels()->attention_ws_floats(S, D, 0));
    mdt_rng r;
    mdt_rng_seed(&r, 1);
    for (int64_t i = 0; i < H * S * D; i++)
        q[i] = (float)mdt_rng_normal(&r), k[i] = (float)mdt_rng_normal(&r),
        v[i] = (float)mdt_rng_normal(&r);
    double t[32];
    for (int i = -1; i < reps; i++) {
        double t0 = mdt_now();
        mdt_cpu_kernels()->attention(q, k, v, o, H * D, NULL, H, S, S, S, D, 1.0f / 11.3f, 0, ws);
        if (i >= 0)
            t[i] = mdt_now() - t0;
    }
    double med = mdt_median(t, reps), flops = 4.0 * (double)H * (double)S * (double)S * (double)D;
    printf("attention H=%lld S=%lld D=%lld: median %.4f s, %.1f GFLOP/s\n", (long long)H,
           (long long)S, (long long)D, med, flops / med * 1e-9);
    free(q), free(k), free(v), free(o), free(ws);
}

static void bench_loader(const char *dir, int reps) {
    mdt_ckpt *c = NULL;
    if (mdt_ckpt_open(dir, &c) != MDT_OK) {
        printf("loader: %s\n", mdt_last_error());
        return;
    }
    int64_t maxn = 0, bytes = 0;
    for (int i = 0; i < c->n; i++) {
        const mdt_st_entry *e = c->refs[i].entry;
        int64_t n = (e->end - e->begin) / (int64_t)mdt_dtype_size(e->dtype);
        maxn = n > maxn ? n : maxn;
        bytes += e->end - e->begin;
    }
    float *buf = malloc(sizeof(float) * (size_t)(maxn + 1));
    double t[32];
    for (int it = -1; it < reps; it++) {
        double t0 = mdt_now();
        for (int i = 0; i < c->n; i++) {
            const mdt_st_entry *e = c->refs[i].entry;
            mdt_st_read_f32(c->refs[i].file, e, 0,
                            (e->end - e->begin) / (int64_t)mdt_dtype_size(e->dtype), buf);
        }
        if (it >= 0)
            t[it] = mdt_now() - t0;
    }
    double med = mdt_median(t, reps);
    printf(
        "loader %s: %.1f MB stored, median %.3f s, %.2f GB/s (page cache, read + convert to f32)\n",
        dir, (double)bytes * 1e-6, med, (double)bytes / med * 1e-9);
    free(buf);
    mdt_ckpt_close(c);
}

int main(int argc, char **argv) {
    printf("cpu kernels: %s (MESHDIT_CPU_ISA picks another)\n", mdt_cpu_isa());
    bench_attention(8, 1280, 128, 5);  /* the medium Flux forward's joint attention */
    bench_attention(24, 4608, 128, 1); /* FLUX.1 at 1024x1024, one layer */
    for (int i = 1; i < argc; i++)
        bench_loader(argv[i], 3);
    return 0;
}
