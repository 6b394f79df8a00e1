/*
 * tensor.c — dtype table and conversions, the named tensor set (a growable array of owned
 * tensors; lookup is linear, sets hold a handful of inputs/outputs).
 */
#include "tensor.h"

#include <math.h>
#include <string.h>

static const struct {
    const char *name;
    size_t size;
} k_dtypes[MDT_DTYPE_COUNT] = {
    [MDT_F32] = {"F32", 4},   [MDT_F16] = {"F16", 2}, [MDT_BF16] = {"BF16", 2},
    [MDT_F64] = {"F64", 8},   [MDT_I64] = {"I64", 8}, [MDT_I32] = {"I32", 4},
    [MDT_I16] = {"I16", 2},   [MDT_I8] = {"I8", 1},   [MDT_U8] = {"U8", 1},
    [MDT_BOOL] = {"BOOL", 1},
};

size_t mdt_dtype_size(mdt_dtype dt) {
    return (unsigned)dt < MDT_DTYPE_COUNT ? k_dtypes[dt].size : 0;
}
const char *mdt_dtype_name(mdt_dtype dt) {
    return (unsigned)dt < MDT_DTYPE_COUNT ? k_dtypes[dt].name : "?";
}
mdt_dtype mdt_dtype_parse(const char *name) {
    for (int i = 0; i < MDT_DTYPE_COUNT; i++)
        if (strcmp(name, k_dtypes[i].name) == 0)
            return (mdt_dtype)i;
    return MDT_DTYPE_COUNT;
}
int mdt_dtype_is_float(mdt_dtype dt) {
    return dt == MDT_F32 || dt == MDT_F16 || dt == MDT_BF16 || dt == MDT_F64;
}

float mdt_bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

uint16_t mdt_f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) /* NaN: keep it quiet, never round to Inf */
        return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest, ties to even */
    return (uint16_t)(u >> 16);
}

float mdt_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    uint32_t u;
    if (exp == 0) {
        if (man == 0) {
            u = sign;
        } else { /* subnormal: normalise */
            int e = -1;
            do {
                e++;
                man <<= 1;
            } while (!(man & 0x400u));
            u = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ffu) << 13);
        }
    } else if (exp == 31) {
        u = sign | 0x7f800000u | (man << 13);
    } else {
        u = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

uint16_t mdt_f32_to_f16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u)
        return (uint16_t)(sign | 0x7e00u);
    if (a >= 0x477ff000u) /* rounds to >= 65520: overflow to Inf */
        return (uint16_t)(sign | 0x7c00u);
    if (a < 0x38800000u) { /* below the smallest normal f16: subnormal or zero */
        float af;
        memcpy(&af, &a, 4);
        /* scale so that one f16 subnormal ulp (2^-24) becomes 1, round half to even */
        return (uint16_t)(sign | (uint32_t)nearbyintf(af * 16777216.0f));
    }
    uint32_t r = a + 0xfffu + ((a >> 13) & 1u) - ((uint32_t)(127 - 15) << 23);
    return (uint16_t)(sign | (r >> 13));
}

MDT_HOT_CLONES mdt_status mdt_convert_to_f32(mdt_dtype dt, const void *src, float *dst, int64_t n) {
    switch (dt) {
    case MDT_F32:
        if ((const void *)dst != src)
            memmove(dst, src, (size_t)n * 4);
        return MDT_OK;
    case MDT_BF16: {
        const uint16_t *s = src;
        for (int64_t i = 0; i < n; i++)
            dst[i] = mdt_bf16_to_f32(s[i]);
        return MDT_OK;
    }
    case MDT_F16: {
        const uint16_t *s = src;
        for (int64_t i = 0; i < n; i++)
            dst[i] = mdt_f16_to_f32(s[i]);
        return MDT_OK;
    }
    case MDT_F64: {
        const double *s = src;
        for (int64_t i = 0; i < n; i++)
            dst[i] = (float)s[i];
        return MDT_OK;
    }
    case MDT_I64: { /* index-like inputs (positions) are accepted where floats are expected */
        const int64_t *s = src;
        for (int64_t i = 0; i < n; i++)
            dst[i] = (float)s[i];
        return MDT_OK;
    }
    case MDT_I32: {
        const int32_t *s = src;
        for (int64_t i = 0; i < n; i++)
            dst[i] = (float)s[i];
        return MDT_OK;
    }
    default: return MDT_FAIL(MDT_E_UNSUPPORTED, "cannot convert %s to F32", mdt_dtype_name(dt));
    }
}

