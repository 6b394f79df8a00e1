/*
 * test_api.c — the public API as a client sees it (meshdit.h only): the docs/api.md example
 * (load once, sample, report, free) compiled and run, the sampler against the golden 2-step
 * result, describe-only views, layout planning, comparison, sizes and errors.
 */
#include "harness.h"
#include "meshdit.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
    /* the streams, the ids and the ControlNet residuals of both block stacks */
    EXPECT(mdt_model_info_cp_count(v, 0) == 6 && mdt_model_info_cp_count(v, 1) == 1, "cp plan");
    int dim = -1;
    EXPECT(strcmp(mdt_model_info_cp_entry(v, 0, 4, &dim, NULL), "controlnet_block_samples") == 0 &&
               dim == 2,
           "controlnet split");
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
    EXPECT_OK(mdt_plan_layouts(v, &dev, &(mdt_plan_request){4, 1024, 0, 2, 0}, &e, &n));
    EXPECT(n == 6 && e && e[0].valid && e[0].t_step <= e[1].t_step, "plan: %d layouts", n);
    /* a guided step: cfg 1 layouts cost two forwards, cfg 2 ones a forward on half the devices
     * and one exchange of the prediction */
    mdt_layout_estimate *g = NULL, *one = NULL;
    int ng = 0, n1 = 0;
    EXPECT_OK(mdt_plan_layouts(v, &dev, &(mdt_plan_request){4, 1024, 0, 2, 1}, &g, &ng));
    EXPECT_OK(mdt_plan_layouts(v, &dev, &(mdt_plan_request){2, 1024, 0, 2, 0}, &one, &n1));
    int cfg2 = 0;
    for (int i = 0; g && e && one && i < ng; i++)
        for (int j = 0; j < (g[i].cfg == 1 ? n : n1); j++) {
            const mdt_layout_estimate *b = g[i].cfg == 1 ? &e[j] : &one[j];
            if (b->tp != g[i].tp || b->ring != g[i].ring || b->ulysses != g[i].ulysses)
                continue;
            cfg2 += g[i].cfg == 2;
            EXPECT(g[i].cfg == 1 ? g[i].t_step == 2 * b->t_step && g[i].bytes_cfg == 0
                                 : g[i].t_step > b->t_step && g[i].bytes_cfg > 0 &&
                                       g[i].flops_linear == b->flops_linear,
                   "guided cfg %d x %d x %d x %d: step %.6f vs %.6f", g[i].cfg, g[i].tp, g[i].ring,
                   g[i].ulysses, g[i].t_step, b->t_step);
        }
    EXPECT(ng == 6 + 3 && cfg2 == 3, "guided plan: %d layouts, %d with cfg 2", ng, cfg2);
    free(g), free(one);
    free(e);
    mdt_model_info_free(v);
    /* a family whose pipeline does not guide (MiniMax-H3: no negative_ inputs) has no branch for
     * a second cfg group: its guided plan lists cfg 1 layouts only, and every one of them */
    EXPECT_OK(mdt_model_info_open("tests/data/h3_tiny", NULL, 1, &v));
    g = e = NULL, ng = n = 0;
    if (v) {
        EXPECT_OK(mdt_plan_layouts(v, &dev, &(mdt_plan_request){4, 1024, 0, 2, 0}, &e, &n));
        EXPECT_OK(mdt_plan_layouts(v, &dev, &(mdt_plan_request){4, 1024, 0, 2, 1}, &g, &ng));
        cfg2 = 0;
        for (int i = 0; g && i < ng; i++)
            cfg2 += g[i].cfg != 1;
        EXPECT(n > 0 && ng == n && cfg2 == 0,
               "guided plan of MiniMax-H3: %d layouts (%d unguided), %d with cfg 2", ng, n, cfg2);
        free(g), free(e);
        mdt_model_info_free(v);
    }
    EXPECT_ERR(mdt_model_info_open("/nonexistent", NULL, 0, &v), MDT_E_NOTFOUND, "/nonexistent");
}

/* The scaling model's per-rank FLOPs for one device against the counters of a real forward of
 * the same checkpoint: the rows each weight runs on (image, text, one per sample) are right for
 * the joint families and for cross-attention (Wan). S, L: attention sequence, text rows. */
