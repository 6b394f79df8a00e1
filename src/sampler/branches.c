/*
 * branches.c — see branches.h. The exchange of the cfg axis: each group sends one row of 1 + n
 * floats, a tag (2 x step + its branch or part) and its prediction, gathered in group order over
 * the cfg communicator, under the step watchdog.
 */
#include "sampler/branches.h"

#include "models/cache.h"

#include "core/testhooks.h"
#include "parallel/plan.h"
#include "tensor/tensor.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

static const char k_neg[] = "negative_";

/* The family's branch inputs, comma-separated, for messages. */
static void branch_list(const mdt_model *m, char *buf, size_t cap) {
    size_t k = 0;
    buf[0] = '\0';
    for (const mdt_input_decl *d = m->fam->inputs(m->impl); d->name && k < cap; d++)
        if (d->flags & MDT_IN_BRANCH)
            k += (size_t)snprintf(buf + k, cap - k, "%s%s", k ? ", " : "", d->name);
    if (!buf[0])
        snprintf(buf, cap, "none: its pipeline does not guide");
}

/* negative_X is an input of the unconditional branch: X is a branch input the conditional
 * branch has too, of the same rank, the same batch where X is batched (dim 0) and the same width
 * where it has one (the last dimension of [B, S, C]). Its sequence may differ: a negative prompt
 * of other length than the positive one comes with ids [S_neg, 3] and a mask [B, S_neg] of its
 * own, and each branch's forward checks its inputs as a whole. */
static mdt_status check_negative(const mdt_model *m, const mdt_tensor_set *in, const char *name,
                                 const mdt_tensor *neg) {
    const char *x = name + sizeof k_neg - 1;
    const mdt_input_decl *d = mdt_model_input(m, x);
    char shown[MDT_ESC_NAME], list[256], a[64], b[64];
    mdt_escape(name, shown, sizeof shown);
    if (!d || !(d->flags & MDT_IN_BRANCH)) {
        branch_list(m, list, sizeof list);
        return MDT_FAIL(MDT_E_INVALID,
                        "inputs: '%s': the unconditional branch of %s brings its own negative_ "
                        "tensors of %s only",
                        shown, m->fam->class_name, list);
    }
    const mdt_tensor *c = mdt_tensor_set_get(in, x);
    if (!c && !(d->flags & MDT_IN_OPTIONAL))
        return MDT_FAIL(MDT_E_INVALID, "inputs: '%s' without the conditional '%s'", shown, x);
    if (neg->dtype == MDT_F32) { /* named here: the forward knows it by the conditional name */
        const int64_t bad = mdt_first_nonfinite(neg->data, mdt_tensor_numel(neg));
        if (bad >= 0)
            return MDT_FAIL(MDT_E_INVALID, "inputs: tensor '%s' holds a NaN or Inf at element %lld",
                            shown, (long long)bad);
    }
    const int batched = c && (d->flags & MDT_IN_BATCH) && c->ndim > 0;
    if (!c) /* an optional input the conditional branch goes without: the forward checks it */
        return MDT_OK;
    if (neg->ndim != c->ndim || (batched && neg->shape[0] != c->shape[0]) ||
        (c->ndim >= 3 && neg->shape[c->ndim - 1] != c->shape[c->ndim - 1]))
        return MDT_FAIL(MDT_E_INVALID,
                        "inputs: '%s' has shape %s, the conditional '%s' %s: the rank, the batch "
                        "and the width must agree",
                        shown, mdt_tensor_shape_str(neg, a, sizeof a), x,
                        mdt_tensor_shape_str(c, b, sizeof b));
    return MDT_OK;
}

/* The inputs of one branch: every conditional input, negative_X in place of X for the
 * unconditional one (`uncond`), or rows [b0, b0 + nb) of the batched ones of batch B (nb > 0;
 * those shared by the batch whole: models/batch.c). */
