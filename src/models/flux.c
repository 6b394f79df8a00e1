/*
 * flux.c — diffusers' FluxTransformer2DModel: config, weight table with TP styles, CP plan,
 * forward, and random inputs. Semantics follow diffusers exactly (see
 * shared/reference/parallel-semantics.md §8.1): timestep x1000, sinusoid cos-then-sin,
 * RoPE interleaved pairs from cat(txt_ids, img_ids) in float64 then float32, text first in the
 * joint sequence, AdaLayerNormZero chunk order (shift, scale, gate) x2, AdaLayerNormContinuous
 * scale-then-shift, LayerNorm eps 1e-6 without affine, per-head RMSNorm eps 1e-6, GELU(tanh).
 *
 * TP: q/k/v and the MLP input colwise, to_out and the MLP output rowwise, the single blocks'
 * proj_out packed rowwise over [attention | MLP], the AdaLN projections replicated-input
 * rowwise, embedders and the final projection replicated. CP: image and text tokens (and their
 * ids) split into P chunks each; the joint sequence of a rank is its text chunk then its image
 * chunk; the output's image rows gathered.
 */
#include "models/dit.h"

#include "backend/backend.h"
#include "core/testhooks.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

enum { FLUX_MAX_AXES = 4 };
static const float k_eps = 1e-6f;

