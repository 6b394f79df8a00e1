/*
 * wan.c — diffusers' WanTransformer3DModel (Wan 2.1 and 2.2 text-to-video, Wan 2.1
 * image-to-video and first-last-frame, Wan 2.2 TI2V-5B with per-token timesteps): config,
 * weight table with TP styles, CP plan, forward, random inputs (the inputs of a forward are
 * read in wan_inputs.c, the structures shared with it are in wan_model.h). Wan 2.2 A14B is two such
 * transformers the pipeline switches between by timestep: nothing extra here.
 *
 * Semantics follow diffusers 0.42.1 (transformer_wan.py): a Conv3d patch embedding with stride =
 * kernel (a linear over each patch's (c, t, h, w) values); the unscaled sinusoid of the timestep
 * (cos first) through linear-SiLU-linear gives temb, and time_proj(SiLU(temb)) the six shared
 * modulation rows (shift, scale, gate of the self-attention, then of the FFN) each block adds to
 * its own scale_shift_table; text through linear-GELU(tanh)-linear; per block: LayerNorm (no
 * affine, eps) + modulation, self-attention with RMSNorm of q and k over the whole inner width
 * (across heads) and interleaved-pair RoPE from the (frame, row, column) of each token (axes
 * head_dim - 4 (head_dim / 6), 2 (head_dim / 6) twice, float64 angles), gated residual;
 * LayerNorm with affine (cross_attn_norm, else none) and cross-attention of the video queries
 * (q normed, no RoPE) to the text keys/values (k normed), plus, for I2V, to the image tokens'
 * add_k_proj / add_v_proj keys/values (k normed), the two results summed, ungated residual;
 * LayerNorm + modulation, GELU(tanh) FFN, gated residual; out: LayerNorm, shift/scale = temb +
 * scale_shift_table (no projection), proj_out, unpatchify to [B, C, F, H, W]. A timestep of
 * shape [B, S] (TI2V) gives every token its own modulation: computed here once per distinct
 * timestep value and picked per token (the same numbers as diffusers' per-token tables).
 * I2V image embeddings: LayerNorm, linear, GELU (erf), linear, LayerNorm (eps 1e-5, affine), with
 * pos_embed added first for first-last-frame models (input [2B, N, D] viewed as [B, 2N, D]).
 * diffusers' I2V attention cuts the context [image | text] at its length - 512 (as a slice bound)
 * and attends the image projections over the tokens before the cut, the text ones over the rest;
 * the same cut here (mdt_wan_context_cut), so any text length gives diffusers' result (with 512
 * text tokens, as Wan's pipelines pad the text, the cut is exactly between image and text).
 *
 * TP: q/k/v, add_k_proj/add_v_proj and the FFN input colwise (the across-heads norm weights
 * sharded with them; the norm's sum of squares all-reduced over TP, mdt_dit_rmsnorm_tp), to_out
 * and the FFN output rowwise; time_embedder and text_embedder as colwise-then-rowwise MLPs;
 * time_proj replicated-input rowwise; patch embedding, image embedder, proj_out and the
 * modulation tables replicated. CP (diffusers' _cp_plan): the video tokens split (after the
 * patch embedding, with their rotary rows and, for [B, S] timesteps, their timesteps), the text
 * and image tokens stay whole on every rank, the output tokens gathered before unpatchify.
 */
#include "models/cache.h"
#include "models/wan_model.h"

#include "backend/backend.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static const float k_img_eps = 1e-5f; /* the image embedder's LayerNorms (torch's default) */

/* ---- weight table ---- */

/* A colwise vector `pfx name`.weight [n]: sharded with the heads it normalises. */
static mdt_status add_colwise(mdt_wtable *t, const float **v, const char *pfx, const char *name,
                              int64_t n) {
    char nm[2 * MDT_NAME_MAX];
    snprintf(nm, sizeof nm, "%s%s.weight", pfx, name);
    return mdt_wtable_add(t, nm, 1, n, 0, MDT_TP_COLWISE, v);
}

/* WanAttention `pfx attnI.`: q, k, v colwise [A, C], to_out rowwise, norm_q / norm_k [A]. */
static mdt_status add_attention(const wan *f, mdt_wtable *t, const char *pfx, const char *attn,
                                mdt_qkv *w, mdt_lin *out) {
    char n[6][48], p[MDT_NAME_MAX + 8];
    const char *sfx[6] = {"to_q", "to_k", "to_v", "to_out.0", "norm_q", "norm_k"};
    for (int i = 0; i < 6; i++)
        snprintf(n[i], sizeof n[i], "%s.%s", attn, sfx[i]);
    /* attn2 is the cross-attention: its keys and values project the text (the context) */
    const mdt_attn_names names = {n[0],
                                  n[1],
                                  n[2],
                                  n[3],
                                  n[4],
                                  n[5],
                                  strcmp(attn, "attn2") == 0 ? MDT_ROWS_TEXT : MDT_ROWS_UNSET};
    const int64_t A = f->heads * f->head_dim;
    MDT_TRY(mdt_dit_declare_attention(t, pfx, &names, w, out, A, f->C, 1));
    snprintf(p, sizeof p, "%s%s.", pfx, attn);
    w->eps = (float)f->eps;
    MDT_TRY(add_colwise(t, &w->norm_q, p, "norm_q", A));
    return add_colwise(t, &w->norm_k, p, "norm_k", A);
}

