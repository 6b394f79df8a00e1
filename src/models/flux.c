/*
 * flux.c — diffusers' FluxTransformer2DModel: config, weight table with TP styles, CP plan,
 * forward, and random inputs. Semantics follow diffusers exactly (see
 * shared/reference/parallel-semantics.md §8.1): timestep x1000, sinusoid cos-then-sin,
 * RoPE interleaved pairs from cat(txt_ids, img_ids) in float64 then float32, text first in the
 * joint sequence, AdaLayerNormZero chunk order (shift, scale, gate) x2, AdaLayerNormContinuous
 * scale-then-shift, LayerNorm eps 1e-6 without affine, per-head RMSNorm eps 1e-6, GELU(tanh).
 *
 * TP: q/k/v and the MLP input colwise, to_out and the MLP output rowwise, the single blocks'
 * proj_out packed rowwise over [attention | MLP], the AdaLN projections and the context
 * embedder replicated-input rowwise, the other embedders and the final projection replicated. CP:
 * image and text tokens (and their ids) split into P chunks each, ControlNet residuals with the
 * image rows (controlnet.h); the joint sequence of a rank is its text chunk then its image chunk;
 * the output's image rows gathered.
 */
#include "models/cache.h"
#include "models/controlnet.h"
#include "models/joint.h"

#include "backend/backend.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

enum { FLUX_MAX_AXES = 4 };
static const float k_eps = 1e-6f;

typedef struct flux_double {
    mdt_lin norm1, norm1_ctx, ff0, ff2, ffc0, ffc2;
    mdt_joint_attn attn; /* the image and text streams' q/k/v, norms and outputs */
} flux_double;

typedef struct flux_single {
    mdt_lin norm, proj_mlp, proj_out;
    mdt_qkv qkv;
} flux_single;

typedef struct flux {
    int64_t patch, in_ch, out_ch, layers, single_layers, head_dim, heads, joint_dim, pooled_dim;
    int guidance;
    int naxes;
    int64_t axes[FLUX_MAX_AXES];
    int64_t inner, mlp_hidden;
    mdt_lin x_emb, ctx_emb, t_lin1, t_lin2, g_lin1, g_lin2, p_lin1, p_lin2, norm_out, proj_out;
    flux_double *dbl;
    flux_single *sgl;
    /* storage for the block arrays (the impl is a flat zeroed struct) */
    flux_double dbl_store[64];
    flux_single sgl_store[128];
} flux;

