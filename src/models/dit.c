/*
 * dit.c — see dit.h.
 */
#include "models/dit.h"

#include "attn/attn.h"
#include "backend/backend.h"
#include "core/testhooks.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

void mdt_dit_begin(mdt_dit *d, mdt_model *m, int64_t heads, int64_t head_dim) {
    *d = (mdt_dit){.m = m, .mesh = m->mesh, .T = m->T, .k = m->tp_index};
    d->ar = &m->arena, d->ha = &m->harena;
    d->heads = heads / m->T, d->head_dim = head_dim;
    mdt_cp_begin(&d->cp, m->fam->cp_plan, m->mesh);
}

const mdt_attn_names mdt_attn_self = {"attn.to_q",   "attn.to_k",   "attn.to_v",   "attn.to_out.0",
                                      "attn.norm_q", "attn.norm_k", MDT_ROWS_UNSET};

mdt_status mdt_dit_declare_attention(mdt_wtable *t, const char *pfx, const mdt_attn_names *n,
                                     mdt_qkv *w, mdt_lin *out, int64_t inner, int64_t C, int bias) {
    MDT_TRY(mdt_wtable_add_linear(t, &w->q, pfx, n->q, inner, C, MDT_TP_COLWISE, bias));
    const mdt_rows own = n->kv_rows != MDT_ROWS_UNSET ? mdt_wtable_rows(t, n->kv_rows) : t->rows;
    mdt_status st = mdt_wtable_add_linear(t, &w->k, pfx, n->k, inner, C, MDT_TP_COLWISE, bias);
    if (st == MDT_OK)
        st = mdt_wtable_add_linear(t, &w->v, pfx, n->v, inner, C, MDT_TP_COLWISE, bias);
    mdt_wtable_rows(t, own);
    MDT_TRY(st);
    return out ? mdt_wtable_add_linear(t, out, pfx, n->out, C, inner, MDT_TP_ROWWISE, bias)
               : MDT_OK;
}

mdt_status mdt_dit_declare_adaln(mdt_wtable *t, mdt_lin *l, const char *pfx, const char *name,
                                 int64_t out, int64_t in, int bias) {
    const mdt_rows prev = mdt_wtable_rows(t, MDT_ROWS_ONE);
    const mdt_status st =
        mdt_wtable_add_linear(t, l, pfx, name, out, in, MDT_TP_REPLICATED_INPUT_ROWWISE, bias);
    mdt_wtable_rows(t, prev);
    return st;
}

mdt_status mdt_dit_declare_text_embedder(mdt_wtable *t, mdt_lin *l, const char *name, int64_t out,
                                         int64_t in, int bias) {
    const mdt_rows prev = mdt_wtable_rows(t, MDT_ROWS_TEXT);
    const int first = t->n;
    const mdt_status st =
        mdt_wtable_add_linear(t, l, "", name, out, in, MDT_TP_REPLICATED_INPUT_ROWWISE, bias);
    mdt_wtable_set_uneven(t, first); /* any tp: the slices follow mdt_split_range */
    mdt_wtable_rows(t, prev);
    return st;
}

mdt_status mdt_dit_declare_qk_norms(mdt_wtable *t, const char *pfx, const mdt_attn_names *n,
                                    mdt_qkv *w, int64_t D, float eps) {
    char nm[MDT_NAME_MAX];
    w->eps = eps;
    snprintf(nm, sizeof nm, "%s.weight", n->norm_q);
    MDT_TRY(mdt_wtable_add_vector(t, &w->norm_q, pfx, nm, D));
    snprintf(nm, sizeof nm, "%s.weight", n->norm_k);
    return mdt_wtable_add_vector(t, &w->norm_k, pfx, nm, D);
}

