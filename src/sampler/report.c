/*
 * report.c — the run statistics of mdt_sample and the run report as JSON (meshdit.h:
 * mdt_run_stats_*, mdt_run_report_json): the layout and device, the step times, every rank's
 * facts and rank 0's view of each tensor. The keys are a contract (DESIGN.md §2, docs).
 */
#include "sampler/run_stats.h"
#include "backend/backend.h"
#include "models/cache.h"
#include "models/lora.h"
#include "models/model.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

int mdt_run_stats_steps(const mdt_run_stats *s) { return s->steps; }
int mdt_run_stats_sampled(const mdt_run_stats *s) { return s->sampled; }
double mdt_run_stats_step_seconds(const mdt_run_stats *s) { return s->step_median_s; }
int mdt_run_stats_rank_count(const mdt_run_stats *s) { return s->nranks; }

double *mdt_run_stats_steal(const mdt_run_stats *s) {
    return s->step_s ? s->step_s + s->steps : NULL;
}

const mdt_rank_stats *mdt_run_stats_rank(const mdt_run_stats *s, int i) {
    return i >= 0 && i < s->nranks ? &s->facts[i].pub : NULL;
}

static void add_rank(cJSON *ranks, const mdt_rank_facts *rf) {
    const mdt_rank_stats *f = &rf->pub;
    cJSON *rk = cJSON_CreateObject();
    cJSON_AddItemToArray(ranks, rk);
    cJSON_AddNumberToObject(rk, "rank", f->rank);
    cJSON *co = cJSON_AddObjectToObject(rk, "coords");
    cJSON_AddNumberToObject(co, "cfg", f->cfg);
    cJSON_AddNumberToObject(co, "tp", f->tp);
    cJSON_AddNumberToObject(co, "ring", f->ring);
    cJSON_AddNumberToObject(co, "ulysses", f->ulysses);
    cJSON_AddNumberToObject(co, "cp_index", f->cp_index);
    cJSON *no = cJSON_AddObjectToObject(rk, "node");
    cJSON_AddStringToObject(no, "host", rf->host);
    cJSON_AddNumberToObject(no, "rank", f->node_rank);
    cJSON_AddNumberToObject(no, "ranks", f->node_size);
    cJSON_AddNumberToObject(rk, "heads_local", (double)f->heads_local);
    cJSON_AddNumberToObject(rk, "weight_bytes", (double)f->weight_bytes);
    cJSON_AddNumberToObject(rk, "peak_bytes", (double)f->peak_bytes);
    cJSON_AddNumberToObject(rk, "max_rss_kib", (double)f->max_rss_kib);
    cJSON_AddNumberToObject(rk, "bytes_read", (double)f->bytes_read);
    cJSON *fl = cJSON_AddObjectToObject(rk, "flops_per_step");
    cJSON_AddNumberToObject(fl, "linear", f->flops_linear);
    cJSON_AddNumberToObject(fl, "attention", f->flops_attn);
    cJSON_AddNumberToObject(fl, "other", f->flops_other);
    cJSON *ks = cJSON_AddObjectToObject(rk, "kernel_seconds_per_step");
    cJSON_AddNumberToObject(ks, "linear", f->seconds_linear);
    cJSON_AddNumberToObject(ks, "attention", f->seconds_attn);
    cJSON_AddNumberToObject(ks, "other", f->seconds_other);
    cJSON *at = cJSON_AddObjectToObject(rk, "attention_per_step");
    cJSON_AddNumberToObject(at, "calls", (double)f->attn_calls);
    cJSON_AddNumberToObject(at, "query_rows_x_heads", (double)f->attn_query_rows);
    cJSON_AddNumberToObject(at, "kv_rows_x_heads", (double)f->attn_kv_rows);
    cJSON *cb = cJSON_AddObjectToObject(rk, "bytes_sent_per_step");
    for (int k = 0; k < MDT_COLL_KIND_COUNT; k++)
        cJSON_AddNumberToObject(cb, mdt_coll_kind_name((mdt_coll_kind)k), (double)rf->coll[k]);
    cJSON *ga = cJSON_AddObjectToObject(rk, "bytes_sent_per_step_by_axis");
    const int64_t axis[MDT_GROUP_COUNT] = {f->bytes_tp, f->bytes_ring, f->bytes_ulysses,
                                           f->bytes_cfg, f->bytes_cp};
    for (int g = 0; g < MDT_GROUP_COUNT; g++)
        cJSON_AddNumberToObject(ga, mdt_group_name((mdt_group)g), (double)axis[g]);
    cJSON *rg = cJSON_AddObjectToObject(rk, "ring_per_step");
    cJSON_AddNumberToObject(rg, "ring_compute_seconds", f->ring_compute_s);
    cJSON_AddNumberToObject(rg, "ring_wait_seconds", f->ring_wait_s);
    cJSON_AddNumberToObject(rk, "world_collectives_per_step", (double)f->world_collectives);
    /* the last step, whose counters these all are: its wall time and the seconds it was blocked
     * in each collective kind and in the world's agreements (what compute did not hide) */
    cJSON_AddNumberToObject(rk, "last_step_seconds", rf->step_s);
    cJSON *ws = cJSON_AddObjectToObject(rk, "wait_seconds_last_step");
    for (int k = 0; k < MDT_WAIT_BUCKETS; k++)
        cJSON_AddNumberToObject(
            ws, k == MDT_WAIT_WORLD ? "agreement" : mdt_coll_kind_name((mdt_coll_kind)k),
            rf->wait_s[k]);
    if (rf->steal_s >= 0) /* the hypervisor's, from this rank's vCPU (null: not known) */
        cJSON_AddNumberToObject(rk, "steal_seconds_last_step", rf->steal_s);
    else
        cJSON_AddNullToObject(rk, "steal_seconds_last_step");
}

