/*
 * sampler.c — the Euler flow-matching sampler and the repeated forward of a benchmark
 * (meshdit.h: mdt_sample), with the step watchdog, the per-step counters and the run
 * statistics gathered to world rank 0.
 */
#define _POSIX_C_SOURCE 200809L
#include "core/steal.h"
#include "core/testhooks.h"
#include "io/checkpoint.h"
#include "models/cache.h"
#include "sampler/branches.h"
#include "sampler/run_stats.h"
#include "models/model.h"
#include "tensor/tensor.h"

#include <mpi.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

mdt_sample_params mdt_sample_params_default(void) {
    return (mdt_sample_params){.steps = 0, .repeat = 1, .step_timeout = 0.0};
}

static long max_rss_kib(void) {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return ru.ru_maxrss;
}

/* This rank's facts of the last step, gathered to world rank 0. Collective over the world. */
static mdt_status gather_stats(const mdt_model *m, const mdt_counters *per, const int64_t *coll,
                               const int64_t *group, int64_t world_colls, const double *wait,
                               double step_s, mdt_run_stats *s) {
    mdt_mesh *mesh = m->mesh;
    mdt_rank_facts mine = {0};
    const int64_t heads = mdt_model_dims_of(m).heads;
    mine.pub = (mdt_rank_stats){.rank = mesh ? mesh->world_rank : 0,
                                .cfg = mesh ? mesh->c : 0,
                                .tp = mesh ? mesh->t : 0,
                                .ring = mesh ? mesh->r : 0,
                                .ulysses = mesh ? mesh->u : 0,
                                .cp_index = mesh ? mesh->cp_index : 0,
                                .node_rank = mesh ? mesh->node_rank : 0,
                                .node_size = mesh ? mesh->node_size : 1,
                                .heads_local = heads / (mesh ? mesh->T : 1),
                                .weight_bytes = m->weight_bytes,
                                .peak_bytes = mdt_mem_peak(),
                                .max_rss_kib = max_rss_kib(),
                                .bytes_read = m->bytes_read,
                                .flops_linear = per->flops[MDT_FLOP_LINEAR],
                                .flops_attn = per->flops[MDT_FLOP_ATTN],
                                .flops_other = per->flops[MDT_FLOP_OTHER],
                                .seconds_linear = per->seconds[MDT_FLOP_LINEAR],
                                .seconds_attn = per->seconds[MDT_FLOP_ATTN],
                                .seconds_other = per->seconds[MDT_FLOP_OTHER],
                                .attn_calls = per->attn_calls,
                                .attn_query_rows = per->attn_query_rows,
                                .attn_kv_rows = per->attn_kv_rows,
                                .bytes_tp = group[MDT_GROUP_TP],
                                .bytes_ring = group[MDT_GROUP_RING],
                                .bytes_ulysses = group[MDT_GROUP_ULYSSES],
                                .bytes_cfg = group[MDT_GROUP_CFG],
                                .bytes_cp = group[MDT_GROUP_CP],
                                .ring_compute_s = per->ring_compute_s,
                                .ring_wait_s = per->ring_wait_s,
                                .prep_s = per->prep_s,
                                .world_collectives = world_colls};
    if (mesh)
        memcpy(mine.host, mesh->host, sizeof mine.host);
    memcpy(mine.coll, coll, sizeof mine.coll);
    memcpy(mine.wait_s, wait, sizeof mine.wait_s);
    mine.step_s = step_s;
    double *steal = mdt_run_stats_steal(s);
    mine.steal_s = steal[s->steps - 1];
    const int world = mesh ? mesh->world_size : 1;
    s->facts = calloc((size_t)world, sizeof *s->facts);
    /* every rank learns whether all could allocate before any enters the gather */
    MDT_TRY(mdt_mesh_agree(mesh, s->facts ? MDT_OK : MDT_FAIL(MDT_E_NOMEM, "out of memory")));
    if (mesh && MPI_Gather(&mine, (int)sizeof mine, MPI_BYTE, s->facts, (int)sizeof mine, MPI_BYTE,
                           0, mesh->world) != MPI_SUCCESS)
        return MDT_FAIL(MDT_E_MPI, "run statistics: MPI_Gather failed");
    s->nranks = mine.pub.rank == 0 ? world : 1;
    s->facts[0] = mine; /* rank 0's own; elsewhere the only entry */
    /* per forward the most any rank lost to the hypervisor: the step waits for the slowest
     * (-1, unknown, loses to any reading) */
    const int root = mine.pub.rank == 0;
    if (mesh && MPI_Reduce(root ? MPI_IN_PLACE : steal, root ? steal : NULL, s->steps, MPI_DOUBLE,
                           MPI_MAX, 0, mesh->world) != MPI_SUCCESS)
        return MDT_FAIL(MDT_E_MPI, "run statistics: MPI_Reduce failed");
    return MDT_OK;
}

