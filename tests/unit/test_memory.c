/*
 * test_memory.c — the memory check of `meshdit run` before any weight is read: what one rank
 * needs (weights + activations, by layout and dtype), the refusal naming the smallest TP degree
 * that fits, and the memory a process may use read from fake /proc and cgroup (v1, v2) trees;
 * and the accounting allocator's mdt_realloc (bytes kept, alignment, the live count); the
 * activation arena across steps (the same step allocates nothing, growing ones stay bounded).
 */
#define _POSIX_C_SOURCE 200809L
#include "harness.h"
#include "core/sysmem.h"
#include "plan/memory.h"

#include <cjson/cJSON.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

static char g_root[256];

/* Writes `text` at g_root/rel, creating the directories on the way. */
static void put(const char *rel, const char *text) {
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", g_root, rel);
    for (char *p = path + strlen(g_root) + 1; *p; p++)
        if (*p == '/') {
            *p = 0;
            mkdir(path, 0777);
            *p = '/';
        }
    FILE *fp = fopen(path, "w");
    if (fp) {
        fputs(text, fp);
        fclose(fp);
    }
}

static void fresh_root(void) {
    char cmd[512];
    if (g_root[0]) {
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_root);
        if (system(cmd) != 0)
            fprintf(stderr, "could not remove %s\n", g_root);
    }
    snprintf(g_root, sizeof g_root, "/tmp/mdt_memory_XXXXXX");
    if (!mkdtemp(g_root))
        g_root[0] = 0;
}

static void available(void) {
    char what[64];
    fresh_root();
    EXPECT(mdt_mem_available(g_root, what, sizeof what) == -1, "nothing readable");
    put("proc/meminfo", "MemTotal:       2000 kB\nMemFree:         100 kB\n"
                        "MemAvailable:    1000 kB\n");
    EXPECT(mdt_mem_available(g_root, what, sizeof what) == 1024000 &&
               strcmp(what, "MemAvailable") == 0,
           "meminfo only: %s", what);
    /* v2: the parent's limit binds (2 000 000 - 1 500 000 + 300 000 of file cache); the leaf is
     * unlimited */
    put("proc/self/cgroup", "0::/a/b\n");
    put("sys/fs/cgroup/a/memory.max", "2000000\n");
    put("sys/fs/cgroup/a/memory.current", "1500000\n");
    put("sys/fs/cgroup/a/memory.stat", "anon 1000\nactive_file 100000\ninactive_file 200000\n");
    put("sys/fs/cgroup/a/b/memory.max", "max\n");
    put("sys/fs/cgroup/a/b/memory.current", "1400000\n");
    int64_t v = mdt_mem_available(g_root, what, sizeof what);
    EXPECT(v == 800000 && strcmp(what, "cgroup memory.max") == 0, "v2 parent: %lld %s",
           (long long)v, what);
    /* ... the leaf's own limit when it is lower; usage over the limit counts as nothing left */
    put("sys/fs/cgroup/a/b/memory.max", "500000\n");
    v = mdt_mem_available(g_root, what, sizeof what);
    EXPECT(v == 0, "v2 leaf over its limit: %lld", (long long)v);
    put("sys/fs/cgroup/a/b/memory.current", "400000\n");
    v = mdt_mem_available(g_root, what, sizeof what);
    EXPECT(v == 100000, "v2 leaf: %lld", (long long)v);

    /* v1: the smaller of memory.limit_in_bytes and hierarchical_memory_limit */
    fresh_root();
    put("proc/meminfo", "MemAvailable:    100000 kB\n");
    put("proc/self/cgroup", "5:cpu,cpuacct:/x\n4:memory:/x\n0::/\n");
    put("sys/fs/cgroup/memory/x/memory.limit_in_bytes", "3000000\n");
    put("sys/fs/cgroup/memory/x/memory.usage_in_bytes", "2500000\n");
    put("sys/fs/cgroup/memory/x/memory.stat",
        "cache 5\nhierarchical_memory_limit 2800000\ntotal_active_file 100000\n"
        "total_inactive_file 0\n");
    v = mdt_mem_available(g_root, what, sizeof what);
    EXPECT(v == 400000 && strcmp(what, "cgroup memory.limit_in_bytes") == 0, "v1: %lld %s",
           (long long)v, what);
    /* a container that sees its cgroup as the mount's root; an unlimited cgroup adds nothing */
    fresh_root();
    put("proc/meminfo", "MemAvailable:    1000 kB\n");
    put("proc/self/cgroup", "4:memory:/docker/abc\n");
    put("sys/fs/cgroup/memory/memory.limit_in_bytes", "600000\n");
    put("sys/fs/cgroup/memory/memory.usage_in_bytes", "100000\n");
    v = mdt_mem_available(g_root, what, sizeof what);
    EXPECT(v == 500000, "v1 at the mount's root: %lld", (long long)v);
    put("sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n");
    v = mdt_mem_available(g_root, what, sizeof what);
    EXPECT(v == 1024000 && strcmp(what, "MemAvailable") == 0, "v1 unlimited: %lld %s", (long long)v,
           what);
    /* this machine: something, or nothing readable */
    EXPECT(mdt_mem_available("", what, sizeof what) >= -1, "this system");
}