static mdt_status make_set(const mdt_model *m, const mdt_tensor_set *in, int uncond, int64_t B,
                           int64_t b0, int64_t nb, mdt_tensor_set **out) {
    if (nb > 0)
        return mdt_model_inputs_rows(m, in, B, b0, nb, out);
    mdt_tensor_set *s = NULL;
    MDT_TRY(mdt_tensor_set_create(&s));
    mdt_status st = MDT_OK;
    char nn[MDT_NAME_MAX + 16];
    for (int i = 0; i < mdt_tensor_set_count(in) && st == MDT_OK; i++) {
        const char *name;
        const mdt_tensor *t = mdt_tensor_set_at(in, i, &name);
        if (strncmp(name, k_neg, sizeof k_neg - 1) == 0)
            continue;
        snprintf(nn, sizeof nn, "%s%s", k_neg, name);
        const mdt_tensor *neg = uncond ? mdt_tensor_set_get(in, nn) : NULL;
        const mdt_input_decl *d = uncond && !neg ? mdt_model_input(m, name) : NULL;
        if (d && (d->flags & MDT_IN_BRANCH) && (d->flags & MDT_IN_OPTIONAL))
            continue; /* the unconditional branch goes without it (its negative_ is absent) */
        st = mdt_tensor_set_add_copy(s, name, neg ? neg : t);
    }
    for (int i = 0; uncond && i < mdt_tensor_set_count(in) && st == MDT_OK; i++) {
        const char *name; /* an optional negative_X whose conditional X is absent */
        const mdt_tensor *t = mdt_tensor_set_at(in, i, &name);
        if (strncmp(name, k_neg, sizeof k_neg - 1) == 0 &&
            !mdt_tensor_set_get(in, name + sizeof k_neg - 1))
            st = mdt_tensor_set_add_copy(s, name + sizeof k_neg - 1, t);
    }
    if (st != MDT_OK) {
        mdt_tensor_set_free(s);
        return st;
    }
    *out = s;
    return MDT_OK;
}

