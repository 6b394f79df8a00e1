/*
 * memory.c — see memory.h: the memory model of a run (weights and activations per rank, the
 * coefficients fitted to measured peaks) and the checks against a limit per rank.
 */
#include "plan/memory.h"

#include "backend/backend.h"
#include "comm/mesh.h"
#include "core/core.h"
#include "core/sysmem.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

double mdt_act_bytes(const mdt_model *m, int T, int R, int U, int64_t batch, int64_t S, double b) {
    const mdt_model_dims md = mdt_model_dims_of(m);
    const double A = (double)(md.heads * md.head_dim), D = (double)md.hidden;
    /* an FFN T does not divide splits unevenly: the largest rank's, ceil(F / T) features */
    const double F = (double)(md.ffn % T ? (md.ffn / T + 1) * T : md.ffn);
    const int64_t P = (int64_t)R * U, rows = (S + P - 1) / P; /* the largest CP chunk */
    const double per_row = 10.0 * D + (4.0 * A + 1.5 * F) / T + (U > 1 ? 14.0 * A / T : 0.0) +
                           (R > 1 ? 14.0 * A / T : 0.0);
    return (double)batch * (double)rows * per_row * b;
}

mdt_run_memory mdt_run_memory_at(const mdt_model *m, int T, int R, int U,
                                 const mdt_run_inputs *in) {
    mdt_run_memory r = {0, 0};
    double weights = 0, widest = 0;
    for (int i = 0; i < m->table.n; i++) {
        const mdt_weight_spec *w = &m->table.specs[i];
        int64_t loc[2];
        mdt_shard_local_shape(w, T, 0, loc); /* coordinate 0: the largest */
        const double n = (double)loc[0] * (w->ndim > 1 ? (double)loc[1] : 1.0);
        const int lin = m->table.lin[i] != NULL;
        weights += n * (in->bf16 && lin ? 2.0 : 4.0);
        if (lin && n > widest)
            widest = n;
    }
    mdt_error_clear(); /* a degree the model cannot take is the caller's to check */
    r.weights = (int64_t)weights;
    if (!in->device_acts) {
        double a = mdt_act_bytes(m, T, R, U, in->batch, in->rows, 4.0) + (double)in->input_bytes +
                   3.0 * (double)in->latent_f32 + 2.0 * 1048576.0;
        if (R * U > 1) /* this CP rank's chunk of each split input */
            a += (double)in->split_f32 / (double)(R * U);
        if (in->bf16) /* the panel a bf16 weight is widened into, at most 64 MiB */
            a += fmin(4.0 * widest, 64.0 * 1048576.0);
        r.activations = (int64_t)a;
    }
    return r;
}

mdt_status mdt_check_run_memory(const mdt_model *m, int T, int R, int U, const mdt_run_inputs *in,
                                int64_t limit, const char *limit_what) {
    const mdt_run_memory need = mdt_run_memory_at(m, T, R, U, in);
    if (need.weights + need.activations <= limit)
        return MDT_OK;
    int fit = 0;
    mdt_run_memory at = need;
    for (int t = T + 1; t <= 256 && !fit; t++) {
        if (mdt_model_check_layout(m, t, R, U) != MDT_OK)
            continue;
        at = mdt_run_memory_at(m, t, R, U, in);
        fit = at.weights + at.activations <= limit ? t : 0;
    }
    mdt_error_clear();
    char acts[160] = "", tail[160], b1[32], b2[32], b3[32];
    if (!in->device_acts)
        snprintf(acts, sizeof acts, " + %s of activations (batch %lld x %lld tokens)",
                 mdt_fmt_size(need.activations, b1, sizeof b1), (long long)in->batch,
                 (long long)in->rows);
    if (fit)
        snprintf(tail, sizeof tail, "tp=%d would need %s", fit,
                 mdt_fmt_size(at.weights + at.activations, b1, sizeof b1));
    else
        snprintf(tail, sizeof tail, "no valid tp up to 256 fits");
    return MDT_FAIL(MDT_E_NOMEM, "tp=%d needs %s per rank (%s of %s%s), over %s; %s%s", T,
                    mdt_fmt_size(need.weights + need.activations, b2, sizeof b2),
                    mdt_fmt_size(need.weights, b3, sizeof b3),
                    in->bf16 ? "weights (linears in bf16)" : "f32 weights", acts, limit_what, tail,
                    need.activations > need.weights
                        ? "; more --ring/--ulysses ranks split the activations"
                        : "");
}

/* Ranks of this job on this node: they share its memory. Collective over the world (for a
 * caller without a mesh; a mesh knows it: node_size). */
static int ranks_on_node(void) {
    MPI_Comm node;
    int n = 1;
    if (MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node) ==
        MPI_SUCCESS) {
        MPI_Comm_size(node, &n);
        MPI_Comm_free(&node);
    }
    return n;
}

/* The inputs as the memory estimate sees them: batch = dim 0 of the latent input; token rows =
 * what the model's context-parallel plan splits (the sum of the sequence-dim-1 tensors, e.g.
 * Flux's image + text rows, else the longest dim-0 one, e.g. MiniMax-H3's packed rows). */