/* ---- weight table (every Flux linear has a bias) ---- */
static mdt_status flux_table(flux *f, mdt_wtable *t) {
    const int64_t C = f->inner, M = f->mlp_hidden, D = f->head_dim;
    const mdt_tp_style rep = MDT_TP_REPLICATED;
    char p[MDT_NAME_MAX];
    /* conditioning: one row per sample */
    mdt_wtable_rows(t, MDT_ROWS_ONE);
    MDT_TRY(mdt_wtable_add_linear(t, &f->t_lin1, "time_text_embed.timestep_embedder.", "linear_1",
                                  C, 256, rep, 1));
    MDT_TRY(mdt_wtable_add_linear(t, &f->t_lin2, "time_text_embed.timestep_embedder.", "linear_2",
                                  C, C, rep, 1));
    if (f->guidance) {
        MDT_TRY(mdt_wtable_add_linear(t, &f->g_lin1, "time_text_embed.guidance_embedder.",
                                      "linear_1", C, 256, rep, 1));
        MDT_TRY(mdt_wtable_add_linear(t, &f->g_lin2, "time_text_embed.guidance_embedder.",
                                      "linear_2", C, C, rep, 1));
    }
    MDT_TRY(mdt_wtable_add_linear(t, &f->p_lin1, "time_text_embed.text_embedder.", "linear_1", C,
                                  f->pooled_dim, rep, 1));
    MDT_TRY(mdt_wtable_add_linear(t, &f->p_lin2, "time_text_embed.text_embedder.", "linear_2", C, C,
                                  rep, 1));
    MDT_TRY(mdt_dit_declare_text_embedder(t, &f->ctx_emb, "context_embedder", C, f->joint_dim, 1));
    mdt_wtable_rows(t, MDT_ROWS_ALL);
    MDT_TRY(mdt_wtable_add_linear(t, &f->x_emb, "", "x_embedder", C, f->in_ch, rep, 1));
    for (int64_t i = 0; i < f->layers; i++) {
        flux_double *b = &f->dbl[i];
        snprintf(p, sizeof p, "transformer_blocks.%lld.", (long long)i);
        MDT_TRY(mdt_dit_declare_adaln(t, &b->norm1, p, "norm1.linear", 6 * C, C, 1));
        MDT_TRY(mdt_dit_declare_adaln(t, &b->norm1_ctx, p, "norm1_context.linear", 6 * C, C, 1));
        MDT_TRY(mdt_joint_declare_attention(t, p, &b->attn, C, 1));
        mdt_wtable_rows(t, MDT_ROWS_IMAGE);
        MDT_TRY(mdt_dit_declare_ff(t, p, "ff", &b->ff0, &b->ff2, C, M, 0, 1));
        mdt_wtable_rows(t, MDT_ROWS_TEXT);
        MDT_TRY(mdt_dit_declare_ff(t, p, "ff_context", &b->ffc0, &b->ffc2, C, M, 0, 1));
        MDT_TRY(mdt_joint_declare_qk_norms(t, p, &b->attn, D, k_eps));
    }
    mdt_wtable_rows(t, MDT_ROWS_ALL); /* the single blocks: the joint rows */
    for (int64_t i = 0; i < f->single_layers; i++) {
        flux_single *b = &f->sgl[i];
        snprintf(p, sizeof p, "single_transformer_blocks.%lld.", (long long)i);
        MDT_TRY(mdt_dit_declare_adaln(t, &b->norm, p, "norm.linear", 3 * C, C, 1));
        MDT_TRY(mdt_dit_declare_attention(t, p, &mdt_attn_self, &b->qkv, NULL, C, C, 1));
        MDT_TRY(mdt_wtable_add_linear(t, &b->proj_mlp, p, "proj_mlp", M, C, MDT_TP_COLWISE, 1));
        MDT_TRY(mdt_wtable_add_linear(t, &b->proj_out, p, "proj_out", C, C + M,
                                      MDT_TP_PACKED_ROWWISE, 1));
        /* proj_out's input is [attn heads | mlp hidden]: two blocks, each sharded on its own */
        mdt_weight_spec *po = &t->specs[t->n - 2];
        po->nblocks = 2, po->blocks[0] = C, po->blocks[1] = M;
        MDT_TRY(mdt_dit_declare_qk_norms(t, p, &mdt_attn_self, &b->qkv, D, k_eps));
    }
    return mdt_joint_declare_out(t, &f->norm_out, &f->proj_out, C, f->patch * f->patch * f->out_ch,
                                 1);
}

static void flux_dims(const void *impl, mdt_model_dims *d) {
    const flux *f = impl;
    *d = (mdt_model_dims){.heads = f->heads,
                          .head_dim = f->head_dim,
                          .hidden = f->inner,
                          .ffn = f->mlp_hidden,
                          .self_attn = f->layers + f->single_layers,
                          .out = f->patch * f->patch * f->out_ch};
}