mdt_status mdt_branches_init(mdt_branches *br, const mdt_model *m, const mdt_tensor_set *in,
                             double scale, int steps) {
    memset(br, 0, sizeof *br);
    const mdt_mesh *mesh = m->mesh;
    const mdt_family *fam = m->fam;
    br->C = mesh ? mesh->C : 1, br->c = mesh ? mesh->c : 0, br->scale = scale;
    int nneg = 0;
    char list[256];
    for (int i = 0; i < mdt_tensor_set_count(in); i++) {
        const char *name;
        const mdt_tensor *t = mdt_tensor_set_at(in, i, &name);
        if (strncmp(name, k_neg, sizeof k_neg - 1) != 0)
            continue;
        MDT_TRY(check_negative(m, in, name, t));
        nneg++;
    }
    br->guided = nneg > 0;
    branch_list(m, list, sizeof list);
    /* the unconditional branch brings every batched branch input of its own (the negative
     * prompt's embeddings and mask): one left out would silently be the conditional's. Only
     * position ids (not batched) may be shared by both branches. */
    const int need = MDT_IN_BRANCH | MDT_IN_BATCH;
    for (const mdt_input_decl *d = fam->inputs(m->impl); br->guided && d->name; d++) {
        char nn[MDT_NAME_MAX + 16], own[256] = "";
        snprintf(nn, sizeof nn, "%s%s", k_neg, d->name);
        if ((d->flags & need) != need || (d->flags & MDT_IN_OPTIONAL) ||
            !mdt_tensor_set_get(in, d->name) || mdt_tensor_set_get(in, nn))
            continue;
        for (const mdt_input_decl *e = fam->inputs(m->impl); e->name; e++)
            if ((e->flags & need) == need && !(e->flags & MDT_IN_OPTIONAL))
                snprintf(own + strlen(own), sizeof own - strlen(own), "%snegative_%s",
                         own[0] ? ", " : "", e->name);
        return MDT_FAIL(MDT_E_INVALID,
                        "inputs: the unconditional branch has negative_ tensors but no '%s': it "
                        "brings its own %s (only ids may be shared), or none",
                        nn, own);
    }
    if (br->guided && !(scale > 0))
        return MDT_FAIL(MDT_E_INVALID,
                        "inputs: the unconditional branch's negative_ tensors need a guidance "
                        "scale (--guidance-scale S, S > 0)");
    if (!br->guided && scale > 0)
        return MDT_FAIL(MDT_E_INVALID,
                        "--guidance-scale %g needs the unconditional branch's inputs: negative_X "
                        "for X among the branch inputs of %s (%s)",
                        scale, fam->class_name, list);
    if (br->guided && steps <= 0)
        return MDT_FAIL(MDT_E_INVALID,
                        "a guided run combines the two branches' predictions each step: it "
                        "needs --steps N");
    const mdt_tensor *lat = mdt_tensor_set_get(in, fam->latent_input);
    const int64_t B = lat && lat->ndim >= 1 ? lat->shape[0] : 0;
    if (br->C == 2 && !br->guided) {
        int batched = 0;
        for (const mdt_input_decl *d = fam->inputs(m->impl); d->name; d++)
            batched |= (d->flags & MDT_IN_BATCH) != 0;
        if (B < 2 || !batched)
            return MDT_FAIL(MDT_E_INVALID,
                            "--cfg 2 needs a guided step (negative_ inputs of %s, and "
                            "--guidance-scale) or a batch of at least 2 to split between its two "
                            "groups; these inputs have batch %lld and no negative_ tensors (a cfg "
                            "group would idle)%s",
                            list, (long long)B,
                            batched ? "" : "; this family's batch is one packed sequence");
        for (int i = 0; i < mdt_tensor_set_count(in); i++) {
            const char *name;
            const mdt_tensor *t = mdt_tensor_set_at(in, i, &name);
            const mdt_input_decl *d = mdt_model_input(m, name);
            if (d && (d->flags & MDT_IN_BATCH) && (t->ndim < 1 || t->shape[0] != B) &&
                !mdt_input_shared_by_batch(d, t, B))
                return MDT_FAIL(MDT_E_INVALID,
                                "inputs: '%s' must have the batch %lld of '%s' in dim 0 to be "
                                "split by --cfg 2%s",
                                name, (long long)B, fam->latent_input,
                                d->flags & MDT_IN_SHARED ? " (or 1: one value for the whole batch)"
                                                         : "");
        }
        br->split = 1;
        for (int j = 0; j < 2; j++)
            mdt_split_range(B, 2, j, &br->b0[j], &br->nb[j]);
    }
    if (!mdt_branches_active(br))
        return MDT_OK;
    /* cfg 2: this group's own branch or part; test-only, group 1 computing the conditional
     * branch too (the exchange's tags must catch it) */
    br->mine = br->C == 2 && br->guided && mdt_test_hooks_get()->cfg_same_branch ? 0 : br->c;
    mdt_status st = MDT_OK;
    for (int k = 0; k < 2 && st == MDT_OK; k++)
        if (br->C == 1 ? br->guided : k == br->mine)
            st = make_set(m, in, br->guided && k == 1, B, br->b0[k], br->split ? br->nb[k] : 0,
                          &br->set[k]);
    if (st != MDT_OK)
        mdt_branches_free(br);
    return st;
}

int mdt_branches_active(const mdt_branches *br) { return br->guided || br->split; }

/* The latent and timestep of the caller's inputs (the sampler's state) into set k: whole for a
 * branch, rows b0.. for a part of the batch (whole again for one shared by the batch, dim 0 of 1:
 * only a source with the batch's rows has a part's rows to read). */
static mdt_status refresh(const mdt_branches *br, const mdt_model *m, const mdt_tensor_set *in,
                          int k) {
    const char *names[2] = {m->fam->latent_input, m->fam->timestep_input};
    for (int i = 0; i < 2; i++) {
        const mdt_tensor *src = mdt_tensor_set_get(in, names[i]);
        mdt_tensor *dst = mdt_tensor_set_get(br->set[k], names[i]);
        if (!src || !dst || src->dtype != dst->dtype)
            continue;
        const int64_t row = src->ndim >= 1 && src->shape[0] > 0
                                ? mdt_tensor_nbytes(src) / src->shape[0]
                                : mdt_tensor_nbytes(src);
        const int64_t B = br->nb[0] + br->nb[1];
        const int64_t off = br->split && src->ndim >= 1 && src->shape[0] == B ? br->b0[k] * row : 0;
        if (off + mdt_tensor_nbytes(dst) > mdt_tensor_nbytes(src))
            return MDT_FAIL(MDT_E_INVALID, "inputs: '%s' changed its shape during the run",
                            names[i]);
        memcpy(dst->data, (const char *)src->data + off, (size_t)mdt_tensor_nbytes(dst));
    }
    return MDT_OK;
}

