/*
 * test_model.c — the generic loader and the Flux model through the public API: generated
 * checkpoints in every storage form give the same forward, bad checkpoints and bad inputs give
 * errors naming the tensor, and repeated forwards allocate nothing new (the arena is reused).
 */
#define _POSIX_C_SOURCE 200809L
#include "backend/backend.h"
#include "backend/cpu_backend.h"
#include "harness.h"
#include "kernels/cpu/cpu.h"
#include "kernels/cpu/gemm.h"
#include "models/model.h"
#include "tensor/tensor.h"

#include <cjson/cJSON.h>
#include <stdlib.h>
#include <string.h>

static char g_dir[256];

static const char *sub(const char *name) {
    static char buf[4][512];
    static int k;
    k = (k + 1) % 4;
    snprintf(buf[k], sizeof buf[k], "%s/%s", g_dir, name);
    return buf[k];
}

static void write_text(const char *path, const char *text) {
    FILE *fp = fopen(path, "w");
    fputs(text, fp);
    fclose(fp);
}

static mdt_tensor_set *inputs_for(mdt_model *m, int64_t img, int64_t txt, int64_t batch) {
    mdt_tensor_set *in;
    mdt_inputs_params p = {.seed = 7,
                           .batch = batch,
                           .img_tokens = img,
                           .txt_tokens = txt,
                           .timestep = 0.6,
                           .guidance = 3.5};
    mdt_tensor_set_create(&in);
    EXPECT_OK(mdt_model_random_inputs(m, &p, in));
    return in;
}

static mdt_model *load_dir(const char *dir) {
    mdt_load_params lp = mdt_load_params_default();
    mdt_model *m = NULL;
    lp.checkpoint_dir = dir;
    EXPECT_OK(mdt_model_load(&lp, &m));
    return m;
}

static float *forward_copy(const char *dir, const mdt_tensor_set *in, int64_t *n) {
    mdt_model *m = load_dir(dir);
    mdt_tensor_set *out = NULL;
    float *res = NULL;
    if (!m)
        return NULL;
    mdt_tensor_set_create(&out);
    EXPECT_OK(mdt_model_forward(m, in, out));
    mdt_tensor *s = mdt_tensor_set_get(out, "sample");
    if (s) {
        *n = mdt_tensor_numel(s);
        res = malloc(sizeof(float) * (size_t)*n);
        memcpy(res, s->data, sizeof(float) * (size_t)*n);
    }
    mdt_tensor_set_free(out);
    mdt_model_free(m);
    return res;
}

/* bf16 GEMM operands (the onednn path on CPUs with bf16 instructions, gemm.h): the same forward
 * with activations rounded to bf16 as GEMM operands only. Against f32 compute on the same bf16
 * weights (c) it must differ (the operands really are rounded: a negative control for a path that
 * silently stays f32) and stay close: measured 2e-3 to 5e-3 on the tiny Flux, tolerance 1e-2. */
static void check_bf16_operands(const mdt_tensor_set *in, const float *c, int64_t n) {
    EXPECT_OK(mdt_cpu_gemm_select("onednn"));
    if (!mdt_cpu_gemm_bf16_operands())
        return; /* oneDNN below AVX-512 has no bf16 matmul */
    EXPECT_OK(mdt_backend_select(MDT_BACKEND_CPU, 0, 1));
    int64_t nf = 0;
    float *f = forward_copy(sub("bf16x2"), in, &nf);
    const double e = f && nf == n ? t_rel_err(f, c, n, 0) : -1.0;
    EXPECT(e > 1e-6 && e < 1e-2, "bf16 operands vs f32 compute on the same weights: %.3e", e);
    free(f);
}

/* mdt_k_shared_begin: linears on a shared (rounded-once) input give the bits of linears that
 * round it themselves; after the end a changed x is rounded anew (nothing stale). */