static void check_estimate(const char *dir, int64_t S, int64_t L) {
    char ck[256], in[256];
    snprintf(ck, sizeof ck, "tests/data/%s", dir);
    snprintf(in, sizeof in, "tests/data/%s/inputs.safetensors", dir);
    mdt_load_params lp = mdt_load_params_default();
    lp.checkpoint_dir = ck;
    mdt_model *m = NULL;
    mdt_model_info *v = NULL;
    mdt_tensor_set *inputs = NULL, *out = NULL;
    mdt_run_stats *stats = NULL;
    mdt_sample_params sp = mdt_sample_params_default();
    EXPECT_OK(mdt_model_load(&lp, &m));
    EXPECT_OK(mdt_tensor_set_load(in, &inputs));
    EXPECT_OK(mdt_tensor_set_create(&out));
    EXPECT_OK(mdt_sample(m, inputs, &sp, out, &stats));
    EXPECT_OK(mdt_model_info_open(ck, NULL, 0, &v));
    mdt_device_spec dev;
    mdt_layout_estimate *e = NULL;
    int n = 0;
    EXPECT_OK(mdt_device_spec_preset("cpu", &dev));
    EXPECT_OK(mdt_plan_layouts(v, &dev, &(mdt_plan_request){1, S, L, 4, 0}, &e, &n));
    const mdt_rank_stats *r = stats ? mdt_run_stats_rank(stats, 0) : NULL;
    EXPECT(r && e && n == 1, "%s: stats and one layout", dir);
    if (r && e && n == 1) {
        EXPECT(fabs(e->flops_linear - r->flops_linear) <= 0.05 * r->flops_linear,
               "%s: linear FLOPs estimated %.0f, counted %.0f", dir, e->flops_linear,
               r->flops_linear);
        EXPECT(fabs(e->flops_attn - r->flops_attn) <= 0.01 * r->flops_attn,
               "%s: attention FLOPs estimated %.0f, counted %.0f", dir, e->flops_attn,
               r->flops_attn);
    }
    free(e);
    mdt_model_info_free(v);
    mdt_run_stats_free(stats);
    mdt_tensor_set_free(out);
    mdt_tensor_set_free(inputs);
    mdt_model_free(m);
}

/* Device files: what is saved loads back; the measured collective costs are what the plan uses
 * (a slower measured link makes the layout that crosses it slower); a hostile file is refused
 * with the field named. */
