/*
 * wan_inputs.c — a Wan forward's inputs on one rank (see wan_model.h and wan.c for the
 * semantics): the latent video patchified in the Conv3d weight's feature order, the timesteps
 * reduced to their distinct values (one modulation row each) with the row of every token, the
 * text and optional image embeddings (whole on every rank), the rotary tables of this rank's
 * tokens, and the output unpatchified.
 */
#include "models/wan_model.h"

#include "backend/backend.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static int cmp_float(const void *a, const void *b) {
    const float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

/* Distinct values tv[*Tn] (sorted) of t [N] and each element's index among them, idx [N]. */
static void distinct(const float *t, int64_t N, float *tv, int64_t *Tn, int64_t *idx) {
    int64_t k = 0;
    memcpy(tv, t, sizeof(float) * (size_t)N);
    qsort(tv, (size_t)N, sizeof(float), cmp_float);
    for (int64_t i = 0; i < N; i++)
        if (k == 0 || tv[i] != tv[k - 1])
            tv[k++] = tv[i];
    for (int64_t i = 0; i < N; i++) {
        int64_t lo = 0, hi = k - 1;
        while (lo < hi) {
            const int64_t mid = (lo + hi) / 2;
            if (tv[mid] < t[i])
                lo = mid + 1;
            else
                hi = mid;
        }
        idx[i] = lo;
    }
    *Tn = k;
}

/* The latent video x [B, Cin, F, H, W] as patches p [B, S, Cin pt ph pw] in token order
 * (frame, row, column) and feature order (c, t, h, w), the Conv3d weight's. */
static void patchify(const wan *f, const wan_in *x, int64_t B, const float *v, float *p) {
    const int64_t pt = f->patch[0], ph = f->patch[1], pw = f->patch[2], Cin = f->in_ch;
    for (int64_t b = 0; b < B; b++)
        for (int64_t s = 0; s < x->S; s++) {
            const int64_t fr = s / (x->Hp * x->Wp), r = s / x->Wp % x->Hp, c = s % x->Wp;
            float *o = p + (b * x->S + s) * f->Pin;
            for (int64_t ch = 0; ch < Cin; ch++)
                for (int64_t i = 0; i < pt; i++)
                    for (int64_t j = 0; j < ph; j++)
                        for (int64_t k = 0; k < pw; k++)
                            *o++ = v[(((b * Cin + ch) * x->F + fr * pt + i) * x->H + r * ph + j) *
                                         x->W +
                                     c * pw + k];
        }
}

/* proj_out rows y [B, S, Pout] (feature order (t, h, w, c)) as the video [B, Cout, F' pt,
 * H' ph, W' pw], diffusers' reshape and permute. */
void mdt_wan_unpatchify(const wan *f, const wan_in *x, int64_t B, const float *y, float *v) {
    const int64_t pt = f->patch[0], ph = f->patch[1], pw = f->patch[2], Co = f->out_ch;
    const int64_t F = x->Fp * pt, H = x->Hp * ph, W = x->Wp * pw;
    for (int64_t b = 0; b < B; b++)
        for (int64_t s = 0; s < x->S; s++) {
            const int64_t fr = s / (x->Hp * x->Wp), r = s / x->Wp % x->Hp, c = s % x->Wp;
            const float *o = y + (b * x->S + s) * f->Pout;
            for (int64_t i = 0; i < pt; i++)
                for (int64_t j = 0; j < ph; j++)
                    for (int64_t k = 0; k < pw; k++)
                        for (int64_t ch = 0; ch < Co; ch++)
                            v[(((b * Co + ch) * F + fr * pt + i) * H + r * ph + j) * W + c * pw +
                              k] = *o++;
        }
}

/* Reads the optional image embeddings: [B, Ni, image_dim], or with pos_embed [2B, Ni/2, D]
 * viewed as [B, Ni, D] (diffusers' view(-1, 2 N, D)). */