/* One forward on set k into *buf (allocated on the first step, `front` floats left free before
 * the output); *n the output's floats (checked against the first step's); the first step also
 * records the output's shape and last dimension in br. */
static mdt_status run_one(mdt_branches *br, mdt_model *m, int k, float **buf, int64_t front,
                          int64_t *n) {
    const int64_t B = br->split ? br->nb[0] + br->nb[1] : 0;
    mdt_tensor_set *res = NULL;
    /* the step cache keeps each branch's state apart, as diffusers' cache_context does */
    if (m->cache)
        MDT_TRY(mdt_cache_select(m->cache, br->guided && k == 1 ? "uncond" : "cond"));
    MDT_TRY(mdt_tensor_set_create(&res));
    /* its tensors carry the conditional names: a failure says whose they are, on the rank that
     * fails, before the agreement (under cfg 2 it is another group's message everywhere) */
    m->fail_label = br->guided && k == 1
                        ? "the unconditional branch (the negative_ inputs in place of theirs)"
                        : NULL;
    mdt_status st = mdt_model_forward(m, br->set[k], res); /* guarded, watched, agreed */
    m->fail_label = NULL;
    const mdt_tensor *o = st == MDT_OK ? mdt_tensor_set_get(res, m->fam->output) : NULL;
    if (st == MDT_OK && (!o || o->dtype != MDT_F32))
        st = MDT_FAIL(MDT_E_INVALID, "the model has no F32 output '%s'", m->fam->output);
    if (st == MDT_OK && !*buf) {
        *n = mdt_tensor_numel(o);
        br->width = o->ndim >= 1 ? o->shape[o->ndim - 1] : 1;
        br->out_ndim = o->ndim;
        memcpy(br->out_shape, o->shape, sizeof br->out_shape);
        if (B > 0 && o->ndim >= 1)
            br->out_shape[0] = B; /* a part's rows of the whole batch */
        if (!(*buf = mdt_alloc(sizeof(float) * (size_t)(front + *n + 1))))
            st = MDT_FAIL(MDT_E_NOMEM, "out of memory for a branch's prediction");
    }
    if (st == MDT_OK && mdt_tensor_numel(o) != *n)
        st = MDT_FAIL(MDT_E_INVALID, "branch %d's output '%s' has %lld values, not %lld", k,
                      m->fam->output, (long long)mdt_tensor_numel(o), (long long)*n);
    if (st == MDT_OK)
        memcpy(*buf + front, o->data, sizeof(float) * (size_t)*n);
    mdt_tensor_set_free(res);
    return st;
}

mdt_status mdt_branches_combine(mdt_cfg_rule rule, double scale, const float *vc, const float *vu,
                                int64_t n, int64_t width, float *v) {
    const float s = (float)scale;
    for (int64_t j = 0; j < n; j++)
        v[j] = vu[j] + s * (vc[j] - vu[j]); /* diffusers: neg + scale * (cond - neg) */
    if (rule != MDT_CFG_RESCALED || width < 1)
        return MDT_OK;
    for (int64_t r = 0; r + width <= n; r += width) { /* each token: the conditional's norm */
        double cn = 0, vn = 0;
        for (int64_t j = r; j < r + width; j++)
            cn += (double)vc[j] * vc[j], vn += (double)v[j] * v[j];
        const float f = (float)sqrt(cn) / (float)sqrt(vn);
        for (int64_t j = r; j < r + width; j++)
            v[j] *= f;
        /* a combined vector of norm 0 (or one past f32) has no direction to rescale: diffusers
         * divides by it into NaNs; here the step ends naming it, before the latent takes it */
        const int64_t bad = mdt_first_nonfinite(v + r, width);
        if (bad >= 0)
            return MDT_FAIL(MDT_E_NUMERIC,
                            "the guided combination (rescale) went non-finite at token %lld "
                            "(element %lld): the combined prediction's norm there is %g, the "
                            "conditional's %g; a zero or overflowing norm cannot be rescaled to "
                            "the conditional's",
                            (long long)(r / width), (long long)(r + bad), sqrt(vn), sqrt(cn));
    }
    return MDT_OK;
}

/* The cfg axis' exchange: this group's tagged row br->send [1 + counts[c]] in, every group's in
 * group order out (rows of 1 + counts[j]); each tag must be 2 step + j (the branch or part due
 * from group j). */