static void check_shared_operand(void) {
    EXPECT_OK(mdt_cpu_gemm_select("onednn"));
    if (!mdt_cpu_gemm_bf16_operands())
        return;
    EXPECT_OK(mdt_backend_select(MDT_BACKEND_CPU, 0, 1));
    enum { M = 37, K = 64, N = 20, LDX = 70 };
    static float x[M * LDX], y1[M * N], y2[M * N], y3[M * N], b[N];
    static uint16_t wh[N * K];
    for (int i = 0; i < M * LDX; i++)
        x[i] = (float)((i * 7919) % 1000) / 997.0f - 0.5f;
    for (int i = 0; i < N * K; i++)
        wh[i] = mdt_f32_to_bf16((float)((i * 104729) % 1000) / 1999.0f - 0.25f);
    for (int i = 0; i < N; i++)
        b[i] = (float)i * 0.125f;
    mdt_k()->linear(x, LDX, NULL, wh, b, y1, N, M, K, N);
    mdt_k_shared_begin(x, LDX, M, K);
    mdt_k_shared_begin(x, LDX, M, K); /* nested: kept */
    mdt_k()->linear(x, LDX, NULL, wh, b, y2, N, M, K, N);
    mdt_k_shared_end();
    mdt_k()->linear(x, LDX, NULL, wh, b, y3, N, M, K, N);
    mdt_k_shared_end();
    int same = 1, changed = 0;
    for (int i = 0; i < M * N; i++)
        same &= y1[i] == y2[i] && y1[i] == y3[i];
    EXPECT(same, "linears on a shared input: the values of rounding it per GEMM");
    for (int i = 0; i < M * LDX; i++)
        x[i] += 1.0f;
    mdt_k()->linear(x, LDX, NULL, wh, b, y2, N, M, K, N);
    for (int i = 0; i < M * N; i++)
        changed |= y1[i] != y2[i];
    EXPECT(changed, "after mdt_k_shared_end a changed input is not stale");
    EXPECT_OK(mdt_backend_check());
    EXPECT_OK(mdt_backend_select(MDT_BACKEND_CPU, 0, 0));
}

/* --dtype bf16 on the CPU backend's openblas path: linear weights held in bf16 (half their
 * bytes), fp32 arithmetic. a: f32 compute on the f32 checkpoint; c: f32 compute on the
 * bf16-stored one. */
static void check_bf16_compute(const mdt_tensor_set *in, const float *a, const float *c,
                               int64_t n) {
    const char *path = mdt_cpu_gemm();
    check_bf16_operands(in, c, n);
    check_shared_operand();
    EXPECT_OK(mdt_cpu_gemm_select("openblas"));
    EXPECT_OK(mdt_backend_select(MDT_BACKEND_CPU, 0, 1));
    int64_t ne = 0, nf = 0;
    float *e = forward_copy(sub("f32"), in, &ne), *f = forward_copy(sub("bf16x2"), in, &nf);
    EXPECT(e && f && ne == n && nf == n, "bf16 forwards ran");
    EXPECT(f && c && t_rel_err(f, c, n, 0) <= 1e-5,
           "bf16 compute = f32 compute on the same bf16 values (%.3e): fp32 arithmetic",
           f && c ? t_rel_err(f, c, n, 0) : -1.0);
    EXPECT(e && t_rel_err(e, a, n, 0) > 1e-6 && t_rel_err(e, a, n, 0) < 2e-2,
           "bf16 compute on f32 weights: rounded (not silently f32), close (%.3e)",
           e ? t_rel_err(e, a, n, 0) : -1.0);
    /* resident bytes: every linear weight at 2 bytes, everything else at 4 */
    mdt_model *m = load_dir(sub("f32"));
    if (m) {
        int64_t want = 0, lin = 0;
        for (int i = 0; i < m->table.n; i++) {
            const mdt_weight_spec *w = &m->table.specs[i];
            const int64_t el = w->shape[0] * (w->ndim > 1 ? w->shape[1] : 1);
            want += el * (m->table.lin[i] ? 2 : 4), lin += m->table.lin[i] ? el : 0;
        }
        EXPECT(m->weight_bytes == want && lin > 0, "bf16 resident weights %lld bytes, want %lld",
               (long long)m->weight_bytes, (long long)want);
        /* the widening scratch is reserved at load: forwards allocate nothing more */
        mdt_tensor_set *o1, *o2, *o3;
        mdt_tensor_set_create(&o1), mdt_tensor_set_create(&o2), mdt_tensor_set_create(&o3);
        EXPECT_OK(mdt_model_forward(m, in, o1));
        const int64_t c0 = mdt_mem_alloc_count();
        EXPECT_OK(mdt_model_forward(m, in, o2));
        const int64_t c1 = mdt_mem_alloc_count();
        EXPECT(c1 - c0 <= 5, "bf16 forward allocations: %lld", (long long)(c1 - c0));
        /* gather unpacks (exactly) and repacks: same output after, and the written f32
         * checkpoint holds the rounded values, so f32 compute on it gives the bf16 result */
        EXPECT_OK(mdt_model_gather(m, sub("gathered")));
        EXPECT_OK(mdt_model_forward(m, in, o3));
        const mdt_tensor *s1 = mdt_tensor_set_get(o1, "sample"),
                         *s3 = mdt_tensor_set_get(o3, "sample");
        EXPECT(s1 && s3 && memcmp(s1->data, s3->data, sizeof(float) * (size_t)n) == 0,
               "forward after gather: same bits");
        EXPECT(m->weight_bytes == want, "repacked after gather");
        mdt_tensor_set_free(o1), mdt_tensor_set_free(o2), mdt_tensor_set_free(o3);
        mdt_model_free(m);
    }
    EXPECT_OK(mdt_backend_select(MDT_BACKEND_CPU, 0, 0));
    int64_t ng = 0;
    float *g = forward_copy(sub("gathered"), in, &ng);
    EXPECT(g && e && ng == n && t_rel_err(g, e, n, 0) <= 1e-5,
           "f32 compute on the gathered bf16-rounded weights = bf16 compute (%.3e)",
           g && e ? t_rel_err(g, e, n, 0) : -1.0);
    free(e), free(f), free(g);
    EXPECT_OK(mdt_cpu_gemm_select(path));
}