static mdt_status flux_configure(void *impl, const cJSON *cfg, mdt_wtable *t) {
    flux *f = impl;
    int64_t ax[FLUX_MAX_AXES] = {0};
    int nax = FLUX_MAX_AXES;
    int64_t *const ints[] = {&f->patch,  &f->in_ch,         &f->out_ch,
                             &f->layers, &f->single_layers, &f->head_dim,
                             &f->heads,  &f->joint_dim,     &f->pooled_dim};
    MDT_TRY(mdt_cfg_ints(cfg,
                         "patch_size=1 in_channels=64 out_channels=0 num_layers=19 "
                         "num_single_layers=38 attention_head_dim=128 num_attention_heads=24 "
                         "joint_attention_dim=4096 pooled_projection_dim=768",
                         ints, 9));
    MDT_TRY(mdt_cfg_bool(cfg, "guidance_embeds", 0, &f->guidance));
    MDT_TRY(mdt_cfg_int_array(cfg, "axes_dims_rope", ax, &nax));
    if (nax == 0) {
        ax[0] = 16, ax[1] = 56, ax[2] = 56;
        nax = 3;
    }
    if (f->out_ch == 0)
        f->out_ch = f->in_ch;
    if (f->patch < 1 || f->in_ch < 1 || f->out_ch < 1 || f->layers < 0 || f->single_layers < 0 ||
        f->head_dim < 2 || f->heads < 1 || f->joint_dim < 1 || f->pooled_dim < 1)
        return MDT_FAIL(MDT_E_INVALID, "config.json: Flux sizes must be positive");
    const int64_t dims[] = {f->patch,
                            f->in_ch,
                            f->out_ch,
                            f->head_dim,
                            f->heads,
                            f->joint_dim,
                            f->pooled_dim,
                            (f->heads <= MDT_MAX_DIM && f->head_dim <= MDT_MAX_DIM)
                                ? f->heads * f->head_dim
                                : MDT_MAX_DIM + 1};
    MDT_TRY(mdt_cfg_check_dims("Flux", dims, sizeof dims / sizeof dims[0]));
    if (f->layers > 64 || f->single_layers > 128)
        return MDT_FAIL(MDT_E_UNSUPPORTED, "config.json: at most 64 double and 128 single blocks");
    MDT_TRY(mdt_dit_check_rope_axes(ax, nax, f->head_dim));
    f->naxes = nax;
    memcpy(f->axes, ax, sizeof ax);
    f->inner = f->heads * f->head_dim;
    f->mlp_hidden = 4 * f->inner;
    f->dbl = f->dbl_store;
    f->sgl = f->sgl_store;

    return flux_table(f, t);
}

/* ---- forward ---- */

/* diffusers' Flux _cp_plan, and the ControlNet residuals [B, N, S_img, C] split with the image
 * rows (controlnet.h) */
static const mdt_cp_plan k_flux_cp_plan = {
    .nsplit = 6,
    .split = {{"hidden_states", 1, NULL},
              {"encoder_hidden_states", 1, NULL},
              {"img_ids", 0, NULL},
              {"txt_ids", 0, NULL},
              {"controlnet_block_samples", 2, NULL},
              {"controlnet_single_block_samples", 2, NULL}},
    .ngather = 1,
    .gather = {{"sample", 1, NULL}},
};

/* A forward's inputs on this rank: read, checked, cut by the CP plan and uploaded. */
typedef struct flux_in {
    mdt_joint_in s;                 /* the image and text streams, this rank's chunks */
    const float *e256;              /* [2, B, 256] timestep and guidance projections */
    const float *pool;              /* [B, pooled] */
    mdt_rope rope;                  /* [st + si, D] text rows first */
    mdt_controlnet ctl, ctl_single; /* ControlNet residuals after the double / single blocks */
} flux_in;

/* The ControlNet residuals of both stacks (controlnet.h), this rank's rows. */
static mdt_status read_controlnet(const flux *f, mdt_dit *d, const mdt_tensor_set *in, flux_in *x) {
    static const char *const names[] = {"controlnet_block_samples",
                                        "controlnet_single_block_samples"};
    mdt_controlnet *c[] = {&x->ctl, &x->ctl_single};
    int repeat, shared;
    MDT_TRY(mdt_input_flag(in, "controlnet_blocks_repeat", &repeat));
    for (int k = 0; k < 2; k++) {
        const float *v;
        int64_t N;
        MDT_TRY(mdt_controlnet_read(d, in, names[k], x->s.Si, f->inner, &v, &N, &shared));
        MDT_TRY(mdt_controlnet_take(d, names[k], v, 0, x->s.B, N, x->s.Si, f->inner,
                                    k == 0 && repeat, shared, c[k]));
    }
    if (repeat && !x->ctl.r)
        return MDT_FAIL(MDT_E_INVALID, "inputs: 'controlnet_blocks_repeat' is set but there is no "
                                       "'controlnet_block_samples' to repeat");
    return MDT_OK;
}

