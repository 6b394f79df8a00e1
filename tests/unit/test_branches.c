/*
 * test_branches.c — the sampler's branches on one rank (sampler/branches.h): which negative_
 * inputs a guided step takes (a negative text of another length than the positive one runs, and
 * gives what its two forwards give), and the families' combinations of the two predictions (a
 * rescale that cannot be done is an error), and the sampler's per-token timesteps (Wan 2.2 TI2V's
 * clean conditioning frame).
 * The cfg axis on two groups is tested from the command line (tests/cli/test_cli.sh).
 */
#include "harness.h"
#include "models/model.h"
#include "sampler/branches.h"
#include "tensor/tensor.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static mdt_tensor_set *merged(const mdt_tensor_set *a, const mdt_tensor_set *b, const char *prefix);

static mdt_model *load(const char *dir) {
    mdt_load_params lp = mdt_load_params_default();
    mdt_model *m = NULL;
    lp.checkpoint_dir = dir;
    EXPECT_OK(mdt_model_load(&lp, &m));
    return m;
}

static mdt_tensor_set *random_inputs(const mdt_model *m, uint64_t seed, int64_t txt, int negative) {
    mdt_tensor_set *s = NULL;
    const mdt_inputs_params p = {.seed = seed,
                                 .batch = 1,
                                 .img_tokens = 16,
                                 .txt_tokens = txt,
                                 .timestep = 1.0,
                                 .guidance = 3.5,
                                 .negative = negative};
    EXPECT_OK(mdt_tensor_set_create(&s));
    EXPECT_OK(mdt_model_random_inputs(m, &p, s));
    return s;
}

/* Every tensor of `a`, then those of `b` whose names start with `prefix` (all: ""). */
static mdt_tensor_set *merged(const mdt_tensor_set *a, const mdt_tensor_set *b,
                              const char *prefix) {
    mdt_tensor_set *s = NULL;
    EXPECT_OK(mdt_tensor_set_create(&s));
    for (int i = 0; s && i < mdt_tensor_set_count(a); i++) {
        const char *name;
        const mdt_tensor *t = mdt_tensor_set_at(a, i, &name);
        EXPECT_OK(mdt_tensor_set_add_copy(s, name, t));
    }
    for (int i = 0; s && b && i < mdt_tensor_set_count(b); i++) {
        const char *name;
        const mdt_tensor *t = mdt_tensor_set_at(b, i, &name);
        if (strncmp(name, prefix, strlen(prefix)) == 0)
            EXPECT_OK(mdt_tensor_set_add_copy(s, name, t));
    }
    return s;
}

/* The guided sample of `in` (one Euler step: sigma 1 -> 0, so the result is x - v) into a copy
 * (n floats), or NULL with the failure recorded. */
static float *guided_sample(mdt_model *m, const mdt_tensor_set *in, double scale, int64_t *n) {
    mdt_tensor_set *x = merged(in, NULL, ""), *out = NULL;
    mdt_sample_params sp = mdt_sample_params_default();
    float *res = NULL;
    sp.steps = 1, sp.guidance_scale = scale;
    EXPECT_OK(mdt_tensor_set_create(&out));
    EXPECT_OK(mdt_sample(m, x, &sp, out, NULL));
    const mdt_tensor *s = out ? mdt_tensor_set_get(out, m->fam->output) : NULL;
    if (s && (res = malloc(sizeof(float) * (size_t)mdt_tensor_numel(s)))) {
        *n = mdt_tensor_numel(s);
        memcpy(res, s->data, sizeof(float) * (size_t)*n);
    }
    mdt_tensor_set_free(out);
    mdt_tensor_set_free(x);
    return res;
}

/* One forward of `in` (negative_X in place of X with `uncond`) at timestep 1, its output in a
 * copy of n floats. */