/* Prepacked f32 weights (residency.h: mdt_res_pack): where the GEMM path packs, the loaded
 * model holds exactly its token-row linears packed (conditioning linears, one row a sample, and
 * row-viewed ones stay plain); its forward equals the plain-weights one (packing off) within
 * fp32 rounding; gather unpacks exactly (the gathered checkpoint gives the same bits) and packs
 * again (the same bits after). Where the path does not pack, nothing is packed. */
static void check_packed(const mdt_tensor_set *in, const float *a, int64_t n) {
    const int wide = strcmp(mdt_cpu_gemm(), "onednn") == 0 && mdt_cpu_gemm_bf16_operands_possible();
    mdt_model *m = load_dir(sub("f32"));
    if (!m)
        return;
    int packed = 0, wrong = 0;
    for (int i = 0; i < m->table.n; i++) {
        const mdt_lin *l = m->table.lin[i];
        const int want = l && !l->views && m->table.specs[i].rows != MDT_ROWS_ONE &&
                         mdt_backend_packed_floats(m->ws[i].local[0], m->ws[i].local[1]) > 0;
        packed += m->ws[i].packed > 0;
        wrong += want != (m->ws[i].packed > 0);
    }
    EXPECT(wrong == 0, "%d tensors packed where they should not be, or not where they should",
           wrong);
    EXPECT(wide ? packed > 0 : packed == 0, "%d linears packed on %s", packed, mdt_cpu_gemm());
    mdt_tensor_set *o1;
    mdt_tensor_set_create(&o1);
    EXPECT_OK(mdt_model_gather(m, sub("gathered_packed")));
    EXPECT_OK(mdt_model_forward(m, in, o1));
    int again = 0;
    for (int i = 0; i < m->table.n; i++)
        again += m->ws[i].packed > 0;
    EXPECT(again == packed, "packed again after gather: %d of %d", again, packed);
    const mdt_tensor *s1 = mdt_tensor_set_get(o1, "sample");
    EXPECT(s1 && memcmp(s1->data, a, sizeof(float) * (size_t)n) == 0,
           "forward after gather: same bits");
    mdt_model_free(m);
    int64_t ng = 0, np = 0;
    float *g = forward_copy(sub("gathered_packed"), in, &ng);
    EXPECT(g && ng == n && memcmp(g, a, sizeof(float) * (size_t)n) == 0,
           "the gathered checkpoint gives the same bits (unpacked exactly)");
    mdt_cpu_backend_set_pack(0);
    m = load_dir(sub("f32"));
    int plain = 0;
    for (int i = 0; m && i < m->table.n; i++)
        plain += m->ws[i].packed == 0;
    EXPECT(m && plain == m->table.n, "packing off: every tensor plain");
    mdt_model_free(m);
    float *p = forward_copy(sub("f32"), in, &np);
    mdt_cpu_backend_set_pack(1);
    EXPECT(p && np == n && t_rel_err(p, a, n, 0) <= 1e-5,
           "packed weights = plain weights within fp32 rounding (%.3e)",
           p ? t_rel_err(p, a, n, 0) : -1.0);
    free(g), free(p);
    mdt_tensor_set_free(o1);
}