static void estimate(void) {
    const mdt_family *fam = mdt_family_by_name("flux");
    cJSON *cfg = cJSON_Parse(mdt_family_preset(fam, "tiny"));
    mdt_model *m = NULL;
    EXPECT_OK(mdt_model_describe(cfg, &m));
    if (!m) {
        cJSON_Delete(cfg);
        return;
    }
    /* flux tiny: 2 heads x 16, 64 image + text rows */
    mdt_run_inputs in = {.batch = 1, .rows = 64, .input_bytes = 2148, .latent_f32 = 16 * 4 * 4};
    const mdt_run_memory t1 = mdt_run_memory_at(m, 1, 1, 1, &in);
    const mdt_run_memory t2 = mdt_run_memory_at(m, 2, 1, 1, &in);
    EXPECT(t1.weights == 273936, "tp=1 f32 weights %lld", (long long)t1.weights);
    EXPECT(t2.weights < t1.weights && t2.activations < t1.activations, "tp=2 holds less");
    /* activations: the arenas' first chunks, the inputs, 3 outputs, and 64 rows of
     * 10 D + (4 A + 1.5 F)/T floats (D = A = 32, F = 128) */
    const int64_t want_act = 2 * 1048576 + 2148 + 3 * 256 + 64 * (10 * 32 + 4 * 32 + 192) * 4;
    EXPECT(t1.activations == want_act, "activations %lld, wanted %lld", (long long)t1.activations,
           (long long)want_act);
    in.bf16 = 1;
    const mdt_run_memory b1 = mdt_run_memory_at(m, 1, 1, 1, &in);
    EXPECT(b1.weights < t1.weights * 6 / 10, "bf16 linears at 2 bytes: %lld",
           (long long)b1.weights);
    in.bf16 = 0;
    /* the sequence split shrinks each rank's rows; Ulysses and Ring add their buffers */
    EXPECT(mdt_act_bytes(m, 1, 1, 2, 1, 4096, 4) < mdt_act_bytes(m, 1, 1, 1, 1, 4096, 4) &&
               mdt_act_bytes(m, 1, 2, 1, 1, 4096, 4) < mdt_act_bytes(m, 1, 1, 1, 1, 4096, 4) &&
               mdt_act_bytes(m, 1, 1, 2, 1, 4096, 4) > mdt_act_bytes(m, 1, 1, 1, 1, 2048, 4),
           "sequence split");
    EXPECT(mdt_act_bytes(m, 1, 1, 1, 3, 100, 4) == 3 * mdt_act_bytes(m, 1, 1, 1, 1, 100, 4),
           "linear in the batch");

    /* the check: fits; refused naming activations and the smallest TP degree that fits */
    EXPECT_OK(mdt_check_run_memory(m, 1, 1, 1, &in, t1.weights + t1.activations, "LIMIT"));
    EXPECT_ERR(mdt_check_run_memory(m, 1, 1, 1, &in, t1.weights + t1.activations - 1, "LIMIT"),
               MDT_E_NOMEM, "tp=1 needs", "of f32 weights", "of activations (batch 1 x 64 tokens)",
               "over LIMIT", "tp=2 would need");
    EXPECT_ERR(mdt_check_run_memory(m, 1, 1, 1, &in, t2.weights + t2.activations - 1, "LIMIT"),
               MDT_E_NOMEM, "no valid tp up to 256 fits",
               "more --ring/--ulysses ranks split the activations");
    /* activations on a GPU are not host memory */
    in.device_acts = 1;
    const mdt_run_memory d1 = mdt_run_memory_at(m, 1, 1, 1, &in);
    EXPECT(d1.activations == 0 && d1.weights == t1.weights, "device activations");
    EXPECT_ERR(mdt_check_run_memory(m, 1, 1, 1, &in, 1000, "LIMIT"), MDT_E_NOMEM, "tp=1 needs",
               "f32 weights), over LIMIT");
    mdt_model_free(m);
    cJSON_Delete(cfg);
}

