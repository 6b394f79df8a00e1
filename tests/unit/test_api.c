/*
 * test_api.c — the public API as a client sees it (meshdit.h only): the docs/api.md example
 * (load once, sample, report, free) compiled and run, the sampler against the golden 2-step
 * result, describe-only views, layout planning, comparison, sizes and errors.
 */
#include "harness.h"
#include "meshdit.h"

#include <stdlib.h>

#define CK "tests/data/flux_tiny"

/* ---- docs/api.md: a client (single rank: no mesh, so no MPI needed) ---- */
static mdt_status sample_once(const char *ckpt, const char *inputs, int steps, mdt_tensor_set **out,
                              char **report) {
    mdt_load_params lp = mdt_load_params_default();
    lp.checkpoint_dir = ckpt; /* lp.mesh: an mdt_mesh for tp x ring x ulysses ranks */
    mdt_model *m = NULL;
    mdt_tensor_set *in = NULL;
    mdt_run_stats *stats = NULL;
    mdt_status st = mdt_model_load(&lp, &m); /* once; then any number of samples */
    if (st == MDT_OK)
        st = mdt_tensor_set_load(inputs, &in);
    if (st == MDT_OK)
        st = mdt_tensor_set_create(out);
    mdt_sample_params sp = mdt_sample_params_default();
    sp.steps = steps; /* Euler flow matching; 0: plain forwards */
    if (st == MDT_OK)
        st = mdt_sample(m, in, &sp, *out, &stats); /* *out: "sample" */
    if (st == MDT_OK)
        st = mdt_run_report_json(m, stats, 0.0, report); /* free() it */
    mdt_run_stats_free(stats);
    mdt_tensor_set_free(in);
    mdt_model_free(m);
    return st; /* on failure: mdt_last_error() says why */
}
/* ---- end of the example ---- */

static void test_sample(void) {
    mdt_tensor_set *out = NULL, *want = NULL;
    char *report = NULL;
    EXPECT_OK(sample_once(CK, CK "/inputs.safetensors", 2, &out, &report));
    EXPECT_OK(mdt_tensor_set_load(CK "/expected_steps2.safetensors", &want));
    const mdt_tensor *a = out ? mdt_tensor_set_get(out, "sample") : NULL;
    const mdt_tensor *b = want ? mdt_tensor_set_get(want, "sample") : NULL;
    mdt_tensor_diff d = {0};
    EXPECT(a && b, "no sample");
    if (a && b) {
        EXPECT_OK(mdt_tensor_compare(a, b, &d));
        EXPECT(d.comparable && !d.nonfinite && d.max_abs_diff <= 1e-4 * d.max_abs_b,
               "2-step sample: max|a-b| %.3e max|b| %.3e", d.max_abs_diff, d.max_abs_b);
    }
    EXPECT(report && strstr(report, "\"tensors_rank0\"") && strstr(report, "\"mesh_order\""),
           "report: %s", report ? report : "(none)");
    free(report);
    mdt_tensor_set_free(out);
    mdt_tensor_set_free(want);
}

static void test_stats_and_errors(void) {
    mdt_load_params lp = mdt_load_params_default();
    lp.checkpoint_dir = CK;
    mdt_model *m = NULL;
    mdt_tensor_set *in = NULL, *out = NULL;
    mdt_run_stats *s = NULL;
    EXPECT_OK(mdt_model_load(&lp, &m));
    EXPECT_OK(mdt_tensor_set_load(CK "/inputs.safetensors", &in));
    EXPECT_OK(mdt_tensor_set_create(&out));
    if (!m || !in || !out)
        goto done;
    mdt_sample_params sp = mdt_sample_params_default();
    sp.repeat = 2;
    EXPECT_OK(mdt_sample(m, in, &sp, out, &s));
    EXPECT(mdt_tensor_set_get(out, "sample") != NULL, "forward output");
    EXPECT(s && mdt_run_stats_steps(s) == 2 && !mdt_run_stats_sampled(s) &&
               mdt_run_stats_rank_count(s) == 1,
           "stats");
    const mdt_rank_stats *r = s ? mdt_run_stats_rank(s, 0) : NULL;
    EXPECT(r && r->weight_bytes == mdt_model_weight_bytes(m) && r->flops_linear > 0 &&
               r->attn_calls > 0 && r->bytes_read == mdt_model_bytes_read(m),
           "rank stats");
    EXPECT_ERR(mdt_sample(m, in, &sp, out, NULL), MDT_E_INVALID, "must be empty");
    int tp, ring, uly;
    mdt_model_layout(m, &tp, &ring, &uly);
    EXPECT(tp == 1 && ring == 1 && uly == 1, "layout");
    mdt_weight_info w;
    EXPECT_OK(mdt_model_weight(m, 0, &w));
    EXPECT(w.bytes_read > 0 && w.local_shape[0] == w.shape[0], "weight 0");
done:
    mdt_run_stats_free(s);
    mdt_tensor_set_free(in);
    mdt_tensor_set_free(out);
    mdt_model_free(m);
}

