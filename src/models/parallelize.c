/*
 * parallelize.c — the in-memory path: a model loaded whole on every rank is sharded for a mesh
 * (TP coordinate 0's values broadcast so ranks agree, each rank keeps its slices). Gives the same
 * bits as shard-on-read.
 */
#include "models/lora.h"
#include "models/residency.h"

#include "parallel/shard.h"

#include <string.h>

mdt_status mdt_model_parallelize(mdt_model *m, mdt_mesh *mesh) {
    mdt_status st = MDT_OK;
    if (m->lora && m->lora->n)
        return MDT_FAIL(MDT_E_INVALID, "the model holds LoRA adapters, whose slices are cut for "
                                       "its layout: unload them before parallelize");
    if (m->sharded_at_load || m->mesh)
        return MDT_FAIL(MDT_E_INVALID,
                        "model is already parallel: parallelism was applied at load time "
                        "(shard-on-read); load it without a mesh to parallelize in memory");
    if (!m->weights && !m->on_device)
        return MDT_FAIL(MDT_E_INVALID, "model has no weights to parallelize");
    if (!mesh)
        return MDT_OK;
    MDT_TRY(mdt_mesh_agree(mesh, mdt_res_to_host(m)));
    const int T = mesh->T, k = mesh->tp_shard_index;
    st = mdt_model_check_layout(m, T, mesh->R, mesh->U);
    if (st == MDT_OK && k >= T)
        st = MDT_FAIL(MDT_E_INVALID, "shard index %d is outside tp=%d", k, T);
    MDT_TRY(mdt_mesh_agree(mesh, st));
    mdt_wstate *ws = mdt_calloc(sizeof(mdt_wstate) * (size_t)(m->table.n ? m->table.n : 1));
    float *buf = NULL;
    if (!ws)
        st = MDT_FAIL(MDT_E_NOMEM, "out of memory");
    if (st == MDT_OK)
        st = mdt_res_alloc(m, T, k, &buf, NULL, ws);
    for (int i = 0; st == MDT_OK && i < m->table.n; i++) {
        const mdt_weight_spec *w = &m->table.specs[i];
        /* TP coordinate 0's values win, so ranks that built different states still agree */
        st = mdt_bcast_floats(mesh, MDT_GROUP_TP, 0, m->ws[i].data,
                              m->ws[i].local[0] * m->ws[i].local[1]);
        if (st == MDT_OK) {
            mdt_shard_copy(w, T, k, m->ws[i].data, ws[i].data, 1);
            ws[i].stored = m->ws[i].stored;
        }
    }
    st = mdt_mesh_agree(mesh, st);
    if (st != MDT_OK) {
        mdt_res_free_host(m, buf);
        mdt_free(ws);
        return st;
    }
    mdt_res_free_host(m, m->weights);
    mdt_free(m->ws);
    m->weights = buf, m->ws = ws;
    m->mesh = mesh, m->T = T, m->tp_index = k;
    mdt_res_bind(m);
    return mdt_mesh_agree(mesh, mdt_res_to_device(m));
}