static void test_device_file(void) {
    mdt_device_spec d, back;
    EXPECT_OK(mdt_device_spec_preset("cpu", &d));
    d.calibrated = 1, d.flops_attn = 2e10, d.flops_other = 2e9, d.node_size = 1;
    snprintf(d.source, sizeof d.source, "test");
    for (int l = 0; l < MDT_LINK_COUNT; l++)
        for (int k = 0; k < MDT_COST_KIND_COUNT; k++)
            d.coll[l][k] = (mdt_link_cost){.latency = 1e-5 * (k + 1), .bw = 1e8 * (l + 1)};
    const char *path = "/tmp/mdt_test_device.json";
    EXPECT_OK(mdt_device_spec_save(&d, path));
    EXPECT_OK(mdt_device_spec_load(path, &back));
    EXPECT(strcmp(back.name, d.name) == 0 && back.calibrated && back.flops == d.flops &&
               back.flops_attn == d.flops_attn && back.node_size == 1 &&
               back.coll[1][2].bw == d.coll[1][2].bw &&
               back.coll[0][3].latency == d.coll[0][3].latency,
           "device file round trip");
    mdt_model_info *v = NULL;
    EXPECT_OK(mdt_model_info_open(CK, NULL, 0, &v));
    mdt_layout_estimate *e1 = NULL, *e2 = NULL;
    int n1 = 0, n2 = 0;
    EXPECT_OK(mdt_plan_layouts(v, &back, &(mdt_plan_request){2, 4096, 0, 4, 0}, &e1, &n1));
    back.coll[MDT_LINK_INTER][MDT_COST_ALLREDUCE].bw /= 100; /* only TP's all-reduce slower */
    EXPECT_OK(mdt_plan_layouts(v, &back, &(mdt_plan_request){2, 4096, 0, 4, 0}, &e2, &n2));
    for (int i = 0; e1 && e2 && i < n1 && i < n2; i++)
        for (int j = 0; j < n2; j++)
            if (e1[i].tp == e2[j].tp && e1[i].ring == e2[j].ring && e1[i].valid)
                EXPECT(e1[i].tp > 1 ? e2[j].t_comm > 10 * e1[i].t_comm
                                    : e2[j].t_comm == e1[i].t_comm,
                       "tp %d ring %d: comm %.6f then %.6f", e1[i].tp, e1[i].ring, e1[i].t_comm,
                       e2[j].t_comm);
    free(e1), free(e2);
    /* the ring's transfer hides behind attention only as far as the measured overlap says */
    double ring_comm[2] = {0, 0};
    for (int o = 0; o < 2; o++) {
        back.coll[MDT_LINK_INTER][MDT_COST_SENDRECV].overlap = o;
        back.coll[MDT_LINK_INTER][MDT_COST_SENDRECV].bw = 1e7;
        EXPECT_OK(mdt_plan_layouts(v, &back, &(mdt_plan_request){2, 4096, 0, 4, 0}, &e1, &n1));
        for (int i = 0; e1 && i < n1; i++)
            if (e1[i].ring == 2)
                ring_comm[o] = e1[i].t_comm;
        free(e1);
    }
    EXPECT(ring_comm[0] > ring_comm[1] && ring_comm[1] > 0, "ring comm: overlap 0 %.6f, 1 %.6f",
           ring_comm[0], ring_comm[1]);
    mdt_model_info_free(v);
    static const struct {
        const char *text, *field;
    } bad[] = {
        {"[1, 2]", "not a JSON object"},
        {"{\"meshdit_device\": 1}", "name"},
        {"{\"meshdit_device\": 2, \"name\": \"x\"}", "meshdit_device"},
        {"{\"meshdit_device\": 1, \"name\": \"x\", \"flops\": {\"linear\": -1}}", "flops.linear"},
        {"{\"meshdit_device\": 1, \"name\": \"x\", \"flops\": {\"linear\": 1e9}, "
         "\"memory_bytes\": 1e9, \"devices_per_node\": 1.5}",
         "devices_per_node"},
        {"{\"meshdit_device\": 1, \"name\": \"x\", \"flops\": {\"linear\": 1e9}, "
         "\"memory_bytes\": 1e9, \"devices_per_node\": 2, \"bandwidth\": {\"intra\": 1e9, "
         "\"inter\": 1e9}, \"latency_s\": 0, \"collectives\": {\"inter\": {\"alltoall\": "
         "{\"latency_s\": 0, \"bytes_per_s\": 0}}}}",
         "collectives.inter.alltoall.bytes_per_s"},
        {"{\"meshdit_device\": 1, \"name\": \"x\", \"flops\": {\"linear\": 1e9}, "
         "\"memory_bytes\": 1e9, \"devices_per_node\": 2, \"bandwidth\": {\"intra\": 1e9}}",
         "bandwidth.inter"},
        {"{\"meshdit_device\": 1, \"name\": \"x\"", "invalid JSON"},
        {"{\"meshdit_device\": 1, \"name\": \"x\", \"flops\": {\"linear\": 1e999}}",
         "flops.linear"},
        {"{\"meshdit_device\": 1, \"name\": \"x\", \"colectives\": {}}", "unknown key colectives"},
        {"{\"meshdit_device\": 1, \"name\": \"x\", \"flops\": {\"linear\": 1e9}, "
         "\"memory_bytes\": 1e9, \"devices_per_node\": 2, \"bandwidth\": {\"intra\": 1e9, "
         "\"inter\": 1e9}, \"latency_s\": 0, \"collectives\": {\"inter\": {\"all_reduce\": "
         "{}}}}",
         "unknown key collectives.inter.all_reduce"},
        {"{\"meshdit_device\": 1, \"name\": "
         "\"xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx\"}",
         "name must be"},
        {"{\"meshdit_device\": 1, \"name\": \"x\", \"name\": \"y\"}", "key name given twice"},
        {"{\"meshdit_device\": 1, \"name\": \"x\", \"flops\": {\"linear\": 1e9, \"linear\": 2e9}}",
         "key flops.linear given twice"},
        {"{\"meshdit_device\": 1, \"name\": \"x\"} {\"meshdit_device\": 9}", "after the JSON"},
        {"{\"meshdit_device\": 1, \"name\": \"a\\u001b[2Jb\"}", "printable"},
        {"{\"meshdit_device\": 1, \"name\": \"vm\\u009b2J\"}", "printable"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        FILE *fp = fopen(path, "w");
        if (fp) {
            fputs(bad[i].text, fp);
            fclose(fp);
        }
        memset(&back, 0x5a, sizeof back);
        EXPECT_ERR(mdt_device_spec_load(path, &back), MDT_E_FORMAT, path, bad[i].field);
    }
    EXPECT_ERR(mdt_device_spec_load("/nonexistent/dev.json", &back), MDT_E_NOTFOUND,
               "/nonexistent/dev.json");
    EXPECT_ERR(mdt_device_spec_load("/tmp", &back), MDT_E_IO, "/tmp", "not a regular file");
    remove(path);
    check_estimate("flux_tiny", 16 + 48, 48);
    check_estimate("flux2_tiny", 16 + 48, 48);
    check_estimate("qwenimage_tiny", 16 + 8, 8);
    check_estimate("wan_tiny", 2 * 8 * 8, 12);
}

static void test_small(void) {
    EXPECT(mdt_size_parse("8G") == (int64_t)8 << 30 && mdt_size_parse("1.5KiB") == 1536 &&
               mdt_size_parse("x") == -1,
           "sizes");
    EXPECT_ERR(mdt_error_set(MDT_E_IO, "injected %d", 7), MDT_E_IO, "injected 7");
    mdt_coords co;
    EXPECT_OK(mdt_mesh_coords_of(&(mdt_layout){1, 2, 2, 2, "ulysses,tp,ring"}, 5, &co));
    EXPECT(co.tp == 0 && co.ring == 1 && co.ulysses == 1 && co.cfg == 0, "coords %d %d %d", co.tp,
           co.ring, co.ulysses);
    /* cfg outermost unless the order says otherwise: rank 9 of cfg 2 x tp 2 x ring 2 x uly 2 */
    EXPECT_OK(mdt_mesh_coords_of(&(mdt_layout){2, 2, 2, 2, "ulysses,tp,ring"}, 9, &co));
    EXPECT(co.cfg == 1 && co.tp == 0 && co.ring == 1 && co.ulysses == 0, "cfg outermost");
    EXPECT_OK(mdt_mesh_coords_of(&(mdt_layout){2, 2, 1, 1, "tp,cfg,ring,ulysses"}, 1, &co));
    EXPECT(co.cfg == 1 && co.tp == 0, "cfg inside tp");
    EXPECT_ERR(mdt_mesh_coords_of(&(mdt_layout){1, 1, 1, 1, "tp,tp"}, 0, &co), MDT_E_INVALID,
               "twice");
    EXPECT(mdt_family_exists("flux") && mdt_family_has_preset("minimax-h3", "tiny") &&
               !mdt_family_has_preset("flux", "huge"),
           "families");
}

/* mdt_tensor_compare: F64 in F64 (1e-300 against 2e-300 is a relative 0.5, and 1e300 is
 * finite), integers exactly (equal I64 inputs compare equal; 2^53 + 1 against 2^53 differs),
 * a float against an integer is not comparable. */
static void test_compare_dtypes(void) {
    double fa[2] = {1e-300, 1e300}, fb[2] = {2e-300, 1e300};
    int64_t ia[2] = {((int64_t)1 << 53) + 1, 7}, ib[2] = {(int64_t)1 << 53, 7};
    float ff[2] = {1, 2};
    const mdt_tensor a = {.dtype = MDT_F64, .ndim = 1, .shape = {2}, .data = fa};
    const mdt_tensor b = {.dtype = MDT_F64, .ndim = 1, .shape = {2}, .data = fb};
    const mdt_tensor i1 = {.dtype = MDT_I64, .ndim = 1, .shape = {2}, .data = ia};
    const mdt_tensor i2 = {.dtype = MDT_I64, .ndim = 1, .shape = {2}, .data = ib};
    const mdt_tensor f1 = {.dtype = MDT_F32, .ndim = 1, .shape = {2}, .data = ff};
    mdt_tensor_diff d;
    EXPECT_OK(mdt_tensor_compare(&a, &b, &d));
    EXPECT(d.comparable && !d.nonfinite && d.max_abs_diff == 1e-300 && d.max_abs_b == 1e300,
           "F64: comparable %d nonfinite %d max|a-b| %g max|b| %g", d.comparable, d.nonfinite,
           d.max_abs_diff, d.max_abs_b);
    EXPECT_OK(mdt_tensor_compare(&i1, &i1, &d));
    EXPECT(d.comparable && d.max_abs_diff == 0, "I64 with itself: %d %g", d.comparable,
           d.max_abs_diff);
    EXPECT_OK(mdt_tensor_compare(&i1, &i2, &d));
    EXPECT(d.comparable && d.max_abs_diff == 1, "I64 2^53 + 1 against 2^53: %g", d.max_abs_diff);
    EXPECT_OK(mdt_tensor_compare(&f1, &i1, &d));
    EXPECT(!d.comparable, "F32 against I64 compared");
}

int main(void) {
    test_compare_dtypes();
    test_sample();
    test_stats_and_errors();
    test_info_and_plan();
    test_device_file();
    test_small();
    TEST_END();
}