static mdt_status flux_read(const flux *f, mdt_dit *d, const mdt_tensor_set *in, flux_in *x) {
    MDT_TRY(mdt_joint_read_streams(d, in, f->in_ch, f->joint_dim, 1, &x->s));
    const int64_t B = x->s.B;
    mdt_arena *ha = d->ha, *ar = d->ar;
    mdt_ids img_ids, txt_ids;
    float *pooled, *ts, *g = NULL;
    MDT_TRY(mdt_input_f32(in, "pooled_projections", 2, (int64_t[]){B, f->pooled_dim}, ha, &pooled));
    MDT_TRY(mdt_input_f32_batch(in, "timestep", 1, (int64_t[]){B}, ha, &ts)); /* or [1] */
    MDT_TRY(mdt_joint_read_ids(d, in, "img_ids", x->s.Si, f->naxes, 1, &img_ids));
    MDT_TRY(mdt_joint_read_ids(d, in, "txt_ids", x->s.St, f->naxes, 1, &txt_ids));
    if (f->guidance)
        MDT_TRY(mdt_input_f32_batch(in, "guidance", 1, (int64_t[]){B}, ha, &g));
    float *e256 = mdt_arena_floats(ha, 2 * B * 256); // [2, B, 256] host: t, g
    if (!e256)
        return MDT_E_NOMEM;
    for (int64_t b = 0; b < B; b++)
        ts[b] = ts[b] * 1000.0f;
    mdt_dit_timestep_embed(ts, B, 256, e256);
    for (int64_t b = 0; g && b < B; b++)
        g[b] = g[b] * 1000.0f;
    if (g)
        mdt_dit_timestep_embed(g, B, 256, e256 + B * 256);
    const mdt_rope_axes axes = {f->naxes, f->axes, 10000.0};
    MDT_TRY(mdt_joint_rope(d, &txt_ids, &img_ids, &axes, &x->rope));
    /* to the backend's memory (the same pointers on the CPU backend) */
    x->s.hs = mdt_k_upload(ar, x->s.hs, sizeof(float) * (size_t)(B * x->s.si * f->in_ch));
    x->s.ehs = mdt_k_upload(ar, x->s.ehs, sizeof(float) * (size_t)(B * x->s.st * f->joint_dim));
    x->e256 = mdt_k_upload(ar, e256, sizeof(float) * (size_t)(2 * B * 256));
    x->pool = mdt_k_upload(ar, pooled, sizeof(float) * (size_t)(B * f->pooled_dim));
    if (!x->s.hs || !x->s.ehs || !x->e256 || !x->pool)
        return MDT_E_NOMEM;
    return read_controlnet(f, d, in, x);
}

/* What every block of one forward reads: the model, the inputs, the heads' scratch. */
typedef struct flux_run {
    const flux *f;
    const flux_in *in;
    const mdt_heads *hd;
} flux_run;

/* FluxTransformerBlock: image x [B, si, C] and text c [B, st, C], joint attention. */
static mdt_status double_block(const flux_run *run, const mdt_dit *d, const flux_double *blk,
                               float *x, float *c, int64_t i) {
    const int64_t C = run->f->inner, B = d->B;
    /* TaylorSeer's slots: block i's image and text attention outputs */
    mdt_joint_rows r = {.x = x,
                        .c = c,
                        .si = run->in->s.si,
                        .st = run->in->s.st,
                        .ts = mdt_cache_taylor_of(d),
                        .slot = 2 * i};
    float *mod = mdt_arena_floats(d->ar, B * 6 * C);  // [B, 6C] image
    float *cmod = mdt_arena_floats(d->ar, B * 6 * C); // [B, 6C] text
    if (!mod || !cmod || mdt_joint_rows_alloc(d, C, blk->attn.img.q.out_local, &r) != MDT_OK)
        return MDT_E_NOMEM;
    float *hb = mdt_arena_floats(d->ar, B * (r.si + r.st) * blk->ff0.out_local); // [B*n, 4C/T]
    if (!hb)
        return MDT_E_NOMEM;
    MDT_TRY(mdt_dit_adaln(d, &blk->norm1, mod));      // [B, 6C]
    MDT_TRY(mdt_dit_adaln(d, &blk->norm1_ctx, cmod)); // [B, 6C]
    MDT_TRY(mdt_joint_attention(d, &blk->attn, mod, cmod, k_eps, &run->in->rope, run->hd, &r));
    const mdt_joint_ff ffx = {
        .x = x, .n = r.si, .mod = mod, .eps = k_eps, .nbuf = r.nx, .hbuf = hb, .ybuf = r.tmp};
    const mdt_joint_ff ffc = {
        .x = c, .n = r.st, .mod = cmod, .eps = k_eps, .nbuf = r.nc, .hbuf = hb, .ybuf = r.tmp};
    MDT_TRY(mdt_joint_ff_gelu(d, &blk->ff0, &blk->ff2, &ffx)); // ff
    return mdt_joint_ff_gelu(d, &blk->ffc0, &blk->ffc2, &ffc); // ff_context
}

