/*
 * flux2.c — diffusers' Flux2Transformer2DModel (FLUX.2 [dev] and [klein]): config, weight table
 * with TP styles, CP plan, forward, random inputs. Semantics follow diffusers 0.42 exactly:
 * timestep (and guidance) x1000 through cos-then-sin sinusoids of timestep_guidance_channels and
 * a SiLU MLP each, summed (temb); no bias anywhere; the modulations are shared by all blocks of a
 * kind: three projections of SiLU(temb) computed once per forward (double image and double text:
 * (shift, scale, gate) x 2; single: shift, scale, gate) and norm_out's (scale, shift), scale
 * first; LayerNorm without affine and per-head RMSNorm with weights, both with the config's eps;
 * RoPE on interleaved pairs from the first len(axes_dims_rope) id columns with theta rope_theta,
 * angles in float64 then rounded to float32; text first in the joint sequence; SwiGLU
 * feed-forwards SiLU(first half) * second half; the single blocks' fused to_qkv_mlp_proj
 * [q | k | v | gate | value] and to_out over [attention | MLP].
 *
 * TP (diffusers' _tp_plan, plus the rest meshdit's styles allow): q/k/v colwise, to_out.0 and
 * to_add_out rowwise, ff(_context).linear_in packed colwise [gate | value] and linear_out rowwise,
 * the single blocks' to_qkv_mlp_proj packed colwise [q, k, v, gate, value] and to_out packed
 * rowwise [attention, MLP]; beyond diffusers: the four modulation projections and
 * context_embedder replicated-input rowwise, the timestep/guidance MLPs colwise then rowwise;
 * x_embedder and proj_out replicated. The projections of a packed output are views of its local
 * rows (lin_rows), so SwiGLU's halves land where the kernel wants them without a copy.
 * CP (diffusers' _cp_plan): image and text tokens and their ids split into P chunks each; a
 * rank's joint sequence is its text chunk then its image chunk; the output gathered.
 */
#include "models/cache.h"
#include "models/joint.h"

#include "backend/backend.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

enum { F2_MAX_AXES = 8, F2_MAX_DOUBLE = 64, F2_MAX_SINGLE = 128 };

typedef struct f2_double {
    mdt_lin ff_in, ff_out, ffc_in, ffc_out;
    mdt_joint_attn attn; /* the image and text streams' q/k/v, norms and outputs */
} f2_double;

typedef struct f2_single {
    mdt_lin qkv_mlp, out; /* attn.to_qkv_mlp_proj, attn.to_out */
    mdt_qkv norms;        /* norm_q / norm_k only: q, k, v are views of qkv_mlp */
} f2_single;

typedef struct flux2 {
    int64_t patch, in_ch, out_ch, layers, single_layers, head_dim, heads, joint_dim, t_ch;
    double mlp_ratio, theta, eps;
    int guidance, naxes;
    int64_t axes[F2_MAX_AXES];
    int64_t inner, mlp_hidden;
    mdt_lin t_lin1, t_lin2, g_lin1, g_lin2, mod_img, mod_txt, mod_single, x_emb, ctx_emb, norm_out,
        proj_out;
    f2_double dbl[F2_MAX_DOUBLE];
    f2_single sgl[F2_MAX_SINGLE];
} flux2;

/* ---- weight table (no Flux.2 linear has a bias) ---- */
/* The block structure of the last tensor appended (a packed weight: each block sharded alone). */
static void set_blocks(mdt_wtable *t, int n, const int64_t *sizes) {
    mdt_weight_spec *w = &t->specs[t->n - 1];
    w->nblocks = n;
    memcpy(w->blocks, sizes, sizeof(int64_t) * (size_t)n);
}

/* A TimestepEmbedding `pfx`: linear_1 colwise [C, in] (this rank's hidden features), linear_2
 * rowwise [C, C]. */
static mdt_status add_embedder(mdt_wtable *t, mdt_lin *l1, mdt_lin *l2, const char *pfx, int64_t C,
                               int64_t in) {
    MDT_TRY(mdt_wtable_add_linear(t, l1, pfx, "linear_1", C, in, MDT_TP_COLWISE, 0));
    return mdt_wtable_add_linear(t, l2, pfx, "linear_2", C, C, MDT_TP_ROWWISE, 0);
}

