/*
 * test_lora.c — LoRA adapters fused into the resident shards, under mpiexec on any layout.
 *
 * usage: mpiexec -n N build/tests/mpi/test_lora DATA_DIR T R U
 * For each case of DATA_DIR/lora (adapters a and b made by scripts/goldens_lora.py on the tiny
 * checkpoints of Flux, Flux.2, Qwen-Image, Wan and MiniMax-H3, with what diffusers + peft
 * compute; every output compared, MiniMax-H3's audio too): adapter a
 * alone and a x 0.7 + b x -1.3 against diffusers (1e-4; bf16: 1e-2) and against the same adapters
 * on one rank (1e-5); unfusing brings every resident shard and the output back bit for bit, by
 * re-reading the checkpoint and from kept copies, which fuse to the same bits; weights 0 are the
 * base run bit for bit; unloading one active adapter leaves the other fused exactly; lora_down /
 * lora_up and peft's base_model.model. prefix read as lora_A / lora_B; a LoRA on one layer
 * changes the output (the negative control). Errors (on flux_tiny and flux2_tiny): keys that map
 * to nothing (all listed, with kohya's hint), a missing factor, a shape mismatch (both shapes),
 * DoRA / LoKr / LoHa keys and DoRA metadata, a norm as target, a LoRA bias on a layer without one,
 * alphas twice, bad names and weights for set_adapters, parallelize with adapters, a checkpoint
 * file changed since the load.
 * MESHDIT_TEST_DTYPE=bf16: the CPU backend with bf16 linear weights.
 */
#define _POSIX_C_SOURCE 200809L
#include "backend/backend.h"
#include "harness.h"
#include "models/lora.h"

#include <cjson/cJSON.h>
#include <fcntl.h>
#include <mpi.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

static int g_rank, g_bf16;
static char g_tmp[256];

static mdt_tensor_set *fwd(mdt_model *m, const mdt_tensor_set *in) {
    mdt_tensor_set *out = NULL;
    mdt_tensor_set_create(&out);
    EXPECT_OK(mdt_model_forward(m, in, out));
    return out;
}

/* Over every output of b (sample; MiniMax-H3 also audio_sample): the largest relative error
 * of a's tensor of that name. */
static double rel(const mdt_tensor_set *a, const mdt_tensor_set *b) {
    double worst = b && mdt_tensor_set_count(b) ? 0 : 1e30;
    for (int i = 0; b && i < mdt_tensor_set_count(b); i++) {
        const char *nm;
        const mdt_tensor *y = mdt_tensor_set_at(b, i, &nm);
        const mdt_tensor *x = a ? mdt_tensor_set_get(a, nm) : NULL;
        const double e = x && mdt_tensor_numel(x) == mdt_tensor_numel(y)
                             ? t_rel_err(x->data, y->data, mdt_tensor_numel(y), 0)
                             : 1e30;
        worst = e > worst || e != e ? e : worst;
    }
    return worst;
}

/* Every output of b bit for bit in a. */
static int same(const mdt_tensor_set *a, const mdt_tensor_set *b) {
    int eq = a && b && mdt_tensor_set_count(a) == mdt_tensor_set_count(b);
    for (int i = 0; eq && i < mdt_tensor_set_count(b); i++) {
        const char *nm;
        const mdt_tensor *y = mdt_tensor_set_at(b, i, &nm), *x = mdt_tensor_set_get(a, nm);
        eq = x && mdt_tensor_nbytes(x) == mdt_tensor_nbytes(y) &&
             memcmp(x->data, y->data, (size_t)mdt_tensor_nbytes(y)) == 0;
    }
    return eq;
}

/* Tensor i's resident bytes: bf16, the GEMM's packed layout (residency.h), or plain f32. */
static size_t resident(const mdt_model *m, int i) {
    if (m->ws[i].packed)
        return (size_t)m->ws[i].packed * 4;
    return (size_t)(m->ws[i].local[0] * m->ws[i].local[1]) * (m->ws[i].h ? 2 : 4);
}

/* Every resident shard's bytes, one after the other (host weights). */
static unsigned char *snap(const mdt_model *m, size_t *len) {
    size_t n = 0;
    for (int i = 0; i < m->table.n; i++)
        n += resident(m, i);
    unsigned char *b = malloc(n + 1), *p = b;
    for (int i = 0; i < m->table.n; i++) {
        const size_t k = resident(m, i);
        memcpy(p, m->ws[i].h ? (const void *)m->ws[i].h : (const void *)m->ws[i].data, k);
        p += k;
    }
    *len = n;
    return b;
}

static int snap_equal(const mdt_model *m, const unsigned char *s0, size_t n0) {
    size_t n;
    unsigned char *s = snap(m, &n);
    const int eq = n == n0 && memcmp(s, s0, n) == 0;
    free(s);
    return eq;
}

