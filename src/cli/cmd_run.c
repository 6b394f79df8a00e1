/*
 * cmd_run.c — `meshdit run`: the mesh, the device, the checks before any weight is read (output
 * paths, memory), the load, then the library's sampler (--steps N) or N forwards (--repeat N),
 * the output and report written both or neither, and the plan report on stdout.
 */
#define _POSIX_C_SOURCE 200809L
#include "cli/cli.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* The progress line on a terminal: "step i/N  seconds". */
static void on_step(void *user, int step, int nsteps, double seconds) {
    *(int *)user = 1;
    fprintf(stderr, "\rstep %d/%d  %.3f s", step, nsteps, seconds);
}

/* The device line of rank 0: the GPU, or the CPU's bf16 path (nothing for the f32 CPU path). */
static void print_device(const mdt_model *m) {
    mdt_device_info d;
    mdt_device_info_get(&d);
    const double wmib = (double)mdt_model_weight_bytes(m) / 1048576.0;
    if (d.gpu)
        printf("device: %s, compute %s, weights %.1f MiB per rank, device memory peak %.2f GiB "
               "(rank 0)\n",
               d.description, d.bf16 ? "bf16 (fp32 accumulation)" : "f32", wmib,
               (double)d.device_mem_peak / 1073741824.0);
    else if (d.bf16 && d.bf16_operands)
        printf("device: cpu, compute bf16 x bf16 GEMM operands with fp32 accumulation (linears, "
               "QK^T, PV; norms, softmax and residuals fp32), weights %.1f MiB per rank, operand "
               "scratch %.1f MiB (rank 0)\n",
               wmib, (double)d.scratch_bytes / 1048576.0);
    else if (d.bf16)
        printf("device: cpu, compute bf16 weights widened to f32 panels for sgemm (fp32 "
               "arithmetic), weights %.1f MiB per rank, widening scratch %.1f MiB (rank 0)\n",
               wmib, (double)d.scratch_bytes / 1048576.0);
}

/* What every rank did (rank 0 holds the gathered facts), then the load and step times. */
static void print_plan(const mdt_model *m, const char *order, const mdt_run_stats *s, double load_s,
                       const char *out) {
    char wb[32], pb[32];
    mdt_device_info d;
    int T, R, U;
    mdt_device_info_get(&d);
    mdt_model_layout(m, &T, &R, &U);
    printf("plan: model %s, world %d = tp %d x ring %d x ulysses %d (mesh order %s), cpu kernels "
           "%s, gemm %s%s%s\n",
           mdt_model_family(m), cli_world, T, R, U, order, d.cpu_kernels, d.cpu_gemm,
           d.bf16_why && d.bf16_why[0] ? ", " : "", d.bf16_why ? d.bf16_why : "");
    double tot0 = 0;
    for (int i = 0; i < mdt_run_stats_rank_count(s); i++) {
        const mdt_rank_stats *f = mdt_run_stats_rank(s, i);
        double tot = f->flops_linear + f->flops_attn + f->flops_other;
        if (i == 0)
            tot0 = tot;
        cli_fmt_bytes((double)f->weight_bytes, wb, sizeof wb);
        cli_fmt_bytes((double)f->peak_bytes, pb, sizeof pb);
        printf("rank %d (tp %d, ring %d, ulysses %d): %lld tp-local heads, weights %s, peak %s, "
               "read %lld B; per forward %.3f GFLOP (linear %.3f, attn %.3f), attn %lld/%lld "
               "q/kv rows x heads; bytes sent tp %lld, ring %lld, ulysses %lld, cp %lld",
               f->rank, f->tp, f->ring, f->ulysses, (long long)f->heads_local, wb, pb,
               (long long)f->bytes_read, tot * 1e-9, f->flops_linear * 1e-9, f->flops_attn * 1e-9,
               (long long)f->attn_query_rows, (long long)f->attn_kv_rows, (long long)f->bytes_tp,
               (long long)f->bytes_ring, (long long)f->bytes_ulysses, (long long)f->bytes_cp);
        if (f->ring_compute_s > 0)
            printf("; ring compute %.4f s, wait %.4f s", f->ring_compute_s, f->ring_wait_s);
        if (f->prep_s > 0)
            printf("; input prep %.6f s", f->prep_s);
        printf("\n");
    }
    const int sampling = mdt_run_stats_sampled(s);
    const double med = mdt_run_stats_step_seconds(s);
    printf("load %.3f s; %s %d: median %.6f s per %s (rank 0: %.2f GFLOP/s); wrote %s\n", load_s,
           sampling ? "steps" : "forwards", mdt_run_stats_steps(s), med,
           sampling ? "step" : "forward", med > 0 ? tot0 / med * 1e-9 : 0.0, out);
}