/* A Flux2FeedForward `pfx ff`: linear_in packed colwise [gate | value] [2 M, C], linear_out
 * rowwise [C, M]; the M features split unevenly when tp does not divide them (the forward takes
 * them from linear_out's local columns). */
static mdt_status add_ff(mdt_wtable *t, mdt_lin *in, mdt_lin *out, const char *pfx, const char *ff,
                         int64_t C, int64_t M) {
    char nm[MDT_NAME_MAX];
    const int first = t->n;
    snprintf(nm, sizeof nm, "%s.linear_in", ff);
    MDT_TRY(mdt_wtable_add_linear(t, in, pfx, nm, 2 * M, C, MDT_TP_PACKED_COLWISE, 0));
    set_blocks(t, 2, (int64_t[]){M, M});
    in->views = 1; /* swiglu_proj: lin_rows */
    snprintf(nm, sizeof nm, "%s.linear_out", ff);
    MDT_TRY(mdt_wtable_add_linear(t, out, pfx, nm, C, M, MDT_TP_ROWWISE, 0));
    mdt_wtable_set_uneven(t, first);
    return MDT_OK;
}

static mdt_status flux2_table(flux2 *f, mdt_wtable *t) {
    const int64_t C = f->inner, M = f->mlp_hidden, D = f->head_dim;
    const mdt_tp_style rep = MDT_TP_REPLICATED;
    const float eps = (float)f->eps;
    char p[MDT_NAME_MAX];
    mdt_wtable_rows(t, MDT_ROWS_ONE); /* conditioning: one row per sample */
    MDT_TRY(add_embedder(t, &f->t_lin1, &f->t_lin2, "time_guidance_embed.timestep_embedder.", C,
                         f->t_ch));
    if (f->guidance)
        MDT_TRY(add_embedder(t, &f->g_lin1, &f->g_lin2, "time_guidance_embed.guidance_embedder.", C,
                             f->t_ch));
    MDT_TRY(mdt_dit_declare_adaln(t, &f->mod_img, "double_stream_modulation_img.", "linear", 6 * C,
                                  C, 0));
    MDT_TRY(mdt_dit_declare_adaln(t, &f->mod_txt, "double_stream_modulation_txt.", "linear", 6 * C,
                                  C, 0));
    MDT_TRY(mdt_dit_declare_adaln(t, &f->mod_single, "single_stream_modulation.", "linear", 3 * C,
                                  C, 0));
    mdt_wtable_rows(t, MDT_ROWS_ALL);
    MDT_TRY(mdt_wtable_add_linear(t, &f->x_emb, "", "x_embedder", C, f->in_ch, rep, 0));
    MDT_TRY(mdt_dit_declare_text_embedder(t, &f->ctx_emb, "context_embedder", C, f->joint_dim, 0));
    mdt_wtable_rows(t, MDT_ROWS_ONE);
    for (int64_t i = 0; i < f->layers; i++) {
        f2_double *b = &f->dbl[i];
        snprintf(p, sizeof p, "transformer_blocks.%lld.", (long long)i);
        MDT_TRY(mdt_joint_declare_attention(t, p, &b->attn, C, 0));
        MDT_TRY(mdt_joint_declare_qk_norms(t, p, &b->attn, D, eps));
        mdt_wtable_rows(t, MDT_ROWS_IMAGE);
        MDT_TRY(add_ff(t, &b->ff_in, &b->ff_out, p, "ff", C, M));
        mdt_wtable_rows(t, MDT_ROWS_TEXT);
        MDT_TRY(add_ff(t, &b->ffc_in, &b->ffc_out, p, "ff_context", C, M));
    }
    mdt_wtable_rows(t, MDT_ROWS_ALL); /* the single blocks: the joint rows */
    for (int64_t i = 0; i < f->single_layers; i++) {
        f2_single *b = &f->sgl[i];
        snprintf(p, sizeof p, "single_transformer_blocks.%lld.", (long long)i);
        const int first = t->n;
        MDT_TRY(mdt_wtable_add_linear(t, &b->qkv_mlp, p, "attn.to_qkv_mlp_proj", 3 * C + 2 * M, C,
                                      MDT_TP_PACKED_COLWISE, 0));
        set_blocks(t, 5, (int64_t[]){C, C, C, M, M});
        b->qkv_mlp.views = 1; /* q, k, v and the MLP halves: lin_rows */
        MDT_TRY(mdt_wtable_add_linear(t, &b->out, p, "attn.to_out", C, C + M, MDT_TP_PACKED_ROWWISE,
                                      0));
        set_blocks(t, 2, (int64_t[]){C, M});
        /* the MLP blocks may split unevenly; the C blocks are whole heads (heads % tp = 0) */
        mdt_wtable_set_uneven(t, first);
        MDT_TRY(mdt_dit_declare_qk_norms(t, p, &mdt_attn_self, &b->norms, D, eps));
    }
    return mdt_joint_declare_out(t, &f->norm_out, &f->proj_out, C, f->patch * f->patch * f->out_ch,
                                 0);
}

