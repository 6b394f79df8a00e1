/*
 * minimax_h3.c — diffusers' MiniMaxH3Transformer3DModel (video + audio over one packed
 * sequence): config, weight table with TP styles, CP plan, forward, random inputs.
 *
 * Semantics follow diffusers (shared/reference/parallel-semantics.md §8.2): per-modality input
 * projections scattered into one packed sequence by row indices; a token refiner on the text
 * (pre-norm blocks, SwiGLU, no RoPE, final RMSNorm); an unscaled sinusoidal timestep embedding
 * (cos first) through a SiLU MLP; per block an AdaLN table of (timestep, modality) rows
 * (adaln_proj: [T_n, 18 C] viewed [3 T_n, 6 C], chunk order shift, scale, gate x 2) selected per
 * row by timestep_index * 3 + token_tag; RMSNorm residual norms; per-head QK RMSNorm; rotate-half
 * RoPE on the first 6 rope_freq_dim channels of each head from (t, h, w) positions, inv_freq
 * computed here (never read from disk); SwiGLU FFN [value | gate]; norm_out shift-then-scale per
 * timestep; video and audio heads over every row, then the rows of each modality selected.
 *
 * TP: q/k/v colwise, to_out.0 rowwise, ff.net.0.proj packed colwise [value | gate], ff.net.2
 * rowwise (blocks and refiner); adaln_proj.linear, norm_out.linear and context_embedder
 * replicated-input rowwise.
 * CP: the packed sequence splits after it is built (with its rope rows, adaln and timestep
 * indices); the refiner runs on the full text on every rank with plain attention (the reference
 * routes it through CP attention over identical copies: same result up to rounding); the head
 * outputs are all-gathered before the rows are selected. fp32 compute (the modules diffusers keeps
 * in fp32 are fp32 here like everything else).
 */
#include "models/cache.h"
#include "models/dit.h"

#include "backend/backend.h"
#include "core/testhooks.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

enum { H3_MAX_LAYERS = 128, H3_MAX_REFINER = 16, H3_MOD = 3 };

typedef struct h3_attn_block {
    const float *norm1, *norm2;
    mdt_lin to_out, ff0, ff2;
    mdt_lin adaln; /* transformer blocks only */
    mdt_qkv qkv;   /* q/k/v with the per-head norms */
} h3_block;

typedef struct h3 {
    int64_t heads, head_dim, hidden, layers, refiner_layers, ffn, in_ch, audio_in, patch[3];
    int64_t text_dim, freq_dim, time_hidden, time_embed, rope_freq;
    double rope_theta, norm_eps, qk_eps, final_eps;
    int64_t A, Pv; /* attention inner width, video patch width */
    mdt_lin proj_in, audio_proj_in, ctx_emb, t_lin1, t_lin2, norm_out, proj_out, audio_proj_out;
    const float *final_norm, *norm_out_w;
    h3_block ref[H3_MAX_REFINER], blk[H3_MAX_LAYERS];
} h3;

/* One block `pfx`: pre-norm self-attention and SwiGLU FFN; transformer blocks also carry the
 * AdaLN table projection (refiner blocks: adaln NULL). */
static mdt_status add_block(const h3 *f, mdt_wtable *t, h3_block *b, const char *pfx, int adaln) {
    const int64_t C = f->hidden;
    MDT_TRY(mdt_wtable_add_vector(t, &b->norm1, pfx, "norm1.weight", C));
    MDT_TRY(mdt_dit_declare_attention(t, pfx, &mdt_attn_self, &b->qkv, &b->to_out, f->A, C, 0));
    MDT_TRY(mdt_dit_declare_ff(t, pfx, "ff", &b->ff0, &b->ff2, C, f->ffn, 1, 0));
    MDT_TRY(
        mdt_dit_declare_qk_norms(t, pfx, &mdt_attn_self, &b->qkv, f->head_dim, (float)f->qk_eps));
    MDT_TRY(mdt_wtable_add_vector(t, &b->norm2, pfx, "norm2.weight", C));
    return adaln ? mdt_dit_declare_adaln(t, &b->adaln, pfx, "adaln_proj.linear", 6 * C * H3_MOD,
                                         f->time_embed, 1)
                 : MDT_OK;
}

static void h3_dims(const void *impl, mdt_model_dims *d) {
    const h3 *f = impl;
    *d = (mdt_model_dims){.heads = f->heads,
                          .head_dim = f->head_dim,
                          .hidden = f->hidden,
                          .ffn = f->ffn,
                          .self_attn = f->layers,
                          .text_attn = f->refiner_layers,
                          .out = f->Pv};
}

