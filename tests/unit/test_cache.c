/*
 * test_cache.c — tentative forwards of a step cache (cache.h): a forward run tentatively and
 * rolled back leaves the branch as if it never ran (the later forwards' outputs and decisions
 * are the bits of the run without it), one committed is the plain forward; the negative
 * control keeps the stray forward and must differ. Every cache kind, on the families that run
 * it (Flux: First-Block Cache, MagCache, TaylorSeer with f32 and bf16 factors; Wan: text_kv). A
 * generation freed while a forward is tentative frees both states (the sanitizer build checks).
 * The state's bytes: those of the plain run after an undone forward; TaylorSeer's bf16 factors
 * take half of f32's.
 */
#include "harness.h"
#include "meshdit.h"
#include "models/cache.h"
#include "models/model.h"

#include <stdlib.h>
#include <string.h>

#define STEPS 6

typedef enum { PLAIN, UNDO_STRAY, COMMIT_EACH, KEEP_STRAY } mode;

/* Every element of input `name` scaled by s (the step's latents, or another context). */
static void scale(mdt_tensor_set *in, const char *name, float s) {
    mdt_tensor *t = mdt_tensor_set_get(in, name);
    float *x = t->data; // [numel]
    for (int64_t i = 0; i < mdt_tensor_numel(t); i++)
        x[i] *= s;
}

/* The model in `dir` with random inputs and a fresh cache of `spec` on branch `branch` (NULL
 * model: the load failed, already reported). */
static mdt_model *cached_model(const char *dir, const char *spec, const char *branch,
                               mdt_tensor_set **in) {
    mdt_load_params lp = mdt_load_params_default();
    lp.checkpoint_dir = dir;
    mdt_model *m = NULL;
    *in = NULL;
    EXPECT_OK(mdt_model_load(&lp, &m));
    if (!m)
        return NULL;
    mdt_inputs_params ip = {.seed = 7, .batch = 1, .timestep = 0.6, .guidance = 3.5};
    mdt_tensor_set_create(in);
    EXPECT_OK(mdt_model_random_inputs(m, &ip, *in));
    mdt_cache_spec sp;
    mdt_cache *c = NULL;
    EXPECT_OK(mdt_cache_spec_parse(spec, &sp));
    EXPECT_OK(mdt_cache_create(&sp, &c));
    EXPECT_OK(mdt_cache_select(c, branch));
    m->cache = c;
    return m;
}

/* STEPS cached forwards of one branch; out [STEPS][n] their samples, skipped [STEPS] their
 * decisions. `stray`: the input a stray forward changes (a speculated other request). */
static void run(const char *dir, const char *spec, const char *stray, mode md, float **out,
                int64_t *n, int *skipped, int64_t *bytes) {
    mdt_tensor_set *in = NULL, *o = NULL;
    mdt_model *m = cached_model(dir, spec, "uncond", &in);
    if (!m)
        return;
    mdt_cache *c = m->cache;
    for (int k = 0; k < STEPS; k++) {
        if (md == UNDO_STRAY || md == KEEP_STRAY) { /* a forward on other inputs first */
            mdt_tensor_set *x = NULL;
            mdt_tensor_set_create(&x);
            for (int i = 0; i < mdt_tensor_set_count(in); i++) {
                const char *name;
                const mdt_tensor *t = mdt_tensor_set_at(in, i, &name);
                mdt_tensor_set_add_copy(x, name, t);
            }
            scale(x, stray, -1.5f);
            mdt_tensor_set_create(&o);
            EXPECT_OK(mdt_cache_tentative(c));
            EXPECT_ERR(mdt_cache_tentative(c), MDT_E_INVALID, "pending");
            EXPECT_OK(mdt_model_forward(m, x, o));
            if (md == UNDO_STRAY)
                mdt_cache_rollback(c);
            else
                mdt_cache_commit(c);
            mdt_tensor_set_free(o), mdt_tensor_set_free(x);
        }
        mdt_tensor_set_create(&o);
        if (md == COMMIT_EACH)
            EXPECT_OK(mdt_cache_tentative(c));
        EXPECT_OK(mdt_model_forward(m, in, o));
        if (md == COMMIT_EACH)
            mdt_cache_commit(c);
        skipped[k] = c->last.skipped;
        const mdt_tensor *s = mdt_tensor_set_get(o, "sample");
        *n = mdt_tensor_numel(s);
        out[k] = malloc(sizeof(float) * (size_t)*n);
        memcpy(out[k], s->data, sizeof(float) * (size_t)*n);
        mdt_tensor_set_free(o);
        scale(in, "hidden_states", 0.97f); /* the next step's latents, a little moved */
    }
    EXPECT(c->nlog == (md == KEEP_STRAY ? 2 * STEPS : STEPS), "%lld forwards logged",
           (long long)c->nlog);
    *bytes = mdt_cache_bytes(c);
    /* a generation dropped while a forward is tentative */
    EXPECT_OK(mdt_cache_tentative(c));
    m->cache = NULL;
    mdt_cache_free(c);
    mdt_tensor_set_free(in);
    mdt_model_free(m);
}

