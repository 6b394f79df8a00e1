/*
 * gemm_packed.c — what keeping the linears' weights in oneDNN's own blocked layout would buy:
 * oneDNN's f32 matmul, y [M, N] = x [M, K] . W^T + b, with the weights given as the model holds
 * them (W [N, K] row-major, the layout the GEMM seam passes: oneDNN packs them on every call)
 * against the same weights reordered once into the layout the primitive asks for
 * (format_tag::any, queried from the primitive descriptor). Per shape, alternating within each
 * repeat, medians over NW distinct weight matrices (more than a 32 MiB L3 holds, as a forward
 * reads them), one thread. Prints GFLOP/s both ways, the implementation oneDNN chose, the
 * blocked layout, whether that layout is the same at every row count (so one packed copy could
 * serve every call), and whether the outputs are bit-identical. Benchmarks only (never in
 * make test); the layouts' rows are the medium step's (1280 rows one rank and tp2, 640 and 512
 * + 128 a CP rank).
 * usage: build/bench/gemm_packed [repeats [MxNxK ...]]
 */
#include "bench_stats.h"
#include "core/core.h"

#include <dnnl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

extern void omp_set_num_threads(int n);

enum { NW = 24, MAXREP = 64 };

static dnnl_engine_t g_eng;
static dnnl_stream_t g_st;

