/*
 * joint.c — see joint.h.
 */
#include "models/joint.h"

#include "models/cache.h"

#include "backend/backend.h"

#include <math.h>
#include <stdio.h>

const mdt_attn_names mdt_attn_added = {"attn.add_q_proj", "attn.add_k_proj",   "attn.add_v_proj",
                                       "attn.to_add_out", "attn.norm_added_q", "attn.norm_added_k",
                                       MDT_ROWS_UNSET};

const mdt_cp_plan mdt_joint_cp_plan = {
    .nsplit = 4,
    .split = {{"hidden_states", 1, NULL},
              {"encoder_hidden_states", 1, NULL},
              {"img_ids", 0, NULL},
              {"txt_ids", 0, NULL}},
    .ngather = 1,
    .gather = {{"sample", 1, NULL}},
};

mdt_status mdt_joint_declare_attention(mdt_wtable *t, const char *pfx, mdt_joint_attn *w, int64_t C,
                                       int bias) {
    const mdt_rows prev = mdt_wtable_rows(t, MDT_ROWS_IMAGE);
    mdt_status st =
        mdt_dit_declare_attention(t, pfx, &mdt_attn_self, &w->img, &w->to_out, C, C, bias);
    mdt_wtable_rows(t, MDT_ROWS_TEXT);
    if (st == MDT_OK)
        st =
            mdt_dit_declare_attention(t, pfx, &mdt_attn_added, &w->ctx, &w->to_add_out, C, C, bias);
    mdt_wtable_rows(t, prev);
    return st;
}

mdt_status mdt_joint_declare_qk_norms(mdt_wtable *t, const char *pfx, mdt_joint_attn *w, int64_t D,
                                      float eps) {
    MDT_TRY(mdt_dit_declare_qk_norms(t, pfx, &mdt_attn_self, &w->img, D, eps));
    return mdt_dit_declare_qk_norms(t, pfx, &mdt_attn_added, &w->ctx, D, eps);
}

mdt_status mdt_joint_declare_out(mdt_wtable *t, mdt_lin *norm_out, mdt_lin *proj_out, int64_t C,
                                 int64_t O, int bias) {
    MDT_TRY(mdt_dit_declare_adaln(t, norm_out, "norm_out.", "linear", 2 * C, C, bias));
    const mdt_rows prev = mdt_wtable_rows(t, MDT_ROWS_ALL);
    const mdt_status st =
        mdt_wtable_add_linear(t, proj_out, "", "proj_out", O, C, MDT_TP_REPLICATED, bias);
    mdt_wtable_rows(t, prev);
    return st;
}

mdt_status mdt_joint_read_streams(mdt_dit *d, const mdt_tensor_set *in, int64_t in_ch,
                                  int64_t joint, int split, mdt_joint_in *x) {
    const int64_t B = mdt_input_dim(in, "hidden_states", 0);
    const int64_t Si = mdt_input_dim(in, "hidden_states", 1);
    const int64_t St = mdt_input_dim(in, "encoder_hidden_states", 1);
    int64_t s0;
    if (B < 1 || Si < 1)
        return MDT_FAIL(MDT_E_INVALID,
                        "inputs: 'hidden_states' must be [B, S_img, %lld] with B, S_img >= 1",
                        (long long)in_ch);
    if (St < 1)
        return MDT_FAIL(MDT_E_INVALID,
                        "inputs: 'encoder_hidden_states' must be [B, S_txt, %lld] with S_txt >= 1",
                        (long long)joint);
    const int64_t shs[] = {B, Si, in_ch}, sehs[] = {B, St, joint};
    *x = (mdt_joint_in){.B = B, .Si = Si, .St = St, .si = Si, .st = St};
    d->B = B;
    MDT_TRY(mdt_input_f32_view(in, "hidden_states", 3, shs, d->ha, &x->hs));
    MDT_TRY(mdt_input_f32_view(in, "encoder_hidden_states", 3, sehs, d->ha, &x->ehs));
    if (!split)
        return MDT_OK;
    MDT_TRY(mdt_cp_take(&d->cp, "hidden_states", x->hs, 4, 3, shs, d->ha, (const void **)&x->hs,
                        &s0, &x->si));
    return mdt_cp_take(&d->cp, "encoder_hidden_states", x->ehs, 4, 3, sehs, d->ha,
                       (const void **)&x->ehs, &s0, &x->st);
}