/* The least limit mdt_check_forward_memory passes for a forward of `in` (binary search). */
static int64_t forward_need(const mdt_model *m, const mdt_tensor_set *in) {
    int64_t lo = 0, hi = (int64_t)1 << 40;
    while (hi - lo > 1) {
        const int64_t mid = lo + (hi - lo) / 2;
        if (mdt_check_forward_memory(m, in, mid, 0) == MDT_OK)
            hi = mid;
        else
            lo = mid;
    }
    mdt_error_clear();
    return hi;
}

/* An input in another dtype than f32 costs its bytes and the f32 copy the forward converts it to
 * (bf16 ControlNet residuals: 3x their file size in all, not 1x). */
static void converted_inputs(void) {
    const mdt_family *fam = mdt_family_by_name("flux");
    cJSON *cfg = cJSON_Parse(mdt_family_preset(fam, "tiny"));
    mdt_model *m = NULL;
    mdt_tensor_set *f32 = NULL, *bf16 = NULL;
    mdt_tensor *t;
    enum { N = 1 << 20 };
    EXPECT_OK(mdt_model_describe(cfg, &m));
    EXPECT_OK(mdt_tensor_set_create(&f32));
    EXPECT_OK(mdt_tensor_set_create(&bf16));
    if (m && f32 && bf16 &&
        mdt_tensor_set_add(f32, "controlnet_block_samples", MDT_F32, 1, (int64_t[]){N}, &t) ==
            MDT_OK &&
        mdt_tensor_set_add(bf16, "controlnet_block_samples", MDT_BF16, 1, (int64_t[]){N}, &t) ==
            MDT_OK) {
        const int64_t a = forward_need(m, f32), b = forward_need(m, bf16);
        EXPECT(b - a == 2 * N,
               "bf16 input: %lld bytes more than f32, wanted %d (2 + 4 - 4 a value)",
               (long long)(b - a), 2 * N);
        /* under CP each rank also copies its chunk of the inputs the plan cuts */
        const mdt_run_inputs none = {.batch = 1, .rows = 64},
                             cut = {.batch = 1, .rows = 64, .split_f32 = 4 * N};
        const int64_t u2 = mdt_run_memory_at(m, 1, 1, 2, &cut).activations -
                           mdt_run_memory_at(m, 1, 1, 2, &none).activations;
        const int64_t ru4 = mdt_run_memory_at(m, 1, 2, 2, &cut).activations -
                            mdt_run_memory_at(m, 1, 2, 2, &none).activations;
        const int64_t one = mdt_run_memory_at(m, 1, 1, 1, &cut).activations -
                            mdt_run_memory_at(m, 1, 1, 1, &none).activations;
        EXPECT(u2 == 2 * N && ru4 == N && one == 0,
               "a split input's chunk: %lld on ulysses2, %lld on ring2 x ulysses2, %lld on one "
               "rank (wanted 1/2, 1/4 of %d and 0)",
               (long long)u2, (long long)ru4, (long long)one, 4 * N);
    }
    mdt_tensor_set_free(f32);
    mdt_tensor_set_free(bf16);
    mdt_model_free(m);
    cJSON_Delete(cfg);
}

/* The activation arena across steps: the same step again gets the same blocks and allocates
 * nothing (before, the second step's chunk was a fresh one, every page of it faulted again), and
 * steps whose shapes keep growing are bounded: after each reset the arena holds at most twice
 * its high-water mark. */