/* The adapters fused into the weights (--lora), rank 0's view. */
static void print_adapters(const mdt_model *m, double lora_s) {
    double fuse_s, base_s;
    int64_t reread, copy;
    if (!mdt_model_lora_count(m))
        return;
    mdt_model_lora_costs(m, &fuse_s, &base_s, &reread, &copy);
    for (int i = 0; i < mdt_model_lora_count(m); i++) {
        mdt_lora_info li;
        char b[32];
        mdt_model_lora_info(m, i, &li);
        cli_fmt_bytes((double)li.bytes, b, sizeof b);
        printf("adapter %s (%s): scale %g, %d linear weights, rank %lld..%lld, %s of factors on "
               "rank 0 (read %lld B)\n",
               li.name, li.source, li.weight, li.targets, (long long)li.rank_min,
               (long long)li.rank_max, b, (long long)li.bytes_read);
    }
    printf("adapters loaded and fused in %.3f s (fusing %.3f s on rank 0)\n", lora_s, fuse_s);
}

/* The step cache's decisions: forwards skipped and computed, and the skip pattern. */
static void print_cache(const mdt_run_stats *s, const char *spec) {
    const int64_t nf = mdt_run_stats_cache_forwards(s);
    if (nf <= 0)
        return;
    char pat[256];
    int64_t n = 0, skipped = 0;
    for (int64_t i = 0; i < nf; i++) {
        const int k = mdt_run_stats_cache_skipped(s, i);
        skipped += k == 1;
        if (n + 1 < (int64_t)sizeof pat)
            pat[n++] = k == 1 ? '-' : 'C';
    }
    pat[n] = '\0';
    printf("cache %s: %lld of %lld forwards skipped blocks (%s%s; C: every block computed, - "
           "skipped)\n",
           spec, (long long)skipped, (long long)nf, pat, n < nf ? "..." : "");
}

/* The options of `meshdit run`. */
typedef struct run_args {
    const char *ck, *inp, *out, *report;
    const char *cache; /* --cache NAME[:key=value,...] */
    cli_layout l;
    int quiet;
    long long steps, repeat, step_timeout;
    double guidance_scale;
    const char *lora[16]; /* --lora FILE[:SCALE], repeatable */
    int nlora;
} run_args;

static int parse_run(int argc, char **argv, run_args *a) {
    static const char *const flags[] = {"quiet", NULL};
    cli_opts o;
    int rc = cli_parse_opts(argc, argv, &o, flags);
    if (rc)
        return rc;
    a->ck = cli_opt_str(&o, "checkpoint", NULL), a->inp = cli_opt_str(&o, "inputs", NULL);
    a->out = cli_opt_str(&o, "out", NULL), a->report = cli_opt_str(&o, "report", NULL);
    a->quiet = cli_opt_str(&o, "quiet", NULL) != NULL;
    a->cache = cli_opt_str(&o, "cache", NULL);
    a->nlora = cli_opt_all(&o, "lora", a->lora, 16);
    if (a->nlora > 16)
        return cli_usage_exit("at most 16 --lora adapters, got %d", a->nlora);
    if ((rc = cli_parse_layout(&o, &a->l)) ||
        (rc = cli_opt_int(&o, "steps", 0, 1, 100000, &a->steps)) || /* absent: 0, forwards */
        (rc = cli_opt_int(&o, "repeat", 1, 1, 100000, &a->repeat)) ||
        (rc = cli_opt_int(&o, "step-timeout", 0, 1, 86400 * 7, &a->step_timeout)) ||
        (rc = cli_opt_double(&o, "guidance-scale", 0, &a->guidance_scale)) ||
        (rc = cli_opts_check_unused(&o)))
        return rc;
    if (!(a->guidance_scale >= 0 && a->guidance_scale < 1e6))
        return cli_usage_exit("--guidance-scale must be a number in [0, 1e6), got %g",
                              a->guidance_scale);
    if (!a->ck || !a->inp || !a->out)
        return cli_usage_exit("run needs --checkpoint DIR --inputs FILE --out FILE");
    if (a->steps > 0 && cli_opt_str(&o, "repeat", NULL))
        return cli_usage_exit("--repeat N times one forward; --steps N runs the sampler: give one "
                              "of them");
    int cached = 0;
    if (mdt_cache_spec_check(a->cache, &cached) != MDT_OK)
        return cli_usage_exit("%s", mdt_last_error());
    if (cached && a->steps == 0)
        return cli_usage_exit(
            "--cache caches across the steps of a generation: it needs --steps N");
    return 0;
}