mdt_status mdt_joint_read_ids(mdt_dit *d, const mdt_tensor_set *in, const char *name, int64_t S,
                              int naxes, int exact, mdt_ids *ids) {
    const int is3 = mdt_input_dim(in, name, 2) >= 0;
    float *full;
    int64_t s0;
    MDT_TRY(mdt_input_f32(in, name, is3 ? 3 : 2, is3 ? (int64_t[]){-1, S, -1} : (int64_t[]){S, -1},
                          d->ha, &full));
    const int64_t A = mdt_input_dim(in, name, is3 ? 2 : 1);
    if (A < naxes || (exact && A != naxes) || (is3 && mdt_input_dim(in, name, 0) < 1))
        return MDT_FAIL(MDT_E_INVALID,
                        "inputs: '%s' must be [%lld, A] or [B, %lld, A] with A %s %d (one column "
                        "per rotary axis of axes_dims_rope)",
                        name, (long long)S, (long long)S, exact ? "=" : ">=", naxes);
    ids->width = A;
    return mdt_cp_take(&d->cp, name, full, sizeof(float), 2, (int64_t[]){S, A}, d->ha,
                       (const void **)&ids->v, &s0, &ids->rows);
}

mdt_status mdt_joint_rope(const mdt_dit *d, const mdt_ids *txt, const mdt_ids *img,
                          const mdt_rope_axes *axes, mdt_rope *rope) {
    const int64_t st = txt->rows, si = img->rows, S = st + si, A = axes->n;
    const int64_t At = txt->width, Ai = img->width;
    const float *txt_ids = txt->v, *img_ids = img->v;
    int64_t D = 0;
    for (int a = 0; a < axes->n; a++)
        D += axes->dims[a];
    float *ids = mdt_arena_floats(d->ha, S * A);                         // [S/P, axes] text first
    int32_t *col_axis = (int32_t *)(void *)mdt_arena_floats(d->ha, D);   // [D] host
    double *col_freq = (double *)(void *)mdt_arena_floats(d->ha, 2 * D); // [D] host
    if (!ids || !col_axis || !col_freq)
        return MDT_E_NOMEM;
    for (int64_t s = 0; s < S; s++) /* the first naxes columns, text rows first */
        for (int64_t a = 0; a < A; a++)
            ids[s * A + a] = s < st ? txt_ids[s * At + a] : img_ids[(s - st) * Ai + a];
    /* per axis of width w, pair j: frequency 1/theta^(2j/w) on both of its channels */
    for (int64_t a = 0, off = 0; a < A; off += axes->dims[a], a++)
        for (int64_t j = 0; j < axes->dims[a] / 2; j++) {
            const double fr = 1.0 / pow(axes->theta, (double)(2 * j) / (double)axes->dims[a]);
            col_axis[off + 2 * j] = col_axis[off + 2 * j + 1] = (int32_t)a;
            col_freq[off + 2 * j] = col_freq[off + 2 * j + 1] = fr;
        }
    const float *ids_d = mdt_k_upload(d->ar, ids, sizeof(float) * (size_t)(S * A));
    const int32_t *cax_d = mdt_k_upload(d->ar, col_axis, sizeof(int32_t) * (size_t)D);
    const double *cfr_d = mdt_k_upload(d->ar, col_freq, sizeof(double) * (size_t)D);
    float *cos_t = mdt_arena_floats(d->ar, S * D), *sin_t = mdt_arena_floats(d->ar, S * D);
    if (!ids_d || !cax_d || !cfr_d || !cos_t || !sin_t)
        return MDT_E_NOMEM;
    mdt_k()->angle_table(ids_d, A, S, D, cax_d, cfr_d, 1, cos_t, sin_t); // [S/P, D]
    *rope = (mdt_rope){cos_t, sin_t, D, MDT_ROPE_INTERLEAVED};
    return MDT_OK;
}