static mdt_status add_block(const wan *f, mdt_wtable *t, wan_block *b, const char *pfx) {
    const int64_t C = f->C, A = f->heads * f->head_dim;
    MDT_TRY(add_attention(f, t, pfx, "attn1", &b->a1, &b->o1));
    MDT_TRY(add_attention(f, t, pfx, "attn2", &b->a2, &b->o2));
    if (f->added_kv) { /* I2V: keys and values of the image-conditioning tokens */
        mdt_wtable_rows(t, MDT_ROWS_TEXT);
        MDT_TRY(mdt_wtable_add_linear(t, &b->ak, pfx, "attn2.add_k_proj", A, f->added_kv,
                                      MDT_TP_COLWISE, 1));
        MDT_TRY(mdt_wtable_add_linear(t, &b->av, pfx, "attn2.add_v_proj", A, f->added_kv,
                                      MDT_TP_COLWISE, 1));
        mdt_wtable_rows(t, MDT_ROWS_ALL);
        char p[MDT_NAME_MAX + 8];
        snprintf(p, sizeof p, "%sattn2.", pfx);
        MDT_TRY(add_colwise(t, &b->n_ak, p, "norm_added_k", A));
    }
    if (f->cross_norm) {
        MDT_TRY(mdt_wtable_add_vector(t, &b->n2w, pfx, "norm2.weight", C));
        MDT_TRY(mdt_wtable_add_vector(t, &b->n2b, pfx, "norm2.bias", C));
    }
    MDT_TRY(mdt_dit_declare_ff(t, pfx, "ffn", &b->ff0, &b->ff2, C, f->ffn, 0, 1));
    char nm[MDT_NAME_MAX + 24];
    snprintf(nm, sizeof nm, "%sscale_shift_table", pfx);
    MDT_TRY(mdt_wtable_add(t, nm, 2, 1, 6 * C, MDT_TP_REPLICATED, &b->sst));
    return mdt_wtable_set_stored_shape(t, t->n - 1, 3, (int64_t[]){1, 6, C});
}

static mdt_status wan_table(wan *f, mdt_wtable *t) {
    const int64_t C = f->C, I = f->image_dim;
    const mdt_tp_style rep = MDT_TP_REPLICATED, col = MDT_TP_COLWISE, row = MDT_TP_ROWWISE;
    const char *ce = "condition_embedder.";
    char pfx[MDT_NAME_MAX];
    mdt_wtable_rows(t, MDT_ROWS_ALL);
    MDT_TRY(mdt_wtable_add_linear(t, &f->patch_emb, "", "patch_embedding", C, f->Pin, rep, 1));
    MDT_TRY(mdt_wtable_set_stored_shape(
        t, t->n - 2, 5, (int64_t[]){C, f->in_ch, f->patch[0], f->patch[1], f->patch[2]}));
    snprintf(pfx, sizeof pfx, "%stime_embedder.", ce);
    mdt_wtable_rows(t, MDT_ROWS_ONE); /* conditioning: one row per sample */
    MDT_TRY(mdt_wtable_add_linear(t, &f->t1, pfx, "linear_1", C, f->freq_dim, col, 1));
    MDT_TRY(mdt_wtable_add_linear(t, &f->t2, pfx, "linear_2", C, C, row, 1));
    MDT_TRY(mdt_dit_declare_adaln(t, &f->tproj, ce, "time_proj", 6 * C, C, 1));
    mdt_wtable_rows(t, MDT_ROWS_TEXT); /* the context: text, then image-conditioning tokens */
    snprintf(pfx, sizeof pfx, "%stext_embedder.", ce);
    MDT_TRY(mdt_wtable_add_linear(t, &f->x1, pfx, "linear_1", C, f->text_dim, col, 1));
    MDT_TRY(mdt_wtable_add_linear(t, &f->x2, pfx, "linear_2", C, C, row, 1));
    if (I) {
        snprintf(pfx, sizeof pfx, "%simage_embedder.", ce);
        MDT_TRY(mdt_wtable_add_vector(t, &f->img_n1w, pfx, "norm1.weight", I));
        MDT_TRY(mdt_wtable_add_vector(t, &f->img_n1b, pfx, "norm1.bias", I));
        MDT_TRY(mdt_wtable_add_linear(t, &f->img0, pfx, "ff.net.0.proj", I, I, rep, 1));
        MDT_TRY(mdt_wtable_add_linear(t, &f->img2, pfx, "ff.net.2", C, I, rep, 1));
        MDT_TRY(mdt_wtable_add_vector(t, &f->img_n2w, pfx, "norm2.weight", C));
        MDT_TRY(mdt_wtable_add_vector(t, &f->img_n2b, pfx, "norm2.bias", C));
        if (f->pos_len) {
            char nm[MDT_NAME_MAX + 16];
            snprintf(nm, sizeof nm, "%spos_embed", pfx);
            MDT_TRY(mdt_wtable_add(t, nm, 2, 1, f->pos_len * I, rep, &f->img_pos));
            MDT_TRY(mdt_wtable_set_stored_shape(t, t->n - 1, 3, (int64_t[]){1, f->pos_len, I}));
        }
    }
    mdt_wtable_rows(t, MDT_ROWS_ALL); /* the video tokens */
    for (int64_t i = 0; i < f->layers; i++) {
        snprintf(pfx, sizeof pfx, "blocks.%lld.", (long long)i);
        MDT_TRY(add_block(f, t, &f->blk[i], pfx));
    }
    MDT_TRY(mdt_wtable_add_linear(t, &f->proj_out, "", "proj_out", f->Pout, C, rep, 1));
    MDT_TRY(mdt_wtable_add(t, "scale_shift_table", 2, 1, 2 * C, rep, &f->sst_out));
    return mdt_wtable_set_stored_shape(t, t->n - 1, 3, (int64_t[]){1, 2, C});
}

static void wan_dims(const void *impl, mdt_model_dims *d) {
    const wan *f = impl;
    *d = (mdt_model_dims){.heads = f->heads,
                          .head_dim = f->head_dim,
                          .hidden = f->C,
                          .ffn = f->ffn,
                          .text_cross = 1,
                          .self_attn = f->layers,
                          .cross_attn = f->layers,
                          .out = f->Pout};
}

