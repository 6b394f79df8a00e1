/*
 * forward.c — the one forward of a loaded model (meshdit.h: mdt_model_forward), used by run,
 * serve and the sampler alike: the watchdog armed, arenas reset, the family's forward run,
 * device errors surfaced, stages and outputs checked finite, and every rank's verdict agreed
 * once; and the forward's two contracts: no silent NaN (mdt_guard_finite after each stage,
 * recorded locally) and no silent degrade (mdt_model_check_promise).
 */
#include "models/model.h"

#include "backend/backend.h"

#include <stdint.h>
#include <stdio.h>
#include <string.h>

void mdt_model_set_step_timeout(mdt_model *m, double seconds) {
    m->step_timeout = seconds > 0 ? seconds : 0;
}

double mdt_model_step_bound(const mdt_model *m) {
    if (m->step_timeout > 0)
        return m->step_timeout;
    return 10.0 * m->longest_s > 60.0 ? 10.0 * m->longest_s : 60.0;
}

mdt_status mdt_model_sit_out(mdt_model *m, mdt_status local) {
    mdt_mesh *mesh = m->mesh;
    /* the peers' forward is watched from here too, with the bound their forwards have taught
     * this rank (it learns from each wait: a rank that only sits out would keep the 60 s floor
     * while the peers' forwards grow); before any, unbounded here (the peers' own waits are
     * watched, and a forward's first agreement is stretched to 10 x its time there too) */
    const double t0 = mdt_now();
    mdt_mesh_set_deadline(mesh,
                          m->longest_s > 0 || m->step_timeout > 0 ? mdt_model_step_bound(m) : 0);
    const mdt_status st = mdt_mesh_agree(mesh, local);
    mdt_mesh_set_deadline(mesh, 0);
    const double secs = mdt_now() - t0;
    m->longest_s = secs > m->longest_s ? secs : m->longest_s;
    return st;
}

void mdt_guard_finite_part(mdt_model *m, const char *what, const float *x, int64_t rows,
                           int64_t width, int parts, int part) {
    m->guard_seq++;
    if (m->nan_elem >= 0 || rows <= 0 || width <= 0 || mdt_backend_mem()) /* device rows: the */
        return;                                                           /* outputs are checked */
    if (parts < 1 || part < 0 || part >= parts) /* no part of its own: all of them */
        parts = 1, part = 0;
    const int64_t r0 = rows * part / parts, r1 = rows * (part + 1) / parts;
    const int64_t bad = mdt_first_nonfinite(x + r0 * width, (r1 - r0) * width);
    if (bad < 0)
        return;
    m->nan_elem = r0 * width + bad, m->nan_seq = m->guard_seq;
    snprintf(m->nan_stage, sizeof m->nan_stage, "%s", what);
}

void mdt_guard_finite(mdt_model *m, const char *what, const float *x, int64_t n) {
    mdt_guard_finite_part(m, what, x, 1, n, 1, 0);
}

/* After the family's forward, this rank's own verdict on what it computed: the first stage that
 * went non-finite, else the first output holding a NaN or Inf (whatever the backend: outputs
 * are on the host); *order: where in the forward that was (the stage's guard, or after all) */
static mdt_status check_finite(const mdt_model *m, const mdt_tensor_set *outputs, int64_t *order) {
    *order = m->nan_elem >= 0 ? m->nan_seq : m->guard_seq + 1;
    if (m->nan_elem >= 0)
        return MDT_FAIL(MDT_E_NUMERIC,
                        "the output of %s went non-finite (NaN or Inf; first on rank %d at element "
                        "%lld of its rows): the weights or inputs are too large for f32",
                        m->nan_stage, m->mesh ? m->mesh->world_rank : 0, (long long)m->nan_elem);
    for (int k = 0; k < mdt_tensor_set_count(outputs); k++) {
        const char *name;
        const mdt_tensor *t = mdt_tensor_set_at(outputs, k, &name);
        const int64_t bad =
            t->dtype == MDT_F32 ? mdt_first_nonfinite(t->data, mdt_tensor_numel(t)) : -1;
        if (bad >= 0)
            return MDT_FAIL(MDT_E_NUMERIC,
                            "output '%s' holds a NaN or Inf at element %lld; not written", name,
                            (long long)bad);
    }
    return MDT_OK;
}