static mdt_status h3_configure(void *impl, const cJSON *cfg, mdt_wtable *t) {
    h3 *f = impl;
    int np = 3;
    int64_t *const ints[] = {&f->heads,          &f->head_dim, &f->hidden, &f->layers,
                             &f->refiner_layers, &f->ffn,      &f->in_ch,  &f->audio_in};
    int64_t *const more[] = {&f->text_dim, &f->freq_dim, &f->time_hidden, &f->time_embed,
                             &f->rope_freq};
    double *const eps[] = {&f->rope_theta, &f->norm_eps, &f->qk_eps, &f->final_eps};
    MDT_TRY(mdt_cfg_ints(cfg,
                         "num_attention_heads=56 attention_head_dim=128 hidden_size=5376 "
                         "num_layers=50 num_refiner_layers=2 ffn_dim=14336 in_channels=24 "
                         "audio_in_channels=32",
                         ints, 8));
    MDT_TRY(mdt_cfg_int_array(cfg, "patch_size", f->patch, &np));
    if (np == 0)
        f->patch[0] = 1, f->patch[1] = 2, f->patch[2] = 2, np = 3;
    MDT_TRY(
        mdt_cfg_ints(cfg,
                     "text_dim=5120 freq_dim=256 time_embed_hidden_dim=5376 time_embed_dim=2688 "
                     "rope_freq_dim=16",
                     more, 5));
    MDT_TRY(mdt_cfg_doubles(
        cfg, "rope_theta=10000 norm_eps=1e-5 qk_norm_eps=1e-5 final_norm_eps=1e-5", eps, 4));
    if (np != 3 || f->heads < 1 || f->head_dim < 2 || f->hidden < 1 || f->layers < 0 ||
        f->refiner_layers < 0 || f->ffn < 1 || f->in_ch < 1 || f->audio_in < 1 || f->text_dim < 1 ||
        f->freq_dim < 2 || f->freq_dim % 2 || f->time_hidden < 1 || f->time_embed < 1 ||
        f->rope_freq < 1 || f->patch[0] < 1 || f->patch[1] < 1 || f->patch[2] < 1)
        return MDT_FAIL(MDT_E_INVALID, "config.json: MiniMax-H3 sizes must be positive (patch_size "
                                       "three values, freq_dim even)");
    const int64_t dims[] = {f->heads,    f->head_dim,    f->hidden,     f->ffn,      f->in_ch,
                            f->audio_in, f->patch[0],    f->patch[1],   f->patch[2], f->text_dim,
                            f->freq_dim, f->time_hidden, f->time_embed, f->rope_freq};
    MDT_TRY(mdt_cfg_check_dims("MiniMax-H3", dims, sizeof dims / sizeof dims[0]));
    if (f->heads * f->head_dim > MDT_MAX_DIM || f->patch[0] * f->patch[1] > MDT_MAX_DIM ||
        f->patch[0] * f->patch[1] * f->patch[2] > MDT_MAX_DIM ||
        f->in_ch * f->patch[0] * f->patch[1] * f->patch[2] > MDT_MAX_DIM)
        return MDT_FAIL(MDT_E_UNSUPPORTED, "config.json: MiniMax-H3 widths exceed %lld",
                        (long long)MDT_MAX_DIM);
    if (6 * f->rope_freq > f->head_dim)
        return MDT_FAIL(MDT_E_INVALID,
                        "config.json: 6 x rope_freq_dim = %lld rotary channels exceed "
                        "attention_head_dim %lld",
                        (long long)(6 * f->rope_freq), (long long)f->head_dim);
    if (f->layers > H3_MAX_LAYERS || f->refiner_layers > H3_MAX_REFINER)
        return MDT_FAIL(MDT_E_UNSUPPORTED, "config.json: at most %d blocks and %d refiner blocks",
                        H3_MAX_LAYERS, H3_MAX_REFINER);
    f->A = f->heads * f->head_dim;
    f->Pv = f->in_ch * f->patch[0] * f->patch[1] * f->patch[2];
    const int64_t C = f->hidden;
    char pfx[MDT_NAME_MAX];
    const mdt_tp_style rep = MDT_TP_REPLICATED;
    mdt_wtable_rows(t, MDT_ROWS_ALL); /* the packed video and audio rows */
    MDT_TRY(mdt_wtable_add_linear(t, &f->proj_in, "", "proj_in", C, f->Pv, rep, 1));
    MDT_TRY(
        mdt_wtable_add_linear(t, &f->audio_proj_in, "", "audio_proj_in", C, f->audio_in, rep, 1));
    MDT_TRY(mdt_dit_declare_text_embedder(t, &f->ctx_emb, "context_embedder", C, f->text_dim, 1));
    mdt_wtable_rows(t, MDT_ROWS_ONE); /* conditioning: one row per timestep */
    MDT_TRY(mdt_wtable_add_linear(t, &f->t_lin1, "time_embedder.", "linear_1", f->time_hidden,
                                  f->freq_dim, rep, 1));
    MDT_TRY(mdt_wtable_add_linear(t, &f->t_lin2, "time_embedder.", "linear_2", f->time_embed,
                                  f->time_hidden, rep, 1));
    mdt_wtable_rows(t, MDT_ROWS_TEXT); /* the token refiner: the whole text on every rank */
    for (int64_t i = 0; i < f->refiner_layers; i++) {
        snprintf(pfx, sizeof pfx, "token_refiner.refiner_blocks.%lld.", (long long)i);
        MDT_TRY(add_block(f, t, &f->ref[i], pfx, 0));
    }
    MDT_TRY(mdt_wtable_add_vector(t, &f->final_norm, "token_refiner.", "final_norm.weight", C));
    mdt_wtable_rows(t, MDT_ROWS_ALL); /* the blocks: the packed sequence */
    for (int64_t i = 0; i < f->layers; i++) {
        snprintf(pfx, sizeof pfx, "transformer_blocks.%lld.", (long long)i);
        MDT_TRY(add_block(f, t, &f->blk[i], pfx, 1));
    }
    MDT_TRY(mdt_wtable_add_vector(t, &f->norm_out_w, "norm_out.", "norm.weight", C));
    MDT_TRY(mdt_dit_declare_adaln(t, &f->norm_out, "norm_out.", "linear", 2 * C, f->time_embed, 1));
    MDT_TRY(mdt_wtable_add_linear(t, &f->proj_out, "", "proj_out", f->Pv, C, rep, 1));
    return mdt_wtable_add_linear(t, &f->audio_proj_out, "", "audio_proj_out", f->audio_in, C, rep,
                                 1);
}