static mdt_status wan_configure(void *impl, const cJSON *cfg, mdt_wtable *t) {
    wan *f = impl;
    int np = 3, cross = 1;
    const char *qk = NULL;
    int64_t *const ints[] = {&f->heads,     &f->head_dim, &f->in_ch,    &f->out_ch,
                             &f->text_dim,  &f->freq_dim, &f->ffn,      &f->layers,
                             &f->image_dim, &f->added_kv, &f->rope_max, &f->pos_len};
    MDT_TRY(mdt_cfg_ints(cfg,
                         "num_attention_heads=40 attention_head_dim=128 in_channels=16 "
                         "out_channels=0 text_dim=4096 freq_dim=256 ffn_dim=13824 num_layers=40 "
                         "image_dim=0 added_kv_proj_dim=0 rope_max_seq_len=1024 "
                         "pos_embed_seq_len=0",
                         ints, 12));
    MDT_TRY(mdt_cfg_int_array(cfg, "patch_size", f->patch, &np));
    if (np == 0)
        f->patch[0] = 1, f->patch[1] = 2, f->patch[2] = 2, np = 3;
    MDT_TRY(mdt_cfg_bool(cfg, "cross_attn_norm", 1, &cross));
    MDT_TRY(mdt_cfg_double(cfg, "eps", 1e-6, &f->eps));
    MDT_TRY(mdt_cfg_string(cfg, "qk_norm", &qk)); /* 0.42.1 ignores it: norms always present */
    f->cross_norm = cross;
    if (f->out_ch == 0)
        f->out_ch = f->in_ch;
    if (np != 3 || f->heads < 1 || f->head_dim < 2 || f->head_dim % 2 || f->in_ch < 1 ||
        f->out_ch < 1 || f->text_dim < 1 || f->freq_dim < 2 || f->freq_dim % 2 || f->ffn < 1 ||
        f->layers < 0 || f->image_dim < 0 || f->added_kv < 0 || f->rope_max < 1 || f->pos_len < 0 ||
        f->patch[0] < 1 || f->patch[1] < 1 || f->patch[2] < 1 || !(f->eps > 0))
        return MDT_FAIL(MDT_E_INVALID, "config.json: Wan sizes must be positive (patch_size three "
                                       "values, attention_head_dim and freq_dim even, eps > 0)");
    const int64_t dims[] = {f->heads,    f->head_dim, f->in_ch,     f->out_ch,   f->text_dim,
                            f->freq_dim, f->ffn,      f->image_dim, f->added_kv, f->rope_max,
                            f->pos_len,  f->patch[0], f->patch[1],  f->patch[2]};
    MDT_TRY(mdt_cfg_check_dims("Wan", dims, sizeof dims / sizeof dims[0]));
    const int64_t pp = f->patch[0] * f->patch[1]; /* each product below stays < 2^49 */
    if (6 * f->heads * f->head_dim > MDT_MAX_DIM || pp > MDT_MAX_DIM ||
        pp * f->patch[2] > MDT_MAX_DIM || f->in_ch * (pp * f->patch[2]) > MDT_MAX_DIM ||
        f->out_ch * (pp * f->patch[2]) > MDT_MAX_DIM || f->pos_len * f->image_dim > MDT_MAX_DIM)
        return MDT_FAIL(MDT_E_UNSUPPORTED, "config.json: Wan widths exceed %lld",
                        (long long)MDT_MAX_DIM);
    if (f->layers > WAN_MAX_LAYERS)
        return MDT_FAIL(MDT_E_UNSUPPORTED, "config.json: at most %d Wan blocks", WAN_MAX_LAYERS);
    f->C = f->heads * f->head_dim;
    if (!f->image_dim != !f->added_kv || (f->added_kv && f->added_kv != f->C))
        return MDT_FAIL(MDT_E_INVALID,
                        "config.json: image_dim and added_kv_proj_dim come together (Wan 2.1 "
                        "I2V), added_kv_proj_dim = num_attention_heads x attention_head_dim = "
                        "%lld (got image_dim %lld, added_kv_proj_dim %lld)",
                        (long long)f->C, (long long)f->image_dim, (long long)f->added_kv);
    if (f->pos_len && (!f->image_dim || f->pos_len % 2))
        return MDT_FAIL(MDT_E_INVALID,
                        "config.json: pos_embed_seq_len %lld needs image_dim and "
                        "must be even (two images' tokens)",
                        (long long)f->pos_len);
    /* the rotary axes of WanRotaryPosEmbed: h = w = 2 (D / 6), t the rest */
    f->axes[1] = f->axes[2] = 2 * (f->head_dim / 6);
    f->axes[0] = f->head_dim - 2 * f->axes[1];
    f->Pin = f->in_ch * f->patch[0] * f->patch[1] * f->patch[2];
    f->Pout = f->out_ch * f->patch[0] * f->patch[1] * f->patch[2];
    return wan_table(f, t);
}

/* WanTransformer3DModel.forward's tensors; the image embedding only for I2V (image_dim > 0) */
#define WAN_INPUTS                                                                                 \
    {"hidden_states", MDT_IN_BATCH}, {"timestep", MDT_IN_BATCH | MDT_IN_SHARED}, {                 \
        "encoder_hidden_states", MDT_IN_BATCH | MDT_IN_BRANCH                                      \
    }
static const mdt_input_decl *wan_inputs(const void *impl) {
    static const mdt_input_decl t2v[] = {WAN_INPUTS, {NULL, 0}};
    static const mdt_input_decl i2v[] = {
        WAN_INPUTS, {"encoder_hidden_states_image", MDT_IN_BATCH}, {NULL, 0}};
    return ((const wan *)impl)->image_dim > 0 ? i2v : t2v;
}

static mdt_status wan_check_layout(const void *impl, int T, int R, int U) {
    /* the other sharded widths are heads x head_dim, which heads % T covers, and the FFN's
     * ffn_dim, which splits unevenly where T does not divide it (mdt_dit_declare_ff) */
    (void)R, (void)U;
    return mdt_dit_check_heads(((const wan *)impl)->heads, T);
}

/* ---- blocks ---- */