mdt_status mdt_dit_declare_ff(mdt_wtable *t, const char *pfx, const char *ff, mdt_lin *l0,
                              mdt_lin *l2, int64_t C, int64_t hidden, int gated, int bias) {
    char nm[MDT_NAME_MAX];
    const int first = t->n;
    snprintf(nm, sizeof nm, "%s.net.0.proj", ff);
    MDT_TRY(mdt_wtable_add_linear(t, l0, pfx, nm, gated ? 2 * hidden : hidden, C,
                                  gated ? MDT_TP_PACKED_COLWISE : MDT_TP_COLWISE, bias));
    for (int i = 1; gated && i <= (bias ? 2 : 1); i++) { /* [value | gate] halves */
        mdt_weight_spec *w = &t->specs[t->n - i];
        w->nblocks = 2, w->blocks[0] = hidden, w->blocks[1] = hidden;
    }
    snprintf(nm, sizeof nm, "%s.net.2", ff);
    MDT_TRY(mdt_wtable_add_linear(t, l2, pfx, nm, C, hidden, MDT_TP_ROWWISE, bias));
    /* the hidden features: any tp (each forward sizes them by the local shape) */
    mdt_wtable_set_uneven(t, first);
    return MDT_OK;
}

mdt_status mdt_dit_check_heads(int64_t heads, int T) {
    if (heads % T != 0)
        return MDT_FAIL(MDT_E_INVALID, "tp=%d does not divide %lld attention heads", T,
                        (long long)heads);
    return MDT_OK;
}

mdt_status mdt_dit_check_tp(int T, int64_t n, const char *what, const char *why) {
    if (n % T != 0)
        return MDT_FAIL(MDT_E_INVALID, "tp=%d does not divide %s %lld (%s)", T, what, (long long)n,
                        why);
    return MDT_OK;
}

mdt_status mdt_dit_check_rope_axes(const int64_t *ax, int nax, int64_t head_dim) {
    int64_t sum = 0;
    for (int i = 0; i < nax; i++) {
        if (ax[i] <= 0 || ax[i] % 2)
            return MDT_FAIL(MDT_E_INVALID,
                            "config.json: axes_dims_rope[%d] = %lld must be even and positive", i,
                            (long long)ax[i]);
        sum += ax[i];
    }
    if (sum != head_dim)
        return MDT_FAIL(MDT_E_INVALID,
                        "config.json: axes_dims_rope sum to %lld but attention_head_dim is %lld",
                        (long long)sum, (long long)head_dim);
    return MDT_OK;
}

void mdt_dit_linear(const mdt_lin *l, const float *x, int64_t M, float *y, int64_t ldy) {
    mdt_k()->linear(x, l->in, l->w, l->wh, l->b, y, ldy, M, l->in, l->out_local);
}

mdt_status mdt_dit_row_linear(const mdt_dit *d, const mdt_lin *l, const float *x, int64_t ldx,
                              float *y, int64_t M) {
    /* the bias rides in TP rank 0's GEMM epilogue, so the sum holds it once and no rank makes
     * a separate pass over y for it */
    mdt_k()->linear(x, ldx, l->w, l->wh, d->k == 0 ? l->b : NULL, y, l->out, M, l->in_local,
                    l->out); // [M, out] partial (+ b on rank 0)
    return d->T > 1 ? mdt_allreduce_sum(d->mesh, MDT_GROUP_TP, y, M * l->out) : MDT_OK;
}

mdt_status mdt_dit_slice_linear(const mdt_dit *d, const mdt_lin *l, const float *x, int64_t ldx,
                                float *y, int64_t M) {
    if (d->T == 1) {
        mdt_k()->linear(x, ldx, l->w, l->wh, l->b, y, l->out, M, l->in, l->out); // [M, out]
        return MDT_OK;
    }
    int64_t start, len;
    mdt_split_range(l->in, d->T, d->k, &start, &len); /* len == l->in_local (the loader's cut) */
    return mdt_dit_row_linear(d, l, x + start, ldx, y, M); // [M, out] reduced, bias once
}

mdt_status mdt_dit_adaln(const mdt_dit *d, const mdt_lin *l, float *y) {
    const float *x = d->cond + (int64_t)d->k * l->in_local; /* this TP rank's input features */
    const int64_t M = d->cond_rows, N = l->out, K = l->in_local;
    const int P = d->cp.P;
    if (P <= 1 || N < P) /* every CP rank shares the condition: the whole projection here */
        return mdt_dit_row_linear(d, l, x, d->cond_width, y, M);
    /* Under CP each rank multiplies its slice of the output features (mdt_split_range over the
     * CP group) and the CP gather puts the columns together (y as [M, N, 1] split along N): the
     * weights, read at a row product's memory rate, are read once per group instead of once per
     * CP rank. Each output element is the same dot product as on one rank. */
    int64_t n0, nl;
    mdt_split_range(N, P, d->cp.chunk, &n0, &nl);
    float *part = mdt_arena_floats(d->ar, M * nl); // [M, N/P] this rank's columns
    if (!part)
        return MDT_E_NOMEM;
    mdt_k()->linear(x, d->cond_width, l->w ? l->w + n0 * K : NULL, l->wh ? l->wh + n0 * K : NULL,
                    l->b && d->k == 0 ? l->b + n0 : NULL, part, nl, M, K, nl); // [M, N/P]
    if (d->T > 1)
        MDT_TRY(mdt_allreduce_sum(d->mesh, MDT_GROUP_TP, part, M * nl));
    return mdt_cp_gather_rows(d->mesh, d->ar, P, M, N, 1, part, y); // [M, N]
}