static void flux2_dims(const void *impl, mdt_model_dims *d) {
    const flux2 *f = impl;
    *d = (mdt_model_dims){.heads = f->heads,
                          .head_dim = f->head_dim,
                          .hidden = f->inner,
                          .ffn = f->mlp_hidden,
                          .self_attn = f->layers + f->single_layers,
                          .out = f->patch * f->patch * f->out_ch};
}

static mdt_status flux2_configure(void *impl, const cJSON *cfg, mdt_wtable *t) {
    flux2 *f = impl;
    int64_t ax[F2_MAX_AXES] = {0};
    int nax = F2_MAX_AXES;
    int64_t *const ints[] = {&f->patch,    &f->in_ch, &f->out_ch,    &f->layers, &f->single_layers,
                             &f->head_dim, &f->heads, &f->joint_dim, &f->t_ch};
    double *const dbls[] = {&f->mlp_ratio, &f->theta, &f->eps};
    MDT_TRY(mdt_cfg_ints(cfg,
                         "patch_size=1 in_channels=128 out_channels=0 num_layers=8 "
                         "num_single_layers=48 attention_head_dim=128 num_attention_heads=48 "
                         "joint_attention_dim=15360 timestep_guidance_channels=256",
                         ints, 9));
    MDT_TRY(mdt_cfg_doubles(cfg, "mlp_ratio=3 rope_theta=2000 eps=1e-6", dbls, 3));
    MDT_TRY(mdt_cfg_bool(cfg, "guidance_embeds", 1, &f->guidance));
    MDT_TRY(mdt_cfg_int_array(cfg, "axes_dims_rope", ax, &nax));
    if (nax == 0) {
        ax[0] = ax[1] = ax[2] = ax[3] = 32;
        nax = 4;
    }
    if (f->out_ch == 0)
        f->out_ch = f->in_ch;
    if (f->patch < 1 || f->in_ch < 1 || f->out_ch < 1 || f->layers < 0 || f->single_layers < 0 ||
        f->head_dim < 2 || f->heads < 1 || f->joint_dim < 1 || f->t_ch < 2 || f->t_ch % 2)
        return MDT_FAIL(MDT_E_INVALID, "config.json: Flux.2 sizes must be positive "
                                       "(timestep_guidance_channels even)");
    if (!(f->mlp_ratio > 0) || !(f->theta > 0) || !(f->eps > 0) || !isfinite(f->mlp_ratio) ||
        !isfinite(f->theta) || !isfinite(f->eps))
        return MDT_FAIL(MDT_E_INVALID,
                        "config.json: mlp_ratio, rope_theta and eps must be positive and finite");
    const int64_t dims[] = {f->patch, f->in_ch,     f->out_ch, f->head_dim,
                            f->heads, f->joint_dim, f->t_ch,   f->patch * f->patch * f->out_ch};
    MDT_TRY(mdt_cfg_check_dims("Flux.2", dims, sizeof dims / sizeof dims[0]));
    f->inner = f->heads * f->head_dim;
    if (f->inner > MDT_MAX_DIM || (double)f->inner * f->mlp_ratio > (double)MDT_MAX_DIM)
        return MDT_FAIL(MDT_E_UNSUPPORTED, "config.json: Flux.2 widths exceed %lld",
                        (long long)MDT_MAX_DIM);
    f->mlp_hidden = (int64_t)((double)f->inner * f->mlp_ratio); /* int(dim * mlp_ratio) */
    if (f->mlp_hidden < 1)
        return MDT_FAIL(MDT_E_INVALID, "config.json: int(inner x mlp_ratio) = 0");
    if (f->layers > F2_MAX_DOUBLE || f->single_layers > F2_MAX_SINGLE)
        return MDT_FAIL(MDT_E_UNSUPPORTED, "config.json: at most %d double and %d single blocks",
                        F2_MAX_DOUBLE, F2_MAX_SINGLE);
    MDT_TRY(mdt_dit_check_rope_axes(ax, nax, f->head_dim));
    f->naxes = nax;
    memcpy(f->axes, ax, sizeof ax);
    return flux2_table(f, t);
}