/* ---- adapter files made here (rank 0 writes, every rank reads) ---- */
typedef struct {
    const char *name;
    int64_t ndim, shape[5];
    mdt_dtype dt;
} key;

/* The next write_keys puts a NaN at element g_nan_at of key g_nan_key (then clears them). */
static int g_nan_key = -1;
static int64_t g_nan_at;

static void write_keys(const char *path, const key *k, int n, const char *meta) {
    if (g_rank == 0) {
        mdt_tensor ts[16];
        const mdt_tensor *tp[16];
        const char *names[16];
        mdt_rng rng;
        mdt_rng_seed(&rng, 7);
        for (int i = 0; i < n; i++) {
            ts[i] = (mdt_tensor){.dtype = k[i].dt, .ndim = (int)k[i].ndim};
            memcpy(ts[i].shape, k[i].shape, sizeof k[i].shape);
            const int64_t ne = mdt_tensor_numel(&ts[i]);
            float *v = malloc(sizeof(float) * (size_t)(ne + 1));
            for (int64_t j = 0; j < ne; j++)
                v[j] = (float)(0.3 * mdt_rng_normal(&rng));
            if (i == g_nan_key && g_nan_at < ne)
                v[g_nan_at] = NAN;
            ts[i].data = malloc((size_t)mdt_tensor_nbytes(&ts[i]) + 8);
            if (k[i].dt == MDT_I64)
                memset(ts[i].data, 0, (size_t)mdt_tensor_nbytes(&ts[i]));
            else
                mdt_convert_from_f32(k[i].dt, v, ts[i].data, ne);
            free(v);
            tp[i] = &ts[i], names[i] = k[i].name;
        }
        const char *md[] = {"format", "pt", "lora_adapter_metadata", meta, NULL};
        if (!meta)
            md[2] = NULL;
        EXPECT_OK(mdt_st_write(path, n, names, tp, md));
        g_nan_key = -1;
        for (int i = 0; i < n; i++)
            free(ts[i].data);
    }
    MPI_Barrier(MPI_COMM_WORLD);
}

/* A copy of `src` with every key's `from` replaced by `to` (and `pfx` in front). */
static void rename_keys(const char *src, const char *dst, const char *from, const char *to,
                        const char *pfx) {
    if (g_rank == 0) {
        mdt_tensor_set *s = NULL, *d = NULL;
        EXPECT_OK(mdt_tensor_set_load(src, &s));
        mdt_tensor_set_create(&d);
        for (int i = 0; s && i < mdt_tensor_set_count(s); i++) {
            const char *nm;
            const mdt_tensor *t = mdt_tensor_set_at(s, i, &nm);
            char out[256];
            const char *hit = strstr(nm, from);
            if (hit)
                snprintf(out, sizeof out, "%s%.*s%s%s", pfx, (int)(hit - nm), nm, to,
                         hit + strlen(from));
            else
                snprintf(out, sizeof out, "%s%s", pfx, nm);
            mdt_tensor *c;
            mdt_tensor_set_add(d, out, t->dtype, t->ndim, t->shape, &c);
            memcpy(c->data, t->data, (size_t)mdt_tensor_nbytes(t));
        }
        EXPECT_OK(mdt_tensor_set_save(d, dst));
        mdt_tensor_set_free(s), mdt_tensor_set_free(d);
    }
    MPI_Barrier(MPI_COMM_WORLD);
}

static void tmp_path(char *buf, size_t cap, const char *name) {
    snprintf(buf, cap, "%s/%s", g_tmp, name);
}

static mdt_model *load(const char *dir, mdt_mesh *mesh) {
    mdt_load_params lp = mdt_load_params_default();
    lp.checkpoint_dir = dir, lp.mesh = mesh;
    mdt_model *m = NULL;
    EXPECT_OK(mdt_model_load(&lp, &m));
    return m;
}