/* FluxSingleTransformerBlock: h [B, S, C] += gate * proj_out([attn(n) | GELU(proj_mlp(n))]),
 * n = LN(h)(1 + scale) + shift; proj_out's local columns are [attn block k | mlp block k]. */
static mdt_status single_block(const flux_run *run, const mdt_dit *d, const flux_single *blk,
                               float *h, int64_t i) {
    mdt_cache *ts = mdt_cache_taylor_of(d); /* TaylorSeer: slot 2 layers + i, the attention's */
    const int predict = mdt_cache_predicts(ts);
    const int64_t slot = 2 * run->f->layers + i;
    const mdt_heads *hd = run->hd;
    const int64_t C = run->f->inner, B = d->B, S = run->in->s.si + run->in->s.st;
    const int64_t Cl = blk->qkv.q.out_local, Ml = blk->proj_mlp.out_local, W = Cl + Ml;
    float *mod = mdt_arena_floats(d->ar, B * 3 * C); // [B, 3C] shift, scale, gate
    float *n = mdt_arena_floats(d->ar, B * S * C);   // [B, S, C]
    float *cat = mdt_arena_floats(d->ar, B * S * W); // [B, S, (C + 4C)/T] = [attn | mlp]
    float *tmp = mdt_arena_floats(d->ar, B * S * C); // [B*S, C]
    if (!mod || !n || !cat || !tmp)
        return MDT_E_NOMEM;
    MDT_TRY(mdt_dit_adaln(d, &blk->norm, mod)); // [B, 3C]
    for (int64_t b = 0; b < B; b++)
        mdt_k()->layernorm_modulate(h + b * S * C, n + b * S * C, S, C, k_eps, mod + b * 3 * C,
                                    mod + b * 3 * C + C); // [S, C]
    mdt_k_shared_begin(n, C, B * S, C); /* n feeds proj_mlp and q, k, v: rounded once */
    mdt_dit_linear(&blk->proj_mlp, n, B * S, cat + Cl, W); // [B*S, 4C/T] in columns [C/T, W)
    mdt_k()->gelu_rows(cat + Cl, W, B * S, Ml);
    if (!predict)
        mdt_dit_qkv(d, &blk->qkv, n, S, 0, &run->in->rope, hd, tmp);
    mdt_k_shared_end();
    if (!predict)
        MDT_TRY(mdt_dit_attend(d, hd, 1, cat, W)); // columns [0, C/T)
    for (int64_t b = 0; ts && b < B; b++)          /* its heads' columns of the joint rows */
        MDT_TRY(mdt_cache_taylor(ts, d, slot, b, cat + b * S * W, S, Cl, W)); // [S, C/T]
    MDT_TRY(mdt_dit_row_linear(d, &blk->proj_out, cat, W, tmp, B * S));       // [B*S, C]
    for (int64_t b = 0; b < B; b++)
        mdt_k()->gate_residual(h + b * S * C, tmp + b * S * C, C, mod + b * 3 * C + 2 * C, S, C);
    return MDT_OK;
}