/* Flux2Transformer2DModel.forward's tensors; guidance only with a guidance embedder (diffusers
 * ignores it without one: here it is refused, so it is never silently unused) */
#define FLUX2_INPUTS                                                                               \
    {"hidden_states", MDT_IN_BATCH}, {"encoder_hidden_states", MDT_IN_BATCH | MDT_IN_BRANCH},      \
        {"timestep", MDT_IN_BATCH | MDT_IN_SHARED}, {"img_ids", 0}, {                              \
        "txt_ids", MDT_IN_BRANCH                                                                   \
    }
static const mdt_input_decl *flux2_inputs(const void *impl) {
    static const mdt_input_decl plain[] = {FLUX2_INPUTS, {NULL, 0}};
    static const mdt_input_decl guided[] = {
        FLUX2_INPUTS, {"guidance", MDT_IN_BATCH | MDT_IN_SHARED}, {NULL, 0}};
    return ((const flux2 *)impl)->guidance ? guided : plain;
}

static mdt_status flux2_check_layout(const void *impl, int T, int R, int U) {
    const flux2 *f = impl;
    (void)R, (void)U;
    /* the MLP width int(inner x mlp_ratio) and the context embedder's input features split
     * unevenly where tp does not divide them */
    return mdt_dit_check_heads(f->heads, T);
}

/* ---- forward ---- */

/* A forward's inputs on this rank: read, checked, cut by the CP plan and uploaded. */
typedef struct f2_in {
    mdt_joint_in s; /* the image and text streams, this rank's chunks */
    const float *e; /* [2, B, t_ch] timestep and guidance sinusoids */
    mdt_rope rope;  /* [st + si, D] text rows first */
} f2_in;

static mdt_status flux2_read(const flux2 *f, mdt_dit *d, const mdt_tensor_set *in, f2_in *x) {
    MDT_TRY(mdt_joint_read_streams(d, in, f->in_ch, f->joint_dim, 1, &x->s));
    const int64_t B = x->s.B, Tc = f->t_ch;
    mdt_arena *ha = d->ha, *ar = d->ar;
    mdt_ids img_ids, txt_ids;
    float *ts, *g = NULL;
    MDT_TRY(mdt_input_f32_batch(in, "timestep", 1, (int64_t[]){B}, ha, &ts)); /* or [1] */
    MDT_TRY(mdt_joint_read_ids(d, in, "img_ids", x->s.Si, f->naxes, 0, &img_ids));
    MDT_TRY(mdt_joint_read_ids(d, in, "txt_ids", x->s.St, f->naxes, 0, &txt_ids));
    if (f->guidance) /* without guidance_embeds diffusers ignores it, and so do we */
        MDT_TRY(mdt_input_f32_batch(in, "guidance", 1, (int64_t[]){B}, ha, &g));
    float *e = mdt_arena_floats(ha, 2 * B * Tc); // [2, B, t_ch] host: t, g
    if (!e)
        return MDT_E_NOMEM;
    for (int64_t b = 0; b < B; b++)
        ts[b] = ts[b] * 1000.0f;
    mdt_dit_timestep_embed(ts, B, Tc, e);
    for (int64_t b = 0; g && b < B; b++)
        g[b] = g[b] * 1000.0f;
    if (g)
        mdt_dit_timestep_embed(g, B, Tc, e + B * Tc);
    const mdt_rope_axes axes = {f->naxes, f->axes, f->theta};
    MDT_TRY(mdt_joint_rope(d, &txt_ids, &img_ids, &axes, &x->rope));
    /* to the backend's memory (the same pointers on the CPU backend) */
    x->s.hs = mdt_k_upload(ar, x->s.hs, sizeof(float) * (size_t)(B * x->s.si * f->in_ch));
    x->s.ehs = mdt_k_upload(ar, x->s.ehs, sizeof(float) * (size_t)(B * x->s.st * f->joint_dim));
    x->e = mdt_k_upload(ar, e, sizeof(float) * (size_t)(2 * B * Tc));
    return x->s.hs && x->s.ehs && x->e ? MDT_OK : MDT_E_NOMEM;
}