static void check_case(const char *data, const char *name, mdt_mesh *mesh) {
    char dir[512], la[600], lb[600], p[700];
    snprintf(dir, sizeof dir, "%s/%s", data, name);
    snprintf(la, sizeof la, "%s/lora/%s/a.safetensors", data, name);
    snprintf(lb, sizeof lb, "%s/lora/%s/b.safetensors", data, name);
    mdt_tensor_set *in = NULL, *ea = NULL, *eab = NULL;
    snprintf(p, sizeof p, "%s/inputs.safetensors", dir);
    EXPECT_OK(mdt_tensor_set_load(p, &in));
    snprintf(p, sizeof p, "%s/lora/%s/expected_a.safetensors", data, name);
    EXPECT_OK(mdt_tensor_set_load(p, &ea));
    snprintf(p, sizeof p, "%s/lora/%s/expected_ab.safetensors", data, name);
    EXPECT_OK(mdt_tensor_set_load(p, &eab));
    mdt_model *m = load(dir, mesh), *one = load(dir, NULL);
    if (!m || !one || !in || !ea || !eab)
        goto done;
    /* bf16: the goldens are diffusers in f32 (test_parallel's bound) */
    const double tol = g_bf16 ? 1e-2 : 1e-4, ltol = g_bf16 ? 5e-3 : 1e-5;
    const char *ab[] = {"a", "b"};
    const double wab[] = {0.7, -1.3}, w1[] = {1.0}, w0[] = {0.0, 0.0};
    mdt_tensor_set *o0 = fwd(m, in);
    size_t n0;
    unsigned char *s0 = snap(m, &n0);
    EXPECT_OK(mdt_model_lora_load(m, "a", la));
    EXPECT_OK(mdt_model_lora_load(m, "b", lb));
    EXPECT_OK(mdt_model_lora_load(one, "a", la));
    EXPECT_OK(mdt_model_lora_load(one, "b", lb));
    EXPECT(mdt_model_lora_count(m) == 2, "%s: 2 adapters loaded", name);
    EXPECT(snap_equal(m, s0, n0), "%s: loading fuses nothing", name);

    EXPECT_OK(mdt_model_set_adapters(m, 1, ab, w1));
    mdt_tensor_set *oa = fwd(m, in);
    EXPECT(rel(oa, ea) <= tol, "%s: a vs diffusers + peft: %.3e", name, rel(oa, ea));
    EXPECT_OK(mdt_model_set_adapters(m, 2, ab, wab));
    mdt_tensor_set *oab = fwd(m, in);
    EXPECT(rel(oab, eab) <= tol, "%s: a 0.7 + b -1.3 vs diffusers + peft: %.3e", name,
           rel(oab, eab));
    EXPECT_OK(mdt_model_set_adapters(one, 2, ab, wab));
    mdt_tensor_set *o1 = fwd(one, in);
    EXPECT(rel(oab, o1) <= ltol, "%s: layout vs one rank with adapters: %.3e", name, rel(oab, o1));

    /* unfuse: every shard and the output back, bit for bit (re-read from the checkpoint) */
    EXPECT_OK(mdt_model_set_adapters(m, 0, NULL, NULL));
    EXPECT(snap_equal(m, s0, n0), "%s: unfused shards are not the base bits", name);
    mdt_tensor_set *ou = fwd(m, in);
    EXPECT(same(ou, o0), "%s: unfused output is not the base run's bits", name);
    EXPECT_OK(mdt_model_set_adapters(m, 2, ab, w0));
    mdt_tensor_set *oz = fwd(m, in);
    EXPECT(same(oz, o0) && snap_equal(m, s0, n0), "%s: weights 0 are not the base run", name);

    /* kept copies: the same fused bits, the same base bits back */
    EXPECT_OK(mdt_model_set_lora_base(m, MDT_LORA_BASE_COPY));
    EXPECT_OK(mdt_model_set_adapters(m, 2, ab, wab));
    mdt_tensor_set *oc = fwd(m, in);
    EXPECT(same(oc, oab), "%s: fused from a copy differs from fused from the checkpoint", name);
    double fs, bs;
    int64_t rb, cb;
    mdt_model_lora_costs(m, &fs, &bs, &rb, &cb);
    EXPECT(cb > 0, "%s: copy mode keeps copies (%lld bytes)", name, (long long)cb);
    EXPECT_ERR(mdt_model_set_lora_base(m, MDT_LORA_BASE_REREAD), MDT_E_INVALID, "fused");
    EXPECT_OK(mdt_model_set_adapters(m, 0, NULL, NULL));
    EXPECT(snap_equal(m, s0, n0), "%s: copy mode: unfused shards are not the base bits", name);
    mdt_model_lora_costs(m, &fs, &bs, &rb, &cb);
    EXPECT(cb == 0, "%s: copies freed once unfused (%lld bytes)", name, (long long)cb);
    EXPECT_OK(mdt_model_set_lora_base(m, MDT_LORA_BASE_REREAD));

    /* a fused twice (from a, then a + b): b alone left after unloading a's partner */
    const char *only_a[] = {"a"};
    const double w07[] = {0.7};
    EXPECT_OK(mdt_model_set_adapters(m, 1, only_a, w07));
    mdt_tensor_set *o07 = fwd(m, in);
    EXPECT_OK(mdt_model_set_adapters(m, 2, ab, wab));
    EXPECT_OK(mdt_model_lora_unload(m, "b"));
    mdt_tensor_set *ol = fwd(m, in);
    EXPECT(same(ol, o07), "%s: unloading b does not leave a x 0.7 exactly", name);
    EXPECT(mdt_model_lora_count(m) == 1, "%s: one adapter left", name);

    /* other spellings of the same adapter: lora_down / lora_up, peft's prefix */
    char pd[300], pp[300];
    tmp_path(pd, sizeof pd, "b_down.safetensors");
    tmp_path(pp, sizeof pp, "b_peft.safetensors");
    rename_keys(lb, pd, ".lora_A.", ".lora_down.", "");
    rename_keys(pd, pd, ".lora_B.", ".lora_up.", "");
    rename_keys(lb, pp, "transformer.", "", "base_model.model.");
    const char *bd[] = {"a", "bd"}, *bp[] = {"a", "bp"};
    EXPECT_OK(mdt_model_lora_load(m, "bd", pd));
    EXPECT_OK(mdt_model_set_adapters(m, 2, bd, wab));
    mdt_tensor_set *od = fwd(m, in);
    EXPECT(same(od, oab), "%s: lora_down/lora_up read differently from lora_A/lora_B", name);
    EXPECT_OK(mdt_model_lora_load(m, "bp", pp));
    EXPECT_OK(mdt_model_set_adapters(m, 2, bp, wab));
    mdt_tensor_set *op = fwd(m, in);
    EXPECT(same(op, oab), "%s: base_model.model. keys read differently", name);
    EXPECT_OK(mdt_model_lora_unload(m, NULL));
    EXPECT(mdt_model_lora_count(m) == 0 && snap_equal(m, s0, n0),
           "%s: unloading all leaves the base", name);

    /* negative control: a LoRA on one linear changes the output */
    int li = -1;
    for (int i = 0; i < m->table.n && li < 0; i++)
        if (m->table.lin[i] && strstr(m->table.specs[i].name, "blocks.0.") &&
            m->table.specs[i].stored_ndim == 0)
            li = i;
    if (li >= 0) {
        const mdt_weight_spec *w = &m->table.specs[li];
        char ka[200], kb[200], p1[300];
        snprintf(ka, sizeof ka, "transformer.%.*s.lora_A.weight", (int)strlen(w->name) - 7,
                 w->name);
        snprintf(kb, sizeof kb, "transformer.%.*s.lora_B.weight", (int)strlen(w->name) - 7,
                 w->name);
        const key k[] = {{ka, 2, {2, w->shape[1]}, MDT_F32}, {kb, 2, {w->shape[0], 2}, MDT_F32}};
        tmp_path(p1, sizeof p1, "one.safetensors");
        write_keys(p1, k, 2, NULL);
        const char *one_n[] = {"one"};
        EXPECT_OK(mdt_model_lora_load(m, "one", p1));
        EXPECT_OK(mdt_model_set_adapters(m, 1, one_n, w1));
        mdt_tensor_set *on = fwd(m, in);
        EXPECT(rel(on, o0) > 1e-3, "%s: a LoRA on %s changes nothing (%.3e)", name, w->name,
               rel(on, o0));
        EXPECT_OK(mdt_model_lora_unload(m, NULL));
        mdt_tensor_set_free(on);
        /* a negative alpha scales by it, as peft does (alpha / r = -1, where it used to be read
         * as "no alpha": +1): the output of alpha = r at weight -1, and not the base's */
        char p2[300], p3[300];
        tmp_path(p2, sizeof p2, "neg.safetensors");
        tmp_path(p3, sizeof p3, "pos.safetensors");
        write_keys(p2, k, 2, "{\"lora_alpha\": -2, \"r\": 2}");
        write_keys(p3, k, 2, "{\"lora_alpha\": 2, \"r\": 2}");
        const char *neg_n[] = {"neg"}, *pos_n[] = {"pos"};
        const double wm1[] = {-1.0};
        EXPECT_OK(mdt_model_lora_load(m, "neg", p2));
        EXPECT_OK(mdt_model_lora_load(m, "pos", p3));
        EXPECT_OK(mdt_model_set_adapters(m, 1, neg_n, w1));
        mdt_tensor_set *oneg = fwd(m, in);
        EXPECT_OK(mdt_model_set_adapters(m, 1, pos_n, wm1));
        mdt_tensor_set *opos = fwd(m, in);
        EXPECT(same(oneg, opos) && rel(oneg, o0) > 1e-3,
               "%s: alpha -2 at weight 1 is not alpha 2 at weight -1 (%.3e from the base)", name,
               rel(oneg, o0));
        EXPECT_OK(mdt_model_lora_unload(m, NULL));
        mdt_tensor_set_free(oneg), mdt_tensor_set_free(opos);
        /* factors and scale finite, their sum with the weight not: refused at the fuse, naming
         * the adapter and the weight, on every rank, with the base weights kept */
        char p4[300];
        tmp_path(p4, sizeof p4, "huge.safetensors");
        write_keys(p4, k, 2, "{\"lora_alpha\": 1e300, \"r\": 2}");
        const char *huge_n[] = {"huge"};
        EXPECT_OK(mdt_model_lora_load(m, "huge", p4));
        EXPECT_ERR(mdt_model_set_adapters(m, 1, huge_n, w1), MDT_E_INVALID, "adapter 'huge'",
                   w->name, "non-finite");
        EXPECT(snap_equal(m, s0, n0), "%s: a refused fuse left other than the base weights", name);
        EXPECT_OK(mdt_model_lora_unload(m, NULL));
    }
    mdt_tensor_set_free(o0), mdt_tensor_set_free(oa), mdt_tensor_set_free(oab);
    mdt_tensor_set_free(o1), mdt_tensor_set_free(ou), mdt_tensor_set_free(oz);
    mdt_tensor_set_free(oc), mdt_tensor_set_free(o07), mdt_tensor_set_free(ol);
    mdt_tensor_set_free(od), mdt_tensor_set_free(op);
    free(s0);
done:
    mdt_model_free(m), mdt_model_free(one);
    mdt_tensor_set_free(in), mdt_tensor_set_free(ea), mdt_tensor_set_free(eab);
}