/* One projection to this rank's heads: dst [B, H/T, n, D] head-major = heads of l(x), then
 * (norm not NULL) RMSNorm over the whole inner width with this rank's slice of the weight, then
 * (rope not NULL) RoPE. */
typedef struct wan_proj {
    const mdt_lin *l;
    const float *norm;
    const mdt_rope *rope;
    float *dst;
} wan_proj;
/* A projection's scratch: two [rows, H/T D] buffers. */
typedef struct wan_scratch {
    float *tmp, *tmp2;
} wan_scratch;

/* p of x [B, n, in]. */
static mdt_status project(const wan *f, const mdt_dit *d, const float *x, int64_t n,
                          const wan_proj *p, const wan_scratch *s) {
    const mdt_lin *l = p->l;
    const mdt_rope *rope = p->rope;
    float *tmp = s->tmp, *tmp2 = s->tmp2, *dst = p->dst;
    const int64_t W = l->out_local, H = d->heads, D = d->head_dim;
    const float *src = tmp;
    mdt_dit_linear(l, x, d->B * n, tmp, W); // [B n, H/T D]
    if (p->norm) {
        MDT_TRY(mdt_dit_rmsnorm_tp(d, tmp, tmp2, d->B * n, W, l->out, p->norm, (float)f->eps));
        src = tmp2;
    }
    for (int64_t b = 0; b < d->B; b++)
        mdt_k()->heads_prepare(src + b * n * W, W, n, H, D, NULL, 0.0f, rope ? rope->cos_t : NULL,
                               rope ? rope->sin_t : NULL, rope ? rope->rot : D,
                               MDT_ROPE_INTERLEAVED, dst + b * H * n * D, n, 0); // [H/T, n, D]
    return MDT_OK;
}

/* attn1 on my tokens nx [B, n, C]: y [B n, C] = to_out(attention over the whole video). */
static mdt_status self_attention(const wan *f, const mdt_dit *d, const wan_in *x,
                                 const wan_block *b, const float *nx, float *y) {
    mdt_arena_mark mk = mdt_arena_mark_get(d->ar);
    const int64_t n = x->n, M = d->B * n, W = b->a1.q.out_local;
    mdt_heads h;
    float *tmp = mdt_arena_floats(d->ar, M * W), *tmp2 = mdt_arena_floats(d->ar, M * W);
    float *ao = mdt_arena_floats(d->ar, M * W); // [B, n, A/T]
    if (!tmp || !tmp2 || !ao || mdt_dit_heads_alloc(d, n, &h) != MDT_OK)
        return MDT_E_NOMEM;
    const wan_scratch s = {tmp, tmp2};
    const wan_proj pq = {&b->a1.q, b->a1.norm_q, &x->rope, h.q};
    const wan_proj pk = {&b->a1.k, b->a1.norm_k, &x->rope, h.k};
    const wan_proj pv = {&b->a1.v, NULL, NULL, h.v};
    mdt_k_shared_begin(nx, f->C, M, f->C); /* one bf16 rounding of nx for q, k, v */
    mdt_status st = project(f, d, nx, n, &pq, &s);
    if (st == MDT_OK)
        st = project(f, d, nx, n, &pk, &s);
    if (st == MDT_OK)
        st = project(f, d, nx, n, &pv, &s);
    mdt_k_shared_end();
    MDT_TRY(st);
    MDT_TRY(mdt_dit_attend(d, &h, 1, ao, W));            // [B, n, A/T]
    MDT_TRY(mdt_dit_row_linear(d, &b->o1, ao, W, y, M)); // [B n, C]
    mdt_arena_rewind(d->ar, mk);
    return MDT_OK;
}

/* Keys and values of a whole context c [B, N, in] (every rank the same): k normed. */
static mdt_status context_kv(const wan *f, const mdt_dit *d, const float *c, int64_t N,
                             const wan_proj *k, const wan_proj *v, const wan_scratch *s) {
    mdt_k_shared_begin(c, k->l->in, d->B * N, k->l->in);
    mdt_status st = project(f, d, c, N, k, s); // [B, H/T, N, D]
    if (st == MDT_OK)
        st = project(f, d, c, N, v, s); // [B, H/T, N, D]
    mdt_k_shared_end();
    return st;
}

/* attn2 on my tokens nx [B, n, C] over the whole text context ctx [B, Nct, C] (and the image
 * context img [B, Nci, C]): y [B n, C] = to_out(attention to text + attention to image). */