/* Every embedded preset describes a model of the family it is filed under; unknown names and
 * families give NULL. */
static void check_presets(void) {
    int n = 0;
    for (const mdt_preset *p = mdt_presets; p->family; p++, n++) {
        const mdt_family *fam = mdt_family_by_name(p->family);
        cJSON *cfg = cJSON_Parse(p->text);
        mdt_model *m = NULL;
        EXPECT(fam && mdt_family_preset(fam, p->name) == p->text, "preset %s.%s found", p->family,
               p->name);
        EXPECT(cfg && mdt_model_describe(cfg, &m) == MDT_OK && m->fam == fam,
               "preset %s.%s describes a %s model", p->family, p->name, p->family);
        mdt_model_free(m);
        cJSON_Delete(cfg);
    }
    EXPECT(n >= 5, "the five presets are embedded (%d)", n);
    EXPECT(mdt_family_preset(mdt_family_by_name("flux"), "no-such") == NULL, "unknown preset");
    EXPECT(mdt_family_preset(NULL, "tiny") == NULL, "no family");
}

/* Every linear of a family's table says which rows it runs on (the planner reads that, never a
 * name): a table that leaves one out is refused naming it, and every preset declares them all. */
static void check_weight_rows(void) {
    mdt_wtable t = {0};
    mdt_lin a, b;
    EXPECT_OK(mdt_wtable_add_linear(&t, &a, "blocks.0.", "ff.net.2", 8, 4, MDT_TP_ROWWISE, 1));
    EXPECT_ERR(mdt_wtable_check(&t), MDT_E_INVALID, "blocks.0.ff.net.2.weight", "declares no rows");
    mdt_wtable_free(&t);
    t = (mdt_wtable){0};
    EXPECT(mdt_wtable_rows(&t, MDT_ROWS_TEXT) == MDT_ROWS_UNSET, "rows start unset");
    EXPECT_OK(mdt_wtable_add_linear(&t, &a, "", "context_embedder", 8, 4, MDT_TP_REPLICATED, 1));
    EXPECT(mdt_wtable_rows(&t, MDT_ROWS_ONE) == MDT_ROWS_TEXT, "the previous rows come back");
    EXPECT_OK(mdt_wtable_add_linear(&t, &b, "", "t_emb", 8, 4, MDT_TP_REPLICATED, 0));
    EXPECT_OK(mdt_wtable_check(&t));
    EXPECT(t.specs[0].rows == MDT_ROWS_TEXT && t.specs[1].rows == MDT_ROWS_NONE &&
               t.specs[2].rows == MDT_ROWS_ONE,
           "weight, bias and the next weight: text, none, one");
    mdt_wtable_free(&t);
    for (const mdt_preset *p = mdt_presets; p->family; p++) {
        cJSON *cfg = cJSON_Parse(p->text);
        mdt_model *m = NULL;
        EXPECT_OK(mdt_model_describe(cfg, &m)); /* mdt_wtable_check runs in describe */
        int linears = 0, text = 0;
        for (int i = 0; m && i < m->table.n; i++) {
            linears += m->table.lin[i] != NULL;
            text += m->table.specs[i].rows == MDT_ROWS_TEXT;
        }
        EXPECT(m && linears > 0 && text > 0, "%s.%s: %d linears, %d on the text rows", p->family,
               p->name, linears, text);
        mdt_model_free(m);
        cJSON_Delete(cfg);
    }
}

/* An input the family's forward does not take is an error naming it, never ignored: a misspelt
 * name, guidance without a guidance embedding, Flux's pooled projections on Flux.2, a misspelt
 * Qwen-Image mask. The golden inputs themselves pass. */