/* MiniMaxH3Transformer3DModel.forward's tensors: the packed sequence's per-row inputs and the
 * modality indices (its pipeline does not guide, and a batch is one packed sequence) */
static const mdt_input_decl *h3_inputs(const void *impl) {
    static const mdt_input_decl k[] = {{"hidden_states", 0},
                                       {"audio_hidden_states", 0},
                                       {"encoder_hidden_states", 0},
                                       {"timestep", 0},
                                       {"timestep_indices", 0},
                                       {"token_tags", 0},
                                       {"position_ids", 0},
                                       {"video_indices", 0},
                                       {"audio_indices", 0},
                                       {"text_indices", 0},
                                       {NULL, 0}};
    (void)impl;
    return k;
}

static mdt_status h3_check_layout(const void *impl, int T, int R, int U) {
    const h3 *f = impl;
    (void)R, (void)U;
    MDT_TRY(mdt_dit_check_heads(f->heads, T));
    return mdt_dit_check_tp(T, f->time_embed, "time_embed_dim",
                            "the input features the AdaLN projections are sharded on");
}

/* ---- forward ---- */

/* A forward's inputs on this rank: read, checked, the per-row ones cut by the CP plan. */
typedef struct h3_in {
    int64_t Nv, Na, Nt, S, Tn, s0, Sc; /* modality rows, packed rows, timesteps, my chunk */
    const float *hs, *ahs;             /* host [B, Nv, Pv], [B, Na, audio] */
    const int64_t *vidx, *aidx, *xidx; /* host [N]: packed row of each modality row */
    const float *ehs, *e;              /* [B, Nt, text]; [T_n, freq] timestep sinusoids */
    const int64_t *ada_rows, *t_rows;  /* [Sc]: AdaLN table row and timestep of each local row */
    mdt_rope rope;                     /* [Sc, 6F] */
} h3_in;

/* The index tensors against each other and token_tags [S]: idx[m] [n[m]] are the packed rows
 * of modality m (tag m: video_indices, text_indices, audio_indices). */
static mdt_status h3_check_rows(mdt_arena *ha, int64_t S, const int64_t *tags,
                                const int64_t *const idx[H3_MOD], const int64_t n[H3_MOD]) {
    static const char *const names[H3_MOD] = {"video_indices", "text_indices", "audio_indices"};
    const mdt_arena_mark mk = mdt_arena_mark_get(ha);
    int64_t *owner = (int64_t *)(void *)mdt_arena_floats(ha, 2 * S); // [S] host: m n + i, or -1
    if (!owner)
        return MDT_E_NOMEM;
    for (int64_t r = 0; r < S; r++)
        owner[r] = -1;
    mdt_status st = MDT_OK;
    for (int m = 0; m < H3_MOD && st == MDT_OK; m++)
        for (int64_t i = 0; i < n[m] && st == MDT_OK; i++) {
            const int64_t r = idx[m][i];
            if (owner[r] >= 0) {
                const int64_t om = owner[r] % H3_MOD, oi = owner[r] / H3_MOD;
                st = MDT_FAIL(MDT_E_INVALID,
                              "inputs: %s[%lld] = %lld, a packed row %s[%lld] already takes: "
                              "each row holds one modality row",
                              names[m], (long long)i, (long long)r, names[om], (long long)oi);
            } else if (tags[r] != m) {
                st = MDT_FAIL(MDT_E_INVALID,
                              "inputs: %s[%lld] = %lld, but token_tags[%lld] is %lld, not %d (0 "
                              "video, 1 text, 2 audio)",
                              names[m], (long long)i, (long long)r, (long long)r,
                              (long long)tags[r], m);
            }
            owner[r] = i * H3_MOD + m;
        }
    mdt_arena_rewind(ha, mk);
    return st;
}