/* Local output rows [r0, r0 + n) of a colwise or packed-colwise linear as a linear of its own: a
 * view of the resident weight (rows of [out_local, in], f32 or bf16), no copy. */
static mdt_lin lin_rows(const mdt_lin *l, int64_t r0, int64_t n) {
    mdt_lin v = *l;
    v.w = l->w ? l->w + r0 * l->in : NULL;
    v.wh = l->wh ? l->wh + r0 * l->in : NULL;
    v.b = l->b ? l->b + r0 : NULL;
    v.out = v.out_local = n;
    return v;
}

/* s [M, n] = SiLU(gate) * value (Flux2SwiGLU) on this rank's features, where l's local output
 * rows [r0, r0 + n) are the gate and [r0 + n, r0 + 2n) the value; each half is projected into
 * the place the swiglu kernel wants ([value | gate]). h [M, 2n] scratch. */
static void swiglu_proj(const mdt_lin *l, int64_t r0, int64_t n, const float *x, int64_t M,
                        float *h, float *s) {
    const mdt_lin gate = lin_rows(l, r0, n), value = lin_rows(l, r0 + n, n);
    mdt_k_shared_begin(x, l->in, M, l->in);    /* x feeds both halves: rounded once */
    mdt_dit_linear(&value, x, M, h, 2 * n);    // [M, n] in columns [0, n)
    mdt_dit_linear(&gate, x, M, h + n, 2 * n); // [M, n] in columns [n, 2n)
    mdt_k_shared_end();
    mdt_k()->swiglu(h, s, M, n); // [M, n]
}

/* s->x [B, n, C] += gate * FF(LN(x) (1 + scale) + shift), the feed-forward half of a double
 * block with the stream's shared modulation; FF = linear_out(SwiGLU(linear_in)), its SwiGLU
 * output in sbuf [B n, M/T] (hbuf holds [value | gate], 2M/T wide). */
static mdt_status ff_residual(const mdt_dit *d, const mdt_lin *l_in, const mdt_lin *l_out,
                              const mdt_joint_ff *s, float *sbuf) {
    const int64_t C = l_out->out, B = d->B, Ml = l_out->in_local, n = s->n;
    for (int64_t b = 0; b < B; b++)
        mdt_k()->layernorm_modulate(s->x + b * n * C, s->nbuf + b * n * C, n, C, s->eps,
                                    s->mod + b * 6 * C + 3 * C,
                                    s->mod + b * 6 * C + 4 * C);     // [n, C]
    swiglu_proj(l_in, 0, Ml, s->nbuf, B * n, s->hbuf, sbuf);         // [B*n, M/T]
    MDT_TRY(mdt_dit_row_linear(d, l_out, sbuf, Ml, s->ybuf, B * n)); // [B*n, C]
    for (int64_t b = 0; b < B; b++)
        mdt_k()->gate_residual(s->x + b * n * C, s->ybuf + b * n * C, C, s->mod + b * 6 * C + 5 * C,
                               n, C);
    return MDT_OK;
}

/* What every block of one forward reads: the model, the inputs, the modulations shared by all
 * blocks of a kind (mi, mt [B, 6C] double image and text, ms [B, 3C] single), the heads. */
typedef struct f2_run {
    const flux2 *f;
    const f2_in *in;
    const float *mi, *mt, *ms;
    const mdt_heads *hd;
} f2_run;