static mdt_status flux_forward(mdt_model *m, const mdt_tensor_set *in, mdt_tensor_set *out) {
    const flux *f = m->impl;
    const double t_prep = mdt_now();
    mdt_dit d;
    flux_in x;
    mdt_dit_begin(&d, m, f->heads, f->head_dim);
    MDT_TRY(flux_read(f, &d, in, &x));
    mdt_counters_get()->prep_s += mdt_now() - t_prep;
    const int64_t C = f->inner, B = d.B, si = x.s.si, st = x.s.st, S = si + st;
    mdt_arena *ar = d.ar;
    float *h;
    mdt_heads hd;
    float *cond = mdt_arena_floats(ar, B * C);    // [B, C] SiLU(temb)
    float *temb = mdt_arena_floats(ar, B * C);    // [B, C]
    float *tmp = mdt_arena_floats(ar, B * C);     // [B, C]
    float *xs = mdt_arena_floats(ar, B * si * C); // [B, Si/P, C] image stream
    float *c = mdt_arena_floats(ar, B * st * C);  // [B, St/P, C] text stream
    if (!cond || !temb || !tmp || !xs || !c || mdt_dit_heads_alloc(&d, S, &hd) != MDT_OK)
        return MDT_E_NOMEM;
    /* conditioning: temb = time(t) (+ guidance(g)) + text(pooled); every AdaLN reads SiLU(temb) */
    mdt_dit_mlp2(&f->t_lin1, &f->t_lin2, x.e256, B, cond, temb); // [B, C]
    if (f->guidance) {
        mdt_dit_mlp2(&f->g_lin1, &f->g_lin2, x.e256 + B * 256, B, cond, tmp); // [B, C]
        mdt_k()->add(temb, tmp, B * C);
    }
    mdt_dit_mlp2(&f->p_lin1, &f->p_lin2, x.pool, B, cond, tmp); // [B, C]
    mdt_k()->add(temb, tmp, B * C);
    mdt_k()->copy2d(cond, 0, temb, 0, 1, B * C);
    mdt_k()->silu(cond, B * C);
    d.cond = cond, d.cond_rows = B, d.cond_width = C;
    mdt_guard_finite(d.m, "time_text_embed", cond, B * C);
    mdt_dit_linear(&f->x_emb, x.s.hs, B * si, xs, C); // [B, Si/P, C]
    MDT_TRY(mdt_dit_slice_linear(&d, &f->ctx_emb, x.s.ehs, f->joint_dim, c,
                                 B * st)); // [B, St/P, C]: this rank's input features, reduced
    mdt_guard_finite(d.m, "x_embedder", xs, B * si * C);
    mdt_guard_finite(d.m, "context_embedder", c, B * st * C);
    const flux_run run = {f, &x, &hd};
    /* the step cache (cache.h): the image stream's residual over block 0 decides */
    mdt_cache *cache;
    int skip = 0;
    MDT_TRY(
        mdt_controlnet_check_cache(&d, x.ctl.r || x.ctl_single.r)); /* before the cache begins */
    MDT_TRY(mdt_cache_begin(&d,
                            MDT_CACHE_BIT(MDT_CACHE_FIRST_BLOCK) | MDT_CACHE_BIT(MDT_CACHE_MAG) |
                                MDT_CACHE_BIT(MDT_CACHE_TAYLOR),
                            f->layers + f->single_layers, &cache));
    const mdt_cache_rows img = {xs, si, C, si * C}; /* the image stream: decides, is cached */
    float *x0;
    int64_t ran = 0;
    MDT_TRY(mdt_cache_pre(cache, &d, &img, &x0, &skip)); /* MagCache may skip every block */
    for (int64_t i = 0; i < f->layers && !skip; i++) {   /* double blocks: image and text */
        const mdt_arena_mark mk = mdt_arena_mark_get(ar);
        MDT_TRY(double_block(&run, &d, &f->dbl[i], xs, c, i));
        mdt_controlnet_add(&x.ctl, i, f->layers, xs, si * C); /* the ControlNet's residual */
        mdt_dit_block_done(&d, mk, "transformer_blocks", i, (mdt_stream[]){{xs, si, C}, {c, st, C}},
                           2);
        ran++;
        if (i == 0) /* test seam: a rank failing mid-step */
            MDT_TRY(mdt_dit_test_point(&d, "step"));
        if (i == 0) /* First-Block Cache may skip the rest */
            MDT_TRY(mdt_cache_after_first(cache, &d, x0, &img, &skip));
    }
    MDT_TRY(mdt_joint_concat(&d, &x.s, C, c, xs, &h)); // [B, S/P, C] text rows, then image rows
    for (int64_t i = 0; i < f->single_layers && !skip; i++) { /* single blocks: the joint rows */
        const mdt_arena_mark mk = mdt_arena_mark_get(ar);
        MDT_TRY(single_block(&run, &d, &f->sgl[i], h, i));
        mdt_controlnet_add(&x.ctl_single, i, f->single_layers, h + st * C, S * C); /* image rows */
        mdt_dit_block_done(&d, mk, "single_transformer_blocks", i, &(mdt_stream){h, S, C}, 1);
        ran++;
    }
    /* the tails: the image rows of the joint sequence (the text rows are not read after it) */
    const mdt_cache_rows tail = {h + st * C, si, C, S * C};
    MDT_TRY(mdt_cache_post(cache, &d, x0, &tail, skip, ran, f->layers + f->single_layers));
    /* norm_out: emb [B, 2C] = (scale, shift) -- scale first; image rows only */
    float *emb = mdt_arena_floats(ar, B * 2 * C); // [B, 2C]
    float *xn = mdt_arena_floats(ar, B * si * C); // [B, Si/P, C]
    if (!emb || !xn)
        return MDT_E_NOMEM;
    MDT_TRY(mdt_dit_adaln(&d, &f->norm_out, emb)); // [B, 2C]
    const int predicted = mdt_cache_predicts(cache);
    const mdt_joint_out o = {h, emb, k_eps, &f->proj_out, xn, (predicted ? 0 : ran) * B};
    return mdt_joint_finish(&d, in, &x.s, &o, out);
}