static mdt_status read_image(const wan *f, mdt_dit *d, const mdt_tensor_set *in, wan_in *x,
                             const float **img) {
    const char *nm = "encoder_hidden_states_image";
    const int64_t B = d->B, n0 = mdt_input_dim(in, nm, 0), n1 = mdt_input_dim(in, nm, 1);
    *img = NULL, x->Ni = 0;
    if (!f->image_dim) {
        if (n0 >= 0)
            return MDT_FAIL(MDT_E_INVALID,
                            "inputs: '%s' is given but config.json has no "
                            "image_dim (not an image-to-video model)",
                            nm);
        return MDT_OK;
    }
    if (n0 < 0)
        return MDT_FAIL(MDT_E_INVALID,
                        "inputs: '%s' [B, N_image, %lld] is required (config.json has image_dim)",
                        nm, (long long)f->image_dim);
    const int pos = f->pos_len > 0;
    if (pos && n1 * 2 != f->pos_len)
        return MDT_FAIL(MDT_E_INVALID,
                        "inputs: '%s' must be [2B, %lld, %lld] (two images, pos_embed_seq_len "
                        "%lld)",
                        nm, (long long)(f->pos_len / 2), (long long)f->image_dim,
                        (long long)f->pos_len);
    if (n1 < 1)
        return MDT_FAIL(MDT_E_INVALID, "inputs: '%s' must hold at least one token", nm);
    MDT_TRY(
        mdt_input_f32_view(in, nm, 3, (int64_t[]){pos ? 2 * B : B, n1, f->image_dim}, d->ha, img));
    x->Ni = pos ? 2 * n1 : n1;
    return MDT_OK;
}

int64_t mdt_wan_context_cut(int64_t Ni, int64_t Nt) {
    const int64_t L = Ni + Nt, c = L - 512; /* `ehs[:, :c]` and `ehs[:, c:]` */
    const int64_t cut = c >= 0 ? c : L + c;
    return cut < 0 ? 0 : cut > L ? L : cut;
}