static mdt_status h3_read(const h3 *f, mdt_dit *d, const mdt_tensor_set *in, h3_in *x) {
    mdt_arena *ha = d->ha, *ar = d->ar;
    const int64_t B = mdt_input_dim(in, "hidden_states", 0), Fr = f->rope_freq, rot = 6 * Fr;
    const int64_t Nv = mdt_input_dim(in, "hidden_states", 1),
                  S = mdt_input_dim(in, "position_ids", 0);
    const int64_t Na = mdt_input_dim(in, "audio_hidden_states", 1),
                  Tn = mdt_input_dim(in, "timestep", 0);
    const int64_t Nt = mdt_input_dim(in, "encoder_hidden_states", 1);
    if (B < 1 || Nv < 0 || Na < 0 || Nt < 0 || S < 1 || Tn < 1)
        return MDT_FAIL(MDT_E_INVALID,
                        "inputs: MiniMax-H3 needs hidden_states [B, N_video, %lld], "
                        "audio_hidden_states [B, N_audio, %lld], encoder_hidden_states [B, N_text, "
                        "%lld], timestep [T_n], position_ids [S, 3] and the index tensors",
                        (long long)f->Pv, (long long)f->audio_in, (long long)f->text_dim);
    /* each packed row picks one timestep (timestep_indices), so more timesteps than rows are
     * ones no row reads, and each would cost the per-block AdaLN table 3 rows of 18 C */
    if (Tn > S)
        return MDT_FAIL(MDT_E_INVALID,
                        "inputs: timestep has %lld entries but the packed sequence has %lld rows "
                        "(position_ids [S, 3]); each row takes one timestep by timestep_indices",
                        (long long)Tn, (long long)S);
    const float *ehs;
    float *ts, *pos;
    int64_t *tidx, *tags, *vidx, *aidx, *xidx;
    MDT_TRY(mdt_input_f32_view(in, "hidden_states", 3, (int64_t[]){B, Nv, f->Pv}, ha, &x->hs));
    MDT_TRY(mdt_input_f32_view(in, "audio_hidden_states", 3, (int64_t[]){B, Na, f->audio_in}, ha,
                               &x->ahs));
    MDT_TRY(mdt_input_f32_view(in, "encoder_hidden_states", 3, (int64_t[]){B, Nt, f->text_dim}, ha,
                               &ehs));
    MDT_TRY(mdt_input_f32(in, "timestep", 1, (int64_t[]){Tn}, ha, &ts));
    MDT_TRY(mdt_input_f32(in, "position_ids", 2, (int64_t[]){S, 3}, ha, &pos));
    MDT_TRY(mdt_input_i64(in, "timestep_indices", 1, (int64_t[]){S}, 0, Tn, ha, &tidx));
    MDT_TRY(mdt_input_i64(in, "token_tags", 1, (int64_t[]){S}, 0, H3_MOD, ha, &tags));
    MDT_TRY(mdt_input_i64(in, "video_indices", 1, (int64_t[]){Nv}, 0, S, ha, &vidx));
    MDT_TRY(mdt_input_i64(in, "audio_indices", 1, (int64_t[]){Na}, 0, S, ha, &aidx));
    MDT_TRY(mdt_input_i64(in, "text_indices", 1, (int64_t[]){Nt}, 0, S, ha, &xidx));
    /* each packed row holds at most one modality row, and its tag is that modality's (0 video,
     * 1 text, 2 audio): a row given twice (diffusers' index_copy keeps either, or the later) or
     * tagged as another modality would take the wrong input or the wrong AdaLN row */
    MDT_TRY(
        h3_check_rows(ha, S, tags, (const int64_t *[]){vidx, xidx, aidx}, (int64_t[]){Nv, Nt, Na}));
    /* the packed sequence splits: its rotary positions, timestep indices and modality tags */
    const void *pos_l, *tidx_l, *tags_l;
    int64_t s0, Sc;
    MDT_TRY(
        mdt_cp_take(&d->cp, "position_ids", pos, 4, 2, (int64_t[]){S, 3}, ha, &pos_l, &s0, &Sc));
    MDT_TRY(mdt_cp_take(&d->cp, "timestep_indices", tidx, 8, 1, &S, ha, &tidx_l, &s0, &Sc));
    MDT_TRY(mdt_cp_take(&d->cp, "token_tags", tags, 8, 1, &S, ha, &tags_l, &s0, &Sc));
    *x = (h3_in){Nv,   Na,   Nt,   S,    Tn,   s0,   Sc,   x->hs, x->ahs,
                 vidx, aidx, xidx, NULL, NULL, NULL, NULL, {0}};
    d->B = B;
    /* rotary columns: angles (t, h, w) x inv_freq (float math), the three axes' columns
     * concatenated, then the whole repeated: column c uses axis (c mod 3F) / F and frequency
     * inv_freq[c mod F]; inv_freq is computed here on every rank, never read from disk */
    int32_t *col_axis = (int32_t *)(void *)mdt_arena_floats(ha, rot);   // [6F] host
    double *col_freq = (double *)(void *)mdt_arena_floats(ha, 2 * rot); // [6F] host
    float *inv = mdt_arena_floats(ha, Fr);                              // [F] host
    float *e_h = mdt_arena_floats(ha, Tn * f->freq_dim);                // [T_n, freq] host
    int64_t *ada_h = (int64_t *)(void *)mdt_arena_floats(ha, 2 * Sc);   // [S/P] host
    if (!col_axis || !col_freq || !inv || !e_h || !ada_h)
        return MDT_E_NOMEM;
    for (int64_t j = 0; j < Fr; j++)
        inv[j] = 1.0f / powf((float)f->rope_theta, (float)(2 * j) / (float)(2 * Fr));
    for (int64_t c = 0; c < rot; c++)
        col_axis[c] = (int32_t)((c % (3 * Fr)) / Fr), col_freq[c] = (double)inv[c % Fr];
    mdt_dit_timestep_embed(ts, Tn, f->freq_dim, e_h); /* unscaled t */
    for (int64_t s = 0; s < Sc; s++)
        ada_h[s] = ((const int64_t *)tidx_l)[s] * H3_MOD + ((const int64_t *)tags_l)[s];
    /* to the backend's memory (the same pointers on the CPU backend) */
    const float *pos_d = mdt_k_upload(ar, pos_l, sizeof(float) * (size_t)(Sc * 3));
    const int32_t *cax_d = mdt_k_upload(ar, col_axis, sizeof(int32_t) * (size_t)rot);
    const double *cfr_d = mdt_k_upload(ar, col_freq, sizeof(double) * (size_t)rot);
    float *cos_t = mdt_arena_floats(ar, Sc * rot), *sin_t = mdt_arena_floats(ar, Sc * rot);
    x->e = mdt_k_upload(ar, e_h, sizeof(float) * (size_t)(Tn * f->freq_dim));
    x->ada_rows = mdt_k_upload(ar, ada_h, sizeof(int64_t) * (size_t)(Sc ? Sc : 1));
    x->t_rows = mdt_k_upload(ar, tidx_l, sizeof(int64_t) * (size_t)(Sc ? Sc : 1));
    x->ehs = mdt_k_upload(ar, ehs, sizeof(float) * (size_t)(B * Nt * f->text_dim));
    if (!pos_d || !cax_d || !cfr_d || !cos_t || !sin_t || !x->e || !x->ada_rows || !x->t_rows ||
        !x->ehs)
        return MDT_E_NOMEM;
    mdt_k()->angle_table(pos_d, 3, Sc, rot, cax_d, cfr_d, 0, cos_t, sin_t); // [S/P, 6F]
    x->rope = (mdt_rope){cos_t, sin_t, rot, MDT_ROPE_HALF};
    return MDT_OK;
}