/* Flux2TransformerBlock: image x [B, si, C] and text c [B, st, C], joint attention. */
static mdt_status double_block(const f2_run *run, const mdt_dit *d, const f2_double *blk, float *x,
                               float *c) {
    const flux2 *f = run->f;
    const f2_in *in = run->in;
    const float *mi = run->mi, *mt = run->mt;
    const int64_t B = d->B, Ml = blk->ff_out.in_local;
    mdt_joint_rows r = {.x = x, .c = c, .si = in->s.si, .st = in->s.st};
    const int64_t n = r.si > r.st ? r.si : r.st;
    if (mdt_joint_rows_alloc(d, f->inner, blk->attn.img.q.out_local, &r) != MDT_OK)
        return MDT_E_NOMEM;
    float *hb = mdt_arena_floats(d->ar, B * n * 2 * Ml); // [B*n, 2M/T] = [value | gate]
    float *sb = mdt_arena_floats(d->ar, B * n * Ml);     // [B*n, M/T]
    if (!hb || !sb)
        return MDT_E_NOMEM;
    const float eps = (float)f->eps;
    MDT_TRY(mdt_joint_attention(d, &blk->attn, mi, mt, eps, &in->rope, run->hd, &r));
    const mdt_joint_ff ffx = {
        .x = x, .n = r.si, .mod = mi, .eps = eps, .nbuf = r.nx, .hbuf = hb, .ybuf = r.tmp};
    const mdt_joint_ff ffc = {
        .x = c, .n = r.st, .mod = mt, .eps = eps, .nbuf = r.nc, .hbuf = hb, .ybuf = r.tmp};
    MDT_TRY(ff_residual(d, &blk->ff_in, &blk->ff_out, &ffx, sb)); // ff
    return ff_residual(d, &blk->ffc_in, &blk->ffc_out, &ffc, sb); // ff_context
}

/* Flux2SingleTransformerBlock: h [B, S, C] += gate * to_out([attn(n) | SwiGLU(n)]) with
 * n = LN(h)(1 + scale) + shift and the shared modulation mod [B, 3C]; to_qkv_mlp_proj's local
 * rows are [q_k | k_k | v_k | gate_k | value_k], to_out's local columns [attn_k | mlp_k]. */
static mdt_status single_block(const f2_run *run, const mdt_dit *d, const f2_single *blk,
                               float *h) {
    const flux2 *f = run->f;
    const f2_in *in = run->in;
    const float *mod = run->ms;
    const mdt_heads *hd = run->hd;
    const int64_t C = f->inner, B = d->B, S = in->s.si + in->s.st, M = B * S;
    /* this rank's MLP features (an uneven split when tp does not divide the MLP width) */
    const int64_t Cl = d->heads * d->head_dim, Ml = blk->out.in_local - Cl, W = Cl + Ml;
    float *n = mdt_arena_floats(d->ar, M * C);       // [B, S, C]
    float *g2 = mdt_arena_floats(d->ar, M * 2 * Ml); // [B*S, 2M/T] = [value | gate]
    float *sw = mdt_arena_floats(d->ar, M * Ml);     // [B*S, M/T]
    float *cat = mdt_arena_floats(d->ar, M * W);     // [B, S, (C + M)/T] = [attn | mlp]
    float *tmp = mdt_arena_floats(d->ar, M * C);     // [B*S, C]
    if (!n || !g2 || !sw || !cat || !tmp)
        return MDT_E_NOMEM;
    for (int64_t b = 0; b < B; b++)
        mdt_k()->layernorm_modulate(h + b * S * C, n + b * S * C, S, C, (float)f->eps,
                                    mod + b * 3 * C, mod + b * 3 * C + C); // [S, C]
    const mdt_qkv qkv = {lin_rows(&blk->qkv_mlp, 0, Cl),
                         lin_rows(&blk->qkv_mlp, Cl, Cl),
                         lin_rows(&blk->qkv_mlp, 2 * Cl, Cl),
                         blk->norms.norm_q,
                         blk->norms.norm_k,
                         blk->norms.eps};
    mdt_k_shared_begin(n, C, M, C); /* n feeds q, k, v and the MLP halves: rounded once */
    mdt_dit_qkv(d, &qkv, n, S, 0, &in->rope, hd, tmp);
    swiglu_proj(&blk->qkv_mlp, 3 * Cl, Ml, n, M, g2, sw); // [B*S, M/T]
    mdt_k_shared_end();
    mdt_k()->copy2d(cat + Cl, W, sw, Ml, M, Ml);               // columns [C/T, W)
    MDT_TRY(mdt_dit_attend(d, hd, 1, cat, W));                 // columns [0, C/T)
    MDT_TRY(mdt_dit_row_linear(d, &blk->out, cat, W, tmp, M)); // [B*S, C]
    for (int64_t b = 0; b < B; b++)
        mdt_k()->gate_residual(h + b * S * C, tmp + b * S * C, C, mod + b * 3 * C + 2 * C, S, C);
    return MDT_OK;
}