/* One bad adapter: loading it fails with `code` and a message holding every substring. */
#define BAD(m, file, keys, meta, code, ...)                                                        \
    do {                                                                                           \
        char p_[300];                                                                              \
        tmp_path(p_, sizeof p_, file);                                                             \
        write_keys(p_, keys, (int)(sizeof keys / sizeof keys[0]), meta);                           \
        EXPECT_ERR(mdt_model_lora_load(m, "bad", p_), code, __VA_ARGS__);                          \
        EXPECT(mdt_model_lora_count(m) == 0, "%s: a failed load leaves no adapter", file);         \
    } while (0)

static void check_errors(const char *data, mdt_mesh *mesh) {
    char dir[512];
    snprintf(dir, sizeof dir, "%s/flux_tiny", data);
    mdt_model *m = load(dir, mesh);
    if (!m)
        return;
        /* flux_tiny: hidden 32, attn.to_q [32, 32] with a bias, norm_q [16] */
#define Q "transformer.transformer_blocks.0.attn.to_q"
    const key ok2[] = {{Q ".lora_A.weight", 2, {4, 32}, MDT_F32},
                       {Q ".lora_B.weight", 2, {32, 4}, MDT_F32}};
    const key unmapped[] = {{Q ".lora_A.weight", 2, {4, 32}, MDT_F32},
                            {Q ".lora_B.weight", 2, {32, 4}, MDT_F32},
                            {"transformer.no_such.lora_A.weight", 2, {4, 32}, MDT_F32},
                            {"text_encoder.x.lora_B.weight", 2, {4, 32}, MDT_F32}};
    BAD(m, "unmapped.safetensors", unmapped, NULL, MDT_E_INVALID, "2 keys map to no weight",
        "transformer.no_such.lora_A.weight", "text_encoder.x.lora_B.weight", "text encoders");
    const key kohya[] = {
        {"lora_unet_double_blocks_0_img_attn_proj.lora_down.weight", 2, {4, 32}, MDT_F32}};
    BAD(m, "kohya.safetensors", kohya, NULL, MDT_E_INVALID, "lora_unet_double_blocks_0", "kohya");
    const key half[] = {{Q ".lora_A.weight", 2, {4, 32}, MDT_F32}};
    BAD(m, "half.safetensors", half, NULL, MDT_E_INVALID, "missing",
        "transformer_blocks.0.attn.to_q.lora_B.weight");
    const key shape[] = {{Q ".lora_A.weight", 2, {4, 33}, MDT_F32},
                         {Q ".lora_B.weight", 2, {32, 4}, MDT_F32}};
    const char *qa = Q ".lora_A.weight";
    BAD(m, "shape.safetensors", shape, NULL, MDT_E_INVALID, qa, "[4, 33]",
        "transformer_blocks.0.attn.to_q.weight", "[32, 32]");
    const key shape_b[] = {{Q ".lora_A.weight", 2, {4, 32}, MDT_F32},
                           {Q ".lora_B.weight", 2, {32, 3}, MDT_F32}};
    BAD(m, "shape_b.safetensors", shape_b, NULL, MDT_E_INVALID, "[32, 3]", "expected [32, 4]");
    const key dora[] = {{Q ".lora_A.weight", 2, {4, 32}, MDT_F32},
                        {Q ".lora_B.weight", 2, {32, 4}, MDT_F32},
                        {Q ".lora_magnitude_vector", 1, {32}, MDT_F32}};
    BAD(m, "dora.safetensors", dora, NULL, MDT_E_UNSUPPORTED, "DoRA");
    BAD(m, "dora_meta.safetensors", ok2, "{\"use_dora\": true, \"r\": 4}", MDT_E_UNSUPPORTED,
        "DoRA", "use_dora");
    const key lokr[] = {{Q ".lokr_w1", 2, {4, 4}, MDT_F32}, {Q ".lokr_w2", 2, {8, 8}, MDT_F32}};
    BAD(m, "lokr.safetensors", lokr, NULL, MDT_E_UNSUPPORTED, "LoKr");
    const key loha[] = {{Q ".hada_w1_a", 2, {32, 4}, MDT_F32}};
    BAD(m, "loha.safetensors", loha, NULL, MDT_E_UNSUPPORTED, "LoHa");
    const key diff[] = {{Q ".diff", 2, {32, 32}, MDT_F32}};
    BAD(m, "diff.safetensors", diff, NULL, MDT_E_UNSUPPORTED, "weight differences");
    const key norm[] = {
        {"transformer.transformer_blocks.0.attn.norm_q.lora_A.weight", 2, {4, 16}, MDT_F32},
        {"transformer.transformer_blocks.0.attn.norm_q.lora_B.weight", 2, {16, 4}, MDT_F32}};
    BAD(m, "norm.safetensors", norm, NULL, MDT_E_UNSUPPORTED, "not a linear", "norm_q");
    const key twice[] = {{Q ".lora_A.weight", 2, {4, 32}, MDT_F32},
                         {Q ".lora_B.weight", 2, {32, 4}, MDT_F32},
                         {Q ".alpha", 0, {0}, MDT_F32}};
    BAD(m, "twice.safetensors", twice, "{\"lora_alpha\": 8, \"r\": 4}", MDT_E_INVALID,
        "both as '.alpha' keys and in its lora_adapter_metadata");
    BAD(m, "rank.safetensors", ok2, "{\"lora_alpha\": 8, \"r\": 8}", MDT_E_INVALID, "rank 4",
        "says 8");
    /* a metadata field of the wrong type is refused, never read as absent */
    BAD(m, "alpha_str.safetensors", ok2, "{\"lora_alpha\": \"8\", \"r\": 4}", MDT_E_FORMAT,
        "lora_alpha is not a number");
    BAD(m, "alpha_null.safetensors", ok2, "{\"lora_alpha\": null}", MDT_E_FORMAT,
        "lora_alpha is not a number");
    BAD(m, "r_str.safetensors", ok2, "{\"r\": \"4\"}", MDT_E_FORMAT, "r is not a number");
    /* a repeated key: cJSON would read the first, peft (Python's json) the last */
    BAD(m, "alpha_twice.safetensors", ok2, "{\"lora_alpha\": 8, \"r\": 4, \"lora_alpha\": 2}",
        MDT_E_FORMAT, "key 'lora_alpha' appears twice");
    BAD(m, "r_negative.safetensors", ok2, "{\"r\": -4}", MDT_E_INVALID,
        "r is -4: a rank is a positive integer");
    BAD(m, "alpha_inf.safetensors", ok2, "{\"lora_alpha\": 1e999, \"r\": 4}", MDT_E_INVALID,
        "lora_alpha is not finite");
    BAD(m, "rslora_str.safetensors", ok2, "{\"use_rslora\": \"yes\"}", MDT_E_FORMAT,
        "use_rslora is not true or false");
    BAD(m, "pattern_list.safetensors", ok2, "{\"alpha_pattern\": [1]}", MDT_E_FORMAT,
        "alpha_pattern is not an object");
    /* the metadata as a pipeline's file has it ("transformer." fields): read, never skipped */
    BAD(m, "dora_pfx.safetensors", ok2, "{\"transformer.use_dora\": true}", MDT_E_UNSUPPORTED,
        "DoRA", "transformer.use_dora");
    BAD(m, "mixed_pfx.safetensors", ok2, "{\"transformer.r\": 4, \"lora_alpha\": 400}",
        MDT_E_INVALID, "'transformer.'-prefixed", "bare 'lora_alpha'");
    BAD(m, "rslora_pfx.safetensors", ok2, "{\"transformer.use_rslora\": \"yes\"}", MDT_E_FORMAT,
        "transformer.use_rslora is not true or false");
    /* no r: peft's LoraConfig default (8), and a rank_pattern is checked without an r too */
    BAD(m, "no_r.safetensors", ok2, "{\"lora_alpha\": 4}", MDT_E_INVALID, "rank 4", "says 8",
        "peft's default r");
    BAD(m, "rank_pattern.safetensors", ok2, "{\"lora_alpha\": 4, \"rank_pattern\": {\"to_q\": 7}}",
        MDT_E_INVALID, "rank 4", "says 7");
    BAD(m, "alpha_pattern_inf.safetensors", ok2,
        "{\"lora_alpha\": 4, \"r\": 4, \"alpha_pattern\": {\"to_q\": 1e400}}", MDT_E_INVALID,
        "alpha_pattern['to_q'] is not finite");
    BAD(m, "rank_pattern_frac.safetensors", ok2, "{\"r\": 4, \"rank_pattern\": {\"to_k\": 2.5}}",
        MDT_E_INVALID, "rank_pattern['to_k'] is not a rank");
    /* a second alpha or bias for one module (another prefix or naming) is refused, not dropped */
    const key alpha2[] = {{Q ".lora_A.weight", 2, {4, 32}, MDT_F32},
                          {Q ".lora_B.weight", 2, {32, 4}, MDT_F32},
                          {Q ".alpha", 0, {0}, MDT_F32},
                          {"transformer_blocks.0.attn.to_q.alpha", 0, {0}, MDT_F32}};
    BAD(m, "alpha2.safetensors", alpha2, NULL, MDT_E_INVALID, "a second alpha", Q ".alpha");
    const key bias2[] = {{Q ".lora_A.weight", 2, {4, 32}, MDT_F32},
                         {Q ".lora_B.weight", 2, {32, 4}, MDT_F32},
                         {Q ".lora_B.bias", 1, {32}, MDT_F32},
                         {Q ".lora_up.bias", 1, {32}, MDT_F32}};
    BAD(m, "bias2.safetensors", bias2, NULL, MDT_E_INVALID, "a second lora_B bias");
    const key only_alpha[] = {{Q ".alpha", 0, {0}, MDT_F32}};
    BAD(m, "only_alpha.safetensors", only_alpha, NULL, MDT_E_INVALID, "2 keys are missing",
        "to_q.lora_A.weight", "to_q.lora_B.weight");
    /* a NaN in a lora_B bias (in TP rank 1's half of the rows: every rank fails with it) */
    const key nan_bias[] = {{Q ".lora_A.weight", 2, {4, 32}, MDT_F32},
                            {Q ".lora_B.weight", 2, {32, 4}, MDT_F32},
                            {Q ".lora_B.bias", 1, {32}, MDT_F32}};
    g_nan_key = 2, g_nan_at = 25;
    BAD(m, "nan_bias.safetensors", nan_bias, NULL, MDT_E_FORMAT, Q ".lora_B.bias",
        "NaN, Inf or beyond");
    const key nan_b[] = {{Q ".lora_A.weight", 2, {4, 32}, MDT_F32},
                         {Q ".lora_B.weight", 2, {32, 4}, MDT_F32}};
    g_nan_key = 1, g_nan_at = 126;
    BAD(m, "nan_b.safetensors", nan_b, NULL, MDT_E_FORMAT, Q ".lora_B.weight",
        "NaN, Inf or beyond");
    /* the scales such metadata gives, as peft computes them (alpha / r) */
    {
        const struct {
            const char *meta;
            double scale;
        } sc[] = {{"{\"transformer.r\": 4, \"transformer.alpha_pattern\": {\"to_q\": 2}}", 0.5},
                  {"{\"r\": 4}", 2.0}, /* lora_alpha: peft's default 8 */
                  {"", 1.0},
                  {"null", 1.0}, /* diffusers: no metadata (alpha = r) */
                  /* a pattern in Python's re: \d (which POSIX lacks) and escaped dots */
                  {"{\"r\": 4, \"lora_alpha\": 4, \"alpha_pattern\": "
                   "{\"transformer_blocks\\\\.\\\\d\\\\.attn\\\\.to_q\": 16}}",
                   4.0},
                  {"{\"transformer.r\": 4, \"transformer.lora_alpha\": 12, "
                   "\"text_encoder.lora_alpha\": 1}",
                   3.0}};
        mdt_model_info *info = NULL;
        EXPECT_OK(mdt_model_info_open(dir, NULL, 1, &info));
        for (size_t i = 0; info && i < sizeof sc / sizeof sc[0]; i++) {
            char p_[300];
            mdt_lora_target_info *ti = NULL;
            int nt = 0;
            char nm[32]; /* a file each: rank 0 writes the next while others read this one */
            snprintf(nm, sizeof nm, "scale%zu.safetensors", i);
            tmp_path(p_, sizeof p_, nm);
            write_keys(p_, ok2, 2, sc[i].meta);
            EXPECT_OK(mdt_model_info_lora(info, p_, 1, &ti, &nt));
            EXPECT(nt == 1 && ti[0].scale == sc[i].scale, "%s: scale %g, expected %g", sc[i].meta,
                   nt == 1 ? ti[0].scale : -1.0, sc[i].scale);
            mdt_lora_targets_free(ti);
        }
        mdt_model_info_free(info);
    }
    const key int_f[] = {{Q ".lora_A.weight", 2, {4, 32}, MDT_I64},
                         {Q ".lora_B.weight", 2, {32, 4}, MDT_F32}};
    BAD(m, "int.safetensors", int_f, NULL, MDT_E_FORMAT, "not a float type");
    char good[300];
    tmp_path(good, sizeof good, "good.safetensors");
    write_keys(good, ok2, 2, NULL);
    EXPECT_ERR(mdt_model_lora_load(m, "", good), MDT_E_INVALID, "name");
    EXPECT_ERR(mdt_model_lora_load(m, "x", "/nonexistent/lora.safetensors"), MDT_E_IO,
               "/nonexistent/lora.safetensors");
    EXPECT_OK(mdt_model_lora_load(m, "g", good));
    EXPECT_ERR(mdt_model_lora_load(m, "g", good), MDT_E_INVALID, "already loaded");
    const char *ng[] = {"nope"}, *gg[] = {"g", "g"}, *g1[] = {"g"};
    const double w2[] = {1, 1}, wn[] = {NAN};
    EXPECT_ERR(mdt_model_set_adapters(m, 1, ng, w2), MDT_E_NOTFOUND, "nope");
    EXPECT_ERR(mdt_model_set_adapters(m, 2, gg, w2), MDT_E_INVALID, "twice");
    EXPECT_ERR(mdt_model_set_adapters(m, 1, g1, wn), MDT_E_INVALID, "not finite");
    EXPECT_ERR(mdt_model_lora_unload(m, "nope"), MDT_E_NOTFOUND, "nope");
    EXPECT_ERR(mdt_model_parallelize(m, mesh), MDT_E_INVALID, "LoRA");
    mdt_model_free(m);

    /* a LoRA bias where the layer has none (Flux.2 has no biases) */
    snprintf(dir, sizeof dir, "%s/flux2_tiny", data);
    m = load(dir, mesh);
    if (m) {
        const key bias[] = {{Q ".lora_A.weight", 2, {4, 32}, MDT_F32},
                            {Q ".lora_B.weight", 2, {32, 4}, MDT_F32},
                            {Q ".lora_B.bias", 1, {32}, MDT_F32}};
        BAD(m, "bias.safetensors", bias, NULL, MDT_E_UNSUPPORTED, "no bias");
    }
    mdt_model_free(m);
#undef Q

    /* a shard file changed since the load: the base cannot be read again */
    char copy[400], cmd[900];
    snprintf(copy, sizeof copy, "%s/ckpt", g_tmp);
    if (g_rank == 0) {
        snprintf(cmd, sizeof cmd, "cp -r '%s/flux_tiny' '%s'", data, copy);
        EXPECT(system(cmd) == 0, "copy the checkpoint");
    }
    MPI_Barrier(MPI_COMM_WORLD);
    m = load(copy, mesh);
    if (m) {
        const char *g[] = {"g"};
        const double w[] = {1.0};
        EXPECT_OK(mdt_model_lora_load(m, "g", good));
        EXPECT_OK(mdt_model_set_adapters(m, 1, g, w));
        MPI_Barrier(MPI_COMM_WORLD);
        if (g_rank == 0) {
            snprintf(cmd, sizeof cmd, "%s/diffusion_pytorch_model.safetensors", copy);
            const struct timespec ts[2] = {{1000000, 0}, {1000000, 0}};
            EXPECT(utimensat(AT_FDCWD, cmd, ts, 0) == 0, "touch the shard");
        }
        MPI_Barrier(MPI_COMM_WORLD);
        EXPECT_ERR(mdt_model_set_adapters(m, 0, NULL, NULL), MDT_E_IO, "changed since");
    }
    mdt_model_free(m);
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
    if (argc != 5) {
        if (g_rank == 0)
            fprintf(stderr, "usage: test_lora DATA_DIR T R U\n");
        MPI_Finalize();
        return 2;
    }
    const char *dt = getenv("MESHDIT_TEST_DTYPE");
    g_bf16 = dt && strcmp(dt, "bf16") == 0;
    if (g_bf16)
        EXPECT_OK(mdt_backend_select(MDT_BACKEND_CPU, 0, 1));
    snprintf(g_tmp, sizeof g_tmp, "/tmp/mdt_lora_%d_XXXXXX", (int)getppid());
    if (g_rank == 0 && !mkdtemp(g_tmp))
        g_tmp[0] = 0;
    MPI_Bcast(g_tmp, sizeof g_tmp, MPI_CHAR, 0, MPI_COMM_WORLD);
    mdt_mesh *mesh = NULL;
    EXPECT_OK(mdt_mesh_create_comm(
        MPI_COMM_WORLD, &(mdt_layout){1, atoi(argv[2]), atoi(argv[3]), atoi(argv[4]), NULL},
        &mesh));
    const char *cases[] = {"flux_tiny", "flux2_tiny", "qwenimage_tiny", "wan_tiny", "h3_tiny"};
    for (size_t i = 0; mesh && i < sizeof cases / sizeof cases[0]; i++)
        check_case(argv[1], cases[i], mesh);
    if (mesh)
        check_errors(argv[1], mesh);
    const mdt_mesh *mesh0 = mesh;
    MPI_Barrier(MPI_COMM_WORLD);
    if (g_rank == 0 && g_tmp[0]) {
        char cmd[300];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_tmp);
        if (system(cmd) != 0)
            fprintf(stderr, "could not remove %s\n", g_tmp);
        printf("test_lora (n=%d, tp=%s ring=%s ulysses=%s%s): ", mdt_mesh_size(mesh0), argv[2],
               argv[3], argv[4], g_bf16 ? ", bf16" : "");
    }
    mdt_mesh_free(mesh);
    if (g_rank != 0)
        t_pass = 0;
    MPI_TEST_END(g_rank);
}