/* Self-attention half of a block on rows n [B, S, C] (normed and modulated): y [B*S, C] =
 * to_out(attn). rope NULL: none (refiner); cp 0: local attention. */
static mdt_status attn_part(const mdt_dit *d, const h3_block *b, const float *n, int64_t S,
                            const mdt_rope *rope, int cp, float *y) {
    mdt_arena_mark mk = mdt_arena_mark_get(d->ar);
    const int64_t Al = b->qkv.q.out_local;
    mdt_heads h;
    float *tmp = mdt_arena_floats(d->ar, d->B * S * Al); // [B*S, A/T]
    MDT_TRY(mdt_dit_heads_alloc(d, S, &h));
    float *ao = mdt_arena_floats(d->ar, d->B * S * Al); // [B, S, A/T]
    if (!tmp || !ao)
        return MDT_E_NOMEM;
    mdt_dit_qkv(d, &b->qkv, n, S, 0, rope, &h, tmp);
    MDT_TRY(mdt_dit_attend(d, &h, cp, ao, Al));                      // [B, S, A/T]
    MDT_TRY(mdt_dit_row_linear(d, &b->to_out, ao, Al, y, d->B * S)); // [B*S, C]
    mdt_arena_rewind(d->ar, mk);
    return MDT_OK;
}

/* SwiGLU FFN on rows n [M, C]: y [M, C] = net.2(value * SiLU(gate)), TP-sharded. */
static mdt_status ff_part(const mdt_dit *d, const h3_block *b, const float *n, int64_t M,
                          float *y) {
    mdt_arena_mark mk = mdt_arena_mark_get(d->ar);
    const int64_t Fl = b->ff2.in_local;
    float *h2 = mdt_arena_floats(d->ar, M * 2 * Fl); // [M, 2F/T] = [value_k | gate_k]
    float *h1 = mdt_arena_floats(d->ar, M * Fl);     // [M, F/T]
    if (!h2 || !h1)
        return MDT_E_NOMEM;
    mdt_dit_linear(&b->ff0, n, M, h2, 2 * Fl);
    mdt_k()->swiglu(h2, h1, M, Fl);
    MDT_TRY(mdt_dit_row_linear(d, &b->ff2, h1, Fl, y, M)); // [M, C]
    mdt_arena_rewind(d->ar, mk);
    return MDT_OK;
}

/* Token refiner on the full text x [B, Nt, C] (every rank; TP-sharded, plain attention). */
static mdt_status refiner(const h3 *f, const mdt_dit *d, float *x, int64_t Nt) {
    const int64_t C = f->hidden, M = d->B * Nt;
    mdt_arena_mark mk = mdt_arena_mark_get(d->ar);
    float *n = mdt_arena_floats(d->ar, M * C), *y = mdt_arena_floats(d->ar, M * C);
    if (!n || !y)
        return MDT_E_NOMEM;
    for (int64_t i = 0; i < f->refiner_layers; i++) {
        const h3_block *b = &f->ref[i];
        mdt_k()->rmsnorm(x, b->norm1, n, M, C, (float)f->norm_eps);
        MDT_TRY(attn_part(d, b, n, Nt, NULL, 0, y));
        mdt_k()->add(x, y, M * C);
        mdt_k()->rmsnorm(x, b->norm2, n, M, C, (float)f->norm_eps);
        MDT_TRY(ff_part(d, b, n, M, y));
        mdt_k()->add(x, y, M * C);
    }
    mdt_k()->rmsnorm(x, f->final_norm, n, M, C, (float)f->final_eps);
    mdt_k()->copy2d(x, 0, n, 0, 1, M * C);
    mdt_arena_rewind(d->ar, mk);
    return MDT_OK;
}

/* Row maps of the rows of one modality that land in this rank's chunk [s0, s0 + Sc): for every
 * batch element, source row b N + i (host) and packed row b Sc + idx[i] - s0 (uploaded);
 * *n = how many. */