static float *branch_forward(mdt_model *m, const mdt_tensor_set *in, int uncond, int64_t n) {
    mdt_tensor_set *b = NULL, *out = NULL;
    float *res = NULL;
    EXPECT_OK(mdt_tensor_set_create(&b));
    EXPECT_OK(mdt_tensor_set_create(&out));
    for (int i = 0; b && out && i < mdt_tensor_set_count(in); i++) {
        const char *name;
        const mdt_tensor *t = mdt_tensor_set_at(in, i, &name);
        char nn[MDT_NAME_MAX + 16];
        if (strncmp(name, "negative_", 9) == 0)
            continue;
        snprintf(nn, sizeof nn, "negative_%s", name);
        const mdt_tensor *neg = uncond ? mdt_tensor_set_get(in, nn) : NULL;
        EXPECT_OK(mdt_tensor_set_add_copy(b, name, neg ? neg : t));
    }
    mdt_tensor *ts = b ? mdt_tensor_set_get(b, m->fam->timestep_input) : NULL;
    if (ts && ts->dtype == MDT_F32)
        for (int64_t j = 0; j < mdt_tensor_numel(ts); j++)
            ((float *)ts->data)[j] = 1.0f;
    EXPECT_OK(mdt_model_forward(m, b, out));
    const mdt_tensor *o = out ? mdt_tensor_set_get(out, m->fam->output) : NULL;
    if (o && mdt_tensor_numel(o) == n && (res = malloc(sizeof(float) * (size_t)n)))
        memcpy(res, o->data, sizeof(float) * (size_t)n);
    mdt_tensor_set_free(out);
    mdt_tensor_set_free(b);
    return res;
}

/* Flux: a negative prompt of 5 text rows beside a positive one of 8 (encoder_hidden_states
 * [1, 5, C], txt_ids [5, 3], pooled_projections [1, P]) is accepted, and the guided step is
 * x - (v_u + S (v_c - v_u)) of the two forwards run on their own. */
static void check_flux_short_negative(void) {
    mdt_model *m = load("tests/data/flux_tiny");
    if (!m)
        return;
    mdt_tensor_set *pos = random_inputs(m, 7, 8, 0), *neg = random_inputs(m, 8, 5, 1);
    mdt_tensor_set *in = merged(pos, neg, "negative_");
    const mdt_tensor *ids = mdt_tensor_set_get(in, "negative_txt_ids");
    EXPECT(ids && ids->ndim == 2 && ids->shape[0] == 5, "negative_txt_ids [5, 3]");
    int64_t n = 0;
    const double scale = 3.0;
    float *got = guided_sample(m, in, scale, &n);
    float *vc = got ? branch_forward(m, in, 0, n) : NULL;
    float *vu = got ? branch_forward(m, in, 1, n) : NULL;
    const mdt_tensor *x = mdt_tensor_set_get(in, m->fam->latent_input);
    if (got && vc && vu && x && mdt_tensor_numel(x) == n) {
        float *want = malloc(sizeof(float) * (size_t)n);
        for (int64_t j = 0; want && j < n; j++) {
            const float v = vu[j] + (float)scale * (vc[j] - vu[j]);
            want[j] = ((const float *)x->data)[j] + -1.0f * v;
        }
        EXPECT(want && t_rel_err(got, want, (long)n, 1e-30) <= 1e-6,
               "flux: the guided step with a 5-row negative text is not its two forwards' "
               "combination");
        free(want);
    } else {
        EXPECT(0, "flux: a 5-row negative text beside an 8-row one did not run: %s",
               mdt_last_error());
    }
    free(got), free(vc), free(vu);
    mdt_tensor_set_free(pos), mdt_tensor_set_free(neg), mdt_tensor_set_free(in);
    mdt_model_free(m);
}

/* Qwen-Image: a negative prompt of 5 text rows (encoder_hidden_states [1, 5, C] and its mask
 * [1, 5]) beside a positive one of 8 is accepted, and gives the guided step of the same 5 rows
 * padded to 8 with masked rows (Qwen-Image drops masked text rows, positions kept). */
