/*
 * model_info.c — what a client may ask of a model (meshdit.h): the describe-only view
 * (mdt_model_info: config and weight table, optionally the checkpoint's stored dtypes), the
 * weights of a loaded model on this rank, its layout, and the family's random inputs.
 */
#include "models/info.h"
#include "core/core.h"

#include <cjson/cJSON.h>

#include <stdio.h>
#include <stdlib.h>

mdt_status mdt_model_info_open(const char *checkpoint_dir, const char *config_path, int read_index,
                               mdt_model_info **out) {
    *out = NULL;
    if (!checkpoint_dir == !config_path)
        return MDT_FAIL(MDT_E_INVALID, "give exactly one of a checkpoint directory or a config");
    mdt_model_info *v = calloc(1, sizeof *v);
    if (!v)
        return MDT_FAIL(MDT_E_NOMEM, "out of memory");
    mdt_status st;
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", checkpoint_dir ? checkpoint_dir : ".");
    if (checkpoint_dir && read_index) {
        st = mdt_ckpt_open(checkpoint_dir, &v->ck);
    } else {
        st = mdt_config_load(checkpoint_dir ? path : config_path, &v->cfg);
    }
    if (st == MDT_OK && (st = mdt_model_describe(v->ck ? v->ck->config : v->cfg, &v->m)) != MDT_OK)
        (void)mdt_config_error_at(st, checkpoint_dir ? path : config_path); /* names the file */
    if (st != MDT_OK) {
        mdt_model_info_free(v);
        return st;
    }
    *out = v;
    return MDT_OK;
}

void mdt_model_info_free(mdt_model_info *info) {
    if (!info)
        return;
    mdt_model_free(info->m);
    cJSON_Delete(info->cfg);
    mdt_ckpt_close(info->ck);
    free(info);
}

const char *mdt_model_info_family(const mdt_model_info *info) { return info->m->fam->name; }

const char *mdt_model_info_class_name(const mdt_model_info *info) {
    return info->m->fam->class_name;
}

int64_t mdt_model_info_heads(const mdt_model_info *info) {
    return mdt_model_dims_of(info->m).heads;
}

int mdt_model_info_weight_count(const mdt_model_info *info) { return info->m->table.n; }

static void weight_of(const mdt_weight_spec *w, mdt_weight_info *out) {
    out->name = w->name;
    out->tp_style = mdt_tp_style_name(w->style);
    out->ndim = w->ndim;
    out->shape[0] = w->shape[0];
    out->shape[1] = w->ndim > 1 ? w->shape[1] : 1;
    out->stored = "-";
    out->bytes_read = 0;
}

mdt_status mdt_model_info_weight(const mdt_model_info *info, int i, int tp, mdt_weight_info *out) {
    return mdt_model_info_weight_at(info, i, tp, 0, out, NULL);
}

mdt_status mdt_model_info_weight_at(const mdt_model_info *info, int i, int tp, int k,
                                    mdt_weight_info *out, int *uneven) {
    if (i < 0 || i >= info->m->table.n)
        return MDT_FAIL(MDT_E_INVALID, "weight %d of %d", i, info->m->table.n);
    const mdt_weight_spec *w = &info->m->table.specs[i];
    weight_of(w, out);
    MDT_TRY(mdt_shard_local_shape(w, tp, k, out->local_shape));
    if (uneven)
        *uneven = mdt_shard_uneven_at(w, tp);
    const mdt_ckpt_ref *ref;
    if (info->ck)
        out->stored = mdt_ckpt_find(info->ck, w->name, &ref) == MDT_OK
                          ? mdt_dtype_name(ref->entry->dtype)
                          : "MISSING";
    return MDT_OK;
}

int mdt_model_info_cp_count(const mdt_model_info *info, int gather) {
    const mdt_cp_plan *cp = info->m->fam->cp_plan;
    return !cp ? 0 : gather ? cp->ngather : cp->nsplit;
}

const char *mdt_model_info_cp_entry(const mdt_model_info *info, int gather, int i, int *dim,
                                    const char **by) {
    const mdt_cp_plan *cp = info->m->fam->cp_plan;
    if (i < 0 || i >= mdt_model_info_cp_count(info, gather))
        return NULL;
    const mdt_cp_split *e = gather ? &cp->gather[i] : &cp->split[i];
    *dim = e->dim;
    if (by)
        *by = e->by;
    return e->input;
}

mdt_status mdt_model_info_check_layout(const mdt_model_info *info, int tp, int ring, int ulysses) {
    return mdt_model_check_layout(info->m, tp, ring, ulysses);
}

mdt_status mdt_model_info_make_inputs(const mdt_model_info *info, const mdt_random_inputs *p,
                                      mdt_tensor_set *out) {
    return mdt_model_make_inputs(info->m, p, out);
}

/* ---- a loaded model ---- */

int mdt_model_weight_count(const mdt_model *m) { return m->table.n; }

mdt_status mdt_model_weight(const mdt_model *m, int i, mdt_weight_info *out) {
    if (i < 0 || i >= m->table.n)
        return MDT_FAIL(MDT_E_INVALID, "weight %d of %d", i, m->table.n);
    weight_of(&m->table.specs[i], out);
    out->local_shape[0] = m->ws ? m->ws[i].local[0] : 0;
    out->local_shape[1] = m->ws ? m->ws[i].local[1] : 0;
    out->stored = m->ws ? mdt_dtype_name(m->ws[i].stored) : "-";
    out->bytes_read = m->ws ? m->ws[i].bytes_read : 0;
    return MDT_OK;
}

void mdt_model_layout(const mdt_model *m, int *tp, int *ring, int *ulysses) {
    *tp = m->mesh ? m->mesh->T : 1;
    *ring = m->mesh ? m->mesh->R : 1;
    *ulysses = m->mesh ? m->mesh->U : 1;
}

int64_t mdt_model_weight_bytes(const mdt_model *m) { return m->weight_bytes; }

int64_t mdt_model_bytes_read(const mdt_model *m) { return m->bytes_read; }

mdt_status mdt_model_make_inputs(const mdt_model *m, const mdt_random_inputs *p,
                                 mdt_tensor_set *out) {
    return mdt_model_random_inputs(m, p, out);
}