static mdt_status chunk_rows(const mdt_dit *d, const h3_in *x, const int64_t *idx, int64_t N,
                             int64_t **src_rows, int64_t **dst_rows, int64_t *n) {
    const int64_t B = d->B, Sc = x->Sc, s0 = x->s0;
    int64_t *sr = (int64_t *)(void *)mdt_arena_floats(d->ha, 2 * B * N); // [B N] host
    int64_t *dr = (int64_t *)(void *)mdt_arena_floats(d->ha, 2 * B * N); // [B N] host
    if (!sr || !dr)
        return MDT_E_NOMEM;
    int64_t k = 0;
    for (int64_t b = 0; b < B; b++)
        for (int64_t i = 0; i < N; i++)
            if (idx[i] >= s0 && idx[i] < s0 + Sc)
                sr[k] = b * N + i, dr[k] = b * Sc + idx[i] - s0, k++;
    *src_rows = sr, *dst_rows = mdt_k_upload(d->ar, dr, sizeof(int64_t) * (size_t)(k ? k : 1));
    *n = k;
    return *dst_rows ? MDT_OK : MDT_E_NOMEM;
}

/* Projects the rows of one modality that land in this rank's chunk and scatters them into
 * h [B, Sc, C]: src [B, N, in] (host input), idx [N] packed positions. */
static mdt_status scatter_modality(const mdt_dit *d, const h3_in *x, const mdt_lin *l,
                                   const float *src, int64_t N, const int64_t *idx, float *h) {
    const int64_t in = l->in, C = l->out;
    mdt_arena_mark mk = mdt_arena_mark_get(d->ar);
    int64_t *sr, *dr, k;
    MDT_TRY(chunk_rows(d, x, idx, N, &sr, &dr, &k));
    float *xin_h = mdt_arena_floats(d->ha, k * in); // [k, in] host
    if (!xin_h)
        return MDT_E_NOMEM;
    mdt_k_host()->copy_rows(xin_h, in, NULL, src, in, sr, k, in);
    const float *xin = mdt_k_upload(d->ar, xin_h, sizeof(float) * (size_t)(k * in)); // [k, in]
    float *y = mdt_arena_floats(d->ar, k * C);                                       // [k, C]
    if (!xin || !y)
        return MDT_E_NOMEM;
    mdt_dit_linear(l, xin, k, y, C);                // [k, C]
    mdt_k()->copy_rows(h, C, dr, y, C, NULL, k, C); // rows of h [B, Sc, C]
    mdt_arena_rewind(d->ar, mk);
    return MDT_OK;
}

/* The packed sequence h [B, Sc, C] of this rank's chunk: refined text, video and audio rows. */
static mdt_status pack(const h3 *f, const mdt_dit *d, const h3_in *x, float *h) {
    const int64_t C = f->hidden, B = d->B;
    int64_t *xsr, *xdr, nx;
    float *txt = mdt_arena_floats(d->ar, B * x->Nt * C); // [B, N_text, C]
    if (!txt)
        return MDT_E_NOMEM;
    mdt_k()->fill(h, B * x->Sc * C, 0.0f);
    MDT_TRY(mdt_dit_slice_linear(d, &f->ctx_emb, x->ehs, f->text_dim, txt,
                                 B * x->Nt)); // [B, N_text, C] reduced
    MDT_TRY(refiner(f, d, txt, x->Nt));
    mdt_guard_finite(d->m, "token_refiner", txt, B * x->Nt * C);
    MDT_TRY(chunk_rows(d, x, x->xidx, x->Nt, &xsr, &xdr, &nx)); /* text rows of my chunk */
    const int64_t *xsr_d = mdt_k_upload(d->ar, xsr, sizeof(int64_t) * (size_t)(nx ? nx : 1));
    if (!xsr_d)
        return MDT_E_NOMEM;
    mdt_k()->copy_rows(h, C, xdr, txt, C, xsr_d, nx, C); // text rows into h [B, S/P, C]
    MDT_TRY(scatter_modality(d, x, &f->proj_in, x->hs, x->Nv, x->vidx, h));
    MDT_TRY(scatter_modality(d, x, &f->audio_proj_in, x->ahs, x->Na, x->aidx, h));
    mdt_guard_finite(d->m, "proj_in / audio_proj_in", h, B * x->Sc * C);
    return MDT_OK;
}

/* A block's scratch, reused by every block: the AdaLN table mod [3 T_n, 6C], the normed rows
 * n and the branch output y [B, Sc, C]. */
typedef struct h3_scratch {
    float *mod, *n, *y;
} h3_scratch;

/* Transformer block i on h [B, Sc, C]: RMSNorm, per-row AdaLN from the (timestep, modality)
 * table (shift, scale, gate x 2), CP attention, SwiGLU FFN, gated residuals. */