/* temb [B, C] = linear_2(SiLU(linear_1(e))): a TimestepEmbedding, linear_1 colwise into this
 * rank's hidden features hid [B, C/T], linear_2 rowwise. */
static mdt_status embed(const mdt_dit *d, const mdt_lin *l1, const mdt_lin *l2, const float *e,
                        float *hid, float *y) {
    mdt_dit_linear(l1, e, d->B, hid, l1->out_local); // [B, C/T]
    mdt_k()->silu(hid, d->B * l1->out_local);
    return mdt_dit_row_linear(d, l2, hid, l1->out_local, y, d->B); // [B, C]
}

static mdt_status flux2_forward(mdt_model *m, const mdt_tensor_set *in, mdt_tensor_set *out) {
    const flux2 *f = m->impl;
    const double t_prep = mdt_now();
    mdt_dit d;
    f2_in x;
    mdt_dit_begin(&d, m, f->heads, f->head_dim);
    mdt_cache *cache; /* none here: diffusers' first-block hook cannot run this family either */
    MDT_TRY(mdt_cache_begin(&d, 0, 0, &cache));
    MDT_TRY(flux2_read(f, &d, in, &x));
    mdt_counters_get()->prep_s += mdt_now() - t_prep;
    const int64_t C = f->inner, B = d.B, si = x.s.si, st = x.s.st, S = si + st;
    mdt_arena *ar = d.ar;
    float *h;
    mdt_heads hd;
    float *hid = mdt_arena_floats(ar, B * C);     // [B, C/T] embedder hidden
    float *temb = mdt_arena_floats(ar, B * C);    // [B, C]
    float *tmp = mdt_arena_floats(ar, B * C);     // [B, C]
    float *mi = mdt_arena_floats(ar, B * 6 * C);  // [B, 6C] double blocks, image
    float *mt = mdt_arena_floats(ar, B * 6 * C);  // [B, 6C] double blocks, text
    float *ms = mdt_arena_floats(ar, B * 3 * C);  // [B, 3C] single blocks
    float *mo = mdt_arena_floats(ar, B * 2 * C);  // [B, 2C] norm_out (scale, shift)
    float *xs = mdt_arena_floats(ar, B * si * C); // [B, Si/P, C] image stream
    float *c = mdt_arena_floats(ar, B * st * C);  // [B, St/P, C] text stream
    if (!hid || !temb || !tmp || !mi || !mt || !ms || !mo || !xs || !c ||
        mdt_dit_heads_alloc(&d, S, &hd) != MDT_OK)
        return MDT_E_NOMEM;
    /* conditioning: temb = time(t) (+ guidance(g)); every modulation reads SiLU(temb) */
    MDT_TRY(embed(&d, &f->t_lin1, &f->t_lin2, x.e, hid, temb)); // [B, C]
    if (f->guidance) {
        MDT_TRY(embed(&d, &f->g_lin1, &f->g_lin2, x.e + B * f->t_ch, hid, tmp)); // [B, C]
        mdt_k()->add(temb, tmp, B * C);
    }
    mdt_k()->silu(temb, B * C);
    d.cond = temb, d.cond_rows = B, d.cond_width = C;
    mdt_guard_finite(d.m, "time_guidance_embed", temb, B * C);
    MDT_TRY(mdt_dit_adaln(&d, &f->mod_img, mi));      // [B, 6C]
    MDT_TRY(mdt_dit_adaln(&d, &f->mod_txt, mt));      // [B, 6C]
    MDT_TRY(mdt_dit_adaln(&d, &f->mod_single, ms));   // [B, 3C]
    MDT_TRY(mdt_dit_adaln(&d, &f->norm_out, mo));     // [B, 2C]
    mdt_dit_linear(&f->x_emb, x.s.hs, B * si, xs, C); // [B, Si/P, C]
    MDT_TRY(mdt_dit_slice_linear(&d, &f->ctx_emb, x.s.ehs, f->joint_dim, c,
                                 B * st)); // [B, St/P, C]: replicated input, this rank's features
    mdt_guard_finite(d.m, "x_embedder", xs, B * si * C);
    mdt_guard_finite(d.m, "context_embedder", c, B * st * C);
    const f2_run run = {f, &x, mi, mt, ms, &hd};
    for (int64_t i = 0; i < f->layers; i++) { /* double blocks: image and text streams */
        const mdt_arena_mark mk = mdt_arena_mark_get(ar);
        MDT_TRY(double_block(&run, &d, &f->dbl[i], xs, c));
        mdt_dit_block_done(&d, mk, "transformer_blocks", i, (mdt_stream[]){{xs, si, C}, {c, st, C}},
                           2);
        if (i == 0) /* test seam: a rank failing mid-step */
            MDT_TRY(mdt_dit_test_point(&d, "step"));
    }
    MDT_TRY(mdt_joint_concat(&d, &x.s, C, c, xs, &h)); // [B, S/P, C] text rows, then image rows
    for (int64_t i = 0; i < f->single_layers; i++) {   /* single blocks: the joint rows */
        const mdt_arena_mark mk = mdt_arena_mark_get(ar);
        MDT_TRY(single_block(&run, &d, &f->sgl[i], h));
        mdt_dit_block_done(&d, mk, "single_transformer_blocks", i, &(mdt_stream){h, S, C}, 1);
    }
    /* norm_out on the image rows (mo = (scale, shift)) into xs, free now */
    const mdt_joint_out o = {
        h, mo, (float)f->eps, &f->proj_out, xs, (f->layers + f->single_layers) * B};
    return mdt_joint_finish(&d, in, &x.s, &o, out);
}