/* FluxTransformer2DModel.forward's tensors; guidance only with a guidance embedding */
#define FLUX_INPUTS                                                                                \
    {"hidden_states", MDT_IN_BATCH}, {"encoder_hidden_states", MDT_IN_BATCH | MDT_IN_BRANCH},      \
        {"pooled_projections", MDT_IN_BATCH | MDT_IN_BRANCH},                                      \
        {"controlnet_block_samples", MDT_IN_BATCH | MDT_IN_SHARED | MDT_IN_OPTIONAL},              \
        {"controlnet_single_block_samples", MDT_IN_BATCH | MDT_IN_SHARED | MDT_IN_OPTIONAL},       \
        {"controlnet_blocks_repeat", MDT_IN_OPTIONAL}, {"timestep", MDT_IN_BATCH | MDT_IN_SHARED}, \
        {"img_ids", 0}, {                                                                          \
        "txt_ids", MDT_IN_BRANCH                                                                   \
    }
static const mdt_input_decl *flux_inputs(const void *impl) {
    static const mdt_input_decl plain[] = {FLUX_INPUTS, {NULL, 0}};
    static const mdt_input_decl guided[] = {
        FLUX_INPUTS, {"guidance", MDT_IN_BATCH | MDT_IN_SHARED}, {NULL, 0}};
    return ((const flux *)impl)->guidance ? guided : plain;
}

static mdt_status flux_check_layout(const void *impl, int T, int R, int U) {
    (void)R, (void)U;
    return mdt_dit_check_heads(((const flux *)impl)->heads, T);
}

/* ---- random inputs ---- */
static mdt_status flux_make_inputs(const void *impl, const mdt_inputs_params *p, mdt_rng *rng,
                                   mdt_tensor_set *out) {
    const flux *f = impl;
    const int64_t B = p->batch, Si = p->img_tokens > 0 ? p->img_tokens : 16;
    const int64_t St = p->txt_tokens > 0 ? p->txt_tokens : 8, w = (int64_t)ceil(sqrt((double)Si));
    mdt_tensor *t;
    MDT_TRY(mdt_inputs_add_normal(out, "hidden_states", 3, (int64_t[]){B, Si, f->in_ch}, rng));
    MDT_TRY(mdt_inputs_add_normal(out, "encoder_hidden_states", 3, (int64_t[]){B, St, f->joint_dim},
                                  rng));
    MDT_TRY(
        mdt_inputs_add_normal(out, "pooled_projections", 2, (int64_t[]){B, f->pooled_dim}, rng));
    MDT_TRY(mdt_inputs_add_const(out, "timestep", B, p->timestep, NULL));
    /* image ids: the latent grid (0, row, col) of a near-square layout, as Flux pipelines build */
    MDT_TRY(mdt_tensor_set_add(out, "img_ids", MDT_F32, 2, (int64_t[]){Si, f->naxes}, &t));
    for (int64_t s = 0; s < Si; s++) {
        const int64_t row = s / w, col = s % w;
        for (int a = 0; a < f->naxes; a++)
            ((float *)t->data)[s * f->naxes + a] = a == 1 ? (float)row : a == 2 ? (float)col : 0.0f;
    }
    MDT_TRY(mdt_tensor_set_add(out, "txt_ids", MDT_F32, 2, (int64_t[]){St, f->naxes}, &t));
    return f->guidance ? mdt_inputs_add_const(out, "guidance", B, p->guidance, NULL) : MDT_OK;
}

const mdt_family mdt_family_flux =
    MDT_FAMILY(flux, "flux", "FluxTransformer2DModel", k_flux_cp_plan, "sample");