static mdt_status cross_attention(const wan *f, const mdt_dit *d, const wan_in *x,
                                  const wan_block *b, const float *nx, const float *ctx,
                                  const float *img, float *y) {
    mdt_arena_mark mk = mdt_arena_mark_get(d->ar);
    const int64_t n = x->n, M = d->B * n, W = b->a2.q.out_local;
    const int64_t Nc = x->Nct > x->Nci ? x->Nct : x->Nci;
    const int64_t R = (M > d->B * Nc ? M : d->B * Nc) * W; /* rows of the scratch */
    float *tmp = mdt_arena_floats(d->ar, R), *tmp2 = mdt_arena_floats(d->ar, R); // [rows, A/T]
    float *q = mdt_arena_floats(d->ar, M * W);                                   // [B, H/T, n, D]
    float *k = mdt_arena_floats(d->ar, d->B * Nc * W);                           // [B, H/T, N, D]
    float *v = mdt_arena_floats(d->ar, d->B * Nc * W);                           // [B, H/T, N, D]
    float *ao = mdt_arena_floats(d->ar, M * W);                                  // [B, n, A/T]
    float *ai = mdt_arena_floats(d->ar, img ? M * W : 1);                        // [B, n, A/T]
    if (!tmp || !tmp2 || !q || !k || !v || !ao || !ai)
        return MDT_E_NOMEM;
    const wan_scratch s = {tmp, tmp2};
    MDT_TRY(project(f, d, nx, n, &(wan_proj){&b->a2.q, b->a2.norm_q, NULL, q}, &s));
    /* text_kv (cache.h): the context's K/V kept from the generation's first forward */
    mdt_cache *kv = mdt_cache_kv_of(d);
    const int64_t slot = 4 * (b - f->blk);
    float *ki = k, *vi = v, *kt = k, *vt = v;
    int valid = 0;
    if (img) { /* I2V: the same queries over the image tokens, added to the text result */
        if (kv) {
            MDT_TRY(mdt_cache_kv_slot(kv, slot + 2, d->B * x->Nci * W, &ki, &valid));
            MDT_TRY(mdt_cache_kv_slot(kv, slot + 3, d->B * x->Nci * W, &vi, &valid));
        }
        if (!valid)
            MDT_TRY(context_kv(f, d, img, x->Nci, &(wan_proj){&b->ak, b->n_ak, NULL, ki},
                               &(wan_proj){&b->av, NULL, NULL, vi}, &s));
        MDT_TRY(mdt_dit_attend_kv(d, q, n, ki, vi, x->Nci, ai, W)); // [B, n, A/T]
    }
    if (kv) {
        MDT_TRY(mdt_cache_kv_slot(kv, slot, d->B * x->Nct * W, &kt, &valid));
        MDT_TRY(mdt_cache_kv_slot(kv, slot + 1, d->B * x->Nct * W, &vt, &valid));
    }
    if (!valid)
        MDT_TRY(context_kv(f, d, ctx, x->Nct, &(wan_proj){&b->a2.k, b->a2.norm_k, NULL, kt},
                           &(wan_proj){&b->a2.v, NULL, NULL, vt}, &s));
    MDT_TRY(mdt_dit_attend_kv(d, q, n, kt, vt, x->Nct, ao, W)); // [B, n, A/T]
    if (img)
        mdt_k()->add(ao, ai, M * W);
    MDT_TRY(mdt_dit_row_linear(d, &b->o2, ao, W, y, M)); // [B n, C]
    mdt_arena_rewind(d->ar, mk);
    return MDT_OK;
}

/* FFN on nx [M, C]: y [M, C] = net.2(GELU_tanh(net.0(nx))), TP-sharded. */
static mdt_status feed_forward(const mdt_dit *d, const wan_block *b, const float *nx, int64_t M,
                               float *y) {
    mdt_arena_mark mk = mdt_arena_mark_get(d->ar);
    const int64_t Fl = b->ff0.out_local;
    float *hb = mdt_arena_floats(d->ar, M * Fl); // [M, F/T]
    if (!hb)
        return MDT_E_NOMEM;
    mdt_dit_linear(&b->ff0, nx, M, hb, Fl);
    mdt_k()->gelu_rows(hb, Fl, M, Fl);
    MDT_TRY(mdt_dit_row_linear(d, &b->ff2, hb, Fl, y, M)); // [M, C]
    mdt_arena_rewind(d->ar, mk);
    return MDT_OK;
}

/* y [M, C] = LayerNorm(x) * w + b (affine as modulation: scale w - 1, shift b). */
static mdt_status layernorm_affine(const mdt_dit *d, const float *x, float *y, int64_t M, int64_t C,
                                   float eps, const float *w, const float *b) {
    float *wm1 = mdt_arena_floats(d->ar, C); // [C]
    if (!wm1)
        return MDT_E_NOMEM;
    mdt_k()->fill(wm1, C, -1.0f);
    mdt_k()->add(wm1, w, C);
    mdt_k()->layernorm_modulate(x, y, M, C, eps, b, wm1); // [M, C]
    return MDT_OK;
}

/* WanTransformerBlock on my tokens h [B, n, C]; tproj [Tn, 6C] the shared modulation rows. */
static mdt_status block(const wan *f, const mdt_dit *d, const wan_in *x, const wan_block *b,
                        const float *tproj, const float *ctx, const float *img, float *h) {
    const int64_t C = f->C, M = d->B * x->n, T6 = 6 * C;
    const float eps = (float)f->eps;
    float *mod = mdt_arena_floats(d->ar, x->Tn * T6); // [Tn, 6C] this block's rows
    float *nx = mdt_arena_floats(d->ar, M * C);       // [B, n, C]
    float *y = mdt_arena_floats(d->ar, M * C);        // [B, n, C]
    if (!mod || !nx || !y)
        return MDT_E_NOMEM;
    mdt_k()->copy2d(mod, T6, tproj, T6, x->Tn, T6);
    mdt_k()->add_bias(mod, T6, b->sst, x->Tn, T6); // table + timestep_proj
    /* 1. self-attention: shift 0, scale 1, gate 2 */
    mdt_k()->layernorm_modulate(h, nx, M, C, eps, NULL, NULL);
    mdt_k()->modulate_rows(nx, M, C, mod, T6, x->trow, 0, C);
    MDT_TRY(self_attention(f, d, x, b, nx, y));
    mdt_k()->gate_residual_rows(h, y, C, mod, T6, x->trow, 2 * C, M, C);
    /* 2. cross-attention, ungated */
    if (f->cross_norm)
        MDT_TRY(layernorm_affine(d, h, nx, M, C, eps, b->n2w, b->n2b));
    else
        mdt_k()->copy2d(nx, C, h, C, M, C);
    MDT_TRY(cross_attention(f, d, x, b, nx, ctx, img, y));
    mdt_k()->add(h, y, M * C);
    /* 3. feed-forward: shift 3, scale 4, gate 5 */
    mdt_k()->layernorm_modulate(h, nx, M, C, eps, NULL, NULL);
    mdt_k()->modulate_rows(nx, M, C, mod, T6, x->trow, 3 * C, 4 * C);
    MDT_TRY(feed_forward(d, b, nx, M, y));
    mdt_k()->gate_residual_rows(h, y, C, mod, T6, x->trow, 5 * C, M, C);
    return MDT_OK;
}

/* ---- conditioning ---- */