static void test_info_and_plan(void) {
    mdt_model_info *v = NULL;
    EXPECT_OK(mdt_model_info_open(CK, NULL, 1, &v));
    if (!v)
        return;
    EXPECT(strcmp(mdt_model_info_family(v), "flux") == 0, "family");
    EXPECT(mdt_model_info_cp_count(v, 0) == 4 && mdt_model_info_cp_count(v, 1) == 1, "cp plan");
    int dim = -1;
    EXPECT(strcmp(mdt_model_info_cp_entry(v, 1, 0, &dim, NULL), "sample") == 0 && dim == 1,
           "gather");
    mdt_weight_info w;
    EXPECT_OK(mdt_model_info_weight(v, 0, 2, &w));
    EXPECT(strcmp(w.stored, "F32") == 0, "stored %s", w.stored);
    EXPECT_ERR(mdt_model_info_check_layout(v, 3, 1, 1), MDT_E_INVALID, "tp=3");
    mdt_tensor_set *set = NULL;
    const mdt_random_inputs ri = {.seed = 1, .batch = 1, .img_tokens = 4, .txt_tokens = 2};
    EXPECT_OK(mdt_tensor_set_create(&set));
    EXPECT_OK(mdt_model_info_make_inputs(v, &ri, set));
    EXPECT(set && mdt_tensor_set_get(set, "hidden_states") != NULL, "random inputs");
    mdt_tensor_set_free(set);
    mdt_device_spec dev;
    mdt_layout_estimate *e = NULL;
    int n = 0;
    EXPECT_OK(mdt_device_spec_preset("h200", &dev));
    EXPECT_ERR(mdt_device_spec_preset("abacus", &dev), MDT_E_NOTFOUND, "abacus");
    EXPECT_OK(mdt_plan_layouts(v, &dev, 4, 1024, 2, &e, &n));
    EXPECT(n == 6 && e && e[0].valid && e[0].t_step <= e[1].t_step, "plan: %d layouts", n);
    free(e);
    mdt_model_info_free(v);
    EXPECT_ERR(mdt_model_info_open("/nonexistent", NULL, 0, &v), MDT_E_NOTFOUND, "/nonexistent");
}

static void test_small(void) {
    EXPECT(mdt_size_parse("8G") == (int64_t)8 << 30 && mdt_size_parse("1.5KiB") == 1536 &&
               mdt_size_parse("x") == -1,
           "sizes");
    EXPECT_ERR(mdt_error_set(MDT_E_IO, "injected %d", 7), MDT_E_IO, "injected 7");
    int t, r, u;
    EXPECT_OK(mdt_mesh_coords_of("ulysses,tp,ring", 5, 2, 2, 2, &t, &r, &u));
    EXPECT(t == 0 && r == 1 && u == 1, "coords %d %d %d", t, r, u);
    EXPECT_ERR(mdt_mesh_coords_of("tp,tp", 0, 1, 1, 1, &t, &r, &u), MDT_E_INVALID, "twice");
    EXPECT(mdt_family_exists("flux") && mdt_family_has_preset("minimax-h3", "tiny") &&
               !mdt_family_has_preset("flux", "huge"),
           "families");
}

int main(void) {
    test_sample();
    test_stats_and_errors();
    test_info_and_plan();
    test_small();
    TEST_END();
}