mdt_status mdt_wan_read(const wan *f, mdt_dit *d, const mdt_tensor_set *in, wan_in *x) {
    mdt_arena *ha = d->ha, *ar = d->ar;
    const int64_t B = mdt_input_dim(in, "hidden_states", 0), D = f->head_dim;
    const int64_t pt = f->patch[0], ph = f->patch[1], pw = f->patch[2];
    *x = (wan_in){.F = mdt_input_dim(in, "hidden_states", 2),
                  .H = mdt_input_dim(in, "hidden_states", 3),
                  .W = mdt_input_dim(in, "hidden_states", 4),
                  .Nt = mdt_input_dim(in, "encoder_hidden_states", 1)};
    if (B < 1 || x->F < pt || x->H < ph || x->W < pw)
        return MDT_FAIL(MDT_E_INVALID,
                        "inputs: 'hidden_states' must be [B, %lld, F, H, W] with F >= %lld, H >= "
                        "%lld, W >= %lld (patch_size)",
                        (long long)f->in_ch, (long long)pt, (long long)ph, (long long)pw);
    if (x->Nt < 1)
        return MDT_FAIL(MDT_E_INVALID,
                        "inputs: 'encoder_hidden_states' must be [B, N_text, %lld], N_text >= 1",
                        (long long)f->text_dim);
    x->Fp = x->F / pt, x->Hp = x->H / ph, x->Wp = x->W / pw, x->S = x->Fp * x->Hp * x->Wp;
    if (x->Fp > f->rope_max || x->Hp > f->rope_max || x->Wp > f->rope_max)
        return MDT_FAIL(MDT_E_INVALID,
                        "inputs: 'hidden_states' has a %lld x %lld x %lld patch grid, beyond "
                        "rope_max_seq_len %lld",
                        (long long)x->Fp, (long long)x->Hp, (long long)x->Wp,
                        (long long)f->rope_max);
    d->B = B;
    const int64_t S = x->S, shs[] = {B, f->in_ch, x->F, x->H, x->W};
    const int tok_t = mdt_input_dim(in, "timestep", 1) >= 0; /* [B, S]: per-token (TI2V) */
    const float *hs;
    float *ts;
    MDT_TRY(mdt_input_f32_view(in, "hidden_states", 5, shs, ha, &hs));
    MDT_TRY(mdt_input_f32_view(in, "encoder_hidden_states", 3, (int64_t[]){B, x->Nt, f->text_dim},
                               ha, &x->ehs));
    MDT_TRY(read_image(f, d, in, x, &x->img));
    x->Nci = x->img ? mdt_wan_context_cut(x->Ni, x->Nt) : 0;
    x->Nct = x->Ni + x->Nt - x->Nci;
    /* [B] or [B, S], or [1] / [1, S] for every sample (diffusers broadcasts them) */
    MDT_TRY(mdt_input_f32_batch(in, "timestep", tok_t ? 2 : 1, (int64_t[]){B, S}, ha, &ts));
    /* per token: the timestep's row among the distinct values (every rank the same table) */
    float *pat = mdt_arena_floats(ha, B * S * f->Pin);                  // [B, S, Pin] host
    float *tv = mdt_arena_floats(ha, B * S);                            // [Tn] host
    int64_t *tix = (int64_t *)(void *)mdt_arena_floats(ha, 2 * B * S);  // [B, S] host
    int64_t *ttok = (int64_t *)(void *)mdt_arena_floats(ha, 2 * B * S); // [B, S] host
    if (!pat || !tv || !tix || !ttok)
        return MDT_E_NOMEM;
    distinct(ts, tok_t ? B * S : B, tv, &x->Tn, tix);
    for (int64_t b = 0; b < B; b++)
        for (int64_t s = 0; s < S; s++)
            ttok[b * S + s] = tok_t ? tix[b * S + s] : tix[b];
    patchify(f, x, B, hs, pat);
    /* the plan: video tokens (after the patch embedding) and their timesteps split */
    const void *pat_l, *trow_l;
    MDT_TRY(mdt_cp_take(&d->cp, "hidden_states", pat, 4, 3, (int64_t[]){B, S, f->Pin}, ha, &pat_l,
                        &x->s0, &x->n));
    MDT_TRY(
        mdt_cp_take(&d->cp, "timestep", ttok, 8, 2, (int64_t[]){B, S}, ha, &trow_l, &x->s0, &x->n));
    const int64_t n = x->n;
    float *e_h = mdt_arena_floats(ha, x->Tn * f->freq_dim);           // [Tn, freq] host
    float *pos = mdt_arena_floats(ha, 3 * n);                         // [n, 3] host
    int32_t *col_axis = (int32_t *)(void *)mdt_arena_floats(ha, D);   // [D] host
    double *col_freq = (double *)(void *)mdt_arena_floats(ha, 2 * D); // [D] host
    if (!e_h || !pos || !col_axis || !col_freq)
        return MDT_E_NOMEM;
    mdt_dit_timestep_embed(tv, x->Tn, f->freq_dim, e_h); /* unscaled t, cos first */
    for (int64_t i = 0; i < n; i++) {                    /* (frame, row, column) of my tokens */
        const int64_t s = x->s0 + i, fr = s / (x->Hp * x->Wp), r = s / x->Wp % x->Hp;
        pos[3 * i] = (float)fr, pos[3 * i + 1] = (float)r, pos[3 * i + 2] = (float)(s % x->Wp);
    }
    /* rotary columns: axis a of width d, pair j at frequency 1 / 1e4^(2j / d) (float64, like
     * get_1d_rotary_pos_embed), each value repeated for both channels of its pair */
    for (int a = 0, off = 0; a < 3; off += (int)f->axes[a], a++)
        for (int64_t j = 0; j < f->axes[a] / 2; j++) {
            col_axis[off + 2 * j] = col_axis[off + 2 * j + 1] = a;
            col_freq[off + 2 * j] = col_freq[off + 2 * j + 1] =
                1.0 / pow(10000.0, (double)(2 * j) / (double)f->axes[a]);
        }
    /* to the backend's memory (the same pointers on the CPU backend) */
    x->x = mdt_k_upload(ar, pat_l, sizeof(float) * (size_t)(B * n * f->Pin));
    x->ehs = mdt_k_upload(ar, x->ehs, sizeof(float) * (size_t)(B * x->Nt * f->text_dim));
    x->img = x->img ? mdt_k_upload(ar, x->img, sizeof(float) * (size_t)(B * x->Ni * f->image_dim))
                    : NULL;
    x->e = mdt_k_upload(ar, e_h, sizeof(float) * (size_t)(x->Tn * f->freq_dim));
    x->trow = mdt_k_upload(ar, trow_l, sizeof(int64_t) * (size_t)(B * n));
    const float *pos_d = mdt_k_upload(ar, pos, sizeof(float) * (size_t)(3 * n));
    const int32_t *cax_d = mdt_k_upload(ar, col_axis, sizeof(int32_t) * (size_t)D);
    const double *cfr_d = mdt_k_upload(ar, col_freq, sizeof(double) * (size_t)D);
    float *cos_t = mdt_arena_floats(ar, n * D), *sin_t = mdt_arena_floats(ar, n * D);
    if (!x->x || !x->ehs || (f->image_dim && !x->img) || !x->e || !x->trow || !pos_d || !cax_d ||
        !cfr_d || !cos_t || !sin_t)
        return MDT_E_NOMEM;
    mdt_k()->angle_table(pos_d, 3, n, D, cax_d, cfr_d, 1, cos_t, sin_t); // [n, D]
    x->rope = (mdt_rope){cos_t, sin_t, D, MDT_ROPE_INTERLEAVED};
    return MDT_OK;
}