/* Under cfg 2 each group's cache saw only its own branch: the two logs, traded over the cfg axis
 * (each entry's numbers as the bits of doubles), become one log on every rank, step by step
 * (cond, then uncond, as cfg 1 runs them), so the report is the same as cfg 1's. Collective. */
static mdt_status merge_cache_logs(mdt_model *m, mdt_cache *c) {
    mdt_mesh *mesh = m->mesh;
    if (!mesh || mesh->C != 2)
        return MDT_OK;
    enum { F = 5 }; /* doubles per entry: skipped, diff, blocks run, blocks skipped, FLOPs saved */
    const int64_t n = c->nlog, nf = 2 * F * n;
    float *mine = malloc(sizeof(float) * (size_t)(nf > 0 ? nf : 1));
    float *both = malloc(sizeof(float) * (size_t)(2 * nf > 0 ? 2 * nf : 1));
    mdt_cache_step *log = malloc(sizeof *log * (size_t)(2 * n > 0 ? 2 * n : 1));
    mdt_status st = mine && both && log ? MDT_OK : MDT_FAIL(MDT_E_NOMEM, "out of memory");
    for (int64_t i = 0; st == MDT_OK && i < n; i++) {
        const mdt_cache_step *e = &c->log[i];
        const double v[F] = {e->skipped, e->diff, (double)e->blocks_run, (double)e->blocks_skip,
                             e->flops_saved};
        memcpy(mine + i * 2 * F, v, sizeof v);
    }
    if (st == MDT_OK)
        st = mdt_allgather_floats(mesh, MDT_GROUP_CFG, mine, both, nf);
    for (int g = 0; st == MDT_OK && g < 2; g++)
        st = mdt_cache_select(c, g ? "uncond" : "cond"); /* the branch names of cfg 1 */
    for (int64_t i = 0; st == MDT_OK && i < n; i++)
        for (int g = 0; g < 2; g++) {
            double v[F];
            memcpy(v, both + g * nf + i * 2 * F, sizeof v);
            log[2 * i + g] = (mdt_cache_step){.branch = g,
                                              .skipped = (int)v[0],
                                              .diff = v[1],
                                              .blocks_run = (int64_t)v[2],
                                              .blocks_skip = (int64_t)v[3],
                                              .flops_saved = v[4]};
        }
    if (st == MDT_OK) {
        free(c->log);
        c->log = log, c->nlog = c->caplog = 2 * n, log = NULL;
    }
    free(mine), free(both), free(log);
    return st;
}