/* ---- random inputs: the ids Flux2Pipeline builds ---- */
static mdt_status flux2_make_inputs(const void *impl, const mdt_inputs_params *p, mdt_rng *rng,
                                    mdt_tensor_set *out) {
    const flux2 *f = impl;
    const int64_t B = p->batch, Si = p->img_tokens > 0 ? p->img_tokens : 16, A = f->naxes;
    const int64_t St = p->txt_tokens > 0 ? p->txt_tokens : 8, w = (int64_t)ceil(sqrt((double)Si));
    mdt_tensor *t;
    MDT_TRY(mdt_inputs_add_normal(out, "hidden_states", 3, (int64_t[]){B, Si, f->in_ch}, rng));
    MDT_TRY(mdt_inputs_add_normal(out, "encoder_hidden_states", 3, (int64_t[]){B, St, f->joint_dim},
                                  rng));
    MDT_TRY(mdt_inputs_add_const(out, "timestep", B, p->timestep, NULL));
    /* image ids (t, h, w, l) = (0, row, col, 0) of a near-square latent grid; text (0, 0, 0, l) */
    MDT_TRY(mdt_tensor_set_add(out, "img_ids", MDT_I64, 2, (int64_t[]){Si, A}, &t));
    for (int64_t s = 0; s < Si; s++)
        for (int64_t a = 0; a < A; a++)
            ((int64_t *)t->data)[s * A + a] = a == 1 ? s / w : a == 2 ? s % w : 0;
    MDT_TRY(mdt_tensor_set_add(out, "txt_ids", MDT_I64, 2, (int64_t[]){St, A}, &t));
    for (int64_t s = 0; s < St; s++)
        for (int64_t a = 0; a < A; a++)
            ((int64_t *)t->data)[s * A + a] = a == A - 1 ? s : 0;
    return f->guidance ? mdt_inputs_add_const(out, "guidance", B, p->guidance, NULL) : MDT_OK;
}

const mdt_family mdt_family_flux2 =
    MDT_FAMILY(flux2, "flux2", "Flux2Transformer2DModel", mdt_joint_cp_plan, "sample");