mdt_status mdt_joint_rows_alloc(const mdt_dit *d, int64_t C, int64_t Cl, mdt_joint_rows *r) {
    const int64_t B = d->B, S = r->si + r->st;
    r->nx = mdt_arena_floats(d->ar, B * r->si * C); // [B, si, C]
    r->nc = mdt_arena_floats(d->ar, B * r->st * C); // [B, st, C]
    r->tmp = mdt_arena_floats(d->ar, B * S * C);    // [B*max(si,st), C]
    r->ao = mdt_arena_floats(d->ar, B * S * Cl);    // [B, S, C/T]
    return r->nx && r->nc && r->tmp && r->ao ? MDT_OK : MDT_E_NOMEM;
}

/* The rows of an element's n that the first table modulates: `split` clamped to [0, n], or all
 * n without a second table m0. */
static int64_t first_rows(const float *m0, int64_t split, int64_t n) {
    return m0 && split < n ? (split > 0 ? split : 0) : n;
}

/* y = LN(x)(1 + scale) + shift over the n rows of one element's stream [n, C]: rows [0, k) by
 * the tables m [B, 6C], rows [k, n) by m0 (zero_cond_t's; k = n without it); `at` is the shift's
 * offset: the element's table (b 6C) plus 0 (attention) or 3C (feed-forward), scale after it. */
static void modulate(const float *x, float *y, int64_t n, int64_t C, float eps, const float *m,
                     const float *m0, int64_t split, int64_t at) {
    const int64_t k = first_rows(m0, split, n);
    mdt_k()->layernorm_modulate(x, y, k, C, eps, m + at, m + at + C); // [k, C]
    if (k < n)
        mdt_k()->layernorm_modulate(x + k * C, y + k * C, n - k, C, eps, m0 + at,
                                    m0 + at + C); // [n - k, C]
}

/* x += gate * y over the n rows of one element's stream, the gate at `at` (b 6C plus 2C or 5C)
 * of m for rows [0, k) and of m0 after them, as modulate() splits them. */
static void gate(float *x, const float *y, int64_t n, int64_t C, const float *m, const float *m0,
                 int64_t split, int64_t at) {
    const int64_t k = first_rows(m0, split, n);
    mdt_k()->gate_residual(x, y, C, m + at, k, C); // [k, C]
    if (k < n)
        mdt_k()->gate_residual(x + k * C, y + k * C, C, m0 + at, n - k, C); // [n - k, C]
}

mdt_status mdt_joint_attention(const mdt_dit *d, const mdt_joint_attn *w, const float *mi,
                               const float *mt, float eps, const mdt_rope *rope, const mdt_heads *h,
                               const mdt_joint_rows *r) {
    const int64_t C = w->to_out.out, B = d->B, si = r->si, st = r->st, S = si + st;
    const int64_t Cl = w->img.q.out_local;
    /* TaylorSeer between its full steps: the attention module's outputs (after to_out and
     * to_add_out) come from the factors, the module does not run */
    const int predict = mdt_cache_predicts(r->ts);
    const float *mi0 = r->mi0;
    for (int64_t b = 0; b < B && !predict; b++) {
        modulate(r->x + b * si * C, r->nx + b * si * C, si, C, eps, mi, mi0, r->split,
                 b * 6 * C); // [si, C]
        mdt_k()->layernorm_modulate(r->c + b * st * C, r->nc + b * st * C, st, C, eps,
                                    mt + b * 6 * C, mt + b * 6 * C + C); // [st, C]
    }
    if (!predict) {
        mdt_dit_qkv(d, &w->ctx, r->nc, st, 0, rope, h, r->tmp);  /* text rows [0, st) */
        mdt_dit_qkv(d, &w->img, r->nx, si, st, rope, h, r->tmp); /* image rows [st, S) */
        MDT_TRY(mdt_dit_attend(d, h, 1, r->ao, Cl));             // [B, S/P, C/T]
    }
    for (int64_t b = 0; b < B; b++) {
        if (!predict)
            MDT_TRY(mdt_dit_row_linear(d, &w->to_out, r->ao + (b * S + st) * Cl, Cl, r->tmp, si));
        if (r->ts)
            MDT_TRY(mdt_cache_taylor(r->ts, d, r->slot, b, r->tmp, si, C, C));        // [si, C]
        gate(r->x + b * si * C, r->tmp, si, C, mi, mi0, r->split, b * 6 * C + 2 * C); // [si, C]
        if (!predict)
            MDT_TRY(mdt_dit_row_linear(d, &w->to_add_out, r->ao + b * S * Cl, Cl, r->tmp, st));
        if (r->ts)
            MDT_TRY(mdt_cache_taylor(r->ts, d, r->slot + 1, b, r->tmp, st, C, C)); // [st, C]
        mdt_k()->gate_residual(r->c + b * st * C, r->tmp, C, mt + b * 6 * C + 2 * C, st, C);
    }
    return MDT_OK;
}