static mdt_run_inputs run_inputs_of(const mdt_model *m, const mdt_tensor_set *in) {
    mdt_run_inputs r = {0};
    const mdt_tensor *lat = mdt_tensor_set_get(in, m->fam->latent_input);
    r.batch = lat && lat->ndim >= 1 ? lat->shape[0] : 1;
    r.latent_f32 = lat ? mdt_tensor_numel(lat) * 4 : 0;
    for (int i = 0; i < mdt_tensor_set_count(in); i++) { /* and the forward's converted copy */
        const mdt_tensor *t = mdt_tensor_set_at(in, i, &(const char *){NULL});
        const int integer = t->dtype == MDT_I64 || t->dtype == MDT_I32 || t->dtype == MDT_I16 ||
                            t->dtype == MDT_I8 || t->dtype == MDT_U8;
        const int64_t per = t->dtype == MDT_F32 ? 0 : integer ? 8 : 4; /* bytes a copied value */
        r.input_bytes += mdt_tensor_nbytes(t) + per * mdt_tensor_numel(t);
    }
    int64_t rows1 = 0, rows0 = 0;
    const mdt_cp_plan *cp = m->fam->cp_plan;
    for (int i = 0; cp && i < cp->nsplit; i++) {
        const mdt_tensor *t = mdt_tensor_set_get(in, cp->split[i].input);
        r.split_f32 += t ? 4 * mdt_tensor_numel(t) : 0;
        if (t && cp->split[i].dim == 1 && t->ndim >= 2)
            rows1 += t->shape[1];
        else if (t && cp->split[i].dim == 0 && t->ndim >= 1 && t->shape[0] > rows0)
            rows0 = t->shape[0];
    }
    r.rows = rows1 > 0 ? rows1 : rows0;
    if (m->fam->token_rows)
        r.rows = m->fam->token_rows(m->impl, in);
    return r;
}

/* This rank's verdict: the limit is lim->max_bytes or, without it, the memory this process may
 * use (the smaller of MemAvailable and its cgroup's limit, or lim->mem_available in their place)
 * divided among the `nlocal` ranks of this node. */
static mdt_status check_local(const char *ck, const mdt_mesh *mesh, const mdt_tensor_set *in,
                              const mdt_memory_limit *lim, int nlocal) {
    char what[256], src[64], b1[32], b2[32];
    int64_t limit = lim->max_bytes;
    if (limit > 0) {
        snprintf(what, sizeof what, "the --max-memory limit of %s",
                 mdt_fmt_size(limit, b1, sizeof b1));
    } else {
        const char *env = lim->mem_available;
        int64_t avail;
        if (env && *env) {
            if ((avail = mdt_size_parse(env)) <= 0)
                return MDT_FAIL(MDT_E_INVALID,
                                "MESHDIT_MEM_AVAILABLE='%s' is not a size like 512M, 8G or "
                                "1048576",
                                env);
            snprintf(src, sizeof src, "MESHDIT_MEM_AVAILABLE");
        } else if ((avail = mdt_mem_available("", src, sizeof src)) < 0) {
            return MDT_OK; /* nothing to go by: no check */
        }
        limit = avail / nlocal;
        snprintf(what, sizeof what,
                 "the %s this rank may use (%s: %s for the %d rank%s on this node; "
                 "--max-memory SIZE overrides this check)",
                 mdt_fmt_size(limit, b1, sizeof b1), src, mdt_fmt_size(avail, b2, sizeof b2),
                 nlocal, nlocal > 1 ? "s" : "");
    }
    const int T = mesh ? mesh->T : 1, R = mesh ? mesh->R : 1, U = mesh ? mesh->U : 1;
    char path[4096];
    cJSON *cfg = NULL;
    mdt_model *m = NULL;
    snprintf(path, sizeof path, "%s/config.json", ck);
    mdt_status st = mdt_config_load(path, &cfg);
    if (st == MDT_OK && (st = mdt_model_describe(cfg, &m)) != MDT_OK)
        (void)mdt_config_error_at(st, path); /* the message names the file */
    if (st == MDT_OK)
        st = mdt_model_check_layout(m, T, R, U);
    if (st == MDT_OK) {
        mdt_run_inputs ri = run_inputs_of(m, in);
        ri.bf16 = mdt_backend_bf16(), ri.device_acts = lim->device_activations;
        st = mdt_check_run_memory(m, T, R, U, &ri, limit, what);
    } else {
        mdt_error_clear();
        st = MDT_OK;
    }
    mdt_model_free(m);
    cJSON_Delete(cfg);
    return st;
}

mdt_status mdt_check_memory(const char *checkpoint_dir, mdt_mesh *mesh,
                            const mdt_tensor_set *inputs, const mdt_memory_limit *lim) {
    const int nlocal = mesh ? mesh->node_size : ranks_on_node(); /* the mesh found it once */
    return mdt_mesh_agree(mesh, check_local(checkpoint_dir, mesh, inputs, lim, nlocal));
}

mdt_status mdt_check_forward_memory(const mdt_model *m, const mdt_tensor_set *inputs, int64_t limit,
                                    int device_activations) {
    char what[96], b[32];
    if (limit <= 0)
        return MDT_OK;
    snprintf(what, sizeof what, "the --max-memory limit of %s", mdt_fmt_size(limit, b, sizeof b));
    mdt_run_inputs ri = run_inputs_of(m, inputs);
    ri.bf16 = mdt_backend_bf16(), ri.device_acts = device_activations;
    const mdt_mesh *mesh = m->mesh;
    return mdt_check_run_memory(m, mesh ? mesh->T : 1, mesh ? mesh->R : 1, mesh ? mesh->U : 1, &ri,
                                limit, what);
}