void mdt_dit_mlp2(const mdt_lin *l1, const mdt_lin *l2, const float *x, int64_t M, float *h,
                  float *y) {
    mdt_k()->linear(x, l1->in, l1->w, l1->wh, l1->b, h, l1->out, M, l1->in, l1->out); // [M, hidden]
    mdt_k()->silu(h, M * l1->out);
    mdt_k()->linear(h, l2->in, l2->w, l2->wh, l2->b, y, l2->out, M, l2->in, l2->out); // [M, out]
}

void mdt_dit_timestep_embed(const float *t, int64_t n, int64_t dim, float *e) {
    const int64_t half = dim / 2;
    for (int64_t b = 0; b < n; b++)
        for (int64_t i = 0; i < half; i++) {
            const float fr = expf(-logf(10000.0f) * (float)i / (float)half);
            e[b * dim + i] = cosf(t[b] * fr);
            e[b * dim + half + i] = sinf(t[b] * fr);
        }
}

mdt_status mdt_dit_heads_alloc(const mdt_dit *d, int64_t S, mdt_heads *h) {
    const int64_t n = d->B * d->heads * S * d->head_dim;
    h->S = S;
    h->q = mdt_arena_floats(d->ar, n); // [B, H/T, S, D]
    h->k = mdt_arena_floats(d->ar, n); // [B, H/T, S, D]
    h->v = mdt_arena_floats(d->ar, n); // [B, H/T, S, D]
    return h->q && h->k && h->v ? MDT_OK : MDT_E_NOMEM;
}

void mdt_dit_qkv(const mdt_dit *d, const mdt_qkv *w, const float *x, int64_t n, int64_t s0,
                 const mdt_rope *rope, const mdt_heads *h, float *tmp) {
    const int64_t C = w->q.in, H = d->heads, D = d->head_dim, S = h->S, W = w->q.out_local;
    const mdt_lin *lins[3] = {&w->q, &w->k, &w->v};
    float *dst[3] = {h->q, h->k, h->v};
    const float *norms[3] = {w->norm_q, w->norm_k, NULL};
    mdt_k_shared_begin(x, C, d->B * n, C); /* one bf16 rounding of x for the three */
    for (int j = 0; j < 3; j++) {
        const int r = rope && j < 2;
        mdt_dit_linear(lins[j], x, d->B * n, tmp, W); // [B*n, H/T D]
        for (int64_t b = 0; b < d->B; b++)
            mdt_k()->heads_prepare(tmp + b * n * W, W, n, H, D, norms[j], w->eps,
                                   r ? rope->cos_t + s0 * rope->rot : NULL,
                                   r ? rope->sin_t + s0 * rope->rot : NULL, r ? rope->rot : D,
                                   r ? rope->kind : MDT_ROPE_INTERLEAVED, dst[j] + b * H * S * D, S,
                                   s0); // [H/T, S, D] rows s0..s0+n
    }
    mdt_k_shared_end();
}

mdt_status mdt_dit_attend(const mdt_dit *d, const mdt_heads *h, int cp, float *out, int64_t ld) {
    const int64_t H = d->heads, D = d->head_dim, S = h->S, n = H * S * D;
    const float scale = 1.0f / sqrtf((float)D);
    for (int64_t b = 0; b < d->B; b++) {
        const mdt_attn_args a = {.q = h->q + b * n,
                                 .k = h->k + b * n,
                                 .v = h->v + b * n,
                                 .out = out + b * S * ld, // [S, H/T D]
                                 .ld_out = ld,
                                 .H = H,
                                 .Sq = S,
                                 .Sk = S,
                                 .kv = S,
                                 .D = D,
                                 .scale = scale};
        MDT_TRY(mdt_attention(cp ? d->cp.mesh : NULL, d->ar, &a));
    }
    return MDT_OK;
}

