/*
 * cp.c — see cp.h.
 */
#include "models/cp.h"

#include "backend/backend.h"
#include "core/testhooks.h"
#include "models/inputs.h"

#include <string.h>

void mdt_cp_begin(mdt_cp *cp, const mdt_cp_plan *plan, mdt_mesh *mesh) {
    const int split = mesh && !mdt_test_hooks_get()->skip_cp_split;
    memset(cp, 0, sizeof *cp);
    cp->plan = plan;
    cp->P = split ? mesh->cp_size : 1;
    cp->chunk = split ? mesh->cp_index : 0;
    cp->mesh = cp->P > 1 ? mesh : NULL;
}

/* Index of `name` in entries e[0:n], or -1. */
static int find(const mdt_cp_split *e, int n, const char *name) {
    for (int i = 0; i < n; i++)
        if (strcmp(e[i].input, name) == 0)
            return i;
    return -1;
}

mdt_status mdt_cp_take(mdt_cp *cp, const char *name, const void *x, size_t esize, int ndim,
                       const int64_t *shape, mdt_arena *a, const void **local, int64_t *start,
                       int64_t *len) {
    const int i = cp->plan ? find(cp->plan->split, cp->plan->nsplit, name) : -1;
    if (i < 0 || cp->plan->split[i].dim >= ndim)
        return MDT_FAIL(MDT_E_INVALID,
                        "cp plan: the forward splits '%s', which the plan does not "
                        "declare at that dim",
                        name);
    const int dim = cp->plan->split[i].dim;
    int64_t outer = 1, inner = (int64_t)esize;
    for (int d = 0; d < dim; d++)
        outer *= shape[d];
    for (int d = dim + 1; d < ndim; d++)
        inner *= shape[d];
    mdt_split_range(shape[dim], cp->P, cp->chunk, start, len);
    cp->taken |= 1u << i;
    if (cp->P == 1) {
        *local = x;
        return MDT_OK;
    }
    unsigned char *dst = (unsigned char *)mdt_arena_floats(a, (outer * *len * inner + 3) / 4 + 1);
    if (!dst)
        return MDT_E_NOMEM;
    for (int64_t o = 0; o < outer; o++) // [outer, len, inner] <- [outer, shape[dim], inner]
        memcpy(dst + o * *len * inner, (const unsigned char *)x + (o * shape[dim] + *start) * inner,
               (size_t)(*len * inner));
    *local = dst;
    return MDT_OK;
}

void mdt_cp_absent(mdt_cp *cp, const char *name) {
    const int i = cp->plan ? find(cp->plan->split, cp->plan->nsplit, name) : -1;
    if (i >= 0)
        cp->taken |= 1u << i;
}

mdt_status mdt_cp_gather_rows(mdt_mesh *mesh, mdt_arena *ar, int P, int64_t B, int64_t S, int64_t O,
                              const float *loc, float *full) {
    if (P == 1) {
        mdt_k()->copy2d(full, 0, loc, 0, 1, B * S * O);
        return MDT_OK;
    }
    int64_t counts[4096], r0, n;
    if (P > 4096)
        return MDT_FAIL(MDT_E_UNSUPPORTED, "a context-parallel group of %d ranks is too large", P);
    mdt_arena_mark mk = mdt_arena_mark_get(ar);
    float *all = mdt_arena_floats(ar, B * S * O); // [P][B][S_c][O]
    if (!all)
        return MDT_E_NOMEM;
    for (int j = 0; j < P; j++)
        mdt_split_range(S, P, j, &r0, &n), counts[j] = B * n * O;
    MDT_TRY(mdt_allgatherv_floats(mesh, MDT_GROUP_CP, loc, all, counts));
    const float *src = all;
    for (int j = 0; j < P; j++) {
        mdt_split_range(S, P, j, &r0, &n);
        mdt_k()->copy2d(full + r0 * O, S * O, src, n * O, B,
                        n * O); // [B, S, O] rows r0.. <- [B, n, O]
        src += B * n * O;
    }
    mdt_arena_rewind(ar, mk);
    return MDT_OK;
}

mdt_status mdt_cp_give(mdt_cp *cp, const char *name, mdt_arena *ar, mdt_arena *ha,
                       const mdt_tensor_set *in, int64_t S, const float *loc, mdt_tensor *out) {
    const int i = cp->plan ? find(cp->plan->gather, cp->plan->ngather, name) : -1;
    const int64_t B = out->shape[0], N = out->shape[1], O = out->shape[2];
    const char *by = i >= 0 ? cp->plan->gather[i].by : NULL;
    if (i < 0)
        return MDT_FAIL(MDT_E_INVALID,
                        "cp plan: the forward gathers '%s', which the plan does "
                        "not declare",
                        name);
    if (out->ndim != 3 || out->dtype != MDT_F32 || (!by && N != S))
        return MDT_FAIL(MDT_E_INVALID, "cp plan: output '%s' is not [B, %lld, O] f32", name,
                        (long long)S);
    int64_t r0, n, *idx = NULL;
    mdt_split_range(S, cp->P, cp->chunk, &r0, &n);
    if (by) /* the rows the plan names, checked against the sequence they index */
        MDT_TRY(mdt_input_i64(in, by, 1, &N, 0, S, ha, &idx));
    cp->given |= 1u << i;
    cp->given_rows += n;
    mdt_arena_mark mk = mdt_arena_mark_get(ar);
    float *full = mdt_arena_floats(ar, B * S * O); // [B, S, O]
    if (!full)
        return MDT_E_NOMEM;
    MDT_TRY(mdt_cp_gather_rows(cp->mesh, ar, cp->P, B, S, O, loc, full));
    if (!by) {
        mdt_k_to_host(out->data, full, sizeof(float) * (size_t)(B * S * O));
        mdt_arena_rewind(ar, mk);
        return MDT_OK;
    }
    float *sel = mdt_arena_floats(ar, B * N * O);                       // [B, N, O]
    int64_t *rows = (int64_t *)(void *)mdt_arena_floats(ha, 2 * B * N); // [B N] host
    if (!sel || !rows)
        return MDT_E_NOMEM;
    for (int64_t b = 0; b < B; b++)
        for (int64_t j = 0; j < N; j++)
            rows[b * N + j] = b * S + idx[j];
    const int64_t *drows =
        mdt_k_upload(ar, rows, sizeof(int64_t) * (size_t)(B * N > 0 ? B * N : 1));
    if (!drows)
        return MDT_E_NOMEM;
    mdt_k()->copy_rows(sel, O, NULL, full, O, drows, B * N, O); // [B N, O]
    mdt_k_to_host(out->data, sel, sizeof(float) * (size_t)(B * N * O));
    mdt_arena_rewind(ar, mk);
    return MDT_OK;
}

mdt_status mdt_cp_end(const mdt_cp *cp) {
    if (cp->P == 1 || !cp->plan)
        return MDT_OK;
    for (int i = 0; i < cp->plan->nsplit; i++)
        if (!(cp->taken >> i & 1))
            return MDT_FAIL(MDT_E_INVALID,
                            "cp plan: input '%s' is declared split but the forward "
                            "did not split it",
                            cp->plan->split[i].input);
    for (int i = 0; i < cp->plan->ngather; i++)
        if (!(cp->given >> i & 1))
            return MDT_FAIL(MDT_E_INVALID,
                            "cp plan: output '%s' is declared gathered but the "
                            "forward did not gather it",
                            cp->plan->gather[i].input);
    return MDT_OK;
}