/* The state's bytes after the plain run. */
static int64_t check(const char *dir, const char *spec, const char *stray, int want_mixed) {
    float *ref[STEPS] = {0}, *got[STEPS] = {0};
    int64_t n = 0, bytes = 0, b2 = 0;
    int sk_ref[STEPS] = {0}, sk[STEPS] = {0};
    run(dir, spec, stray, PLAIN, ref, &n, sk_ref, &bytes);
    int nskip = 0;
    for (int k = 0; k < STEPS; k++)
        nskip += sk_ref[k];
    if (want_mixed)
        EXPECT(nskip > 0 && nskip < STEPS - 1, "%s: %d of %d skipped (wanted some of each)", spec,
               nskip, STEPS);
    for (int md = UNDO_STRAY; md <= KEEP_STRAY; md++) {
        run(dir, spec, stray, (mode)md, got, &n, sk, &b2);
        if (md != KEEP_STRAY)
            EXPECT(b2 == bytes, "%s: %lld state bytes, %lld in the plain run", spec, (long long)b2,
                   (long long)bytes);
        int same = 1;
        for (int k = 0; k < STEPS; k++) {
            same = same && got[k] && ref[k] && sk[k] == sk_ref[k] &&
                   memcmp(got[k], ref[k], sizeof(float) * (size_t)n) == 0;
            free(got[k]);
            got[k] = NULL;
        }
        if (md == KEEP_STRAY) /* negative control: the stray forward kept changes the run
                                 (text_kv, exact: its decisions, to recompute every K/V) */
            EXPECT(!same, "%s: keeping a stray forward changed nothing", spec);
        else
            EXPECT(same, "%s: mode %d differs from the plain run", spec, md);
    }
    for (int k = 0; k < STEPS; k++)
        free(ref[k]);
    return bytes;
}

/* A forward the cache refuses (TaylorSeer asked to predict before any computed step) changes
 * nothing: the same forward is refused again, at the same step, and nothing is logged (before,
 * the refused forward used up the step, so a retry ran a schedule shifted by one). */
static void refused_forward_keeps_the_step(void) {
    mdt_tensor_set *in = NULL, *o = NULL;
    mdt_model *m =
        cached_model("tests/data/flux_tiny",
                     "taylorseer:cache_interval=2,disable_cache_before_step=0", "cond", &in);
    if (!m)
        return;
    mdt_cache *c = m->cache;
    mdt_tensor_set_create(&o);
    for (int k = 0; k < 2; k++)
        EXPECT_ERR(mdt_model_forward(m, in, o), MDT_E_INVALID, "would predict step 0");
    EXPECT(c->nlog == 0 && !c->in_forward, "%lld forwards logged after two refusals",
           (long long)c->nlog);
    m->cache = NULL;
    mdt_cache_free(c);
    mdt_tensor_set_free(in);
    mdt_tensor_set_free(o);
    mdt_model_free(m);
}

/* The report's spec (mdt_cache_spec_text) reads back as the same cache, MagCache's ratios too:
 * they were counted ("(28 mag_ratios)"), so --cache could not take the report's text. */
static void spec_text_reads_back(void) {
    const char *mag = "mag:mag_ratios=1.0/1.2/1.1/1.05/0.3333333/1e-7,threshold=0.1,"
                      "num_inference_steps=6,retention_ratio=0.25,max_skip_steps=2";
    const char *specs[] = {"mag:mag_ratios=1/2/3", mag, "first_block:threshold=0.05",
                           "taylorseer:cache_interval=3,disable_cache_after_step=9", "text_kv"};
    char *text = malloc(MDT_CACHE_SPEC_MAX + 1);
    for (size_t i = 0; text && i < sizeof specs / sizeof specs[0]; i++) {
        mdt_cache_spec a, b;
        EXPECT_OK(mdt_cache_spec_parse(specs[i], &a));
        EXPECT(mdt_cache_spec_text(&a, text, MDT_CACHE_SPEC_MAX + 1) == 1, "'%s' not whole",
               specs[i]);
        EXPECT_OK(mdt_cache_spec_parse(text, &b));
        EXPECT(mdt_cache_spec_equal(&a, &b), "'%s' -> '%s' is another cache", specs[i], text);
    }
    free(text);
}

int main(void) {
    spec_text_reads_back();
    refused_forward_keeps_the_step();
    check("tests/data/flux_tiny", "first_block:threshold=0.03", "hidden_states", 1);
    check("tests/data/flux_tiny",
          "mag:threshold=0.1,num_inference_steps=6,retention_ratio=0.2,max_skip_steps=2,"
          "mag_ratios=1.0/1.2/1.1/1.05/1.04/1.03",
          "hidden_states", 1);
    const int64_t f32 = check(
        "tests/data/flux_tiny",
        "taylorseer:cache_interval=2,disable_cache_before_step=1,taylor_factors_dtype=float32",
        "hidden_states", 1);
    const int64_t bf16 = check(
        "tests/data/flux_tiny",
        "taylorseer:cache_interval=2,disable_cache_before_step=1,taylor_factors_dtype=bfloat16",
        "hidden_states", 1);
    /* the factors are TaylorSeer's whole state: bf16 keeps them in half the bytes */
    EXPECT(f32 > 0 && 2 * bf16 == f32, "TaylorSeer state %lld bytes in f32, %lld in bf16",
           (long long)f32, (long long)bf16);
    check("tests/data/wan_tiny", "text_kv", "encoder_hidden_states", 0);
    TEST_END();
}