/* --out and --report replace none of the files the run reads (rank 0 checks: it writes them). */
static mdt_status outputs_not_inputs(const run_args *a) {
    static char paths[16][4096];
    const char *in[17] = {a->inp};
    int n = 1;
    double scale;
    for (int i = 0; i < a->nlora; i++) /* a spec whose scale is malformed: the load says so */
        if (cli_lora_spec(a->lora[i], paths[i], sizeof paths[i], &scale) == MDT_OK)
            in[n++] = paths[i];
    const mdt_status st = mdt_output_not_input("--out", a->out, a->ck, in, n);
    return st != MDT_OK ? st : mdt_output_not_input("--report", a->report, a->ck, in, n);
}

int cmd_run(int argc, char **argv) {
    run_args a = {0};
    int rc = parse_run(argc, argv, &a);
    if (rc)
        return rc;
    mdt_mesh *mesh = NULL;
    mdt_model *m = NULL;
    mdt_tensor_set *in = NULL, *res = NULL;
    mdt_run_stats *stats = NULL;
    const mdt_layout lay = cli_mesh_layout(&a.l);
    mdt_status st = mdt_mesh_create_world(&lay, &mesh);
    if (st != MDT_OK)
        return cli_fail_exit(st); /* same verdict on every rank: nothing to agree on */
    /* rank 0 writes the outputs: it finds out now, not after the compute, that it cannot */
    st = MDT_OK;
    if (cli_rank == 0 && (st = mdt_outputs_check(a.out, a.report)) == MDT_OK)
        st = outputs_not_inputs(&a);
    st = mdt_mesh_agree(mesh, st);
    if (st == MDT_OK)
        st = mdt_device_select(mesh, a.l.device, a.l.dtype, a.l.comm);
    if (st != MDT_OK)
        goto done;
    /* the inputs first: the memory check counts their activations before the weights load */
    st = mdt_mesh_agree(mesh, mdt_tensor_set_load(a.inp, &in));
    if (st != MDT_OK)
        goto done;
    double load_s = 0, lora_s = 0;
    st = cli_load_model(&a.l, a.ck, mesh, in, &m, &load_s);
    if (st == MDT_OK && a.nlora)
        st = cli_load_loras(m, a.lora, a.nlora, &lora_s);
    if (st == MDT_OK)
        st = mdt_tensor_set_create(&res);
    if (st != MDT_OK)
        goto done;
    const int progress = !a.quiet && cli_rank == 0 && a.steps > 0 && isatty(STDERR_FILENO);
    int printed = 0;
    mdt_sample_params sp = mdt_sample_params_default();
    sp.steps = (int)a.steps, sp.repeat = (int)a.repeat, sp.step_timeout = (double)a.step_timeout;
    sp.guidance_scale = a.guidance_scale, sp.cache = a.cache;
    sp.on_step = progress ? on_step : NULL, sp.user = &printed;
    st = mdt_sample(m, in, &sp, res, &stats);
    if (printed)
        fprintf(stderr, "\n");
    if (st != MDT_OK)
        goto done;
    if (cli_rank == 0) { /* the output and the report: both or neither */
        char *txt = NULL;
        st = a.report ? mdt_run_report_json(m, stats, load_s, &txt) : MDT_OK;
        if (st == MDT_OK)
            st = mdt_outputs_write(a.out, res, a.report, txt);
        free(txt);
    }
    st = mdt_mesh_agree(mesh, st);
    if (st != MDT_OK)
        goto done;
    if (cli_rank == 0 && !a.quiet)
        print_device(m);
    st = mdt_mesh_agree(mesh, st);
    if (st == MDT_OK && !a.quiet && cli_rank == 0) {
        print_plan(m, a.l.order, stats, load_s, a.out);
        print_adapters(m, lora_s);
        print_cache(stats, a.cache);
    }
done:
    if (st != MDT_OK && mdt_mesh_peers_stuck(mesh)) {
        /* this rank failed inside a step while its peers wait in a collective: no agreement is
         * possible, so report from here and end the whole job */
        cli_print_error(mdt_last_error());
        cli_abort_job(1);
    }
    mdt_run_stats_free(stats);
    mdt_tensor_set_free(res);
    mdt_tensor_set_free(in);
    mdt_model_free(m);
    mdt_mesh_free(mesh);
    return st == MDT_OK ? 0 : cli_fail_exit(st);
}