static void check_qwen_short_negative(void) {
    mdt_model *m = load("tests/data/qwenimage_tiny");
    if (!m)
        return;
    mdt_tensor_set *pos = random_inputs(m, 7, 8, 0), *neg = random_inputs(m, 8, 5, 1);
    mdt_tensor_set *in = merged(pos, neg, "negative_");
    mdt_tensor_set *padded = merged(pos, NULL, "");
    const mdt_tensor *e = mdt_tensor_set_get(neg, "negative_encoder_hidden_states");
    const mdt_tensor *mk = mdt_tensor_set_get(neg, "negative_encoder_hidden_states_mask");
    EXPECT(e && e->ndim == 3 && e->shape[1] == 5 && mk && mk->ndim == 2 && mk->shape[1] == 5 &&
               mk->dtype == MDT_I64,
           "qwen: the negative text is [1, 5, C] with a mask [1, 5]");
    if (e && mk && padded) {
        mdt_tensor *pe = NULL, *pm = NULL;
        const int64_t C = e->shape[2];
        EXPECT_OK(mdt_tensor_set_add(padded, "negative_encoder_hidden_states", MDT_F32, 3,
                                     (int64_t[]){1, 8, C}, &pe)); // [1, 8, C]
        EXPECT_OK(mdt_tensor_set_add(padded, "negative_encoder_hidden_states_mask", MDT_I64, 2,
                                     (int64_t[]){1, 8}, &pm)); // [1, 8]
        if (pe && pm) {
            for (int64_t j = 0; j < 8 * C; j++) /* rows 5..7: anything, masked */
                ((float *)pe->data)[j] = j < 5 * C ? ((const float *)e->data)[j] : 9.0f;
            for (int64_t j = 0; j < 8; j++)
                ((int64_t *)pm->data)[j] = j < 5;
        }
    }
    int64_t n = 0, np = 0;
    float *got = guided_sample(m, in, 4.0, &n);
    float *want = got ? guided_sample(m, padded, 4.0, &np) : NULL;
    EXPECT(got && want && n == np && t_rel_err(got, want, (long)n, 1e-30) <= 1e-6,
           "qwen: a 5-row negative text is not the 8-row one with 3 rows masked: %s",
           got ? "differs" : mdt_last_error());
    free(got), free(want);
    mdt_tensor_set_free(pos), mdt_tensor_set_free(neg), mdt_tensor_set_free(in);
    mdt_tensor_set_free(padded);
    mdt_model_free(m);
}

/* What still must agree: the batch of a batched input, the width of a [B, S, C] one. */
static void check_negative_shapes(void) {
    mdt_model *m = load("tests/data/flux_tiny");
    if (!m)
        return;
    mdt_tensor_set *pos = random_inputs(m, 7, 8, 0);
    static const struct {
        const char *name;
        int ndim;
        int64_t shape[3];
    } bad[] = {{"negative_encoder_hidden_states", 3, {2, 8, 32}},
               {"negative_encoder_hidden_states", 3, {1, 8, 31}},
               {"negative_pooled_projections", 2, {2, 32}},
               {"negative_txt_ids", 3, {1, 8, 3}}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        mdt_tensor_set *in = merged(pos, NULL, "");
        mdt_branches br;
        EXPECT_OK(mdt_tensor_set_add(in, bad[i].name, MDT_F32, bad[i].ndim, bad[i].shape, NULL));
        EXPECT_ERR(mdt_branches_init(&br, m, in, 3.0, 1), MDT_E_INVALID, bad[i].name,
                   "the rank, the batch and the width must agree");
        mdt_tensor_set_free(in);
    }
    mdt_tensor_set_free(pos);
    mdt_model_free(m);
}

/* A half-present unconditional branch: each of its batched inputs (the negative prompt's
 * embeddings and pooled projections) left out is refused by name, never taken from the
 * conditional branch; position ids may be shared (check_flux_short_negative gives its own, this
 * leaves them out), and Qwen-Image's mask is each branch's own or absent (diffusers drops an
 * all-ones one): the unconditional branch then runs without one, not with the conditional's. */