typedef struct flux_double {
    mdt_lin norm1, norm1_ctx, to_out, to_add_out, ff0, ff2, ffc0, ffc2;
    mdt_qkv img, ctx; /* the image and text streams' q/k/v with their norms */
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

static const mdt_cp_plan k_flux_cp_plan = {
    .nsplit = 4,
    .split = {{"hidden_states", 1, NULL},
              {"encoder_hidden_states", 1, NULL},
              {"img_ids", 0, NULL},
              {"txt_ids", 0, NULL}},
    .ngather = 1,
    .gather = {{"sample", 1, NULL}},
};

/* ---- weight table (every Flux linear has a bias) ---- */
static const mdt_attn_names k_added = {"attn.add_q_proj", "attn.add_k_proj",   "attn.add_v_proj",
                                       "attn.to_add_out", "attn.norm_added_q", "attn.norm_added_k"};

static mdt_status flux_table(flux *f, mdt_wtable *t) {
    const int64_t C = f->inner, M = f->mlp_hidden, D = f->head_dim;
    const mdt_tp_style rep = MDT_TP_REPLICATED, adaln = MDT_TP_REPLICATED_INPUT_ROWWISE;
    char p[MDT_NAME_MAX];
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
    MDT_TRY(mdt_wtable_add_linear(t, &f->ctx_emb, "", "context_embedder", C, f->joint_dim, rep, 1));
    MDT_TRY(mdt_wtable_add_linear(t, &f->x_emb, "", "x_embedder", C, f->in_ch, rep, 1));
    for (int64_t i = 0; i < f->layers; i++) {
        flux_double *b = &f->dbl[i];
        snprintf(p, sizeof p, "transformer_blocks.%lld.", (long long)i);
        MDT_TRY(mdt_wtable_add_linear(t, &b->norm1, p, "norm1.linear", 6 * C, C, adaln, 1));
        MDT_TRY(
            mdt_wtable_add_linear(t, &b->norm1_ctx, p, "norm1_context.linear", 6 * C, C, adaln, 1));
        MDT_TRY(mdt_dit_declare_attention(t, p, &mdt_attn_self, &b->img, &b->to_out, C, C, 1));
        MDT_TRY(mdt_dit_declare_attention(t, p, &k_added, &b->ctx, &b->to_add_out, C, C, 1));
        MDT_TRY(mdt_dit_declare_ff(t, p, "ff", &b->ff0, &b->ff2, C, M, 0, 1));
        MDT_TRY(mdt_dit_declare_ff(t, p, "ff_context", &b->ffc0, &b->ffc2, C, M, 0, 1));
        MDT_TRY(mdt_dit_declare_qk_norms(t, p, &mdt_attn_self, &b->img, D, k_eps));
        MDT_TRY(mdt_dit_declare_qk_norms(t, p, &k_added, &b->ctx, D, k_eps));
    }
    for (int64_t i = 0; i < f->single_layers; i++) {
        flux_single *b = &f->sgl[i];
        snprintf(p, sizeof p, "single_transformer_blocks.%lld.", (long long)i);
        MDT_TRY(mdt_wtable_add_linear(t, &b->norm, p, "norm.linear", 3 * C, C, adaln, 1));
        MDT_TRY(mdt_dit_declare_attention(t, p, &mdt_attn_self, &b->qkv, NULL, C, C, 1));
        MDT_TRY(mdt_wtable_add_linear(t, &b->proj_mlp, p, "proj_mlp", M, C, MDT_TP_COLWISE, 1));
        MDT_TRY(mdt_wtable_add_linear(t, &b->proj_out, p, "proj_out", C, C + M,
                                      MDT_TP_PACKED_ROWWISE, 1));
        /* proj_out's input is [attn heads | mlp hidden]: two blocks, each sharded on its own */
        mdt_weight_spec *po = &t->specs[t->n - 2];
        po->nblocks = 2, po->blocks[0] = C, po->blocks[1] = M;
        MDT_TRY(mdt_dit_declare_qk_norms(t, p, &mdt_attn_self, &b->qkv, D, k_eps));
    }
    MDT_TRY(mdt_wtable_add_linear(t, &f->norm_out, "norm_out.", "linear", 2 * C, C, adaln, 1));
    return mdt_wtable_add_linear(t, &f->proj_out, "", "proj_out", f->patch * f->patch * f->out_ch,
                                 C, rep, 1);
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
    int64_t axsum = 0;
    for (int i = 0; i < nax; i++) {
        if (ax[i] <= 0 || ax[i] % 2)
            return MDT_FAIL(MDT_E_INVALID,
                            "config.json: axes_dims_rope[%d] = %lld must be even "
                            "and positive",
                            i, (long long)ax[i]);
        axsum += ax[i];
    }
    if (axsum != f->head_dim)
        return MDT_FAIL(MDT_E_INVALID,
                        "config.json: axes_dims_rope sum to %lld but attention_head_dim is %lld",
                        (long long)axsum, (long long)f->head_dim);
    f->naxes = nax;
    memcpy(f->axes, ax, sizeof ax);
    f->inner = f->heads * f->head_dim;
    f->mlp_hidden = 4 * f->inner;
    f->dbl = f->dbl_store;
    f->sgl = f->sgl_store;

    return flux_table(f, t);
}

/* ---- forward ---- */

/* A forward's inputs on this rank: read, checked, cut by the CP plan and uploaded. */
typedef struct flux_in {
    int64_t Si, St, si, st; /* image and text rows: whole and this rank's chunk */
    const float *hs, *ehs;  /* [B, si, in], [B, st, joint] */
    const float *e256;      /* [2, B, 256] timestep and guidance projections */
    const float *pool;      /* [B, pooled] */
    mdt_rope rope;          /* [st + si, D] text rows first */
} flux_in;

/* Rotary columns: per axis of width d, pair j has frequency 1/1e4^(2j/d), each value repeated for
 * the two channels of its pair; col_axis/col_freq [D]: the id column and frequency of each. */
static void rope_columns(const flux *f, int32_t *col_axis, double *col_freq) {
    int64_t off = 0;
    for (int a = 0; a < f->naxes; a++) {
        const int64_t d = f->axes[a];
        for (int64_t j = 0; j < d / 2; j++) {
            const double fr = 1.0 / pow(10000.0, (double)(2 * j) / (double)d);
            col_axis[off + 2 * j] = col_axis[off + 2 * j + 1] = a;
            col_freq[off + 2 * j] = col_freq[off + 2 * j + 1] = fr;
        }
        off += d;
    }
}

/* ids [S, naxes], 2-D or (deprecated, like diffusers: batch 0 is used) 3-D, cut to this chunk. */
static mdt_status read_ids(const flux *f, mdt_dit *d, const mdt_tensor_set *in, const char *name,
                           int64_t S, const float **ids) {
    const int is3 = mdt_input_dim(in, name, 2) >= 0;
    float *full;
    int64_t s0, n;
    MDT_TRY(mdt_input_f32(in, name, is3 ? 3 : 2,
                          is3 ? (int64_t[]){-1, S, f->naxes} : (int64_t[]){S, f->naxes}, d->ha,
                          &full));
    return mdt_cp_take(&d->cp, name, full, sizeof(float), 2, (int64_t[]){S, f->naxes}, d->ha,
                       (const void **)ids, &s0, &n);
}

static mdt_status flux_read(const flux *f, mdt_dit *d, const mdt_tensor_set *in, flux_in *x) {
    const int64_t B = mdt_input_dim(in, "hidden_states", 0), D = f->head_dim, A = f->naxes;
    const int64_t Si = mdt_input_dim(in, "hidden_states", 1);
    const int64_t St = mdt_input_dim(in, "encoder_hidden_states", 1);
    mdt_arena *ha = d->ha, *ar = d->ar;
    int64_t s0;
    if (B < 1 || Si < 1)
        return MDT_FAIL(MDT_E_INVALID,
                        "inputs: 'hidden_states' must be [B, S_img, %lld] with "
                        "B, S_img >= 1",
                        (long long)f->in_ch);
    if (St < 1)
        return MDT_FAIL(MDT_E_INVALID,
                        "inputs: 'encoder_hidden_states' must be [B, S_txt, %lld] "
                        "with S_txt >= 1",
                        (long long)f->joint_dim);
    const float *hs, *ehs, *img_ids, *txt_ids;
    float *pooled, *ts, *g = NULL;
    const int64_t shs[] = {B, Si, f->in_ch}, sehs[] = {B, St, f->joint_dim};
    MDT_TRY(mdt_input_f32_view(in, "hidden_states", 3, shs, ha, &hs));
    MDT_TRY(mdt_input_f32_view(in, "encoder_hidden_states", 3, sehs, ha, &ehs));
    MDT_TRY(mdt_input_f32(in, "pooled_projections", 2, (int64_t[]){B, f->pooled_dim}, ha, &pooled));
    MDT_TRY(mdt_input_f32(in, "timestep", 1, (int64_t[]){B}, ha, &ts));
    MDT_TRY(read_ids(f, d, in, "img_ids", Si, &img_ids));
    MDT_TRY(read_ids(f, d, in, "txt_ids", St, &txt_ids));
    if (f->guidance)
        MDT_TRY(mdt_input_f32(in, "guidance", 1, (int64_t[]){B}, ha, &g));
    MDT_TRY(
        mdt_cp_take(&d->cp, "hidden_states", hs, 4, 3, shs, ha, (const void **)&hs, &s0, &x->si));
    MDT_TRY(mdt_cp_take(&d->cp, "encoder_hidden_states", ehs, 4, 3, sehs, ha, (const void **)&ehs,
                        &s0, &x->st));
    d->B = B, x->Si = Si, x->St = St;
    const int64_t S = x->si + x->st;
    float *e256 = mdt_arena_floats(ha, 2 * B * 256);                  // [2, B, 256] host: t, g
    float *ids = mdt_arena_floats(ha, S * A);                         // [S/P, axes] text first
    int32_t *col_axis = (int32_t *)(void *)mdt_arena_floats(ha, D);   // [D] host
    double *col_freq = (double *)(void *)mdt_arena_floats(ha, 2 * D); // [D] host
    if (!e256 || !ids || !col_axis || !col_freq)
        return MDT_E_NOMEM;
    for (int64_t b = 0; b < B; b++)
        ts[b] = ts[b] * 1000.0f;
    mdt_dit_timestep_embed(ts, B, 256, e256);
    for (int64_t b = 0; g && b < B; b++)
        g[b] = g[b] * 1000.0f;
    if (g)
        mdt_dit_timestep_embed(g, B, 256, e256 + B * 256);
    memcpy(ids, txt_ids, sizeof(float) * (size_t)(x->st * A));
    memcpy(ids + x->st * A, img_ids, sizeof(float) * (size_t)(x->si * A));
    rope_columns(f, col_axis, col_freq);
    /* to the backend's memory (the same pointers on the CPU backend) */
    x->hs = mdt_k_upload(ar, hs, sizeof(float) * (size_t)(B * x->si * f->in_ch));
    x->ehs = mdt_k_upload(ar, ehs, sizeof(float) * (size_t)(B * x->st * f->joint_dim));
    x->e256 = mdt_k_upload(ar, e256, sizeof(float) * (size_t)(2 * B * 256));
    x->pool = mdt_k_upload(ar, pooled, sizeof(float) * (size_t)(B * f->pooled_dim));
    const float *ids_d = mdt_k_upload(ar, ids, sizeof(float) * (size_t)(S * A));
    const int32_t *cax_d = mdt_k_upload(ar, col_axis, sizeof(int32_t) * (size_t)D);
    const double *cfr_d = mdt_k_upload(ar, col_freq, sizeof(double) * (size_t)D);
    float *cos_t = mdt_arena_floats(ar, S * D), *sin_t = mdt_arena_floats(ar, S * D); // [S/P, D]
    if (!x->hs || !x->ehs || !x->e256 || !x->pool || !ids_d || !cax_d || !cfr_d || !cos_t || !sin_t)
        return MDT_E_NOMEM;
    mdt_k()->angle_table(ids_d, A, S, D, cax_d, cfr_d, 1, cos_t, sin_t); // [S/P, D]
    x->rope = (mdt_rope){cos_t, sin_t, D, MDT_ROPE_INTERLEAVED};
    return MDT_OK;
}

/* x [B, n, C] += gate * FF(LN(x) (1 + scale) + shift), the MLP half of a double block. */
static mdt_status ff_residual(const mdt_dit *d, float *x, int64_t n, const float *mod,
                              const mdt_lin *l0, const mdt_lin *l2, float *nbuf, float *hbuf,
                              float *ybuf) {
    const int64_t C = l2->out, B = d->B, Ml = l0->out_local;
    for (int64_t b = 0; b < B; b++)
        mdt_k()->layernorm_modulate(x + b * n * C, nbuf + b * n * C, n, C, k_eps,
                                    mod + b * 6 * C + 3 * C, mod + b * 6 * C + 4 * C); // [n, C]
    mdt_dit_linear(l0, nbuf, B * n, hbuf, Ml); // [B*n, 4C/T]
    mdt_k()->gelu_rows(hbuf, Ml, B * n, Ml);
    MDT_TRY(mdt_dit_row_linear(d, l2, hbuf, Ml, ybuf, B * n)); // [B*n, C]
    for (int64_t b = 0; b < B; b++)
        mdt_k()->gate_residual(x + b * n * C, ybuf + b * n * C, C, mod + b * 6 * C + 5 * C, n, C);
    return MDT_OK;
}

/* FluxTransformerBlock: image x [B, si, C] and text c [B, st, C], joint attention. */
static mdt_status double_block(const flux *f, const flux_double *blk, const mdt_dit *d,
                               const flux_in *in, const mdt_heads *h, float *x, float *c) {
    const int64_t C = f->inner, B = d->B, Si = in->si, St = in->st, S = Si + St;
    const int64_t Cl = blk->img.q.out_local;
    float *mod = mdt_arena_floats(d->ar, B * 6 * C);                 // [B, 6C] image
    float *cmod = mdt_arena_floats(d->ar, B * 6 * C);                // [B, 6C] text
    float *nx = mdt_arena_floats(d->ar, B * Si * C);                 // [B, Si, C]
    float *nc = mdt_arena_floats(d->ar, B * St * C);                 // [B, St, C]
    float *tmp = mdt_arena_floats(d->ar, B * S * C);                 // [B*max(Si,St), C]
    float *ao = mdt_arena_floats(d->ar, B * S * Cl);                 // [B, S, C/T]
    float *hb = mdt_arena_floats(d->ar, B * S * blk->ff0.out_local); // [B*n, 4C/T]
    if (!mod || !cmod || !nx || !nc || !tmp || !ao || !hb)
        return MDT_E_NOMEM;
    MDT_TRY(mdt_dit_adaln(d, &blk->norm1, mod));      // [B, 6C]
    MDT_TRY(mdt_dit_adaln(d, &blk->norm1_ctx, cmod)); // [B, 6C]
    for (int64_t b = 0; b < B; b++) {
        mdt_k()->layernorm_modulate(x + b * Si * C, nx + b * Si * C, Si, C, k_eps, mod + b * 6 * C,
                                    mod + b * 6 * C + C); // [Si, C]
        mdt_k()->layernorm_modulate(c + b * St * C, nc + b * St * C, St, C, k_eps, cmod + b * 6 * C,
                                    cmod + b * 6 * C + C); // [St, C]
    }
    mdt_dit_qkv(d, &blk->ctx, nc, St, 0, &in->rope, h, tmp);  /* text rows [0, St) */
    mdt_dit_qkv(d, &blk->img, nx, Si, St, &in->rope, h, tmp); /* image rows [St, S) */
    MDT_TRY(mdt_dit_attend(d, h, 1, ao, Cl));                 // [B, S/P, C/T]
    for (int64_t b = 0; b < B; b++) {
        MDT_TRY(mdt_dit_row_linear(d, &blk->to_out, ao + (b * S + St) * Cl, Cl, tmp, Si));
        mdt_k()->gate_residual(x + b * Si * C, tmp, C, mod + b * 6 * C + 2 * C, Si, C);
        MDT_TRY(mdt_dit_row_linear(d, &blk->to_add_out, ao + b * S * Cl, Cl, tmp, St));
        mdt_k()->gate_residual(c + b * St * C, tmp, C, cmod + b * 6 * C + 2 * C, St, C);
    }
    MDT_TRY(ff_residual(d, x, Si, mod, &blk->ff0, &blk->ff2, nx, hb, tmp));
    return ff_residual(d, c, St, cmod, &blk->ffc0, &blk->ffc2, nc, hb, tmp);
}

/* FluxSingleTransformerBlock: h [B, S, C] += gate * proj_out([attn(n) | GELU(proj_mlp(n))]),
 * n = LN(h)(1 + scale) + shift; proj_out's local columns are [attn block k | mlp block k]. */
static mdt_status single_block(const flux *f, const flux_single *blk, const mdt_dit *d,
                               const flux_in *in, const mdt_heads *hd, float *h) {
    const int64_t C = f->inner, B = d->B, S = in->si + in->st;
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
    mdt_dit_qkv(d, &blk->qkv, n, S, 0, &in->rope, hd, tmp);
    mdt_k_shared_end();
    MDT_TRY(mdt_dit_attend(d, hd, 1, cat, W));                          // columns [0, C/T)
    MDT_TRY(mdt_dit_row_linear(d, &blk->proj_out, cat, W, tmp, B * S)); // [B*S, C]
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
    const int64_t C = f->inner, B = d.B, si = x.si, st = x.st, S = si + st, O = f->proj_out.out;
    mdt_arena *ar = d.ar;
    char stage[48];
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
    MDT_TRY(mdt_guard_finite(d.mesh, "time_text_embed", cond, B * C));
    mdt_dit_linear(&f->x_emb, x.hs, B * si, xs, C);   // [B, Si/P, C]
    mdt_dit_linear(&f->ctx_emb, x.ehs, B * st, c, C); // [B, St/P, C]
    MDT_TRY(mdt_guard_finite(d.mesh, "x_embedder", xs, B * si * C));
    MDT_TRY(mdt_guard_finite(d.mesh, "context_embedder", c, B * st * C));
    for (int64_t i = 0; i < f->layers; i++) { /* a block's scratch is reused by the next */
        mdt_arena_mark mk = mdt_arena_mark_get(ar);
        MDT_TRY(double_block(f, &f->dbl[i], &d, &x, &hd, xs, c));
        mdt_arena_rewind(ar, mk);
        snprintf(stage, sizeof stage, "transformer_blocks.%lld", (long long)i);
        MDT_TRY(mdt_guard_finite(d.mesh, stage, xs, B * si * C));
        MDT_TRY(mdt_guard_finite(d.mesh, stage, c, B * st * C));
        if (i == 0) /* test seam: fail mid-step */
            MDT_TRY(mdt_test_point("step", d.mesh ? d.mesh->world_rank : 0));
    }
    float *h = mdt_arena_floats(ar, B * S * C); // [B, S/P, C] = cat(c, x) per batch
    if (!h)
        return MDT_E_NOMEM;
    mdt_k()->copy2d(h, S * C, c, st * C, B, st * C);           // text rows of every batch
    mdt_k()->copy2d(h + st * C, S * C, xs, si * C, B, si * C); // image rows after them
    for (int64_t i = 0; i < f->single_layers; i++) {
        mdt_arena_mark mk = mdt_arena_mark_get(ar);
        MDT_TRY(single_block(f, &f->sgl[i], &d, &x, &hd, h));
        mdt_arena_rewind(ar, mk);
        snprintf(stage, sizeof stage, "single_transformer_blocks.%lld", (long long)i);
        MDT_TRY(mdt_guard_finite(d.mesh, stage, h, B * S * C));
    }
    /* norm_out: emb [B, 2C] = (scale, shift) -- scale first; image rows only */
    float *emb = mdt_arena_floats(ar, B * 2 * C); // [B, 2C]
    float *xn = mdt_arena_floats(ar, B * si * C); // [B, Si/P, C]
    float *ol = mdt_arena_floats(ar, B * si * O); // [B, Si/P, O]
    mdt_tensor *o;
    if (!emb || !xn || !ol)
        return MDT_E_NOMEM;
    MDT_TRY(mdt_dit_adaln(&d, &f->norm_out, emb)); // [B, 2C]
    for (int64_t b = 0; b < B; b++)
        mdt_k()->layernorm_modulate(h + (b * S + st) * C, xn + b * si * C, si, C, k_eps,
                                    emb + b * 2 * C + C, emb + b * 2 * C); // [Si/P, C]
    mdt_dit_linear(&f->proj_out, xn, B * si, ol, O);                       // [B, Si/P, O]
    MDT_TRY(mdt_guard_finite(d.mesh, "proj_out", ol, B * si * O));
    MDT_TRY(mdt_tensor_set_add(out, "sample", MDT_F32, 3, (int64_t[]){B, x.Si, O}, &o));
    MDT_TRY(mdt_cp_give(&d.cp, "sample", ar, d.ha, in, x.Si, ol, o));
    /* no silent degrade: each query row once over the joint sequence, per block and batch */
    mdt_promise p = {0};
    mdt_dit_promise_cp(&d, &p, (int64_t[]){x.St, x.Si}, 2, (f->layers + f->single_layers) * B);
    return mdt_dit_end(&d, &p);
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