mdt_status mdt_sample(mdt_model *m, mdt_tensor_set *in, const mdt_sample_params *p,
                      mdt_tensor_set *outputs, mdt_run_stats **stats) {
    if (stats)
        *stats = NULL;
    const mdt_family *fam = m->fam;
    mdt_mesh *mesh = m->mesh;
    const int steps = p->steps, nsteps = steps > 0 ? steps : p->repeat;
    if (steps < 0 || nsteps < 1)
        return MDT_FAIL(MDT_E_INVALID, "sample: steps %d, repeat %d", steps, p->repeat);
    if (mdt_tensor_set_count(outputs) != 0)
        return MDT_FAIL(MDT_E_INVALID, "sample: the outputs set must be empty");
    /* [2, nsteps]: each forward's wall seconds, then the seconds the hypervisor took from this
     * rank's vCPU during it (-1: unknown; read only for the statistics) */
    double *times = calloc(2 * (size_t)nsteps, sizeof(double));
    double *steal = times ? times + nsteps : NULL;
    mdt_counters per = {0};
    int64_t coll[MDT_COLL_KIND_COUNT] = {0}, group[MDT_GROUP_COUNT] = {0}, world_colls = 0;
    double wait[MDT_WAIT_BUCKETS] = {0}; /* the last step's blocked seconds */
    mdt_tensor *lat = NULL, *tst = NULL;
    mdt_tensor_set *res = NULL;
    mdt_branches br;
    if (!times)
        return MDT_FAIL(MDT_E_NOMEM, "out of memory");
    if (steps > 0) {
        lat = mdt_tensor_set_get(in, fam->latent_input);
        tst = mdt_tensor_set_get(in, fam->timestep_input);
        mdt_status cs = !lat || !tst
                            ? MDT_FAIL(MDT_E_INVALID, "inputs: --steps needs '%s' and '%s'",
                                       fam->latent_input, fam->timestep_input)
                        : !mdt_dtype_is_float(lat->dtype)
                            ? MDT_FAIL(MDT_E_INVALID,
                                       "inputs: --steps integrates '%s' in f32: it must be a float "
                                       "tensor (F32, BF16, F16, F64), not %s",
                                       fam->latent_input, mdt_dtype_name(lat->dtype))
                            : MDT_OK;
        /* the sampler's state in f32, converted once (the latent is integrated and returned in
         * f32; the timestep is written each step, so any number dtype will do) */
        if (cs == MDT_OK)
            cs = mdt_tensor_set_to_f32(in, lat);
        if (cs == MDT_OK && (cs = mdt_tensor_set_to_f32(in, tst)) == MDT_E_UNSUPPORTED)
            cs = MDT_FAIL(MDT_E_INVALID, "inputs: --steps: '%s' has dtype %s, not a number",
                          fam->timestep_input, mdt_dtype_name(tst->dtype));
        if (cs != MDT_OK) {
            free(times);
            return cs;
        }
    }
    /* conditioning in the latent (a per-token timestep's clean tokens, an edit's condition
     * images): its elements stay as given, as the pipeline puts the condition back before each
     * forward or never steps it */
    unsigned char *keep = NULL;
    float *x0 = NULL;
    if (tst && fam->clean_elements) {
        const int64_t n = mdt_tensor_numel(lat);
        keep = calloc((size_t)n + 1, 1);
        x0 = malloc(sizeof(float) * (size_t)n + 1);
        if (!keep || !x0) {
            free(keep), free(x0), free(times);
            return MDT_FAIL(MDT_E_NOMEM, "out of memory");
        }
        fam->clean_elements(m->impl, in, lat, tst, keep);
        if (memchr(keep, 1, (size_t)n)) {
            memcpy(x0, lat->data, sizeof(float) * (size_t)n);
        } else { /* no conditioning in this latent */
            free(keep), free(x0);
            keep = NULL, x0 = NULL;
        }
    }
    /* guidance's two branches, or the cfg axis splitting the batch; every rank reads the same
     * inputs, so every rank reaches the same verdict */
    mdt_status st = mdt_branches_init(&br, m, in, p->guidance_scale, steps);
    if (st != MDT_OK) {
        free(keep), free(x0), free(times);
        return st;
    }
    /* the step cache of this run: a generation's state, one branch per guidance branch */
    mdt_cache *cache = NULL;
    mdt_cache_spec spec;
    st = mdt_cache_spec_parse(p->cache, &spec);
    if (st == MDT_OK && spec.kind != MDT_CACHE_OFF && br.split)
        st = MDT_FAIL(MDT_E_UNSUPPORTED,
                      "--cache with cfg 2 and no guidance: each cfg group would decide on its "
                      "half of the batch, where one rank decides on the whole (run cfg 1)");
    if (st == MDT_OK && spec.kind != MDT_CACHE_OFF)
        st = mdt_cache_create(&spec, &cache);
    if (st == MDT_OK && cache)
        st = mdt_cache_select(cache, "cond");
    if (st != MDT_OK) {
        mdt_cache_free(cache);
        mdt_branches_free(&br);
        free(keep), free(x0), free(times);
        return st;
    }
    m->cache = cache;
    /* the step watchdog: each forward arms it (mdt_model_forward), with this run's bound */
    const double saved_timeout = m->step_timeout;
    if (p->step_timeout > 0)
        mdt_model_set_step_timeout(m, p->step_timeout);
    /* the vCPU's steal, read once a forward for the statistics (a few microseconds): forward i's
     * counts from forward i-1's end, the sampler's update between them included */
    const char *proc = mdt_test_hooks_get()->proc_root; /* the test seam */
    if (!proc)
        proc = "";
    mdt_steal_mark mark;
    if (stats)
        mdt_steal_mark_now(proc, &mark);
    for (int i = 0; i < nsteps && st == MDT_OK; i++) {
        /* flow-matching Euler: sigma_i = 1 - i/N, x <- x + (sigma_{i+1} - sigma_i) v */
        double sig = 1.0 - (double)i / (double)nsteps, sig_next = 1.0 - (double)(i + 1) / nsteps;
        const double tscale = fam->timestep_scale > 0 ? fam->timestep_scale : 1.0;
        /* sigma in the model's units; a per-token timestep ([B, S], Wan 2.2 TI2V) keeps its
         * zeros: those are conditioning tokens (the clean first frame), never noised */
        if (tst)
            for (int64_t b = 0; b < mdt_tensor_numel(tst); b++)
                if (tst->ndim < 2 || ((float *)tst->data)[b] != 0.0f)
                    ((float *)tst->data)[b] = (float)(sig * tscale);
        mdt_tensor_set_free(res);
        res = NULL;
        /* the last of the plain forwards writes straight into the caller's set */
        const int direct = steps == 0 && i == nsteps - 1 && !mdt_branches_active(&br);
        if (!direct && (st = mdt_tensor_set_create(&res)) != MDT_OK)
            break;
        int64_t c0[MDT_COLL_KIND_COUNT] = {0}, gb0[MDT_GROUP_COUNT] = {0}, w0 = 0;
        double ws0[MDT_WAIT_BUCKETS] = {0};
        if (mesh) {
            memcpy(c0, mesh->bytes_sent, sizeof c0);
            memcpy(ws0, mesh->wait_s, sizeof ws0);
            memcpy(gb0, mesh->group_bytes, sizeof gb0);
            w0 = mesh->world_collectives;
        }
        mdt_counters_reset();
        /* no barrier first: the previous forward's agreement (or the load's) left every rank
         * together */
        double ts = mdt_now();
        if (mdt_branches_active(&br)) {
            /* both branches (in turn, or one per cfg group and one exchange), or this group's
             * part of the batch: the prediction, the same on every rank, is the step's output */
            mdt_tensor *o = NULL;
            st = mdt_branches_step(&br, m, in, i);
            if (st == MDT_OK)
                st = mdt_tensor_set_add(res, fam->output, MDT_F32, br.out_ndim, br.out_shape, &o);
            if (st == MDT_OK)
                memcpy(o->data, br.v, sizeof(float) * (size_t)br.nv);
        } else {
            st = mdt_model_forward(m, in, direct ? outputs : res); /* guarded, watched, agreed */
        }
        times[i] = mdt_now() - ts;
        steal[i] = stats ? mdt_steal_since(proc, &mark) : -1.0;
        per = *mdt_counters_get();
        for (int k = 0; mesh && k < MDT_WAIT_BUCKETS; k++)
            wait[k] = mesh->wait_s[k] - ws0[k];
        for (int k = 0; mesh && k < MDT_COLL_KIND_COUNT; k++)
            coll[k] = mesh->bytes_sent[k] - c0[k];
        for (int g = 0; mesh && g < MDT_GROUP_COUNT; g++)
            group[g] = mesh->group_bytes[g] - gb0[g];
        world_colls = mesh ? mesh->world_collectives - w0 : 0;
        if (st != MDT_OK && steps > 0) /* say which step: its input is ours, not the user's */
            st = mdt_fail_prefix(st, "step %d of %d", i + 1, nsteps);
        if (st != MDT_OK)
            break;
        /* the Euler update runs on the gathered output, the same bits on every rank, so every
         * rank reaches the same verdict on it without agreeing */
        if (lat) {
            mdt_tensor *v = mdt_tensor_set_get(res, fam->output);
            if (!v || mdt_tensor_numel(v) != mdt_tensor_numel(lat)) {
                char s1[96] = "(none)", s2[96];
                if (v)
                    mdt_tensor_shape_str(v, s1, sizeof s1);
                st = MDT_FAIL(MDT_E_INVALID,
                              "the model output '%s' %s does not match the latent '%s' %s, so "
                              "it cannot be integrated (--steps needs a velocity of the latent's "
                              "shape)",
                              fam->output, s1, fam->latent_input,
                              mdt_tensor_shape_str(lat, s2, sizeof s2));
                break;
            }
            float *x = lat->data;
            const float *vv = v->data;
            for (int64_t j = 0; j < mdt_tensor_numel(lat); j++)
                x[j] = keep && keep[j] ? x0[j] : x[j] + (float)(sig_next - sig) * vv[j];
            const int64_t bad = mdt_first_nonfinite(x, mdt_tensor_numel(lat));
            if (bad >= 0) {
                st = MDT_FAIL(MDT_E_NUMERIC,
                              "step %d of %d: the sampler's latent went non-finite at element "
                              "%lld (the model output times the step size overflowed f32)",
                              i + 1, nsteps, (long long)bad);
                break;
            }
        }
        if (p->on_step)
            p->on_step(p->user, i + 1, nsteps, times[i]);
    }
    m->step_timeout = saved_timeout;
    m->cache = NULL;
    free(keep), free(x0);
    /* a plain forward split between the cfg groups: its gathered output is the result */
    if (st == MDT_OK && !lat && mdt_branches_active(&br))
        st = mdt_tensor_set_add_copy(outputs, fam->output, mdt_tensor_set_get(res, fam->output));
    mdt_branches_free(&br);
    mdt_tensor_set_free(res);
    /* the sampler's result is the final latent, under the model's output name */
    if (st == MDT_OK && lat)
        st = mdt_tensor_set_add_copy(outputs, fam->output, lat);
    st = mdt_mesh_agree(mesh, st); /* a local failure between forwards (out of memory) */
    if (st != MDT_OK || !stats) {
        mdt_cache_free(cache);
        free(times);
        return st;
    }
    mdt_run_stats *s = calloc(1, sizeof *s);
    double *sorted = malloc((size_t)nsteps * sizeof *sorted);
    /* the statistics' collectives follow: every rank learns whether all could allocate */
    st = mdt_mesh_agree(mesh, s && sorted ? MDT_OK : MDT_FAIL(MDT_E_NOMEM, "out of memory"));
    if (st != MDT_OK || !s || !sorted) {
        mdt_cache_free(cache);
        free(times), free(s), free(sorted);
        return st;
    }
    s->cache = cache; /* its decisions go to the report */
    s->steps = nsteps, s->sampled = steps > 0;
    const double last_s = times[nsteps - 1]; /* the step the other counters are of */
    s->step_s = times;                       /* in order; the median sorts a copy */
    memcpy(sorted, times, (size_t)nsteps * sizeof *sorted);
    s->step_median_s = mdt_median(sorted, nsteps);
    free(sorted);
    if (cache && (st = merge_cache_logs(m, cache)) != MDT_OK) {
        mdt_run_stats_free(s);
        return st;
    }
    if ((st = gather_stats(m, &per, coll, group, world_colls, wait, last_s, s)) != MDT_OK) {
        mdt_run_stats_free(s);
        return st;
    }
    *stats = s;
    return MDT_OK;
}

int64_t mdt_run_stats_cache_forwards(const mdt_run_stats *s) {
    return s && s->cache ? s->cache->nlog : 0;
}

int mdt_run_stats_cache_skipped(const mdt_run_stats *s, int64_t i) {
    if (!s || !s->cache || i < 0 || i >= s->cache->nlog)
        return -1;
    return s->cache->log[i].skipped;
}

void mdt_run_stats_free(mdt_run_stats *s) {
    if (!s)
        return;
    mdt_cache_free(s->cache);
    free(s->facts);
    free(s->step_s);
    free(s);
}