const mdt_input_decl *mdt_model_input(const mdt_model *m, const char *name) {
    for (const mdt_input_decl *d = m->fam->inputs(m->impl); d->name; d++)
        if (strcmp(d->name, name) == 0)
            return d;
    return NULL;
}

/* Every input is one the family's forward takes: a misspelt or unused one is an error. */
static mdt_status check_input_names(const mdt_model *m, const mdt_tensor_set *in) {
    for (int i = 0; i < mdt_tensor_set_count(in); i++) {
        const char *name;
        mdt_tensor_set_at(in, i, &name);
        if (mdt_model_input(m, name))
            continue;
        char shown[MDT_ESC_NAME], takes[512] = "";
        size_t n = 0;
        for (const mdt_input_decl *d = m->fam->inputs(m->impl); d->name && n < sizeof takes; d++)
            n += (size_t)snprintf(takes + n, sizeof takes - n, "%s%s", n ? ", " : "", d->name);
        return MDT_FAIL(MDT_E_INVALID, "inputs: unknown tensor '%s' (%s takes %s)",
                        mdt_escape(name, shown, sizeof shown), m->fam->class_name, takes);
    }
    return MDT_OK;
}

mdt_status mdt_model_forward(mdt_model *m, const mdt_tensor_set *inputs, mdt_tensor_set *outputs) {
    mdt_status st;
    if (!m->weights && !m->on_device)
        return MDT_FAIL(MDT_E_INVALID, "model has no weights (described, not loaded)");
    mdt_mesh *mesh = m->mesh;
    /* watched: a rank that does not reach a collective of this forward within the bound ends
     * the job with one line naming it; default 10 x the longest forward so far, at least 60 s */
    mdt_mesh_set_deadline(mesh, mdt_model_step_bound(m));
    const double t0 = mdt_now();
    m->arena.src = mdt_backend_mem();       /* activations where the weights are */
    m->harena.src = mdt_backend_host_mem(); /* page-locked staging for the uploads */
    m->nan_elem = -1, m->nan_stage[0] = '\0', m->guard_seq = m->nan_seq = 0;
    st = check_input_names(m, inputs);
    if (st == MDT_OK)
        st = mdt_arena_reset(&m->arena);
    if (st == MDT_OK)
        st = mdt_arena_reset(&m->harena);
    m->fwd_c0 = *mdt_counters_get(); /* the no-silent-degrade check compares against these */
    memset(m->fwd_g0, 0, sizeof m->fwd_g0);
    if (mesh)
        memcpy(m->fwd_g0, mesh->group_bytes, sizeof m->fwd_g0);
    if (st == MDT_OK)
        st = m->fam->forward(m, inputs, outputs);
    if (st == MDT_OK)
        st = mdt_backend_check(); /* a device failure surfaces here at the latest */
    int64_t order = 0;            /* a failure before the checks: first */
    if (st == MDT_OK)
        st = check_finite(m, outputs, &order);
    /* the deadline bounds each wait, and this rank waits here for the slowest peer's forward:
     * on a first forward (no longest_s yet) or on the longer of two cfg groups' parts that can
     * outlast the 60 s floor; so at least 10 x this forward, unless the caller set the bound */
    if (!(m->step_timeout > 0)) {
        const double el = 10.0 * (mdt_now() - t0), bound = mdt_model_step_bound(m);
        mdt_mesh_set_deadline(mesh, el > bound ? el : bound);
    }
    if (st != MDT_OK && m->fail_label)
        st = mdt_fail_prefix(st, "%s", m->fail_label);
    st = mdt_mesh_agree_ordered(mesh, st, order); /* agreed once, for the whole forward */
    const double secs = mdt_now() - t0;
    m->longest_s = secs > m->longest_s ? secs : m->longest_s;
    mdt_mesh_set_deadline(mesh, 0); /* what follows waits as long as it takes */
    return st;
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
        const int deg[MDT_GROUP_COUNT] = {mesh->T, R, U, mesh->C, R * U};
        for (int g = 0; g < MDT_GROUP_COUNT; g++)
            if (p->owes[g] && mesh->group_bytes[g] == g0[g])
                return MDT_FAIL(MDT_E_INVALID,
                                "no silent degrade: the %s group (degree %d) moved no bytes in a "
                                "forward: that axis did nothing",
                                mdt_group_name((mdt_group)g), deg[g]);
    }
    return MDT_OK;
}