static mdt_status exchange(mdt_branches *br, mdt_model *m, int step, const int64_t counts[2]) {
    mdt_mesh *mesh = m->mesh;
    int64_t *c = mesh->member_i64; /* per-member counts, the mesh's host scratch */
    for (int j = 0; j < 2; j++)
        c[j] = counts[j] + 1;
    if (!br->xchg && !(br->xchg = mdt_alloc(sizeof(float) * (size_t)(c[0] + c[1]))))
        return MDT_FAIL(MDT_E_NOMEM, "out of memory for the cfg exchange");
    mdt_mesh_set_deadline(mesh, mdt_model_step_bound(m)); /* a group stopped here is named */
    const mdt_status st = mdt_allgatherv_floats(mesh, MDT_GROUP_CFG, br->send, br->xchg, c);
    mdt_mesh_set_deadline(mesh, 0);
    MDT_TRY(st);
    for (int j = 0, off = 0; j < 2; off += (int)c[j], j++) {
        const float want = (float)(2 * step + j), got = br->xchg[off];
        if (got != want)
            return MDT_FAIL(MDT_E_INVALID,
                            "no silent degrade: cfg group %d sent %s %d of step %d where its own "
                            "(%d of step %d) was due",
                            j, br->guided ? "branch" : "batch part", (int)got % 2, (int)got / 2, j,
                            step);
    }
    return MDT_OK;
}

/* br->v [nv], allocated on the first step. */
static mdt_status ensure_v(mdt_branches *br, int64_t nv) {
    if (br->v && br->nv == nv)
        return MDT_OK;
    mdt_free(br->v);
    br->nv = nv;
    br->v = mdt_alloc(sizeof(float) * (size_t)(nv > 0 ? nv : 1));
    return br->v ? MDT_OK : MDT_FAIL(MDT_E_NOMEM, "out of memory for a step's prediction");
}

mdt_status mdt_branches_step(mdt_branches *br, mdt_model *m, const mdt_tensor_set *in, int step) {
    const mdt_family *fam = m->fam;
    if (br->C == 1) { /* guided on one cfg group: both branches in turn */
        for (int k = 0; k < 2; k++) {
            MDT_TRY(refresh(br, m, in, k));
            MDT_TRY(run_one(br, m, k, &br->pred[k], 0, &br->n));
        }
        MDT_TRY(ensure_v(br, br->n));
        return mdt_branches_combine(fam->cfg_rule, br->scale, br->pred[0], br->pred[1], br->n,
                                    br->width, br->v);
    }
    /* cfg 2: this group's branch or part (tagged), then one exchange */
    const int k = br->mine;
    MDT_TRY(refresh(br, m, in, k));
    MDT_TRY(run_one(br, m, k, &br->send, 1, &br->n_mine));
    br->send[0] = (float)(2 * step + k);
    int64_t counts[2] = {br->n_mine, br->n_mine};
    if (br->split) { /* the parts' rows: counts in proportion to their batch rows */
        const int64_t per = br->n_mine / br->nb[br->c];
        counts[0] = per * br->nb[0], counts[1] = per * br->nb[1];
    }
    MDT_TRY(exchange(br, m, step, counts));
    MDT_TRY(ensure_v(br, br->split ? counts[0] + counts[1] : br->n_mine));
    const float *r0 = br->xchg + 1, *r1 = br->xchg + counts[0] + 2;
    if (br->split) { /* the parts in batch order */
        memcpy(br->v, r0, sizeof(float) * (size_t)counts[0]);
        memcpy(br->v + counts[0], r1, sizeof(float) * (size_t)counts[1]);
    } else {
        /* the same two rows on every rank: the same verdict, nothing to agree */
        MDT_TRY(
            mdt_branches_combine(fam->cfg_rule, br->scale, r0, r1, br->n_mine, br->width, br->v));
    }
    return MDT_OK;
}

void mdt_branches_free(mdt_branches *br) {
    for (int k = 0; k < 2; k++) {
        mdt_tensor_set_free(br->set[k]);
        mdt_free(br->pred[k]);
    }
    mdt_free(br->xchg);
    mdt_free(br->send);
    mdt_free(br->v);
    memset(br, 0, sizeof *br);
}