/* The step cache's decisions: the spec, then per forward its branch, the statistic, the blocks
 * run and skipped and the FLOPs the skip saved (this rank's; the decisions are every rank's). */
static void add_cache(cJSON *r, const mdt_cache *c) {
    char *spec = malloc(MDT_CACHE_SPEC_MAX + 1);
    cJSON *o = cJSON_AddObjectToObject(r, "cache");
    if (spec) /* read back by --cache as the same cache */
        mdt_cache_spec_text(&c->spec, spec, MDT_CACHE_SPEC_MAX + 1);
    cJSON_AddStringToObject(o, "spec", spec ? spec : "(out of memory)");
    free(spec);
    const int64_t skipped = mdt_cache_skipped(c);
    double saved = 0;
    for (int64_t i = 0; i < c->nlog; i++)
        saved += c->log[i].flops_saved;
    cJSON_AddNumberToObject(o, "forwards", (double)c->nlog);
    cJSON_AddNumberToObject(o, "skipped", (double)skipped);
    cJSON_AddNumberToObject(o, "computed", (double)(c->nlog - skipped));
    cJSON_AddNumberToObject(o, "flops_saved", saved);
    /* this rank's, the most it kept at once (a schedule's end frees MagCache's residual) */
    cJSON_AddNumberToObject(o, "state_bytes", (double)c->peak_bytes);
    cJSON *steps = cJSON_AddArrayToObject(o, "forwards_log");
    const int per = c->nbranches > 0 ? c->nbranches : 1; /* forwards per sampler step */
    for (int64_t i = 0; i < c->nlog; i++) {
        const mdt_cache_step *e = &c->log[i];
        cJSON *t = cJSON_CreateObject();
        cJSON_AddItemToArray(steps, t);
        const int64_t step = i / per;
        cJSON_AddNumberToObject(t, "step", (double)step);
        cJSON_AddStringToObject(t, "branch", c->br[e->branch].name);
        cJSON_AddBoolToObject(t, "skipped", e->skipped);
        if (isfinite(e->diff))
            cJSON_AddNumberToObject(t, "diff", e->diff);
        else
            cJSON_AddNullToObject(t, "diff");
        cJSON_AddNumberToObject(t, "blocks_computed", (double)e->blocks_run);
        cJSON_AddNumberToObject(t, "blocks_skipped", (double)e->blocks_skip);
        cJSON_AddNumberToObject(t, "flops_saved", e->flops_saved);
    }
}