static mdt_status block(const h3 *f, const mdt_dit *d, const h3_in *x, int64_t i, float *h,
                        const h3_scratch *s) {
    const h3_block *b = &f->blk[i];
    float *mod = s->mod, *n = s->n, *y = s->y;
    const int64_t C = f->hidden, Sc = x->Sc;
    MDT_TRY(mdt_dit_adaln(d, &b->adaln, mod)); // [T_n, 18C]
    for (int64_t bb = 0; bb < d->B; bb++) {
        mdt_k()->rmsnorm(h + bb * Sc * C, b->norm1, n + bb * Sc * C, Sc, C, (float)f->norm_eps);
        mdt_k()->modulate_rows(n + bb * Sc * C, Sc, C, mod, 6 * C, x->ada_rows, 0, C);
    }
    MDT_TRY(attn_part(d, b, n, Sc, &x->rope, 1, y)); // [B*S/P, C]
    for (int64_t bb = 0; bb < d->B; bb++) {
        mdt_k()->gate_residual_rows(h + bb * Sc * C, y + bb * Sc * C, C, mod, 6 * C, x->ada_rows,
                                    2 * C, Sc, C);
        mdt_k()->rmsnorm(h + bb * Sc * C, b->norm2, n + bb * Sc * C, Sc, C, (float)f->norm_eps);
        mdt_k()->modulate_rows(n + bb * Sc * C, Sc, C, mod, 6 * C, x->ada_rows, 3 * C, 4 * C);
    }
    if (i == 0) /* test seam: fail mid-step, between a block's collectives */
        MDT_TRY(mdt_dit_test_point(d, "step"));
    MDT_TRY(ff_part(d, b, n, d->B * Sc, y)); // [B*S/P, C]
    for (int64_t bb = 0; bb < d->B; bb++)
        mdt_k()->gate_residual_rows(h + bb * Sc * C, y + bb * Sc * C, C, mod, 6 * C, x->ada_rows,
                                    5 * C, Sc, C);
    return MDT_OK;
}

static mdt_status h3_forward(mdt_model *m, const mdt_tensor_set *in, mdt_tensor_set *out) {
    const h3 *f = m->impl;
    mdt_dit d;
    h3_in x;
    mdt_dit_begin(&d, m, f->heads, f->head_dim);
    mdt_cache *cache; /* none here: diffusers' first-block hook cannot run this family either */
    MDT_TRY(mdt_cache_begin(&d, 0, 0, &cache));
    MDT_TRY(h3_read(f, &d, in, &x));
    const int64_t C = f->hidden, E = f->time_embed, B = d.B, M = B * x.Sc;
    mdt_arena *ar = d.ar;
    float *th = mdt_arena_floats(ar, x.Tn * f->time_hidden); // [T_n, time_hidden]
    float *temb = mdt_arena_floats(ar, x.Tn * E);            // [T_n, E]
    float *h = mdt_arena_floats(ar, M * C);                  // [B, S/P, C] packed local rows
    float *mod = mdt_arena_floats(ar, x.Tn * 18 * C);        // [T_n, 18C] = [3 T_n, 6C]
    float *n = mdt_arena_floats(ar, M * C);                  // [B, S/P, C]
    float *y = mdt_arena_floats(ar, M * C);                  // [B, S/P, C]
    float *vo = mdt_arena_floats(ar, M * f->Pv);             // [B, S/P, Pv]
    float *ao = mdt_arena_floats(ar, M * f->audio_in);       // [B, S/P, audio]
    mdt_tensor *ov, *oa;
    if (!th || !temb || !h || !mod || !n || !y || !vo || !ao)
        return MDT_E_NOMEM;
    mdt_dit_mlp2(&f->t_lin1, &f->t_lin2, x.e, x.Tn, th, temb); // [T_n, E]
    mdt_k()->silu(temb, x.Tn * E); // SiLU(temb): the input of every AdaLN projection
    d.cond = temb, d.cond_rows = x.Tn, d.cond_width = E;
    mdt_guard_finite(d.m, "time_embedder", temb, x.Tn * E);
    MDT_TRY(pack(f, &d, &x, h));
    const h3_scratch scr = {mod, n, y};
    for (int64_t i = 0; i < f->layers; i++) {
        const mdt_arena_mark mk = mdt_arena_mark_get(ar);
        MDT_TRY(block(f, &d, &x, i, h, &scr));
        if (i == 0) /* test seam: fail between two blocks, the peers inside the next one's */
            MDT_TRY(mdt_dit_test_point(&d, "stage"));
        mdt_dit_block_done(&d, mk, "transformer_blocks", i, &(mdt_stream){h, x.Sc, C}, 1);
    }
    /* norm_out: [shift | scale] per timestep, rows picked by timestep index */
    MDT_TRY(mdt_dit_adaln(&d, &f->norm_out, mod)); // [T_n, 2C]
    for (int64_t bb = 0; bb < B; bb++) {
        mdt_k()->rmsnorm(h + bb * x.Sc * C, f->norm_out_w, n + bb * x.Sc * C, x.Sc, C,
                         (float)f->final_eps);
        mdt_k()->modulate_rows(n + bb * x.Sc * C, x.Sc, C, mod, 2 * C, x.t_rows, 0, C);
    }
    mdt_dit_linear(&f->proj_out, n, M, vo, f->Pv);             // [B, S/P, Pv]
    mdt_dit_linear(&f->audio_proj_out, n, M, ao, f->audio_in); // [B, S/P, audio]
    mdt_guard_finite(d.m, "proj_out", vo, M * f->Pv);
    mdt_guard_finite(d.m, "audio_proj_out", ao, M * f->audio_in);
    MDT_TRY(mdt_tensor_set_add(out, "sample", MDT_F32, 3, (int64_t[]){B, x.Nv, f->Pv}, &ov));
    MDT_TRY(mdt_tensor_set_add(out, "audio_sample", MDT_F32, 3, (int64_t[]){B, x.Na, f->audio_in},
                               &oa));
    MDT_TRY(mdt_cp_give(&d.cp, "sample", ar, d.ha, in, x.S, vo, ov));
    MDT_TRY(mdt_cp_give(&d.cp, "audio_sample", ar, d.ha, in, x.S, ao, oa));
    /* no silent degrade: the packed sequence in every block; the refiner on every rank */
    mdt_promise p = {0};
    mdt_dit_promise_cp(&d, &p, &x.S, 1, f->layers * B);
    mdt_dit_promise_local(&d, &p, x.Nt, f->refiner_layers * B);
    return mdt_dit_end(&d, &p);
}