static void check_negative_complete(void) {
    static const struct {
        const char *dir, *drop, *want;
    } cases[] = {{"tests/data/flux_tiny", "negative_pooled_projections", NULL},
                 {"tests/data/flux_tiny", "negative_encoder_hidden_states", NULL},
                 {"tests/data/qwenimage_tiny", "negative_encoder_hidden_states_mask", "own"},
                 {"tests/data/flux_tiny", "negative_txt_ids", "shared"}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        mdt_model *m = load(cases[i].dir);
        if (!m)
            continue;
        mdt_tensor_set *pos = random_inputs(m, 7, 8, 0), *neg = random_inputs(m, 8, 8, 1);
        mdt_tensor_set *in = merged(pos, NULL, ""), *all = merged(pos, neg, "negative_");
        for (int j = 0; in && all && j < mdt_tensor_set_count(all); j++) {
            const char *name;
            const mdt_tensor *t = mdt_tensor_set_at(all, j, &name);
            if (strncmp(name, "negative_", 9) == 0 && strcmp(name, cases[i].drop) != 0)
                EXPECT_OK(mdt_tensor_set_add_copy(in, name, t));
        }
        mdt_branches br;
        if (cases[i].want) {
            EXPECT_OK(mdt_branches_init(&br, m, in, 3.0, 1));
            mdt_branches_free(&br);
        } else {
            EXPECT_ERR(mdt_branches_init(&br, m, in, 3.0, 1), MDT_E_INVALID,
                       "the unconditional branch has negative_ tensors but no", cases[i].drop);
        }
        mdt_tensor_set_free(pos), mdt_tensor_set_free(neg);
        mdt_tensor_set_free(in), mdt_tensor_set_free(all);
        mdt_model_free(m);
    }
    /* a negative text of 5 rows with the conditional's 8-row ids: the unconditional branch's
     * forward fails, and says it was that branch's (its tensors carry the conditional names) */
    {
        mdt_model *mf = load("tests/data/flux_tiny");
        mdt_tensor_set *p8 = mf ? random_inputs(mf, 7, 8, 0) : NULL;
        mdt_tensor_set *n5 = mf ? random_inputs(mf, 8, 5, 1) : NULL, *out = NULL;
        mdt_tensor_set *x = p8 ? merged(p8, NULL, "") : NULL;
        const char *keep[] = {"negative_encoder_hidden_states", "negative_pooled_projections"};
        for (int j = 0; x && n5 && j < 2; j++)
            EXPECT_OK(mdt_tensor_set_add_copy(x, keep[j], mdt_tensor_set_get(n5, keep[j])));
        mdt_sample_params sp = mdt_sample_params_default();
        sp.steps = 1, sp.guidance_scale = 3.0;
        EXPECT_OK(mdt_tensor_set_create(&out));
        if (x && out)
            EXPECT_ERR(mdt_sample(mf, x, &sp, out, NULL), MDT_E_INVALID,
                       "the unconditional branch (the negative_ inputs in place of theirs): ",
                       "'txt_ids'");
        mdt_tensor_set_free(p8), mdt_tensor_set_free(n5), mdt_tensor_set_free(x);
        mdt_tensor_set_free(out);
        mdt_model_free(mf);
    }
    /* a NaN in a negative tensor is named as the negative one (the forward would see it under
     * the conditional name) */
    mdt_model *m = load("tests/data/flux_tiny");
    if (!m)
        return;
    mdt_tensor_set *pos = random_inputs(m, 7, 8, 0), *neg = random_inputs(m, 8, 8, 1);
    mdt_tensor_set *in = merged(pos, neg, "negative_");
    mdt_tensor *e = in ? mdt_tensor_set_get(in, "negative_encoder_hidden_states") : NULL;
    if (e)
        ((float *)e->data)[3] = NAN;
    mdt_branches br;
    EXPECT_ERR(mdt_branches_init(&br, m, in, 3.0, 1), MDT_E_INVALID,
               "tensor 'negative_encoder_hidden_states' holds a NaN or Inf at element 3");
    mdt_tensor_set_free(pos), mdt_tensor_set_free(neg), mdt_tensor_set_free(in);
    mdt_model_free(m);
}

/* Wan 2.2 TI2V: a [B, S] timestep whose first frame's tokens are 0 marks that frame as the clean
 * condition. Sampling keeps it as given (its pipeline puts it back before every forward and at
 * the end): two steps equal two forwards by hand, each on the latent with frame 0 the input's,
 * its tokens at timestep 0, the rest at sigma x 1000, and the result's frame 0 is the input's. */