mdt_status mdt_joint_ff_gelu(const mdt_dit *d, const mdt_lin *l0, const mdt_lin *l2,
                             const mdt_joint_ff *f) {
    const int64_t C = l2->out, B = d->B, Ml = l0->out_local, n = f->n;
    const float *m0 = f->mod0;
    for (int64_t b = 0; b < B; b++)
        modulate(f->x + b * n * C, f->nbuf + b * n * C, n, C, f->eps, f->mod, m0, f->split,
                 b * 6 * C + 3 * C);                 // [n, C]
    mdt_dit_linear(l0, f->nbuf, B * n, f->hbuf, Ml); // [B*n, M/T]
    mdt_k()->gelu_rows(f->hbuf, Ml, B * n, Ml);
    MDT_TRY(mdt_dit_row_linear(d, l2, f->hbuf, Ml, f->ybuf, B * n)); // [B*n, C]
    for (int64_t b = 0; b < B; b++)
        gate(f->x + b * n * C, f->ybuf + b * n * C, n, C, f->mod, m0, f->split,
             b * 6 * C + 5 * C); // [n, C]
    return MDT_OK;
}

mdt_status mdt_joint_concat(const mdt_dit *d, const mdt_joint_in *s, int64_t C, const float *c,
                            const float *x, float **h) {
    const int64_t B = d->B, si = s->si, st = s->st, S = si + st;
    *h = mdt_arena_floats(d->ar, B * S * C); // [B, S/P, C] = cat(c, x) per batch
    if (!*h)
        return MDT_E_NOMEM;
    mdt_k()->copy2d(*h, S * C, c, st * C, B, st * C);          // text rows of every batch
    mdt_k()->copy2d(*h + st * C, S * C, x, si * C, B, si * C); // image rows after them
    return MDT_OK;
}

mdt_status mdt_joint_finish(mdt_dit *d, const mdt_tensor_set *in, const mdt_joint_in *x,
                            const mdt_joint_out *e, mdt_tensor_set *out) {
    const mdt_lin *proj_out = e->proj_out;
    const float *h = e->h, *mo = e->mo;
    float *xn = e->xn;
    const int64_t B = d->B, C = proj_out->in, si = x->si, st = x->st, S = si + st;
    const int64_t O = proj_out->out;
    float *ol = mdt_arena_floats(d->ar, B * si * O); // [B, Si/P, O]
    mdt_tensor *o;
    if (!ol)
        return MDT_E_NOMEM;
    for (int64_t b = 0; b < B; b++)
        mdt_k()->layernorm_modulate(h + (b * S + st) * C, xn + b * si * C, si, C, e->eps,
                                    mo + b * 2 * C + C, mo + b * 2 * C); // [Si/P, C]
    mdt_dit_linear(proj_out, xn, B * si, ol, O);                         // [B, Si/P, O]
    mdt_guard_finite(d->m, "proj_out", ol, B * si * O);
    MDT_TRY(mdt_tensor_set_add(out, "sample", MDT_F32, 3, (int64_t[]){B, x->Si, O}, &o));
    MDT_TRY(mdt_cp_give(&d->cp, "sample", d->ar, d->ha, in, x->Si, ol, o));
    /* no silent degrade: each query row once over the joint sequence, per block and batch */
    mdt_promise p = {0};
    mdt_dit_promise_cp(d, &p, (int64_t[]){x->St, x->Si}, 2, e->calls);
    return mdt_dit_end(d, &p);
}