/* y [M, C] = l2(act(l1(x [M, in]))) with l1 colwise and l2 rowwise (gelu: GELU(tanh), else
 * SiLU): diffusers' TimestepEmbedding and PixArtAlphaTextProjection, TP-sharded. */
static mdt_status mlp_tp(const mdt_dit *d, const mdt_lin *l1, const mdt_lin *l2, const float *x,
                         int64_t M, int gelu, float *y) {
    mdt_arena_mark mk = mdt_arena_mark_get(d->ar);
    const int64_t Hl = l1->out_local;
    float *hb = mdt_arena_floats(d->ar, M * Hl); // [M, C/T]
    if (!hb)
        return MDT_E_NOMEM;
    mdt_dit_linear(l1, x, M, hb, Hl);
    if (gelu)
        mdt_k()->gelu_rows(hb, Hl, M, Hl);
    else
        mdt_k()->silu(hb, M * Hl);
    MDT_TRY(mdt_dit_row_linear(d, l2, hb, Hl, y, M)); // [M, C]
    mdt_arena_rewind(d->ar, mk);
    return MDT_OK;
}

/* WanImageEmbedding: y [B Ni, C] = LN2(ff(LN1(img (+ pos_embed)))), GELU (erf) on the host: no
 * kernel has it and it runs once per forward on the image tokens. */
static mdt_status image_embed(const wan *f, const mdt_dit *d, const wan_in *x, float *y) {
    const int64_t I = f->image_dim, M = d->B * x->Ni;
    mdt_arena_mark mk = mdt_arena_mark_get(d->ar), hk = mdt_arena_mark_get(d->ha);
    float *a = mdt_arena_floats(d->ar, M * I), *g = mdt_arena_floats(d->ar, M * I); // [M, I]
    float *g_h = mdt_arena_floats(d->ha, M * I);                                    // host
    float *z = mdt_arena_floats(d->ar, M * f->C);                                   // [M, C]
    if (!a || !g || !g_h || !z)
        return MDT_E_NOMEM;
    mdt_k()->copy2d(a, I, x->img, I, M, I);
    for (int64_t b = 0; f->pos_len && b < d->B; b++)
        mdt_k()->add(a + b * x->Ni * I, f->img_pos, x->Ni * I); // + pos_embed [2N, I]
    MDT_TRY(layernorm_affine(d, a, g, M, I, k_img_eps, f->img_n1w, f->img_n1b));
    mdt_dit_linear(&f->img0, g, M, a, I); // [M, I]
    mdt_k_to_host(g_h, a, sizeof(float) * (size_t)(M * I));
    for (int64_t i = 0; i < M * I; i++)
        g_h[i] = 0.5f * g_h[i] * (1.0f + erff(g_h[i] * 0.70710678118654752f));
    const float *gd = mdt_k_upload(d->ar, g_h, sizeof(float) * (size_t)(M * I));
    if (!gd)
        return MDT_E_NOMEM;
    mdt_dit_linear(&f->img2, gd, M, z, f->C); // [M, C]
    MDT_TRY(layernorm_affine(d, z, y, M, f->C, k_img_eps, f->img_n2w, f->img_n2b));
    mdt_arena_rewind(d->ar, mk);
    mdt_arena_rewind(d->ha, hk);
    return MDT_OK;
}

/* The I2V contexts as diffusers' attention processor cuts them (mdt_wan_context_cut): of
 * [img [B, Ni, C] | ctx [B, Nt, C]], *ci [B, Nci, C] the rows before the cut (NULL when there
 * are none: no image attention, as zero keys give zeros) and *ct [B, Nct, C] the rows after.
 * With 512 text tokens the cut is between the two: img and ctx themselves, no copy. */
static mdt_status context_cut(const mdt_dit *d, const wan_in *x, int64_t C, const float *img,
                              const float *ctx, const float **ci, const float **ct) {
    const int64_t B = d->B, Ni = x->Ni, Nt = x->Nt, p = x->Nci;
    *ci = p ? img : NULL, *ct = ctx;
    if (p == Ni)
        return MDT_OK;
    float *bi = mdt_arena_floats(d->ar, B * p * C);      // [B, Nci, C]
    float *bt = mdt_arena_floats(d->ar, B * x->Nct * C); // [B, Nct, C]
    if (!bi || !bt)
        return MDT_E_NOMEM;
    const int64_t li = p * C, lt = x->Nct * C; /* rows of every batch element, as floats */
    if (p < Ni) { /* the text attention also gets the image tokens [p, Ni) */
        mdt_k()->copy2d(bi, li, img, Ni * C, B, li);
        mdt_k()->copy2d(bt, lt, img + li, Ni * C, B, (Ni - p) * C);
        mdt_k()->copy2d(bt + (Ni - p) * C, lt, ctx, Nt * C, B, Nt * C);
    } else { /* the image attention also gets the text tokens [0, p - Ni) */
        mdt_k()->copy2d(bi, li, img, Ni * C, B, Ni * C);
        mdt_k()->copy2d(bi + Ni * C, li, ctx, Nt * C, B, (p - Ni) * C);
        mdt_k()->copy2d(bt, lt, ctx + (p - Ni) * C, Nt * C, B, lt);
    }
    *ci = p ? bi : NULL, *ct = bt;
    return MDT_OK;
}