mdt_status mdt_dit_attend_kv(const mdt_dit *d, const float *q, int64_t Sq, const float *k,
                             const float *v, int64_t Sk, float *out, int64_t ld) {
    const int64_t H = d->heads, D = d->head_dim;
    const float scale = 1.0f / sqrtf((float)D);
    for (int64_t b = 0; b < d->B; b++) {
        const mdt_attn_args a = {.q = q + b * H * Sq * D,
                                 .k = k + b * H * Sk * D,
                                 .v = v + b * H * Sk * D,
                                 .out = out + b * Sq * ld, // [Sq, H/T D]
                                 .ld_out = ld,
                                 .H = H,
                                 .Sq = Sq,
                                 .Sk = Sk,
                                 .kv = Sk,
                                 .D = D,
                                 .scale = scale};
        MDT_TRY(mdt_k_attention(d->ar, &a));
    }
    mdt_counters *cn = mdt_counters_get();
    cn->attn_query_rows += d->B * H * Sq;
    cn->attn_kv_rows += d->B * H * Sk;
    return MDT_OK;
}

mdt_status mdt_dit_rmsnorm_tp(const mdt_dit *d, const float *x, float *y, int64_t M, int64_t W,
                              int64_t width, const float *w, float eps) {
    if (d->T == 1 || M == 0) {
        mdt_k()->rmsnorm(x, w, y, M, W, eps); // [M, W]
        return MDT_OK;
    }
    /* no kernel reduces a row to a scalar or scales rows by scalars, so: squares by the
     * per-row product kernel, row sums by a GEMM with ones, the all-reduce, 1/sqrt on the host
     * (M floats), the per-row factor times w as an outer-product GEMM, then the product */
    mdt_arena_mark mk = mdt_arena_mark_get(d->ar), hk = mdt_arena_mark_get(d->ha);
    float *one_h = mdt_arena_floats(d->ha, W), *s_h = mdt_arena_floats(d->ha, M); // host
    int64_t *row_h = (int64_t *)(void *)mdt_arena_floats(d->ha, 2 * M);           // host [M]
    float *t = mdt_arena_floats(d->ar, M * W), *ss = mdt_arena_floats(d->ar, M);  // [M, W], [M]
    if (!one_h || !s_h || !row_h || !t || !ss)
        return MDT_E_NOMEM;
    for (int64_t j = 0; j < W; j++)
        one_h[j] = 1.0f;
    for (int64_t i = 0; i < M; i++)
        row_h[i] = i;
    const float *one = mdt_k_upload(d->ar, one_h, sizeof(float) * (size_t)W);
    const int64_t *rows = mdt_k_upload(d->ar, row_h, sizeof(int64_t) * (size_t)M);
    if (!one || !rows)
        return MDT_E_NOMEM;
    mdt_k()->fill(t, M * W, 0.0f);
    mdt_k()->gate_residual_rows(t, x, W, x, W, rows, 0, M, W); // [M, W] = x * x
    mdt_k()->linear(t, W, one, NULL, NULL, ss, 1, M, W, 1);    // [M] this rank's sums
    MDT_TRY(mdt_allreduce_sum(d->mesh, MDT_GROUP_TP, ss, M));  // [M] whole rows
    mdt_k_to_host(s_h, ss, sizeof(float) * (size_t)M);
    for (int64_t i = 0; i < M; i++)
        s_h[i] = 1.0f / sqrtf(s_h[i] / (float)width + eps);
    const float *s = mdt_k_upload(d->ar, s_h, sizeof(float) * (size_t)M);
    if (!s)
        return MDT_E_NOMEM;
    mdt_k()->linear(s, 1, w, NULL, NULL, t, W, M, 1, W); // [M, W] = s_i w_j
    mdt_k()->fill(y, M * W, 0.0f);
    mdt_k()->gate_residual_rows(y, x, W, t, W, rows, 0, M, W); // [M, W] = x s w
    mdt_arena_rewind(d->ar, mk);
    mdt_arena_rewind(d->ha, hk);
    return MDT_OK;
}