MDT_HOT_CLONES mdt_status mdt_convert_from_f32(mdt_dtype dt, const float *src, void *dst,
                                               int64_t n) {
    switch (dt) {
    case MDT_F32:
        if (dst != (const void *)src)
            memmove(dst, src, (size_t)n * 4);
        return MDT_OK;
    case MDT_BF16: {
        uint16_t *d = dst;
        for (int64_t i = 0; i < n; i++)
            d[i] = mdt_f32_to_bf16(src[i]);
        return MDT_OK;
    }
    case MDT_F16: {
        uint16_t *d = dst;
        for (int64_t i = 0; i < n; i++)
            d[i] = mdt_f32_to_f16(src[i]);
        return MDT_OK;
    }
    default: return MDT_FAIL(MDT_E_UNSUPPORTED, "cannot convert F32 to %s", mdt_dtype_name(dt));
    }
}

const char *mdt_shape_str(int ndim, const int64_t *shape, char *buf, size_t cap) {
    size_t n = 0;
    n += (size_t)snprintf(buf + n, cap - n, "[");
    for (int i = 0; i < ndim && n < cap; i++)
        n += (size_t)snprintf(buf + n, cap - n, "%s%lld", i ? ", " : "", (long long)shape[i]);
    if (n < cap)
        snprintf(buf + n, cap - n, "]");
    return buf;
}

int64_t mdt_tensor_numel(const mdt_tensor *t) {
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++)
        n *= t->shape[i];
    return n;
}
int64_t mdt_tensor_nbytes(const mdt_tensor *t) {
    return mdt_tensor_numel(t) * (int64_t)mdt_dtype_size(t->dtype);
}

/* ---- tensor set ---- */
/* Names are found through an open-addressing hash (linear probing, FNV-1a): a set built from a
 * request or a file of N tensors costs O(N), where a scan per add made 60,000 names cost
 * billions of comparisons. `slots` holds index + 1 of a tensor, 0 for an empty slot; its size is
 * a power of two at least twice `cap`, so a probe ends quickly. Sets never remove a tensor. */
struct mdt_tensor_set {
    int count, cap;
    char **names; /* one block with `tensors` and `slots` */
    mdt_tensor **tensors;
    int *slots;
    int nslots;
};

static uint32_t name_hash(const char *s) {
    uint32_t h = 2166136261u;
    for (; *s; s++)
        h = (h ^ (unsigned char)*s) * 16777619u;
    return h;
}

/* The slot of `name`: where it is, or the empty slot where it would go. */
static int slot_of(const mdt_tensor_set *set, const char *name) {
    const int mask = set->nslots - 1;
    int i = (int)(name_hash(name) & (uint32_t)mask);
    while (set->slots[i] && strcmp(set->names[set->slots[i] - 1], name) != 0)
        i = (i + 1) & mask;
    return i;
}

mdt_status mdt_tensor_set_create(mdt_tensor_set **out) {
    *out = mdt_calloc(sizeof **out);
    return *out ? MDT_OK : MDT_FAIL(MDT_E_NOMEM, "out of memory");
}

void mdt_tensor_set_free(mdt_tensor_set *set) {
    if (!set)
        return;
    for (int i = 0; i < set->count; i++) {
        mdt_free(set->names[i]);
        mdt_free(set->tensors[i]->data);
        mdt_free(set->tensors[i]);
    }
    mdt_free(set->names); /* the block holding the tensors' pointers and the slots too */
    mdt_free(set);
}

mdt_tensor *mdt_tensor_set_get(const mdt_tensor_set *set, const char *name) {
    if (set->nslots == 0)
        return NULL;
    const int k = set->slots[slot_of(set, name)];
    return k ? set->tensors[k - 1] : NULL;
}

int mdt_tensor_set_count(const mdt_tensor_set *set) { return set->count; }

mdt_tensor *mdt_tensor_set_at(const mdt_tensor_set *set, int i, const char **name) {
    if (i < 0 || i >= set->count)
        return NULL;
    if (name)
        *name = set->names[i];
    return set->tensors[i];
}