static mdt_status wan_forward(mdt_model *m, const mdt_tensor_set *in, mdt_tensor_set *out) {
    const wan *f = m->impl;
    mdt_dit d;
    wan_in x;
    mdt_dit_begin(&d, m, f->heads, f->head_dim);
    MDT_TRY(mdt_wan_read(f, &d, in, &x));
    const int64_t C = f->C, B = d.B, M = B * x.n, Tn = x.Tn, O = f->Pout;
    mdt_arena *ar = d.ar;
    float *temb = mdt_arena_floats(ar, Tn * C);      // [Tn, C]
    float *cond = mdt_arena_floats(ar, Tn * C);      // [Tn, C] SiLU(temb)
    float *tproj = mdt_arena_floats(ar, Tn * 6 * C); // [Tn, 6C]
    float *ctx = mdt_arena_floats(ar, B * x.Nt * C); // [B, Nt, C]
    float *img = mdt_arena_floats(ar, B * x.Ni * C); // [B, Ni, C]
    float *h = mdt_arena_floats(ar, M * C);          // [B, n, C] my tokens
    if (!temb || !cond || !tproj || !ctx || !img || !h)
        return MDT_E_NOMEM;
    /* conditioning: temb, the shared modulation rows time_proj(SiLU(temb)), text, image */
    MDT_TRY(mlp_tp(&d, &f->t1, &f->t2, x.e, Tn, 0, temb)); // [Tn, C]
    mdt_k()->copy2d(cond, C, temb, C, Tn, C);
    mdt_k()->silu(cond, Tn * C);
    d.cond = cond, d.cond_rows = Tn, d.cond_width = C;
    MDT_TRY(mdt_dit_adaln(&d, &f->tproj, tproj)); // [Tn, 6C]
    mdt_guard_finite(d.m, "condition_embedder.time_proj", tproj, Tn * 6 * C);
    MDT_TRY(mlp_tp(&d, &f->x1, &f->x2, x.ehs, B * x.Nt, 1, ctx)); // [B, Nt, C]
    mdt_guard_finite(d.m, "condition_embedder.text_embedder", ctx, B * x.Nt * C);
    if (x.img) {
        MDT_TRY(image_embed(f, &d, &x, img)); // [B, Ni, C]
        mdt_guard_finite(d.m, "condition_embedder.image_embedder", img, B * x.Ni * C);
    }
    const float *cimg = x.img ? img : NULL, *ctxt = ctx; /* the cross-attention's contexts */
    if (x.img)
        MDT_TRY(context_cut(&d, &x, C, img, ctx, &cimg, &ctxt));
    mdt_dit_linear(&f->patch_emb, x.x, M, h, C); // [B, n, C]
    mdt_guard_finite(d.m, "patch_embedding", h, M * C);
    /* the step cache (cache.h): the video rows' residual over block 0 decides */
    mdt_cache *cache;
    MDT_TRY(mdt_cache_begin(&d,
                            MDT_CACHE_BIT(MDT_CACHE_FIRST_BLOCK) | MDT_CACHE_BIT(MDT_CACHE_MAG) |
                                MDT_CACHE_BIT(MDT_CACHE_TEXT_KV),
                            f->layers, &cache));
    if (cache && cache->spec.kind == MDT_CACHE_TEXT_KV) /* the contexts the K/V come from */
        MDT_TRY(
            mdt_cache_kv_context(cache, &d, ctxt, B * x.Nct * C, cimg, cimg ? B * x.Nci * C : 0));
    const mdt_cache_rows vid = {h, x.n, C, x.n * C};
    float *x0;
    int skip = 0;
    int64_t ran = 0;
    MDT_TRY(mdt_cache_pre(cache, &d, &vid, &x0, &skip)); /* MagCache may skip every block */
    for (int64_t i = 0; i < f->layers && !skip; i++) {
        const mdt_arena_mark mk = mdt_arena_mark_get(ar);
        MDT_TRY(block(f, &d, &x, &f->blk[i], tproj, ctxt, cimg, h));
        mdt_dit_block_done(&d, mk, "blocks", i, &(mdt_stream){h, x.n, C}, 1);
        ran++;
        if (i == 0) /* First-Block Cache may skip the rest */
            MDT_TRY(mdt_cache_after_first(cache, &d, x0, &vid, &skip));
    }
    MDT_TRY(mdt_cache_post(cache, &d, x0, &vid, skip, ran, f->layers));
    /* norm_out: shift, scale = scale_shift_table + temb (per distinct timestep, picked per token)
     */
    float *tab = mdt_arena_floats(ar, Tn * 2 * C);     // [Tn, 2C]
    float *nx = mdt_arena_floats(ar, M * C);           // [B, n, C]
    float *ol = mdt_arena_floats(ar, M * O);           // [B, n, O]
    float *full = mdt_arena_floats(d.ha, B * x.S * O); // [B, S, O] host
    mdt_tensor *o, rows = {.dtype = MDT_F32, .ndim = 3, .shape = {B, x.S, O}, .data = full};
    if (!tab || !nx || !ol || !full)
        return MDT_E_NOMEM;
    mdt_k()->copy2d(tab, 2 * C, temb, C, Tn, C);
    mdt_k()->copy2d(tab + C, 2 * C, temb, C, Tn, C);
    mdt_k()->add_bias(tab, 2 * C, f->sst_out, Tn, 2 * C);
    mdt_k()->layernorm_modulate(h, nx, M, C, (float)f->eps, NULL, NULL);
    mdt_k()->modulate_rows(nx, M, C, tab, 2 * C, x.trow, 0, C);
    mdt_dit_linear(&f->proj_out, nx, M, ol, O); // [B, n, O]
    mdt_guard_finite(d.m, "proj_out", ol, M * O);
    MDT_TRY(mdt_cp_give(&d.cp, "sample", ar, d.ha, in, x.S, ol, &rows)); // [B, S, O]
    MDT_TRY(mdt_tensor_set_add(
        out, "sample", MDT_F32, 5,
        (int64_t[]){B, f->out_ch, x.Fp * f->patch[0], x.Hp * f->patch[1], x.Wp * f->patch[2]}, &o));
    mdt_wan_unpatchify(f, &x, B, full, o->data);
    /* no silent degrade: per block and batch element, the video over CP, text and image whole */
    mdt_promise p = {0};
    mdt_dit_promise_cp(&d, &p, &x.S, 1, ran * B);
    mdt_dit_promise_kv(&d, &p, x.S, x.Nct, ran * B);
    if (cimg)
        mdt_dit_promise_kv(&d, &p, x.S, x.Nci, ran * B);
    return mdt_dit_end(&d, &p);
}