/* This rank's Ulysses head group [*h0, *h0 + *hn) and coordinates under the layout. */
static void layout_of(const mdt_dit *d, int *R, int *U, int *r, int64_t *hn) {
    const mdt_mesh *mesh = d->mesh;
    int64_t h0;
    *R = mesh ? mesh->R : 1, *U = mesh ? mesh->U : 1, *r = mesh ? mesh->r : 0;
    mdt_split_range(d->heads, *U, mesh ? mesh->u : 0, &h0, hn);
}

void mdt_dit_promise_cp(const mdt_dit *d, mdt_promise *p, const int64_t *parts, int nparts,
                        int64_t calls) {
    int R, U, r;
    int64_t hn, L = 0, S = 0, s0, n;
    layout_of(d, &R, &U, &r, &hn);
    int64_t own = 0;                   /* my chunk's rows */
    for (int i = 0; i < nparts; i++) { /* my sequence block: the chunks of my Ulysses group */
        S += parts[i];
        for (int j = 0; j < U; j++) {
            mdt_split_range(parts[i], R * U, r * U + j, &s0, &n), L += n;
            if (d->mesh && j == d->mesh->u)
                own += n;
        }
    }
    /* the all-to-all receives the group's other rows of my heads and sends my rows of the
     * others' heads: a rank with no rows and no heads (S < R U and heads < U) moves nothing */
    p->ulysses_elems += calls * (hn * (L - own) + own * (d->heads - hn));
    p->want_q += calls * hn * L;
    p->want_kv += calls * hn * S;
    p->whole_q += calls * d->heads * S;
    p->unscattered_q += calls * d->heads * L;
    p->ringless_kv += calls * hn * L;
    p->cp_calls += calls;
}

void mdt_dit_promise_kv(const mdt_dit *d, mdt_promise *p, int64_t S, int64_t Sk, int64_t calls) {
    int64_t s0, n;
    mdt_split_range(S, d->mesh ? d->mesh->cp_size : 1, d->mesh ? d->mesh->cp_index : 0, &s0, &n);
    p->want_q += calls * d->heads * n, p->want_kv += calls * d->heads * Sk;
    p->whole_q += calls * d->heads * S, p->unscattered_q += calls * d->heads * n;
    p->ringless_kv += calls * d->heads * Sk;
}

void mdt_dit_promise_local(const mdt_dit *d, mdt_promise *p, int64_t S, int64_t calls) {
    const int64_t q = calls * d->heads * S;
    p->want_q += q, p->want_kv += q, p->whole_q += q, p->unscattered_q += q, p->ringless_kv += q;
}

mdt_status mdt_dit_end(const mdt_dit *d, mdt_promise *p) {
    int R, U, r;
    int64_t hn;
    MDT_TRY(mdt_cp_end(&d->cp));
    layout_of(d, &R, &U, &r, &hn);
    p->owes[MDT_GROUP_TP] = d->T > 1;
    p->owes[MDT_GROUP_RING] = R > 1 && hn > 0 && p->cp_calls > 0;
    p->owes[MDT_GROUP_ULYSSES] = U > 1 && p->cp_calls > 0 && p->ulysses_elems > 0;
    p->owes[MDT_GROUP_CP] = R * U > 1 && d->cp.given_rows > 0;
    return mdt_model_check_promise(d->m, p);
}

void mdt_dit_block_done(const mdt_dit *d, mdt_arena_mark mk, const char *stack, int64_t i,
                        const mdt_stream *out, int n) {
    char stage[48];
    mdt_arena_rewind(d->ar, mk);
    snprintf(stage, sizeof stage, "%s.%lld", stack, (long long)i);
    const mdt_test_hooks *th = mdt_test_hooks_get();
    if (th->nan_stage && n > 0 && strcmp(th->nan_stage, stage) == 0 && !mdt_backend_mem() &&
        th->nan_elem < d->B * out[0].rows * out[0].width)
        out[0].x[th->nan_elem] = NAN; /* the test seam: this block went non-finite */
    for (int s = 0; s < n; s++)       /* each TP rank scans its part of the replicated rows */
        mdt_guard_finite_part(d->m, stage, out[s].x, d->B * out[s].rows, out[s].width, d->T, d->k);
}

mdt_status mdt_dit_test_point(const mdt_dit *d, const char *phase) {
    return mdt_test_point(phase, d->mesh ? d->mesh->world_rank : 0);
}
