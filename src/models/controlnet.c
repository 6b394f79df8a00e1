/*
 * controlnet.c — see controlnet.h.
 */
#include "models/controlnet.h"

#include "models/cache.h"

mdt_status mdt_controlnet_read(mdt_dit *d, const mdt_tensor_set *in, const char *name, int64_t Si,
                               int64_t C, const float **x, int64_t *N, int *shared) {
    *x = NULL, *N = 0, *shared = 0;
    if (!mdt_tensor_set_get(in, name)) {
        mdt_cp_absent(&d->cp, name);
        return MDT_OK;
    }
    const int64_t n = mdt_input_dim(in, name, 1);
    *shared = d->B > 1 && mdt_input_dim(in, name, 0) == 1;
    MDT_TRY(mdt_input_f32_view(in, name, 4, (int64_t[]){*shared ? 1 : d->B, n, Si, C}, d->ha, x));
    if (n < 1)
        return MDT_FAIL(MDT_E_INVALID,
                        "inputs: tensor '%s' holds no residual (dim 1 is 0); leave it out for "
                        "none",
                        name);
    *N = n;
    return MDT_OK;
}

mdt_status mdt_controlnet_take(mdt_dit *d, const char *name, const float *x, int64_t b0, int64_t n,
                               int64_t N, int64_t Si, int64_t C, int repeat, int shared,
                               mdt_controlnet *c) {
    const void *loc;
    int64_t s0, si;
    const int64_t ne = shared ? 1 : n; /* the elements held */
    *c = (mdt_controlnet){.n = n, .N = N, .C = C, .repeat = repeat, .shared = shared};
    if (!x)
        return MDT_OK;
    MDT_TRY(mdt_cp_take(&d->cp, name, x + (shared ? 0 : b0) * N * Si * C, sizeof(float), 4,
                        (int64_t[]){ne, N, Si, C}, d->ha, &loc, &s0, &si));
    c->si = si;
    c->r = mdt_k_upload(d->ar, loc, sizeof(float) * (size_t)(ne * N * si * C)); // [ne, N, si, C]
    return c->r ? MDT_OK : MDT_E_NOMEM;
}

mdt_status mdt_controlnet_check_cache(const mdt_dit *d, int have) {
    if (have && mdt_cache_on(d))
        return MDT_FAIL(MDT_E_UNSUPPORTED,
                        "cache: a step cache with ControlNet residuals is not supported (a "
                        "skipped block would skip its residual); run the ControlNet without one");
    return MDT_OK;
}

void mdt_controlnet_add(const mdt_controlnet *c, int64_t i, int64_t L, float *x, int64_t ld) {
    if (!c->r)
        return;
    const int64_t every = (L + c->N - 1) / c->N; /* diffusers: ceil(L / N) */
    const int64_t k = c->repeat ? i % c->N : i / every, rows = c->si * c->C;
    for (int64_t e = 0; e < c->n; e++)
        mdt_k()->add(x + e * ld, c->r + ((c->shared ? 0 : e) * c->N + k) * rows, rows); // [si, C]
}