mdt_status mdt_tensor_set_add(mdt_tensor_set *set, const char *name, mdt_dtype dtype, int ndim,
                              const int64_t *shape, mdt_tensor **out) {
    if (mdt_tensor_set_get(set, name))
        return MDT_FAIL(MDT_E_INVALID, "tensor '%s' is already in the set", name);
    if (ndim < 0 || ndim > MDT_MAX_DIMS || (unsigned)dtype >= MDT_DTYPE_COUNT)
        return MDT_FAIL(MDT_E_INVALID, "tensor '%s': bad rank %d or dtype", name, ndim);
    if (set->count == set->cap) {
        /* one block: the names, the tensors and the hash's slots (as many allocations per
         * growth as before the hash: the forward's allocation count is a tested contract) */
        const int cap = set->cap ? set->cap * 2 : 8;
        const size_t pn = sizeof(char *) * (size_t)cap, pt = sizeof(mdt_tensor *) * (size_t)cap;
        unsigned char *block = mdt_calloc(pn + pt + sizeof(int) * (size_t)cap * 2);
        if (!block)
            return MDT_FAIL(MDT_E_NOMEM, "out of memory");
        char **nn = (char **)(void *)block;
        mdt_tensor **nt = (mdt_tensor **)(void *)(block + pn);
        if (set->count) {
            memcpy(nn, set->names, sizeof(char *) * (size_t)set->count);
            memcpy(nt, set->tensors, sizeof(mdt_tensor *) * (size_t)set->count);
        }
        mdt_free(set->names); /* the previous block */
        set->names = nn, set->tensors = nt, set->cap = cap;
        set->slots = (int *)(void *)(block + pn + pt), set->nslots = cap * 2;
        for (int i = 0; i < set->count; i++) /* rehash every name */
            set->slots[slot_of(set, set->names[i])] = i + 1;
    }
    mdt_tensor *t = mdt_calloc(sizeof *t);
    size_t len = strlen(name) + 1;
    char *nm = mdt_alloc(len);
    if (!t || !nm) {
        mdt_free(t), mdt_free(nm);
        return MDT_FAIL(MDT_E_NOMEM, "out of memory");
    }
    memcpy(nm, name, len);
    t->dtype = dtype, t->ndim = ndim;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0) {
            mdt_free(t), mdt_free(nm);
            return MDT_FAIL(MDT_E_INVALID, "tensor '%s': negative dimension", name);
        }
        t->shape[i] = shape[i];
    }
    int64_t nbytes = mdt_tensor_nbytes(t);
    t->data = mdt_calloc((size_t)(nbytes > 0 ? nbytes : 1));
    if (!t->data) {
        mdt_free(t), mdt_free(nm);
        return MDT_FAIL(MDT_E_NOMEM, "out of memory for tensor '%s' (%lld bytes)", name,
                        (long long)nbytes);
    }
    set->names[set->count] = nm;
    set->tensors[set->count] = t;
    set->count++;
    set->slots[slot_of(set, nm)] = set->count;
    if (out)
        *out = t;
    return MDT_OK;
}

mdt_status mdt_convert_number_to_f32(mdt_dtype dt, const void *src, float *dst, int64_t n) {
    switch (dt) {
    case MDT_I16:
        for (int64_t i = 0; i < n; i++)
            dst[i] = ((const int16_t *)src)[i];
        return MDT_OK;
    case MDT_I8:
        for (int64_t i = 0; i < n; i++)
            dst[i] = ((const int8_t *)src)[i];
        return MDT_OK;
    case MDT_U8:
        for (int64_t i = 0; i < n; i++)
            dst[i] = ((const uint8_t *)src)[i];
        return MDT_OK;
    default: return mdt_convert_to_f32(dt, src, dst, n);
    }
}

mdt_status mdt_tensor_set_to_f32(mdt_tensor_set *set, mdt_tensor *t) {
    (void)set; /* the set owns t's data: it frees what it holds */
    if (t->dtype == MDT_F32)
        return MDT_OK;
    const int64_t n = mdt_tensor_numel(t);
    float *f = mdt_alloc(sizeof(float) * (size_t)(n > 0 ? n : 1));
    if (!f)
        return MDT_FAIL(MDT_E_NOMEM, "out of memory");
    const mdt_status st = mdt_convert_number_to_f32(t->dtype, t->data, f, n);
    if (st != MDT_OK) {
        mdt_free(f);
        return st;
    }
    mdt_free(t->data);
    t->data = f, t->dtype = MDT_F32;
    return MDT_OK;
}

mdt_status mdt_tensor_set_add_copy(mdt_tensor_set *set, const char *name, const mdt_tensor *t) {
    mdt_tensor *dst;
    MDT_TRY(mdt_tensor_set_add(set, name, t->dtype, t->ndim, t->shape, &dst));
    memcpy(dst->data, t->data, (size_t)mdt_tensor_nbytes(t));
    return MDT_OK;
}
