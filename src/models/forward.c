/*
 * forward.c — one forward of a loaded model: arenas reset, the family's forward run, device
 * errors surfaced, every rank's verdict agreed; and the forward's two contracts: no silent NaN
 * (mdt_guard_finite after each stage) and no silent degrade (mdt_model_check_promise).
 */
#include "models/model.h"

#include "backend/backend.h"

#include <stdint.h>
#include <string.h>

mdt_status mdt_model_forward(mdt_model *m, const mdt_tensor_set *inputs, mdt_tensor_set *outputs) {
    mdt_status st;
    if (!m->weights && !m->on_device)
        return MDT_FAIL(MDT_E_INVALID, "model has no weights (described, not loaded)");
    m->arena.src = mdt_backend_mem();       /* activations where the weights are */
    m->harena.src = mdt_backend_host_mem(); /* page-locked staging for the uploads */
    st = mdt_arena_reset(&m->arena);
    if (st == MDT_OK)
        st = mdt_arena_reset(&m->harena);
    m->fwd_c0 = *mdt_counters_get(); /* the no-silent-degrade check compares against these */
    memset(m->fwd_g0, 0, sizeof m->fwd_g0);
    if (m->mesh)
        memcpy(m->fwd_g0, m->mesh->group_bytes, sizeof m->fwd_g0);
    if (st == MDT_OK)
        st = m->fam->forward(m, inputs, outputs);
    if (st == MDT_OK)
        st = mdt_backend_check(); /* a device failure surfaces here at the latest */
    return mdt_mesh_agree(m->mesh, st);
}

mdt_status mdt_guard_finite(mdt_mesh *mesh, const char *what, const float *x, int64_t n) {
    if (mdt_backend_mem()) /* device activations: the host-side output check covers them */
        return MDT_OK;
    const int64_t bad = n > 0 ? mdt_first_nonfinite(x, n) : -1;
    /* one reduction finds the lowest failing rank and its element: rank in the high bits */
    const int64_t rank = mesh ? mesh->world_rank : 0, span = (int64_t)1 << 40;
    int64_t key = bad >= 0 ? rank * span + (bad < span ? bad : span - 1) : INT64_MAX;
    MDT_TRY(mdt_mesh_min_i64(mesh, &key, "finite-output check"));
    if (key == INT64_MAX)
        return MDT_OK;
    return MDT_FAIL(MDT_E_NUMERIC,
                    "the output of %s went non-finite (NaN or Inf; first on rank %lld at element "
                    "%lld of its rows): the weights or inputs are too large for f32",
                    what, (long long)(key / span), (long long)(key % span));
}

mdt_status mdt_model_check_promise(const mdt_model *m, const mdt_promise *p) {
    const mdt_counters *c0 = &m->fwd_c0;
    const int64_t *g0 = m->fwd_g0;
    const mdt_mesh *mesh = m->mesh;
    const mdt_counters *c1 = mdt_counters_get();
    const int64_t got_q = c1->attn_query_rows - c0->attn_query_rows;
    const int64_t got_kv = c1->attn_kv_rows - c0->attn_kv_rows;
    const int R = mesh ? mesh->R : 1, U = mesh ? mesh->U : 1;
    if (got_q != p->want_q || got_kv != p->want_kv) {
        const char *axis = got_q == p->whole_q && R * U > 1
                               ? "the sequence split (ring x ulysses) did nothing: this rank "
                                 "computed the whole sequence"
                           : U > 1 && got_q == p->unscattered_q
                               ? "ulysses did nothing: heads were not scattered"
                           : R > 1 && got_kv == p->ringless_kv
                               ? "ring did nothing: the other ring blocks were never attended"
                               : "the layout was not applied as configured";
        return MDT_FAIL(MDT_E_INVALID,
                        "no silent degrade: this rank attended %lld query rows x heads and %lld "
                        "key rows x heads per forward, but tp=%d ring=%d ulysses=%d promises %lld "
                        "and %lld: %s",
                        (long long)got_q, (long long)got_kv, m->T, R, U, (long long)p->want_q,
                        (long long)p->want_kv, axis);
    }
    if (mesh) {
        const int deg[MDT_GROUP_COUNT] = {mesh->T, R, U, R * U};
        for (int g = 0; g < MDT_GROUP_COUNT; g++)
            if (p->owes[g] && mesh->group_bytes[g] == g0[g])
                return MDT_FAIL(MDT_E_INVALID,
                                "no silent degrade: the %s group (degree %d) moved no bytes in a "
                                "forward: that axis did nothing",
                                mdt_group_name((mdt_group)g), deg[g]);
    }
    return MDT_OK;
}