/* ---- random inputs ---- */

/* A near-square grid of `n` tokens: 2 frames when n is even and >= 8, rows the largest divisor of
 * the rest not above its square root. */
static void grid_of(int64_t n, int64_t g[3]) {
    g[0] = n % 2 == 0 && n >= 8 ? 2 : 1;
    const int64_t r = n / g[0];
    g[1] = 1;
    for (int64_t i = 1; i * i <= r; i++)
        if (r % i == 0)
            g[1] = i;
    g[2] = r / g[1];
}

static mdt_status wan_make_inputs(const void *impl, const mdt_inputs_params *p, mdt_rng *rng,
                                  mdt_tensor_set *out) {
    const wan *f = impl;
    const int64_t B = p->batch, Nt = p->txt_tokens > 0 ? p->txt_tokens : 8;
    int64_t g[3];
    grid_of(p->img_tokens > 0 ? p->img_tokens : 16, g);
    MDT_TRY(mdt_inputs_add_normal(
        out, "hidden_states", 5,
        (int64_t[]){B, f->in_ch, g[0] * f->patch[0], g[1] * f->patch[1], g[2] * f->patch[2]}, rng));
    MDT_TRY(mdt_inputs_add_normal(out, "encoder_hidden_states", 3, (int64_t[]){B, Nt, f->text_dim},
                                  rng));
    if (f->image_dim) /* CLIP ViT-H/14's 257 tokens per image; two for first-last-frame */
        MDT_TRY(mdt_inputs_add_normal(
            out, "encoder_hidden_states_image", 3,
            (int64_t[]){f->pos_len ? 2 * B : B, f->pos_len ? f->pos_len / 2 : 257, f->image_dim},
            rng));
    /* the sigma on Wan's 1000 training timesteps, as its pipelines pass it */
    return mdt_inputs_add_const(out, "timestep", B, p->timestep * 1000.0, NULL);
}

/* diffusers' _cp_plan: the block input hidden_states [B, S, C] (here the patch sequence it is
 * made from) and the rotary rows split on the tokens; timestep split on dim 1 (per token: a
 * [B] timestep is every token's); encoder_hidden_states (text, and image) whole; proj_out's
 * tokens gathered. */
static const mdt_cp_plan k_wan_cp_plan = {
    .nsplit = 2,
    .split = {{"hidden_states", 1, NULL}, {"timestep", 1, NULL}},
    .ngather = 1,
    .gather = {{"sample", 1, NULL}},
};

/* Video tokens after patchify plus the text and image tokens every rank holds whole: the rows
 * the memory estimate counts (the latent's dim 1 is its channels, not tokens). */
static int64_t wan_token_rows(const void *impl, const mdt_tensor_set *in) {
    const wan *f = impl;
    const mdt_tensor *x = mdt_tensor_set_get(in, "hidden_states"),
                     *e = mdt_tensor_set_get(in, "encoder_hidden_states"),
                     *im = mdt_tensor_set_get(in, "encoder_hidden_states_image");
    int64_t rows = 0;
    if (x && x->ndim == 5)
        rows +=
            x->shape[2] / f->patch[0] * (x->shape[3] / f->patch[1]) * (x->shape[4] / f->patch[2]);
    if (e && e->ndim == 3)
        rows += e->shape[1];
    if (im && im->ndim == 3)
        rows += im->shape[1];
    return rows;
}

/* The elements of latent [B, C, F, H, W] whose patch token has timestep 0 in timestep [B, S] or
 * [1, S] (S = the patch grid, f-major): Wan 2.2 TI2V's conditioning frame. */
static void wan_clean_elements(const void *impl, const mdt_tensor_set *in, const mdt_tensor *latent,
                               const mdt_tensor *timestep, unsigned char *keep) {
    const wan *f = impl;
    (void)in;
    if (latent->ndim != 5 || timestep->ndim != 2 || timestep->dtype != MDT_F32 ||
        (timestep->shape[0] != latent->shape[0] && timestep->shape[0] != 1))
        return; /* [B, S], or [1, S]: every sample's (docs/models.md) */
    const int64_t B = latent->shape[0], C = latent->shape[1], F = latent->shape[2],
                  H = latent->shape[3], W = latent->shape[4];
    const int64_t Hp = H / f->patch[1], Wp = W / f->patch[2], S = timestep->shape[1];
    if (F % f->patch[0] || H % f->patch[1] || W % f->patch[2] || S != F / f->patch[0] * Hp * Wp)
        return;
    const float *t = timestep->data; // [B, S]
    for (int64_t b = 0; b < B; b++)
        for (int64_t c = 0; c < C; c++)
            for (int64_t z = 0; z < F; z++)
                for (int64_t y = 0; y < H; y++)
                    for (int64_t x = 0; x < W; x++) {
                        const int64_t tok =
                            (z / f->patch[0] * Hp + y / f->patch[1]) * Wp + x / f->patch[2];
                        keep[(((b * C + c) * F + z) * H + y) * W + x] =
                            t[(timestep->shape[0] == 1 ? 0 : b) * S + tok] == 0.0f;
                    }
}

/* Wan takes the scheduler's timestep (0..1000), so the sampler's sigma is scaled by 1000. */
const mdt_family mdt_family_wan = {
    .name = "wan",
    .class_name = "WanTransformer3DModel",
    .impl_size = sizeof(wan),
    .configure = wan_configure,
    .check_layout = wan_check_layout,
    .forward = wan_forward,
    .make_inputs = wan_make_inputs,
    .cp_plan = &k_wan_cp_plan,
    .latent_input = "hidden_states",
    .timestep_input = "timestep",
    .output = "sample",
    .timestep_scale = 1000.0,
    .token_rows = wan_token_rows,
    .clean_elements = wan_clean_elements,
    .dims = wan_dims,
    .inputs = wan_inputs,
};