/* ---- random inputs: one packed layout [text | audio | video] ---- */
static mdt_status h3_make_inputs(const void *impl, const mdt_inputs_params *p, mdt_rng *rng,
                                 mdt_tensor_set *out) {
    const h3 *f = impl;
    const int64_t Nv = p->img_tokens > 0 ? p->img_tokens : 8, B = p->batch;
    const int64_t Nt = p->txt_tokens > 0 ? p->txt_tokens : 4;
    const int64_t Na = p->audio_tokens > 0 ? p->audio_tokens : 6, S = Nt + Na + Nv;
    mdt_tensor *t;
    const struct {
        const char *name;
        int64_t n, w;
    } lat[] = {{"hidden_states", Nv, f->Pv},
               {"audio_hidden_states", Na, f->audio_in},
               {"encoder_hidden_states", Nt, f->text_dim}};
    for (int i = 0; i < 3; i++)
        MDT_TRY(
            mdt_inputs_add_normal(out, lat[i].name, 3, (int64_t[]){B, lat[i].n, lat[i].w}, rng));
    MDT_TRY(mdt_inputs_add_const(out, "timestep", 2, p->timestep, &t)); /* video t, audio t/2 */
    ((float *)t->data)[1] = (float)(p->timestep * 0.5);
    mdt_tensor *ti, *tg, *pos, *vi, *ai, *xi;
    MDT_TRY(mdt_tensor_set_add(out, "timestep_indices", MDT_I64, 1, (int64_t[]){S}, &ti));
    MDT_TRY(mdt_tensor_set_add(out, "token_tags", MDT_I64, 1, (int64_t[]){S}, &tg));
    MDT_TRY(mdt_tensor_set_add(out, "position_ids", MDT_I64, 2, (int64_t[]){S, 3}, &pos));
    MDT_TRY(mdt_tensor_set_add(out, "video_indices", MDT_I64, 1, (int64_t[]){Nv}, &vi));
    MDT_TRY(mdt_tensor_set_add(out, "audio_indices", MDT_I64, 1, (int64_t[]){Na}, &ai));
    MDT_TRY(mdt_tensor_set_add(out, "text_indices", MDT_I64, 1, (int64_t[]){Nt}, &xi));
    int64_t *tiv = ti->data, *tgv = tg->data, *pv = pos->data;
    const int64_t w = (int64_t)ceil(sqrt((double)Nv));
    for (int64_t s = 0; s < S; s++) {
        const int is_text = s < Nt, is_audio = !is_text && s < Nt + Na;
        tgv[s] = is_text ? 1 : is_audio ? 2 : 0;
        tiv[s] = is_audio ? 1 : 0;
        const int64_t v = s - Nt - Na;
        pv[s * 3] = is_text ? s : is_audio ? s - Nt : 0;
        pv[s * 3 + 1] = (!is_text && !is_audio) ? v / w : 0;
        pv[s * 3 + 2] = (!is_text && !is_audio) ? v % w : 0;
        if (is_text)
            ((int64_t *)xi->data)[s] = s;
        else if (is_audio)
            ((int64_t *)ai->data)[s - Nt] = s;
        else
            ((int64_t *)vi->data)[v] = s;
    }
    return MDT_OK;
}

/* The packed sequence splits once it is built: these per-row inputs split with it (the rotary
 * rows come from position_ids; adaln rows from timestep_indices and token_tags). */
static const mdt_cp_plan k_h3_cp_plan = {
    .nsplit = 3,
    .split = {{"position_ids", 0, NULL}, {"timestep_indices", 0, NULL}, {"token_tags", 0, NULL}},
    .ngather = 2,
    .gather = {{"sample", 1, "video_indices"}, {"audio_sample", 1, "audio_indices"}},
};

/* The packed rows plus the rows of the per-block AdaLN table (3 per timestep, (timestep,
 * modality), as wide as a row's activations): the rows the memory estimate counts, checked
 * before the load. */
static int64_t h3_token_rows(const void *impl, const mdt_tensor_set *in) {
    (void)impl;
    const int64_t S = mdt_input_dim(in, "position_ids", 0), Tn = mdt_input_dim(in, "timestep", 0);
    return (S > 0 ? S : 0) + 3 * (Tn > 0 ? Tn : 0);
}

const mdt_family mdt_family_minimax_h3 = {
    MDT_FAMILY_FIELDS(h3, "minimax-h3", "MiniMaxH3Transformer3DModel", k_h3_cp_plan, "sample"),
    .token_rows = h3_token_rows};