static void check_ti2v_clean_frame(int one_row) {
    mdt_model *m = load("tests/data/wan_ti2v");
    mdt_tensor_set *in = NULL, *out = NULL;
    if (!m || mdt_tensor_set_load("tests/data/wan_ti2v/inputs.safetensors", &in) != MDT_OK) {
        EXPECT(0, "wan_ti2v: %s", mdt_last_error());
        mdt_model_free(m);
        return;
    }
    if (one_row) { /* timestep [1, S]: every sample's per-token timesteps */
        mdt_tensor *t0 = mdt_tensor_set_get(in, "timestep");
        if (t0 && t0->ndim == 2)
            t0->shape[0] = 1; /* the first row's values, the rest of the buffer unread */
    }
    mdt_tensor_set *x = merged(in, NULL, "");
    const mdt_tensor *lat0 = mdt_tensor_set_get(in, "hidden_states"); // [B, C, F, H, W]
    mdt_tensor *lat = mdt_tensor_set_get(x, "hidden_states"),
               *ts = mdt_tensor_set_get(x, "timestep");
    const int64_t n = mdt_tensor_numel(lat0), B = lat0->shape[0], per_b = n / B;
    const int64_t frame = lat0->shape[3] * lat0->shape[4]; /* the elements of one frame */
    float *want = malloc(sizeof(float) * (size_t)n);
    memcpy(want, lat0->data, sizeof(float) * (size_t)n);
    for (int i = 0; i < 2; i++) { /* sigma 1 then 0.5; Euler to 0.5 then 0 */
        const double sig = 1.0 - i / 2.0;
        memcpy(lat->data, want, sizeof(float) * (size_t)n);
        for (int64_t j = 0; j < mdt_tensor_numel(ts); j++)
            if (((const float *)mdt_tensor_set_get(in, "timestep")->data)[j] != 0.0f)
                ((float *)ts->data)[j] = (float)(sig * 1000.0);
        mdt_tensor_set *o = NULL;
        EXPECT_OK(mdt_tensor_set_create(&o));
        EXPECT_OK(mdt_model_forward(m, x, o));
        const mdt_tensor *v = o ? mdt_tensor_set_get(o, "sample") : NULL;
        for (int64_t j = 0; v && j < n; j++) {
            const int64_t c_frame = (j % per_b) % (lat0->shape[2] * frame) < frame;
            want[j] = c_frame ? ((const float *)lat0->data)[j]
                              : want[j] + (float)(-0.5) * ((const float *)v->data)[j];
        }
        mdt_tensor_set_free(o);
    }
    mdt_tensor_set_free(x);
    x = merged(in, NULL, "");
    mdt_sample_params sp = mdt_sample_params_default();
    sp.steps = 2;
    EXPECT_OK(mdt_tensor_set_create(&out));
    EXPECT_OK(mdt_sample(m, x, &sp, out, NULL));
    const mdt_tensor *got = out ? mdt_tensor_set_get(out, "sample") : NULL;
    int same = got && mdt_tensor_numel(got) == n, frame0 = same, moved = 0;
    for (int64_t j = 0; same && j < n; j++) {
        const float g = ((const float *)got->data)[j], w = want[j];
        const int in0 = (j % per_b) % (lat0->shape[2] * frame) < frame;
        same = fabsf(g - w) <= 1e-6f * (1.0f + fabsf(w));
        frame0 = frame0 && (!in0 || g == ((const float *)lat0->data)[j]);
        moved |= !in0 && g != ((const float *)lat0->data)[j];
    }
    EXPECT(same && frame0 && moved,
           "wan_ti2v --steps 2 (timestep [%s, S]): equal to the two forwards by hand %d, frame 0 "
           "the input's %d, the other frames sampled %d",
           one_row ? "1" : "B", same, frame0, moved);
    free(want);
    mdt_tensor_set_free(x), mdt_tensor_set_free(out), mdt_tensor_set_free(in);
    mdt_model_free(m);
}

/* Qwen-Image: a negative prompt without a mask (diffusers' encode_prompt drops an all-ones one)
 * beside a positive one with padding masked: the unconditional branch attends all its text rows,
 * as with an all-ones mask, not through the conditional branch's mask. */
