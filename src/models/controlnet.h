/*
 * controlnet.h — ControlNet residuals on the image stream: diffusers' controlnet_block_samples
 * (FluxTransformer2DModel, QwenImageTransformer2DModel) and controlnet_single_block_samples
 * (Flux). A ControlNet model, run by the caller's pipeline, gives N residuals [B, S_img, C]; the
 * transformer adds residual k(i) to its image rows after block i of a stack of L:
 * k = i / ceil(L / N), or i mod N for XLabs' ControlNets (controlnet_blocks_repeat). With N > L
 * the residuals past L are not read (diffusers' indexing). meshdit takes the list as one tensor
 * [B, N, S_img, C]: stacked on dim 1, the batch first, so the cfg axis and a family's per-element
 * passes cut it as they cut hidden_states; the CP plan splits it on dim 2 with the image rows.
 */
#ifndef MDT_MODELS_CONTROLNET_H
#define MDT_MODELS_CONTROLNET_H

#include "models/dit.h"

/* One forward's residuals of one stack, this rank's rows of its batch elements. */
typedef struct mdt_controlnet {
    const float *r; /* backend [n or 1, N, si, C]; NULL: no residuals (nothing is added) */
    int64_t n, N, si, C;
    int repeat; /* XLabs: residual i mod N after block i */
    int shared; /* one element's residuals for every element (diffusers broadcasts [1, S, C]) */
} mdt_controlnet;

/* Optional input `name` [B or 1, N, Si, C] (any number dtype, converted to f32; finite; N >= 1):
 * *x a host view of it, *N, and *shared = its dim 0 is 1 for a batch B > 1 (every element's, as
 * diffusers broadcasts it); *x = NULL when absent (its CP split counted as done). */
mdt_status mdt_controlnet_read(mdt_dit *d, const mdt_tensor_set *in, const char *name, int64_t Si,
                               int64_t C, const float **x, int64_t *N, int *shared);
/* c = this rank's CP chunk of elements [b0, b0 + n) of x [B, N, Si, C] (mdt_controlnet_read's; with
 * `shared`, its one element for all), in backend memory; x NULL gives c->r NULL. */
mdt_status mdt_controlnet_take(mdt_dit *d, const char *name, const float *x, int64_t b0, int64_t n,
                               int64_t N, int64_t Si, int64_t C, int repeat, int shared,
                               mdt_controlnet *c);
/* MDT_E_UNSUPPORTED when the model has a step cache on and the forward has residuals (`have`):
 * a skipped block would skip its residual. Called before the cache begins (its state untouched). */
mdt_status mdt_controlnet_check_cache(const mdt_dit *d, int have);
/* After block i of a stack of L: each element e's rows x + e ld + [0, si) C of [si, C] get
 * residual k(i) added (ld: floats from one element's first image row to the next one's). */
void mdt_controlnet_add(const mdt_controlnet *c, int64_t i, int64_t L, float *x, int64_t ld);

#endif /* MDT_MODELS_CONTROLNET_H */