static void arena_steps(void) {
    enum { MIB = 1 << 20, F = MIB / 4 }; /* floats in a MiB */
    const int64_t base = mdt_mem_live();
    mdt_arena a;
    mdt_arena_init(&a);
    float *first[2] = {mdt_arena_floats(&a, 4 * F), mdt_arena_floats(&a, 4 * F)}; /* 2 chunks */
    EXPECT_OK(mdt_arena_reset(&a));
    const int64_t n0 = mdt_mem_alloc_count();
    float *again[2] = {mdt_arena_floats(&a, 4 * F), mdt_arena_floats(&a, 4 * F)};
    EXPECT(again[0] == first[0] && again[1] == first[1] && mdt_mem_alloc_count() == n0,
           "the same step again: %lld allocations, blocks %s",
           (long long)(mdt_mem_alloc_count() - n0),
           again[0] == first[0] && again[1] == first[1] ? "the same" : "moved");
    EXPECT_OK(mdt_arena_reset(&a));
    int64_t most = 0, hw = 8 * MIB;
    for (int k = 5; k <= 12; k++) { /* one block, larger each step */
        EXPECT(mdt_arena_floats(&a, (int64_t)k * F) != NULL, "a block of %d MiB", k);
        EXPECT_OK(mdt_arena_reset(&a));
        hw = (int64_t)k * MIB > hw ? (int64_t)k * MIB : hw;
        const int64_t held = mdt_mem_live() - base;
        most = held > most ? held : most;
        EXPECT(held <= 2 * hw + 4096,
               "after a %d MiB step the arena holds %lld bytes, over twice "
               "its high-water mark %lld",
               k, (long long)held, (long long)hw);
    }
    EXPECT(most > 8 * MIB + 5 * MIB, "the chain never grew past its first step (%lld bytes)",
           (long long)most);
    mdt_arena_release(&a);
    EXPECT(mdt_mem_live() == base, "the arena released %lld bytes too few",
           (long long)(mdt_mem_live() - base));
}

/* A block grown from 100 bytes through the sizes the server's request buffer takes (small
 * blocks the C library moves, large ones it remaps) and shrunk: its bytes, its 64-byte
 * alignment and the live count follow at every step. */
static void reallocation(void) {
    const int64_t live0 = mdt_mem_live();
    const size_t sizes[] = {100, 1000, 70000, 1 << 20, 40 << 20, 48 << 20, 10, 0, 5000};
    unsigned char *p = mdt_alloc(sizes[0]);
    size_t have = sizes[0];
    for (size_t i = 0; i < have; i++)
        p[i] = (unsigned char)(i * 7 + 3);
    for (size_t k = 1; p && k < sizeof sizes / sizeof sizes[0]; k++) {
        unsigned char *q = mdt_realloc(p, sizes[k]);
        EXPECT(q != NULL, "realloc to %zu bytes", sizes[k]);
        if (!q)
            break;
        p = q;
        const size_t kept = have < sizes[k] ? have : sizes[k];
        size_t bad = 0;
        for (size_t i = 0; i < kept; i++)
            bad += p[i] != (unsigned char)(i * 7 + 3);
        EXPECT(bad == 0 && (uintptr_t)p % 64 == 0, "%zu bytes: %zu differ, address %p", sizes[k],
               bad, (void *)p);
        EXPECT(mdt_mem_live() - live0 == (int64_t)sizes[k], "live %lld after %zu bytes",
               (long long)(mdt_mem_live() - live0), sizes[k]);
        for (size_t i = kept; i < sizes[k]; i++)
            p[i] = (unsigned char)(i * 7 + 3);
        have = sizes[k];
    }
    mdt_free(p);
    EXPECT(mdt_mem_live() == live0, "live %lld after the free",
           (long long)(mdt_mem_live() - live0));
    void *fresh = mdt_realloc(NULL, 16);
    EXPECT(fresh && mdt_mem_live() - live0 == 16, "a realloc of NULL allocates");
    mdt_free(fresh);
}

int main(void) {
    reallocation();
    arena_steps();
    available();
    estimate();
    converted_inputs();
    char cmd[512];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_root);
    if (g_root[0] && system(cmd) != 0)
        fprintf(stderr, "could not remove %s\n", g_root);
    TEST_END();
}