static void check_unknown_inputs(void) {
    static const struct {
        const char *dir, *extra;
    } cases[] = {{"flux_guidance", "guidence"},
                 {"flux_tiny", "guidance"},
                 {"flux2_tiny", "pooled_projections"},
                 {"qwenimage_mask", "encoder_hidden_state_mask"},
                 {"wan_tiny", "encoder_hidden_states_image"},
                 {"h3_tiny", "negative_encoder_hidden_states"}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char dir[256], p[300];
        snprintf(dir, sizeof dir, "tests/data/%s", cases[i].dir);
        snprintf(p, sizeof p, "%s/inputs.safetensors", dir);
        mdt_load_params lp = mdt_load_params_default();
        lp.checkpoint_dir = dir;
        mdt_model *m = NULL;
        mdt_tensor_set *in = NULL, *out = NULL;
        EXPECT_OK(mdt_model_load(&lp, &m));
        EXPECT_OK(mdt_tensor_set_load(p, &in));
        mdt_tensor_set_create(&out);
        if (!m || !in || !out)
            continue;
        EXPECT_OK(mdt_model_forward(m, in, out));
        mdt_tensor_set_free(out);
        mdt_tensor_set_create(&out);
        EXPECT_OK(mdt_tensor_set_add(in, cases[i].extra, MDT_F32, 1, (int64_t[]){1}, NULL));
        EXPECT_ERR(mdt_model_forward(m, in, out), MDT_E_INVALID, "unknown tensor", cases[i].extra,
                   "takes");
        EXPECT(mdt_tensor_set_count(out) == 0, "%s: no output on a refused input", dir);
        mdt_tensor_set_free(in), mdt_tensor_set_free(out);
        mdt_model_free(m);
    }
}