#define CK(call)                                                                                   \
    do {                                                                                           \
        dnnl_status_t s_ = (call);                                                                 \
        if (s_ != dnnl_success) {                                                                  \
            printf("gemm_packed: %s failed (%d)\n", #call, (int)s_);                               \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

/* The matmul primitive for [M, K] . [K, N] + b with weights `wmd` (plain [N, K] or any). */
static dnnl_primitive_desc_t prim_desc(int64_t M, int64_t N, int64_t K,
                                       const dnnl_memory_desc_t *wmd) {
    dnnl_memory_desc_t src, dst, bias;
    dnnl_dims_t sd = {M, K}, dd = {M, N}, bd = {1, N};
    CK(dnnl_memory_desc_init_by_tag(&src, 2, sd, dnnl_f32, dnnl_ab));  // [M, K]
    CK(dnnl_memory_desc_init_by_tag(&dst, 2, dd, dnnl_f32, dnnl_ab));  // [M, N]
    CK(dnnl_memory_desc_init_by_tag(&bias, 2, bd, dnnl_f32, dnnl_ab)); // [1, N]
    dnnl_matmul_desc_t md;
    CK(dnnl_matmul_desc_init(&md, &src, wmd, &bias, &dst));
    dnnl_primitive_desc_t pd;
    CK(dnnl_primitive_desc_create(&pd, &md, NULL, g_eng, NULL));
    return pd;
}

static void weights_md(dnnl_memory_desc_t *d, int64_t N, int64_t K, dnnl_format_tag_t tag) {
    dnnl_dims_t wd = {K, N};
    CK(dnnl_memory_desc_init_by_tag(d, 2, wd, dnnl_f32, tag)); // [K, N] logical; ba = W [N, K]
}

static void layout_name(const dnnl_memory_desc_t *d, char *buf, size_t n) {
    const dnnl_blocking_desc_t *b = &d->format_desc.blocking;
    int o = snprintf(buf, n, "blocks");
    for (int i = 0; i < b->inner_nblks && o > 0 && (size_t)o < n; i++)
        o += snprintf(buf + o, n - (size_t)o, " %lld%c", (long long)b->inner_blks[i],
                      b->inner_idxs[i] == 0 ? 'k' : 'n');
    if (b->inner_nblks == 0)
        snprintf(buf, n, "plain");
}

static void run(dnnl_primitive_t p, dnnl_memory_t x, dnnl_memory_t w, dnnl_memory_t b,
                dnnl_memory_t y) {
    dnnl_exec_arg_t a[4] = {
        {DNNL_ARG_SRC, x}, {DNNL_ARG_WEIGHTS, w}, {DNNL_ARG_BIAS, b}, {DNNL_ARG_DST, y}};
    CK(dnnl_primitive_execute(p, g_st, 4, a));
}

static int shape(int64_t M, int64_t N, int64_t K, int reps) {
    dnnl_memory_desc_t plain, any;
    weights_md(&plain, N, K, dnnl_ba); // W [N, K]
    weights_md(&any, N, K, dnnl_format_tag_any);
    dnnl_primitive_desc_t pd[2] = {prim_desc(M, N, K, &plain), prim_desc(M, N, K, &any)};
    const dnnl_memory_desc_t *packed =
        dnnl_primitive_desc_query_md(pd[1], dnnl_query_weights_md, 0);
    const char *impl[2];
    for (int f = 0; f < 2; f++)
        CK(dnnl_primitive_desc_query(pd[f], dnnl_query_impl_info_str, 0, &impl[f]));
    /* one packed copy for every row count: the layout asked for at other M, and the impl kept */
    int same = 1;
    const int64_t other[] = {1, 16, 128, 4096};
    for (size_t i = 0; i < sizeof other / sizeof other[0]; i++) {
        dnnl_primitive_desc_t q = prim_desc(other[i], N, K, &any);
        same = same && dnnl_memory_desc_equal(
                           dnnl_primitive_desc_query_md(q, dnnl_query_weights_md, 0), packed);
        dnnl_primitive_desc_destroy(q);
    }
    dnnl_primitive_t p[2];
    for (int f = 0; f < 2; f++)
        CK(dnnl_primitive_create(&p[f], pd[f]));
    float *x = mdt_bench_filled(M * K, 3), *b = mdt_bench_filled(N, 5),
          *y[2] = {malloc(sizeof(float) * (size_t)(M * N)),
                   malloc(sizeof(float) * (size_t)(M * N))};
    if (!x || !b || !y[0] || !y[1]) {
        printf("gemm_packed: out of memory\n");
        return 1;
    }
    dnnl_memory_desc_t xd, yd, bd;
    dnnl_dims_t xs = {M, K}, ys = {M, N}, bs = {1, N};
    CK(dnnl_memory_desc_init_by_tag(&xd, 2, xs, dnnl_f32, dnnl_ab));
    CK(dnnl_memory_desc_init_by_tag(&yd, 2, ys, dnnl_f32, dnnl_ab));
    CK(dnnl_memory_desc_init_by_tag(&bd, 2, bs, dnnl_f32, dnnl_ab));
    dnnl_memory_t mx, mb, my[2], mw[2][NW];
    CK(dnnl_memory_create(&mx, &xd, g_eng, x));
    CK(dnnl_memory_create(&mb, &bd, g_eng, b));
    for (int f = 0; f < 2; f++)
        CK(dnnl_memory_create(&my[f], &yd, g_eng, y[f]));
    dnnl_primitive_desc_t rpd;
    CK(dnnl_reorder_primitive_desc_create(&rpd, &plain, g_eng, packed, g_eng, NULL));
    dnnl_primitive_t reorder;
    CK(dnnl_primitive_create(&reorder, rpd));
    for (int i = 0; i < NW; i++) {
        float *w = mdt_bench_filled(N * K, i); // [N, K]
        if (!w) {
            printf("gemm_packed: out of memory\n");
            return 1;
        }
        CK(dnnl_memory_create(&mw[0][i], &plain, g_eng, w));
        CK(dnnl_memory_create(&mw[1][i], packed, g_eng, DNNL_MEMORY_ALLOCATE));
        dnnl_exec_arg_t a[2] = {{DNNL_ARG_FROM, mw[0][i]}, {DNNL_ARG_TO, mw[1][i]}};
        CK(dnnl_primitive_execute(reorder, g_st, 2, a));
    }
    CK(dnnl_stream_wait(g_st));
    double t[2][MAXREP];
    for (int rep = -1; rep < reps; rep++) /* rep -1 warms up */
        for (int f = 0; f < 2; f++) {
            const double t0 = mdt_now();
            for (int i = 0; i < NW; i++)
                run(p[f], mx, mw[f][i], mb, my[f]);
            CK(dnnl_stream_wait(g_st));
            if (rep >= 0)
                t[f][rep] = mdt_now() - t0;
        }
    const int ident = memcmp(y[0], y[1], sizeof(float) * (size_t)(M * N)) == 0;
    const double fl = 2.0 * (double)(M * N * K) * NW * 1e-9;
    const double r0 = fl / mdt_bench_median(t[0], reps), r1 = fl / mdt_bench_median(t[1], reps);
    char lay[96];
    layout_name(packed, lay, sizeof lay);
    printf("| %lld x %lld . %lld x %lld | %.1f | %.1f (%.2fx) | %s / %s | %s, %zu bytes | %s | "
           "%s |\n",
           (long long)M, (long long)K, (long long)K, (long long)N, r0, r1, r1 / r0, impl[0],
           impl[1], lay, dnnl_memory_desc_get_size(packed), same ? "yes" : "no",
           ident ? "yes" : "NO");
    for (int i = 0; i < NW; i++) {
        void *h = NULL;
        CK(dnnl_memory_get_data_handle(mw[0][i], &h));
        free(h);
        dnnl_memory_destroy(mw[0][i]), dnnl_memory_destroy(mw[1][i]);
    }
    dnnl_memory_destroy(mx), dnnl_memory_destroy(mb);
    dnnl_memory_destroy(my[0]), dnnl_memory_destroy(my[1]);
    dnnl_primitive_destroy(reorder), dnnl_primitive_desc_destroy(rpd);
    for (int f = 0; f < 2; f++)
        dnnl_primitive_destroy(p[f]), dnnl_primitive_desc_destroy(pd[f]);
    free(x), free(b), free(y[0]), free(y[1]);
    return 0;
}

int main(int argc, char **argv) {
    int reps = argc > 1 ? atoi(argv[1]) : 5;
    reps = reps < 1 ? 1 : reps > MAXREP ? MAXREP : reps;
    omp_set_num_threads(1);
    CK(dnnl_engine_create(&g_eng, dnnl_cpu, 0));
    CK(dnnl_stream_create(&g_st, g_eng, dnnl_stream_default_flags));
    const dnnl_version_t *v = dnnl_version();
    printf("oneDNN %d.%d, one thread, %d weight matrices a shape, medians of %d\n", v->major,
           v->minor, NW, reps);
    printf("| M x K . K x N | weights as held GFLOP/s | prepacked | impl (held / prepacked) | "
           "packed layout | same layout at M = 1..4096 | bit-identical |\n"
           "|---|---|---|---|---|---|---|\n");
    int bad = 0;
    if (argc > 2) /* the shapes asked for */
        return mdt_bench_shape_args("gemm_packed", argv + 2, argc - 2, shape, reps);
    /* {M, N, K}: the medium step's linears on one rank (1280 rows), tp2 (N or K halved), a CP
     * rank (640 single-block rows; 512 image + 128 text rows in the double blocks), the cache
     * bench's 96 rows */
    const int64_t shapes[][3] = {{1280, 1024, 1024}, {1280, 4096, 1024}, {1280, 1024, 4096},
                                 {1280, 1024, 5120}, {1280, 512, 1024},  {1280, 2048, 1024},
                                 {1280, 1024, 2560}, {640, 1024, 1024},  {640, 4096, 1024},
                                 {640, 1024, 5120},  {512, 1024, 1024},  {512, 4096, 1024},
                                 {512, 1024, 4096},  {128, 1024, 1024},  {128, 1024, 4096},
                                 {96, 1024, 1024},   {96, 4096, 1024},   {96, 1024, 5120}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
        bad |= shape(shapes[s][0], shapes[s][1], shapes[s][2], reps);
    return bad;
}