static void check_qwen_negative_without_mask(void) {
    mdt_model *m = load("tests/data/qwenimage_tiny");
    if (!m)
        return;
    mdt_tensor_set *pos = random_inputs(m, 7, 8, 0), *neg = random_inputs(m, 8, 8, 1);
    mdt_tensor *mk = mdt_tensor_set_get(pos, "encoder_hidden_states_mask");
    for (int64_t j = 5; mk && mk->dtype == MDT_I64 && j < mdt_tensor_numel(mk); j++)
        ((int64_t *)mk->data)[j] = 0; /* the positive prompt padded: rows 5..7 masked */
    mdt_tensor_set *bare = merged(pos, NULL, ""), *ones = merged(pos, NULL, "");
    const mdt_tensor *ne = mdt_tensor_set_get(neg, "negative_encoder_hidden_states");
    const mdt_tensor *nm = mdt_tensor_set_get(neg, "negative_encoder_hidden_states_mask");
    if (!ne || !nm || !bare || !ones) {
        EXPECT(0, "qwen: inputs not made: %s", mdt_last_error());
        mdt_tensor_set_free(pos), mdt_tensor_set_free(neg);
        mdt_tensor_set_free(bare), mdt_tensor_set_free(ones);
        mdt_model_free(m);
        return;
    }
    {
        EXPECT_OK(mdt_tensor_set_add_copy(bare, "negative_encoder_hidden_states", ne));
        EXPECT_OK(mdt_tensor_set_add_copy(ones, "negative_encoder_hidden_states", ne));
        mdt_tensor *o = NULL;
        EXPECT_OK(mdt_tensor_set_add(ones, "negative_encoder_hidden_states_mask", MDT_I64, nm->ndim,
                                     nm->shape, &o));
        for (int64_t j = 0; o && j < mdt_tensor_numel(o); j++)
            ((int64_t *)o->data)[j] = 1;
    }
    int64_t n = 0, n1 = 0;
    float *got = guided_sample(m, bare, 4.0, &n);
    float *want = got ? guided_sample(m, ones, 4.0, &n1) : NULL;
    EXPECT(got && want && n == n1 && t_rel_err(got, want, (long)n, 1e-30) <= 1e-6,
           "qwen: a negative prompt without a mask is not the one with an all-ones mask: %s",
           got ? "differs" : mdt_last_error());
    free(got), free(want);
    mdt_tensor_set_free(pos), mdt_tensor_set_free(neg);
    mdt_tensor_set_free(bare), mdt_tensor_set_free(ones);
    mdt_model_free(m);
}

/* Qwen-Image's rescaled combination: each token of v_u + S (v_c - v_u) rescaled to v_c's norm;
 * a token whose combined vector is 0 (v_u = 2 v_c at S = 2; or v_c = 0 at S = 1) has no direction
 * to rescale: an error naming the combination, never NaNs handed on. */
static void check_rescale(void) {
    enum { W = 4, N = 3 * W };
    float vc[N], vu[N], v[N];
    for (int j = 0; j < N; j++)
        vc[j] = (float)(j % 5) - 1.5f, vu[j] = 0.25f * (float)(j % 3) + 0.5f;
    EXPECT_OK(mdt_branches_combine(MDT_CFG_RESCALED, 2.0, vc, vu, N, W, v));
    for (int r = 0; r < N; r += W) {
        double cn = 0, vn = 0, dot = 0;
        for (int j = r; j < r + W; j++) {
            const double c = vu[j] + 2.0 * (vc[j] - vu[j]);
            cn += (double)vc[j] * vc[j], vn += (double)v[j] * v[j], dot += c * v[j];
        }
        EXPECT(fabs(sqrt(vn) - sqrt(cn)) <= 1e-5 * sqrt(cn) && dot > 0,
               "token %d: norm %g, the conditional's %g", r / W, sqrt(vn), sqrt(cn));
    }
    for (int j = W; j < 2 * W; j++) /* token 1: v_u = 2 v_c, so v_u + 2 (v_c - v_u) = 0 */
        vu[j] = 2.0f * vc[j];
    EXPECT_ERR(mdt_branches_combine(MDT_CFG_RESCALED, 2.0, vc, vu, N, W, v), MDT_E_NUMERIC,
               "the guided combination (rescale)", "token 1", "norm there is 0");
    EXPECT_OK(mdt_branches_combine(MDT_CFG_PLAIN, 2.0, vc, vu, N, W, v)); /* 0 is a prediction */
    EXPECT(v[W] == 0.0f && v[2 * W - 1] == 0.0f, "plain: token 1 is 0");
    for (int j = 0; j < N; j++) /* S = 1, v_c = 0: the combination is v_c, 0 everywhere */
        vc[j] = 0.0f;
    EXPECT_ERR(mdt_branches_combine(MDT_CFG_RESCALED, 1.0, vc, vu, N, W, v), MDT_E_NUMERIC,
               "the guided combination (rescale)", "token 0");
}

int main(void) {
    check_flux_short_negative();
    check_qwen_short_negative();
    check_negative_shapes();
    check_negative_complete();
    check_qwen_negative_without_mask();
    check_ti2v_clean_frame(0);
    check_ti2v_clean_frame(1);
    check_rescale();
    EXPECT(mdt_mem_live() == 0, "everything freed: %lld bytes live", (long long)mdt_mem_live());
    TEST_END();
}