int main(void) {
    check_presets();
    check_weight_rows();
    check_unknown_inputs();
    snprintf(g_dir, sizeof g_dir, "/tmp/mdt_test_model_XXXXXX");
    if (!mkdtemp(g_dir))
        return 1;
    const mdt_family *fam = mdt_family_by_name("flux");
    const char *tiny = mdt_family_preset(fam, "tiny");
    EXPECT_OK(mdt_model_gen(tiny, 3, MDT_F32, 1, sub("f32")));
    EXPECT_OK(mdt_model_gen(tiny, 3, MDT_F32, 3, sub("f32x3")));
    EXPECT_OK(mdt_model_gen(tiny, 3, MDT_BF16, 2, sub("bf16x2")));
    EXPECT_OK(mdt_model_gen(tiny, 3, MDT_F16, 1, sub("f16")));

    /* same seed -> same values; shards change nothing; bf16/f16 storage rounds only */
    mdt_load_params lp = mdt_load_params_default();
    mdt_model *m = NULL;
    char f32dir[512];
    snprintf(f32dir, sizeof f32dir, "%s", sub("f32"));
    lp.checkpoint_dir = f32dir;
    EXPECT_OK(mdt_model_load(&lp, &m));
    if (!m)
        TEST_END();
    mdt_tensor_set *in = inputs_for(m, 13, 5, 2);
    int64_t n1 = 0, n2 = 0, n3 = 0, n4 = 0;
    float *a = forward_copy(sub("f32"), in, &n1), *b = forward_copy(sub("f32x3"), in, &n2);
    float *c = forward_copy(sub("bf16x2"), in, &n3), *d = forward_copy(sub("f16"), in, &n4);
    EXPECT(a && b && n1 == n2 && memcmp(a, b, sizeof(float) * (size_t)n1) == 0,
           "3-shard checkpoint gives bit-identical output");
    EXPECT(c && n3 == n1 && t_rel_err(c, a, n1, 0) < 5e-2 && t_rel_err(c, a, n1, 0) > 1e-6,
           "bf16 storage: close to f32 but rounded (%.3e)", c ? t_rel_err(c, a, n1, 0) : -1.0);
    EXPECT(d && n4 == n1 && t_rel_err(d, a, n1, 0) < 5e-3, "f16 storage close to f32");
    EXPECT(n1 == 2 * 13 * 4, "output [2, 13, 4]");
    check_bf16_compute(in, a, c, n1);
    check_packed(in, a, n1);

    /* repeated forwards: the arena is reused; per-call allocations are only the output's */
    mdt_tensor_set *o1, *o2, *o3;
    mdt_tensor_set_create(&o1), mdt_tensor_set_create(&o2), mdt_tensor_set_create(&o3);
    EXPECT_OK(mdt_model_forward(m, in, o1));
    int64_t c0 = mdt_mem_alloc_count();
    EXPECT_OK(mdt_model_forward(m, in, o2));
    int64_t c1 = mdt_mem_alloc_count();
    EXPECT_OK(mdt_model_forward(m, in, o3));
    int64_t c2 = mdt_mem_alloc_count();
    EXPECT(c1 - c0 == c2 - c1 && c2 - c1 <= 5, "allocations per forward: %lld then %lld",
           (long long)(c1 - c0), (long long)(c2 - c1));
    EXPECT(memcmp(mdt_tensor_set_get(o1, "sample")->data, mdt_tensor_set_get(o3, "sample")->data,
                  sizeof(float) * (size_t)n1) == 0,
           "forward is deterministic");
    mdt_tensor_set_free(o1), mdt_tensor_set_free(o2), mdt_tensor_set_free(o3);

    /* bad inputs: one message naming the tensor and the expectation */
    mdt_tensor_set *bad, *out;
    mdt_tensor_set_create(&out);
    mdt_tensor_set_create(&bad);
    EXPECT_ERR(mdt_model_forward(m, bad, out), MDT_E_INVALID, "hidden_states");
    for (int i = 0; i < mdt_tensor_set_count(in); i++) {
        const char *nm;
        mdt_tensor *t = mdt_tensor_set_at(in, i, &nm);
        if (strcmp(nm, "pooled_projections") != 0)
            mdt_tensor_set_add_copy(bad, nm, t);
    }
    EXPECT_ERR(mdt_model_forward(m, bad, out), MDT_E_INVALID, "pooled_projections", "missing");
    mdt_tensor *pp;
    mdt_tensor_set_add(bad, "pooled_projections", MDT_F32, 2, (int64_t[]){2, 31}, &pp);
    EXPECT_ERR(mdt_model_forward(m, bad, out), MDT_E_INVALID, "pooled_projections", "[2, 31]",
               "[2, 32]");
    mdt_tensor *ts = mdt_tensor_set_get(in, "timestep");
    ((float *)ts->data)[1] = NAN;
    EXPECT_ERR(mdt_model_forward(m, in, out), MDT_E_INVALID, "timestep", "NaN");
    mdt_tensor_set_free(bad), mdt_tensor_set_free(out), mdt_tensor_set_free(in);
    mdt_model_free(m);
    free(a), free(b), free(c), free(d);

    /* checkpoints that lie: the config needs a tensor the weights lack; a shape disagrees */
    char cfg[1024];
    snprintf(cfg, sizeof cfg, "%s", tiny);
    char *g = strstr(cfg, "\"guidance_embeds\": false");
    memcpy(g, "\"guidance_embeds\": true ", 24);
    write_text(sub("f32/config.json"), cfg);
    EXPECT_ERR(mdt_model_load(&lp, &m), MDT_E_NOTFOUND,
               "time_text_embed.guidance_embedder.linear_1.weight", "missing");
    snprintf(cfg, sizeof cfg, "%s", tiny);
    g = strstr(cfg, "\"joint_attention_dim\": 32");
    memcpy(g, "\"joint_attention_dim\": 16", 25);
    write_text(sub("f32/config.json"), cfg);
    EXPECT_ERR(mdt_model_load(&lp, &m), MDT_E_INVALID, "context_embedder.weight", "[32, 32]",
               "[32, 16]");
    write_text(sub("f32/config.json"), "{\"_class_name\": \"SD3Transformer2DModel\"}");
    EXPECT_ERR(mdt_model_load(&lp, &m), MDT_E_UNSUPPORTED, "SD3Transformer2DModel");
    write_text(sub("f32/config.json"), "{\"_class_name\": \"FluxTransformer2DModel\", "
                                       "\"attention_head_dim\": 16, \"axes_dims_rope\": [4, 4]}");
    EXPECT_ERR(mdt_model_load(&lp, &m), MDT_E_INVALID, "axes_dims_rope", "16");
    EXPECT(m == NULL, "no model on failure");

    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
    if (system(cmd) != 0)
        fprintf(stderr, "could not remove %s\n", g_dir);
    EXPECT(mdt_mem_live() == 0, "everything freed: %lld bytes live", (long long)mdt_mem_live());
    TEST_END();
}
