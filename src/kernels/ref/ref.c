/* ref.c — the reference kernels of ref.h: clarity over speed. */
#include "ref.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

void mdt_ref_linear(const float *x, const float *w, const float *b, float *y, int64_t M, int64_t K,
                    int64_t N) {
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < N; j++) {
            double acc = b ? b[j] : 0.0;
            for (int64_t k = 0; k < K; k++)
                acc += (double)x[i * K + k] * (double)w[j * K + k];
            y[i * N + j] = (float)acc;
        }
}

void mdt_ref_linear_bf16(const float *x, const uint16_t *wh, const float *b, float *y, int64_t M,
                         int64_t K, int64_t N) {
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < N; j++) {
            double acc = b ? b[j] : 0.0;
            for (int64_t k = 0; k < K; k++) {
                const uint32_t bits = (uint32_t)wh[j * K + k] << 16;
                float w;
                memcpy(&w, &bits, sizeof w);
                acc += (double)x[i * K + k] * (double)w;
            }
            y[i * N + j] = (float)acc;
        }
}

void mdt_ref_layernorm(const float *x, float *y, int64_t M, int64_t C, float eps) {
    for (int64_t i = 0; i < M; i++) {
        double mean = 0, var = 0;
        for (int64_t c = 0; c < C; c++)
            mean += x[i * C + c];
        mean /= (double)C;
        for (int64_t c = 0; c < C; c++)
            var += (x[i * C + c] - mean) * (x[i * C + c] - mean);
        var /= (double)C;
        double inv = 1.0 / sqrt(var + eps);
        for (int64_t c = 0; c < C; c++)
            y[i * C + c] = (float)((x[i * C + c] - mean) * inv);
    }
}

void mdt_ref_rmsnorm(const float *x, const float *w, float *y, int64_t M, int64_t D, float eps) {
    for (int64_t i = 0; i < M; i++) {
        double ms = 0;
        for (int64_t d = 0; d < D; d++)
            ms += (double)x[i * D + d] * x[i * D + d];
        double inv = 1.0 / sqrt(ms / (double)D + eps);
        for (int64_t d = 0; d < D; d++)
            y[i * D + d] = (float)(x[i * D + d] * inv * w[d]);
    }
}

void mdt_ref_modulate(float *x, const float *shift, const float *scale, int64_t M, int64_t C) {
    for (int64_t i = 0; i < M; i++)
        for (int64_t c = 0; c < C; c++)
            x[i * C + c] = x[i * C + c] * (1.0f + scale[c]) + shift[c];
}

void mdt_ref_gelu_tanh(float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        double v = x[i];
        x[i] = (float)(0.5 * v * (1.0 + tanh(0.7978845608028654 * (v + 0.044715 * v * v * v))));
    }
}

void mdt_ref_silu(float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        x[i] = (float)(x[i] / (1.0 + exp(-(double)x[i])));
}

void mdt_ref_rope_interleaved(float *x, const float *cos_t, const float *sin_t, int64_t S,
                              int64_t H, int64_t D) {
    for (int64_t s = 0; s < S; s++)
        for (int64_t h = 0; h < H; h++) {
            float *v = x + (s * H + h) * D;
            for (int64_t m = 0; m < D / 2; m++) {
                float re = v[2 * m], im = v[2 * m + 1];
                v[2 * m] = re * cos_t[s * D + 2 * m] - im * sin_t[s * D + 2 * m];
                v[2 * m + 1] = im * cos_t[s * D + 2 * m + 1] + re * sin_t[s * D + 2 * m + 1];
            }
        }
}

void mdt_ref_rope_half(float *x, const float *cos_t, const float *sin_t, int64_t S, int64_t H,
                       int64_t D, int64_t rot) {
    const int64_t half = rot / 2;
    for (int64_t s = 0; s < S; s++)
        for (int64_t h = 0; h < H; h++) {
            float *v = x + (s * H + h) * D;
            for (int64_t m = 0; m < half; m++) {
                double x1 = v[m], x2 = v[m + half];
                v[m] = (float)(x1 * cos_t[s * rot + m] - x2 * sin_t[s * rot + m]);
                v[m + half] =
                    (float)(x2 * cos_t[s * rot + m + half] + x1 * sin_t[s * rot + m + half]);
            }
        }
}

void mdt_ref_swiglu(const float *in, float *out, int64_t M, int64_t n) {
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < n; j++) {
            double g = in[i * 2 * n + n + j];
            out[i * n + j] = (float)(in[i * 2 * n + j] * g / (1.0 + exp(-g)));
        }
}

void mdt_ref_attention(const float *q, const float *k, const float *v, float *out, float *lse,
                       int64_t Sq, int64_t Sk, int64_t D, float scale) {
    double *p = malloc(sizeof(double) * (size_t)(Sk > 0 ? Sk : 1));
    if (!p)
        return;
    for (int64_t i = 0; i < Sq; i++) {
        double mx = -INFINITY, sum = 0;
        for (int64_t j = 0; j < Sk; j++) {
            double s = 0;
            for (int64_t d = 0; d < D; d++)
                s += (double)q[i * D + d] * k[j * D + d];
            p[j] = s * scale;
            if (p[j] > mx)
                mx = p[j];
        }
        for (int64_t j = 0; j < Sk; j++)
            sum += (p[j] = exp(p[j] - mx));
        for (int64_t d = 0; d < D; d++) {
            double acc = 0;
            for (int64_t j = 0; j < Sk; j++)
                acc += p[j] * v[j * D + d];
            out[i * D + d] = (float)(acc / sum);
        }
        if (lse)
            lse[i] = (float)(mx + log(sum));
    }
    free(p);
}

void mdt_ref_round_bf16(float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, &x[i], sizeof u);
        if (isnan(x[i]))
            continue;
        const uint32_t lsb = (u >> 16) & 1u;
        u = (u + 0x7fffu + lsb) & 0xffff0000u;
        memcpy(&x[i], &u, sizeof u);
    }
}