mdt_status mdt_run_report_json(const mdt_model *m, const mdt_run_stats *s, double load_seconds,
                               char **json) {
    *json = NULL;
    const mdt_mesh *mesh = m->mesh;
    char order[64] = "tp,ring,ulysses";
    if (mesh)
        mdt_mesh_order_str(mesh->order, order, sizeof order);
    cJSON *r = cJSON_CreateObject();
    cJSON_AddStringToObject(r, "model", m->fam->name);
    cJSON_AddNumberToObject(r, "world", mesh ? mesh->world_size : 1);
    cJSON *lay = cJSON_AddObjectToObject(r, "layout");
    cJSON_AddNumberToObject(lay, "cfg", mesh ? mesh->C : 1);
    cJSON_AddNumberToObject(lay, "tp", mesh ? mesh->T : 1);
    cJSON_AddNumberToObject(lay, "ring", mesh ? mesh->R : 1);
    cJSON_AddNumberToObject(lay, "ulysses", mesh ? mesh->U : 1);
    cJSON_AddStringToObject(lay, "mesh_order", order);
    mdt_device_info dev;
    mdt_device_info_get(&dev);
    cJSON_AddStringToObject(r, "device", dev.backend);
    cJSON_AddStringToObject(r, "weights_dtype", dev.bf16 ? "bf16" : "f32");
    cJSON_AddStringToObject(r, "cpu_kernels", dev.cpu_kernels);
    cJSON_AddStringToObject(r, "cpu_gemm", dev.cpu_gemm);
    if (dev.bf16_why && dev.bf16_why[0])
        cJSON_AddStringToObject(r, "bf16_path", dev.bf16_why);
    cJSON_AddStringToObject(r, "gemm_operands", dev.bf16_operands ? "bf16" : "f32");
    cJSON_AddNumberToObject(r, "load_seconds", load_seconds);
    cJSON_AddNumberToObject(r, "step_seconds_median", s->step_median_s);
    cJSON_AddNumberToObject(r, "steps", s->steps);
    cJSON *each = cJSON_AddArrayToObject(r, "step_seconds"); /* rank 0's, in order: the spread */
    for (int i = 0; each && s->step_s && i < s->steps; i++)
        cJSON_AddItemToArray(each, cJSON_CreateNumber(s->step_s[i]));
    /* per forward the most seconds the hypervisor took from any rank's vCPU (/proc/stat's
     * steal, 10 ms ticks; null: not known): a step slowed by a shared host, not by the mesh */
    cJSON *stl = cJSON_AddArrayToObject(r, "steal_seconds");
    const double *steal = mdt_run_stats_steal(s);
    for (int i = 0; stl && steal && i < s->steps; i++)
        cJSON_AddItemToArray(stl,
                             steal[i] >= 0 ? cJSON_CreateNumber(steal[i]) : cJSON_CreateNull());
    mdt_lora_report(m, r); /* the adapters fused into the weights */
    if (s->cache)
        add_cache(r, s->cache);
    cJSON *ranks = cJSON_AddArrayToObject(r, "ranks");
    for (int i = 0; i < s->nranks; i++)
        add_rank(ranks, &s->facts[i]);
    if (!mesh || mesh->world_rank == 0) { /* per tensor: style, local shape, bytes read */
        cJSON *tens = cJSON_AddArrayToObject(r, "tensors_rank0");
        for (int i = 0; i < m->table.n; i++) {
            const mdt_weight_spec *w = &m->table.specs[i];
            cJSON *t = cJSON_CreateObject();
            cJSON_AddItemToArray(tens, t);
            cJSON_AddStringToObject(t, "name", w->name);
            cJSON_AddStringToObject(t, "style", mdt_tp_style_name(w->style));
            cJSON *ls = cJSON_AddArrayToObject(t, "local_shape");
            for (int d = 0; d < w->ndim; d++)
                cJSON_AddItemToArray(ls, cJSON_CreateNumber((double)m->ws[i].local[d]));
            cJSON_AddNumberToObject(t, "bytes_read", (double)m->ws[i].bytes_read);
        }
    }
    char *txt = cJSON_Print(r);
    cJSON_Delete(r);
    if (!txt)
        return MDT_FAIL(MDT_E_NOMEM, "out of memory");
    *json = malloc(strlen(txt) + 1); /* the caller frees it with free() */
    if (*json)
        memcpy(*json, txt, strlen(txt) + 1);
    cJSON_free(txt);
    return *json ? MDT_OK : MDT_FAIL(MDT_E_NOMEM, "out of memory");
}
