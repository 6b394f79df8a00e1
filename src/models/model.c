/*
 * model.c — the generic half of every model: weight tables, family registry, the checkpoint
 * loader (validate every planned tensor's presence, shape and dtype, read it converted to f32 into
 * the one weights buffer), forward dispatch, and the random-checkpoint generator.
 */
#define _POSIX_C_SOURCE 200809L
#include "model.h"

#include "backend/backend.h"
#include "core/outfile.h"
#include "kernels/cpu/cpu.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

extern const mdt_family mdt_family_flux;
extern const mdt_family mdt_family_minimax_h3;
static mdt_status write_text(const char *path, const char *text);
static mdt_status write_weights(const char *path, int n, const char *const *names,
                                const mdt_tensor *const *tensors);
static const mdt_family *const k_families[] = {&mdt_family_flux, &mdt_family_minimax_h3};
enum { N_FAMILIES = sizeof k_families / sizeof k_families[0] };

mdt_status mdt_wtable_add(mdt_wtable *t, const char *name, int ndim, int64_t d0, int64_t d1,
                          mdt_tp_style style, const float **bind) {
    if (strlen(name) >= MDT_NAME_MAX)
        return MDT_FAIL(MDT_E_INVALID, "weight name too long: %s", name);
    if (t->n == t->cap) {
        int cap = t->cap ? 2 * t->cap : 64;
        mdt_weight_spec *s = mdt_calloc(sizeof *s * (size_t)cap);
        const float ***b = mdt_calloc(sizeof *b * (size_t)cap);
        int *r = mdt_calloc(sizeof *r * (size_t)cap);
        mdt_lin **l = mdt_calloc(sizeof(mdt_lin *) * (size_t)cap);
        if (!s || !b || !r || !l) {
            mdt_free(s), mdt_free((void *)b), mdt_free(r), mdt_free((void *)l);
            return MDT_FAIL(MDT_E_NOMEM, "out of memory");
        }
        if (t->n) {
            memcpy(s, t->specs, sizeof *s * (size_t)t->n);
            memcpy((void *)b, (const void *)t->bind, sizeof *b * (size_t)t->n);
            memcpy(r, t->required, sizeof *r * (size_t)t->n);
            memcpy((void *)l, (const void *)t->lin, sizeof(mdt_lin *) * (size_t)t->n);
        }
        mdt_free(t->specs), mdt_free((void *)t->bind), mdt_free(t->required);
        mdt_free((void *)t->lin);
        t->specs = s, t->bind = b, t->required = r, t->lin = l, t->cap = cap;
    }
    mdt_weight_spec *w = &t->specs[t->n];
    memset(w, 0, sizeof *w);
    snprintf(w->name, sizeof w->name, "%s", name);
    w->ndim = ndim;
    w->shape[0] = d0;
    w->shape[1] = ndim > 1 ? d1 : 0;
    w->style = style;
    t->bind[t->n] = bind;
    t->lin[t->n] = NULL;
    t->required[t->n] = 1;
    t->n++;
    return MDT_OK;
}

mdt_status mdt_wtable_add_linear(mdt_wtable *t, mdt_lin *l, const char *name, int64_t out,
                                 int64_t in, mdt_tp_style style, int bias) {
    char nm[MDT_NAME_MAX + 16]; /* mdt_wtable_add refuses names longer than MDT_NAME_MAX */
    l->in = in, l->out = out, l->b = NULL, l->wh = NULL;
    snprintf(nm, sizeof nm, "%s.weight", name);
    MDT_TRY(mdt_wtable_add(t, nm, 2, out, in, style, &l->w));
    t->lin[t->n - 1] = l;
    if (!bias)
        return MDT_OK;
    snprintf(nm, sizeof nm, "%s.bias", name);
    return mdt_wtable_add(t, nm, 1, out, 0,
                          mdt_tp_shard_dim(style) == 0 ? style : MDT_TP_REPLICATED, &l->b);
}

void mdt_wtable_free(mdt_wtable *t) {
    mdt_free((void *)t->lin);
    mdt_free(t->specs);
    mdt_free((void *)t->bind);
    mdt_free(t->required);
    memset(t, 0, sizeof *t);
}

const mdt_family *mdt_family_by_name(const char *name) {
    for (int i = 0; i < N_FAMILIES; i++)
        if (strcmp(k_families[i]->name, name) == 0 || strcmp(k_families[i]->class_name, name) == 0)
            return k_families[i];
    return NULL;
}

mdt_status mdt_family_from_config(const cJSON *config, const mdt_family **out) {
    const char *cls;
    *out = NULL;
    MDT_TRY(mdt_cfg_string(config, "_class_name", &cls));
    if (!cls)
        return MDT_FAIL(MDT_E_INVALID, "config.json: '_class_name' is missing (which model is "
                                       "this?)");
    *out = mdt_family_by_name(cls);
    char shown[MDT_ESC_NAME];
    if (!*out)
        return MDT_FAIL(MDT_E_UNSUPPORTED,
                        "config.json: model class '%s' is not supported "
                        "(supported: FluxTransformer2DModel, MiniMaxH3Transformer3DModel)",
                        mdt_escape(cls, shown, sizeof shown));
    return MDT_OK;
}

static int64_t spec_numel(const mdt_weight_spec *w) {
    return w->shape[0] * (w->ndim > 1 ? w->shape[1] : 1);
}

mdt_status mdt_model_describe(const cJSON *config, mdt_model **out) {
    mdt_status st;
    const mdt_family *fam;
    *out = NULL;
    MDT_TRY(mdt_family_from_config(config, &fam));
    mdt_model *m = mdt_calloc(sizeof *m);
    if (!m)
        return MDT_FAIL(MDT_E_NOMEM, "out of memory");
    m->fam = fam;
    mdt_arena_init(&m->arena);
    m->impl = mdt_calloc(fam->impl_size);
    m->config = cJSON_Duplicate(config, 1);
    if (!m->impl || !m->config)
        MDT_CHECK(MDT_FAIL(MDT_E_NOMEM, "out of memory"));
    MDT_CHECK(fam->configure(m->impl, m->config, &m->table));
    *out = m;
    return MDT_OK;
fail:
    mdt_model_free(m);
    return st;
}

mdt_load_params mdt_load_params_default(void) {
    mdt_load_params p = {NULL, NULL, 0};
    return p;
}

mdt_status mdt_model_check_layout(const mdt_model *m, int T, int R, int U) {
    if (m->fam->check_layout)
        MDT_TRY(m->fam->check_layout(m->impl, T, R, U));
    int64_t st[MDT_MAX_BLOCKS], ln[MDT_MAX_BLOCKS];
    int n;
    for (int i = 0; i < m->table.n; i++)
        MDT_TRY(mdt_shard_ranges(&m->table.specs[i], T, 0, st, ln, &n));
    return MDT_OK;
}

void mdt_shard_copy(const mdt_weight_spec *w, int T, int k, float *full, float *local,
                    int to_local) {
    int64_t st[MDT_MAX_BLOCKS], ln[MDT_MAX_BLOCKS];
    int n;
    if (mdt_shard_ranges(w, T, k, st, ln, &n) != MDT_OK)
        return; /* callers check the layout first */
    const int dim = T > 1 ? mdt_tp_shard_dim(w->style) : -1;
    const int64_t rows = w->shape[0], cols = w->ndim > 1 ? w->shape[1] : 1;
    if (dim < 0) {
        if (to_local)
            memcpy(local, full, sizeof(float) * (size_t)(rows * cols));
        else
            memcpy(full, local, sizeof(float) * (size_t)(rows * cols));
        return;
    }
    if (dim == 0) { /* whole rows: one contiguous run per block */
        int64_t off = 0;
        for (int b = 0; b < n; b++) {
            float *f = full + st[b] * cols, *l = local + off * cols;
            size_t bytes = sizeof(float) * (size_t)(ln[b] * cols);
            if (to_local)
                memcpy(l, f, bytes);
            else
                memcpy(f, l, bytes);
            off += ln[b];
        }
        return;
    }
    int64_t lcols = 0;
    for (int b = 0; b < n; b++)
        lcols += ln[b];
    for (int64_t r = 0; r < rows; r++) { /* dim 1: per row, one piece per block */
        int64_t off = 0;
        for (int b = 0; b < n; b++) {
            float *f = full + r * cols + st[b], *l = local + r * lcols + off;
            if (to_local)
                memcpy(l, f, sizeof(float) * (size_t)ln[b]);
            else
                memcpy(f, l, sizeof(float) * (size_t)ln[b]);
            off += ln[b];
        }
    }
}

/* Reads this rank's shard of `w` straight into `dst` (f32), touching only its bytes for
 * replicated and dim-0 tensors; dim-1 pieces go through a bounded window when they are small. */
static mdt_status read_shard(const mdt_ckpt_ref *ref, const mdt_weight_spec *w, int T, int k,
                             float *dst) {
    int64_t st[MDT_MAX_BLOCKS], ln[MDT_MAX_BLOCKS];
    int n;
    MDT_TRY(mdt_shard_ranges(w, T, k, st, ln, &n));
    const mdt_st_file *f = ref->file;
    const mdt_st_entry *e = ref->entry;
    const int dim = T > 1 ? mdt_tp_shard_dim(w->style) : -1;
    const int64_t rows = w->shape[0], cols = w->ndim > 1 ? w->shape[1] : 1;
    if (dim < 0)
        return mdt_st_read_f32(f, e, 0, rows * cols, dst);
    if (dim == 0) {
        int64_t off = 0;
        for (int b = 0; b < n; b++) {
            MDT_TRY(mdt_st_read_f32(f, e, st[b] * cols, ln[b] * cols, dst + off * cols));
            off += ln[b];
        }
        return MDT_OK;
    }
    int64_t lcols = 0;
    for (int b = 0; b < n; b++)
        lcols += ln[b];
    /* dim 1: each row's pieces are read exactly (one pread each, never the other ranks' bytes)
     * into a bounded buffer (<= 4 MiB of stored bytes), which is converted in one pass; the
     * pieces of a row land side by side, which is the local layout [block0_k | block1_k | ...]. */
    const size_t es = mdt_dtype_size(e->dtype);
    const int64_t lrow_bytes = lcols * (int64_t)es;
    int64_t win = ((int64_t)4 << 20) / (lrow_bytes > 0 ? lrow_bytes : 1);
    if (win < 1)
        win = 1;
    if (win > rows)
        win = rows;
    unsigned char *buf = mdt_alloc((size_t)(win * lrow_bytes) + 1);
    if (!buf)
        return MDT_FAIL(MDT_E_NOMEM, "out of memory");
    mdt_status s = MDT_OK;
    for (int64_t r0 = 0; r0 < rows && s == MDT_OK; r0 += win) {
        const int64_t nr = rows - r0 < win ? rows - r0 : win;
        unsigned char *p = buf;
        for (int64_t r = r0; r < r0 + nr && s == MDT_OK; r++)
            for (int b = 0; b < n && s == MDT_OK; b++) {
                s = mdt_st_read_range(f, e, (r * cols + st[b]) * (int64_t)es, ln[b] * (int64_t)es,
                                      p);
                p += ln[b] * (int64_t)es;
            }
        if (s == MDT_OK)
            s = mdt_convert_to_f32(e->dtype, buf, dst + r0 * lcols, nr * lcols);
    }
    mdt_free(buf);
    return s;
}

void mdt_model_cp_split(const mdt_model *m, int *P, int *chunk) {
    const char *skip = getenv("MESHDIT_TEST_SKIP_CP_SPLIT");
    const int split = m->mesh && !(skip && strcmp(skip, "1") == 0);
    *P = split ? m->mesh->cp_size : 1;
    *chunk = split ? m->mesh->cp_index : 0;
}

mdt_status mdt_test_fail_point(const mdt_mesh *mesh, const char *phase) {
    const char *e = getenv("MESHDIT_TEST_FAIL");
    char ph[16];
    int rank = -1, n = 0;
    if (!e || sscanf(e, "%15[a-z]:%d%n", ph, &rank, &n) != 2 || strcmp(ph, phase) != 0 ||
        rank != (mesh ? mesh->world_rank : 0))
        return MDT_OK;
    if (strcmp(e + n, ":kill") == 0)
        raise(SIGKILL); /* a rank that dies */
    return MDT_FAIL(MDT_E_IO, "injected failure during %s (MESHDIT_TEST_FAIL=%s)", phase, e);
}

static void bind_all(mdt_model *m);
static int64_t slot_floats(int64_t n) { return (n + 15) & ~(int64_t)15; /* 64-byte slots */ }
static int64_t slot_halves(int64_t n) { return (n + 31) & ~(int64_t)31; /* bf16, 64 bytes */ }
/* bf16 linear weights on the host: the CPU backend under --dtype bf16. */
static int host_bf16(void) { return mdt_backend_bf16() && !mdt_backend_mem(); }

/* Allocates the weights buffer for degree T and points every tensor's state at its slot. With
 * `hbuf_out` (CPU bf16), linear weights get slots in a second, bf16 buffer instead (ws[i].h,
 * ws[i].data NULL): the packed form, half their bytes. */
static mdt_status alloc_weights(mdt_model *m, int T, float **buf_out, uint16_t **hbuf_out,
                                mdt_wstate *ws) {
    int64_t total = 0, htotal = 0, bytes = 0;
    for (int i = 0; i < m->table.n; i++) {
        int64_t loc[2];
        MDT_TRY(mdt_shard_local_shape(&m->table.specs[i], T, loc));
        ws[i].local[0] = loc[0], ws[i].local[1] = m->table.specs[i].ndim > 1 ? loc[1] : 1;
        const int64_t n = ws[i].local[0] * ws[i].local[1];
        if (hbuf_out && m->table.lin[i])
            htotal += slot_halves(n), bytes += n * 2;
        else
            total += slot_floats(n), bytes += n * 4;
    }
    const mdt_mem_source *dev = mdt_backend_mem();
    const size_t nbytes = sizeof(float) * (size_t)(total > 0 ? total : 1);
    /* page-locked when the weights go on to a device, so the copies overlap the reads */
    float *buf = dev ? dev->host_alloc(nbytes) : mdt_alloc(nbytes);
    uint16_t *hbuf = hbuf_out ? mdt_alloc(2 * (size_t)(htotal > 0 ? htotal : 1)) : NULL;
    if (!buf || (hbuf_out && !hbuf)) {
        if (buf)
            dev ? dev->host_free(buf) : mdt_free(buf);
        mdt_free(hbuf);
        return MDT_FAIL(MDT_E_NOMEM, "out of memory for %lld weight bytes", (long long)bytes);
    }
    float *slot = buf;
    uint16_t *hslot = hbuf;
    for (int i = 0; i < m->table.n; i++) {
        const int64_t n = ws[i].local[0] * ws[i].local[1];
        ws[i].data = NULL, ws[i].h = NULL;
        if (hbuf && m->table.lin[i])
            ws[i].h = hslot, hslot += slot_halves(n);
        else
            ws[i].data = slot, slot += slot_floats(n);
    }
    *buf_out = buf;
    if (hbuf_out)
        *hbuf_out = hbuf;
    m->weight_bytes = bytes;
    m->weights_pinned = dev != NULL;
    return MDT_OK;
}

/* Every bf16 linear's widening scratch, reserved now so a forward never runs out (CPU bf16). */
static mdt_status reserve_linear(const mdt_model *m) {
    for (int i = 0; i < m->table.n; i++)
        if (m->ws[i].h)
            MDT_TRY(mdt_backend_reserve_linear(m->ws[i].local[1], m->ws[i].local[0]));
    return MDT_OK;
}

static void free_host_weights(mdt_model *m, float *buf) {
    const mdt_mem_source *dev = mdt_backend_mem();
    if (m->weights_pinned && dev)
        dev->host_free(buf);
    else
        mdt_free(buf);
}

/* CPU bf16: from the plain f32 form (every tensor in `weights`) to the packed form (linear
 * weights rounded to bf16, to nearest even) and back (exact: a bf16 value widens to the same f32),
 * so parallelize and gather work on plain f32 and a packed model round-trips unchanged. */
static mdt_status repack(mdt_model *m, int to_packed) {
    if (to_packed ? m->hbf16 != NULL || !host_bf16() : m->hbf16 == NULL)
        return MDT_OK;
    mdt_wstate *ws = mdt_calloc(sizeof(mdt_wstate) * (size_t)(m->table.n ? m->table.n : 1));
    float *buf = NULL;
    uint16_t *hbuf = NULL;
    mdt_status st = ws ? alloc_weights(m, m->T, &buf, to_packed ? &hbuf : NULL, ws)
                       : MDT_FAIL(MDT_E_NOMEM, "out of memory");
    if (st != MDT_OK) {
        mdt_free(ws);
        return st;
    }
    for (int i = 0; i < m->table.n; i++) {
        const int64_t n = ws[i].local[0] * ws[i].local[1];
        ws[i].stored = m->ws[i].stored, ws[i].bytes_read = m->ws[i].bytes_read;
        if (ws[i].h)
            mdt_convert_from_f32(MDT_BF16, m->ws[i].data, ws[i].h, n);
        else if (m->ws[i].h)
            mdt_convert_to_f32(MDT_BF16, m->ws[i].h, ws[i].data, n);
        else if (n)
            memcpy(ws[i].data, m->ws[i].data, sizeof(float) * (size_t)n);
    }
    free_host_weights(m, m->weights);
    mdt_free(m->hbf16);
    mdt_free(m->ws);
    m->weights = buf, m->hbf16 = hbuf, m->ws = ws;
    bind_all(m);
    return to_packed ? reserve_linear(m) : MDT_OK;
}

/* ---- weights on the device: prepare (allocate), upload tensor by tensor, finish ---- */
static int bf16_slot(const mdt_model *m, int i) { return mdt_backend_bf16() && m->table.lin[i]; }

static mdt_status dev_prepare(mdt_model *m) {
    const mdt_backend_ops *ops = mdt_backend_device_ops();
    int64_t nf = 0, nh = 0, bytes = 0, scratch = 0;
    for (int i = 0; i < m->table.n; i++) {
        const int64_t n = m->ws[i].local[0] * m->ws[i].local[1];
        if (bf16_slot(m, i))
            nh += slot_halves(n), bytes += 2 * n, scratch = n > scratch ? n : scratch;
        else
            nf += slot_floats(n), bytes += 4 * n;
    }
    m->dev_f32 = ops->alloc(sizeof(float) * (size_t)(nf + scratch + 16));
    m->dev_bf16 = nh ? ops->alloc(2 * (size_t)nh) : NULL;
    if (!m->dev_f32 || (nh && !m->dev_bf16))
        return MDT_FAIL(MDT_E_NOMEM, "out of device memory for %lld weight bytes",
                        (long long)bytes);
    float *f = m->dev_f32;
    uint16_t *h = m->dev_bf16;
    for (int i = 0; i < m->table.n; i++) {
        const int64_t n = m->ws[i].local[0] * m->ws[i].local[1];
        m->ws[i].dev = NULL, m->ws[i].devh = NULL;
        if (bf16_slot(m, i))
            m->ws[i].devh = h, h += slot_halves(n);
        else
            m->ws[i].dev = f, f += slot_floats(n);
    }
    m->dev_scratch = f;
    m->weight_bytes = bytes;
    return MDT_OK;
}

/* Queues tensor i's host slice to the device (bf16: through the f32 scratch past the f32 slots,
 * converted on the device). Returns at once: the next tensor's read overlaps the copy. */
static void dev_upload(mdt_model *m, int i) {
    const mdt_backend_ops *ops = mdt_backend_device_ops();
    const int64_t n = m->ws[i].local[0] * m->ws[i].local[1];
    if (n == 0)
        return;
    if (m->ws[i].devh) {
        float *scratch = m->dev_f32;
        for (int j = 0; j < m->table.n; j++) /* the scratch begins after the last f32 slot */
            if (m->ws[j].dev &&
                m->ws[j].dev + slot_floats(m->ws[j].local[0] * m->ws[j].local[1]) > scratch)
                scratch = m->ws[j].dev + slot_floats(m->ws[j].local[0] * m->ws[j].local[1]);
        ops->to_device_async(scratch, m->ws[i].data, sizeof(float) * (size_t)n);
        ops->to_bf16(m->ws[i].devh, scratch, n);
    } else {
        ops->to_device_async(m->ws[i].dev, m->ws[i].data, sizeof(float) * (size_t)n);
    }
}

/* Waits for the copies, frees the host weights and points every binding at the device. */
static mdt_status dev_finish(mdt_model *m) {
    MDT_TRY(mdt_backend_check());
    free_host_weights(m, m->weights);
    m->weights = NULL;
    for (int i = 0; i < m->table.n; i++) {
        m->ws[i].data = NULL;
        if (m->ws[i].devh) {
            m->table.lin[i]->w = NULL;
            m->table.lin[i]->wh = m->ws[i].devh;
        } else if (m->table.bind[i]) {
            *m->table.bind[i] = m->ws[i].dev;
        }
    }
    m->on_device = 1;
    return MDT_OK;
}

static void dev_release(mdt_model *m) {
    const mdt_backend_ops *ops = mdt_backend_device_ops();
    if (ops) {
        ops->free(m->dev_f32);
        ops->free(m->dev_bf16);
    }
    m->dev_f32 = NULL, m->dev_bf16 = NULL, m->dev_scratch = NULL, m->on_device = 0;
}

/* Brings device weights back to a host buffer (for parallelize and gather). */
static mdt_status weights_to_host(mdt_model *m) {
    if (!m->on_device)
        return repack(m, 0);
    if (m->dev_bf16)
        return MDT_FAIL(MDT_E_UNSUPPORTED,
                        "the weights are on the device in bf16: parallelize or gather a model "
                        "loaded in f32");
    MDT_TRY(alloc_weights(m, m->T, &m->weights, NULL, m->ws));
    for (int i = 0; i < m->table.n; i++)
        mdt_k_to_host(m->ws[i].data, m->ws[i].dev,
                      sizeof(float) * (size_t)(m->ws[i].local[0] * m->ws[i].local[1]));
    dev_release(m);
    bind_all(m);
    return MDT_OK;
}

/* Puts host weights on the device backend, if there is one (CPU bf16: packs them). */
static mdt_status weights_to_device(mdt_model *m) {
    if (!mdt_backend_mem())
        return repack(m, 1);
    if (m->on_device)
        return MDT_OK;
    MDT_TRY(dev_prepare(m));
    for (int i = 0; i < m->table.n; i++)
        dev_upload(m, i);
    return dev_finish(m);
}

static void bind_all(mdt_model *m) {
    for (int i = 0; i < m->table.n; i++) {
        if (m->table.bind[i])
            *m->table.bind[i] = m->ws[i].data;
        if (m->table.lin[i])
            m->table.lin[i]->wh = m->ws[i].h;
    }
}

static mdt_status load_local(mdt_model *m, const mdt_ckpt *ck, const mdt_mesh *mesh, int T, int k) {
    char sb1[96], sb2[96];
    m->ws = mdt_calloc(sizeof(mdt_wstate) * (size_t)(m->table.n ? m->table.n : 1));
    if (!m->ws)
        return MDT_FAIL(MDT_E_NOMEM, "out of memory");
    /* every planned tensor must exist with the config's shape before any byte is read */
    for (int i = 0; i < m->table.n; i++) {
        const mdt_weight_spec *w = &m->table.specs[i];
        const mdt_ckpt_ref *ref;
        MDT_TRY(mdt_ckpt_find(ck, w->name, &ref));
        const mdt_st_entry *e = ref->entry;
        int same = e->ndim == w->ndim;
        for (int d = 0; same && d < w->ndim; d++)
            same = e->shape[d] == w->shape[d];
        if (!same)
            return MDT_FAIL(MDT_E_INVALID, "%s: tensor '%s': shape %s but config.json implies %s",
                            ref->file->path, w->name, mdt_shape_str(e->ndim, e->shape, sb1, 96),
                            mdt_shape_str(w->ndim, w->shape, sb2, 96));
        if (!mdt_dtype_is_float(e->dtype))
            return MDT_FAIL(MDT_E_INVALID, "%s: tensor '%s': dtype %s is not a float type",
                            ref->file->path, w->name, mdt_dtype_name(e->dtype));
        m->ws[i].stored = e->dtype;
    }
    MDT_TRY(alloc_weights(m, T, &m->weights, host_bf16() ? &m->hbf16 : NULL, m->ws));
    const int dev = mdt_backend_mem() != NULL;
    if (dev)
        MDT_TRY(dev_prepare(m));
    /* packed (CPU bf16): each linear weight is read into one f32 scratch and rounded into its
     * bf16 slot, so the f32 copy of the weights never exists whole */
    int64_t scratch_n = 0;
    for (int i = 0; i < m->table.n; i++)
        if (m->ws[i].h && m->ws[i].local[0] * m->ws[i].local[1] > scratch_n)
            scratch_n = m->ws[i].local[0] * m->ws[i].local[1];
    float *scratch = scratch_n ? mdt_alloc(sizeof(float) * (size_t)scratch_n) : NULL;
    mdt_status st = scratch_n && !scratch ? MDT_FAIL(MDT_E_NOMEM, "out of memory") : MDT_OK;
    for (int i = 0; st == MDT_OK && i < m->table.n; i++) {
        const mdt_ckpt_ref *ref;
        float *dst = m->ws[i].h ? scratch : m->ws[i].data;
        st = mdt_ckpt_find(ck, m->table.specs[i].name, &ref);
        int64_t before = mdt_counters_get()->bytes_read;
        if (st == MDT_OK)
            st = read_shard(ref, &m->table.specs[i], T, k, dst);
        if (st != MDT_OK)
            break;
        m->ws[i].bytes_read = mdt_counters_get()->bytes_read - before;
        m->bytes_read += m->ws[i].bytes_read;
        const int64_t nloc = m->ws[i].local[0] * m->ws[i].local[1];
        const int64_t j = mdt_first_nonfinite(dst, nloc); /* damaged data in this rank's slice */
        if (j >= 0)
            st = MDT_FAIL(MDT_E_FORMAT,
                          "%s: tensor '%s': non-finite value (NaN or Inf) at element %lld of "
                          "this rank's shard",
                          ref->file->path, m->table.specs[i].name, (long long)j);
        if (st == MDT_OK && m->ws[i].h)
            st = mdt_convert_from_f32(MDT_BF16, dst, m->ws[i].h, nloc);
        if (st == MDT_OK && dev)
            dev_upload(m, i); /* on its way while the next tensor is read */
        if (st == MDT_OK && i == m->table.n / 2)
            st = mdt_test_fail_point(mesh, "load"); /* test-only: fail mid-load */
    }
    mdt_free(scratch);
    MDT_TRY(st);
    if (ck->n > m->table.n)
        mdt_log(MDT_LOG_WARN, "%s: %d tensors in the checkpoint are not used by the model", ck->dir,
                ck->n - m->table.n);
    bind_all(m);
    MDT_TRY(reserve_linear(m));
    return dev ? dev_finish(m) : MDT_OK;
}

mdt_status mdt_model_load_ckpt(mdt_model *m, const mdt_ckpt *ck, mdt_mesh *mesh) {
    const int T = mesh ? mesh->T : 1, k = mesh ? mesh->tp_shard_index : 0;
    mdt_status st = mdt_model_check_layout(m, T, mesh ? mesh->R : 1, mesh ? mesh->U : 1);
    MDT_TRY(mdt_mesh_agree(mesh, st)); /* layout verdict before any weight is read */
    if (k >= T)                        /* only under the test-only shard-index bug switch */
        st = MDT_FAIL(MDT_E_INVALID, "shard index %d is outside tp=%d", k, T);
    if (st == MDT_OK)
        st = load_local(m, ck, mesh, T, k);
    MDT_TRY(mdt_mesh_agree(mesh, st));
    m->mesh = mesh, m->T = T, m->tp_index = k;
    m->sharded_at_load = T > 1;
    return MDT_OK;
}

/* Resident weight bytes per rank at degree T (0 if the layout is invalid): 4 per weight, 2 for
 * linear weights under bf16. */
static int64_t weight_bytes_at(const mdt_model *m, int T) {
    int64_t bytes = 0, loc[2];
    if (mdt_model_check_layout(m, T, 1, 1) != MDT_OK)
        return 0;
    for (int i = 0; i < m->table.n; i++) {
        mdt_shard_local_shape(&m->table.specs[i], T, loc);
        bytes += loc[0] * (m->table.specs[i].ndim > 1 ? loc[1] : 1) *
                 (mdt_backend_bf16() && m->table.lin[i] ? 2 : 4);
    }
    return bytes;
}

/* Refuses, before any weight is read, a layout whose per-rank weights exceed the limit. */
static mdt_status check_memory(const mdt_model *m, int T, int64_t limit) {
    const int64_t need = weight_bytes_at(m, T);
    if (need <= limit)
        return MDT_OK;
    int fit = 0;
    for (int t = T + 1; t <= 256 && !fit; t++) {
        const int64_t b = weight_bytes_at(m, t);
        fit = b > 0 && b <= limit ? t : 0;
    }
    mdt_error_clear();
    const char *kind = mdt_backend_bf16() ? "weights (linears in bf16)" : "f32 weights";
    if (fit)
        return MDT_FAIL(MDT_E_NOMEM,
                        "tp=%d needs %.1f MiB of %s per rank, over the --max-memory limit of %.1f "
                        "MiB; tp=%d would need %.1f MiB",
                        T, (double)need / 1048576.0, kind, (double)limit / 1048576.0, fit,
                        (double)weight_bytes_at(m, fit) / 1048576.0);
    return MDT_FAIL(MDT_E_NOMEM,
                    "tp=%d needs %.1f MiB of %s per rank, over the --max-memory limit of %.1f MiB, "
                    "and no valid tp fits",
                    T, (double)need / 1048576.0, kind, (double)limit / 1048576.0);
}

mdt_status mdt_model_load(const mdt_load_params *p, mdt_model **out) {
    mdt_status st;
    mdt_ckpt *ck = NULL;
    mdt_model *m = NULL;
    mdt_mesh *mesh = p->mesh;
    *out = NULL;
    st = mdt_ckpt_open(p->checkpoint_dir, &ck);
    if (st == MDT_OK)
        st = mdt_model_describe(ck->config, &m);
    if (st == MDT_OK && p->max_weight_bytes > 0)
        st = check_memory(m, mesh ? mesh->T : 1, p->max_weight_bytes);
    MDT_CHECK(mdt_mesh_agree(mesh, st));
    MDT_CHECK(mdt_model_load_ckpt(m, ck, mesh));
    mdt_ckpt_close(ck);
    *out = m;
    return MDT_OK;
fail:
    mdt_ckpt_close(ck);
    mdt_model_free(m);
    return st;
}

mdt_status mdt_model_parallelize(mdt_model *m, mdt_mesh *mesh) {
    mdt_status st = MDT_OK;
    if (m->sharded_at_load || m->mesh)
        return MDT_FAIL(MDT_E_INVALID,
                        "model is already parallel: parallelism was applied at load time "
                        "(shard-on-read); load it without a mesh to parallelize in memory");
    if (!m->weights && !m->on_device)
        return MDT_FAIL(MDT_E_INVALID, "model has no weights to parallelize");
    if (!mesh)
        return MDT_OK;
    MDT_TRY(mdt_mesh_agree(mesh, weights_to_host(m)));
    const int T = mesh->T, k = mesh->tp_shard_index;
    st = mdt_model_check_layout(m, T, mesh->R, mesh->U);
    if (st == MDT_OK && k >= T)
        st = MDT_FAIL(MDT_E_INVALID, "shard index %d is outside tp=%d", k, T);
    MDT_TRY(mdt_mesh_agree(mesh, st));
    mdt_wstate *ws = mdt_calloc(sizeof(mdt_wstate) * (size_t)(m->table.n ? m->table.n : 1));
    float *buf = NULL;
    if (!ws)
        st = MDT_FAIL(MDT_E_NOMEM, "out of memory");
    if (st == MDT_OK)
        st = alloc_weights(m, T, &buf, NULL, ws);
    for (int i = 0; st == MDT_OK && i < m->table.n; i++) {
        const mdt_weight_spec *w = &m->table.specs[i];
        /* TP coordinate 0's values win, so ranks that built different states still agree */
        st = mdt_bcast_floats(mesh, MDT_GROUP_TP, 0, m->ws[i].data,
                              m->ws[i].local[0] * m->ws[i].local[1]);
        if (st == MDT_OK) {
            mdt_shard_copy(w, T, k, m->ws[i].data, ws[i].data, 1);
            ws[i].stored = m->ws[i].stored;
        }
    }
    st = mdt_mesh_agree(mesh, st);
    if (st != MDT_OK) {
        free_host_weights(m, buf);
        mdt_free(ws);
        return st;
    }
    free_host_weights(m, m->weights);
    mdt_free(m->ws);
    m->weights = buf, m->ws = ws;
    m->mesh = mesh, m->T = T, m->tp_index = k;
    bind_all(m);
    return mdt_mesh_agree(mesh, weights_to_device(m));
}

static mdt_status gather_host(mdt_model *m, const char *dir) {
    mdt_status st = MDT_OK;
    mdt_mesh *mesh = m->mesh;
    const int T = m->T, me = mesh ? mesh->world_rank : 0;
    const int n = m->table.n;
    mdt_tensor *ts = mdt_calloc(sizeof(mdt_tensor) * (size_t)(n ? n : 1));
    const mdt_tensor **tp = mdt_calloc(sizeof(const mdt_tensor *) * (size_t)(n ? n : 1));
    const char **names = mdt_calloc(sizeof(const char *) * (size_t)(n ? n : 1));
    float *full = NULL, *all = NULL;
    if (!ts || !tp || !names)
        st = MDT_FAIL(MDT_E_NOMEM, "out of memory");
    for (int i = 0; st == MDT_OK && i < n; i++) {
        const mdt_weight_spec *w = &m->table.specs[i];
        const int64_t numel = w->shape[0] * (w->ndim > 1 ? w->shape[1] : 1);
        const int64_t lnum = m->ws[i].local[0] * m->ws[i].local[1];
        full = mdt_alloc(sizeof(float) * (size_t)numel);
        all = T > 1 ? mdt_alloc(sizeof(float) * (size_t)(lnum * T)) : NULL;
        if (!full || (T > 1 && !all)) {
            st = MDT_FAIL(MDT_E_NOMEM, "out of memory gathering '%s'", w->name);
            break;
        }
        if (T > 1 && mesh) { /* rank-major concatenation of the shards, then each to its place */
            st = mdt_allgather_floats(mesh, MDT_GROUP_TP, m->ws[i].data, all, lnum);
            for (int r = 0; st == MDT_OK && r < T; r++)
                mdt_shard_copy(w, T, r, full, all + r * lnum, 0);
        } else {
            memcpy(full, m->ws[i].data, sizeof(float) * (size_t)numel);
        }
        if (st == MDT_OK && me == 0) {
            ts[i].dtype = m->ws[i].stored;
            ts[i].ndim = w->ndim;
            ts[i].shape[0] = w->shape[0], ts[i].shape[1] = w->shape[1];
            ts[i].data = mdt_alloc(mdt_dtype_size(ts[i].dtype) * (size_t)numel);
            st = ts[i].data ? mdt_convert_from_f32(ts[i].dtype, full, ts[i].data, numel)
                            : MDT_FAIL(MDT_E_NOMEM, "out of memory");
            tp[i] = &ts[i];
            names[i] = w->name;
        }
        mdt_free(full), mdt_free(all);
        full = all = NULL;
    }
    if (st == MDT_OK && me == 0) {
        char path[4096];
        char *cfg = cJSON_Print(m->config);
        if (mkdir(dir, 0777) != 0 && errno != EEXIST)
            st = MDT_FAIL(MDT_E_IO, "%s: cannot create directory: %s", dir, strerror(errno));
        snprintf(path, sizeof path, "%s/config.json", dir);
        if (st == MDT_OK)
            st = cfg ? write_text(path, cfg) : MDT_FAIL(MDT_E_NOMEM, "out of memory");
        snprintf(path, sizeof path, "%s/%s", dir, MDT_CKPT_WEIGHTS);
        if (st == MDT_OK)
            st = write_weights(path, n, names, tp);
        cJSON_free(cfg);
    }
    for (int i = 0; ts && i < n; i++)
        mdt_free(ts[i].data);
    mdt_free(ts), mdt_free((void *)tp), mdt_free((void *)names);
    return mdt_mesh_agree(mesh, st);
}

mdt_status mdt_model_gather(mdt_model *m, const char *dir) {
    MDT_TRY(mdt_mesh_agree(m->mesh, weights_to_host(m)));
    MDT_TRY(gather_host(m, dir));
    return mdt_mesh_agree(m->mesh, weights_to_device(m));
}

void mdt_model_free(mdt_model *m) {
    if (!m)
        return;
    mdt_arena_release(&m->arena);
    mdt_arena_release(&m->harena);
    mdt_wtable_free(&m->table);
    dev_release(m);
    free_host_weights(m, m->weights);
    mdt_free(m->hbf16);
    mdt_free(m->ws);
    mdt_free(m->impl);
    cJSON_Delete(m->config);
    mdt_free(m);
    mdt_backend_release_scratch(); /* the next model reserves its own */
}

const char *mdt_model_family(const mdt_model *m) { return m->fam->name; }

mdt_status mdt_model_forward(mdt_model *m, const mdt_tensor_set *inputs, mdt_tensor_set *outputs) {
    mdt_status st;
    if (!m->weights && !m->on_device)
        return MDT_FAIL(MDT_E_INVALID, "model has no weights (described, not loaded)");
    m->arena.src = mdt_backend_mem();       /* activations where the weights are */
    m->harena.src = mdt_backend_host_mem(); /* page-locked staging for the uploads */
    st = mdt_arena_reset(&m->arena);
    if (st == MDT_OK)
        st = mdt_arena_reset(&m->harena);
    m->fwd_c0 = *mdt_counters_get(); /* the no-silent-degrade check compares against these */
    memset(m->fwd_g0, 0, sizeof m->fwd_g0);
    if (m->mesh)
        memcpy(m->fwd_g0, m->mesh->group_bytes, sizeof m->fwd_g0);
    if (st == MDT_OK)
        st = m->fam->forward(m, inputs, outputs);
    if (st == MDT_OK)
        st = mdt_backend_check(); /* a device failure surfaces here at the latest */
    return mdt_mesh_agree(m->mesh, st);
}

/* ---- inputs ---- */
static mdt_status input_tensor(const mdt_tensor_set *in, const char *name, int ndim,
                               const int64_t *shape, const mdt_tensor **out) {
    char s1[96], s2[96];
    const mdt_tensor *t = mdt_tensor_set_get(in, name);
    if (!t)
        return MDT_FAIL(MDT_E_INVALID, "inputs: tensor '%s' is missing (the model needs it)", name);
    int same = t->ndim == ndim;
    for (int i = 0; same && i < ndim; i++)
        same = shape[i] < 0 || t->shape[i] == shape[i];
    if (!same)
        return MDT_FAIL(MDT_E_INVALID, "inputs: tensor '%s' has shape %s, expected %s", name,
                        mdt_shape_str(t->ndim, t->shape, s1, 96),
                        mdt_shape_str(ndim, shape, s2, 96));
    *out = t;
    return MDT_OK;
}

mdt_status mdt_guard_finite(mdt_mesh *mesh, const char *what, const float *x, int64_t n) {
    if (mdt_backend_mem()) /* device activations: the host-side output check covers them */
        return MDT_OK;
    const int64_t bad = n > 0 ? mdt_first_nonfinite(x, n) : -1;
    /* one reduction finds the lowest failing rank and its element: rank in the high bits */
    const int64_t rank = mesh ? mesh->world_rank : 0, span = (int64_t)1 << 40;
    int64_t key = bad >= 0 ? rank * span + (bad < span ? bad : span - 1) : INT64_MAX;
    MDT_TRY(mdt_mesh_min_i64(mesh, &key, "finite-output check"));
    if (key == INT64_MAX)
        return MDT_OK;
    return MDT_FAIL(MDT_E_NUMERIC,
                    "the output of %s went non-finite (NaN or Inf; first on rank %lld at element "
                    "%lld of its rows): the weights or inputs are too large for f32",
                    what, (long long)(key / span), (long long)(key % span));
}

static mdt_status check_finite(const char *name, const float *v, int64_t n) {
    const int64_t i = mdt_first_nonfinite(v, n);
    if (i >= 0)
        return MDT_FAIL(MDT_E_INVALID, "inputs: tensor '%s' holds a NaN or Inf at element %lld",
                        name, (long long)i);
    return MDT_OK;
}

mdt_status mdt_input_f32(const mdt_tensor_set *in, const char *name, int ndim, const int64_t *shape,
                         mdt_arena *a, float **out) {
    const mdt_tensor *t;
    MDT_TRY(input_tensor(in, name, ndim, shape, &t));
    if (t->dtype == MDT_BOOL)
        return MDT_FAIL(MDT_E_INVALID, "inputs: tensor '%s' has dtype BOOL, expected a number",
                        name);
    const int64_t n = mdt_tensor_numel(t);
    *out = mdt_arena_floats(a, n);
    if (!*out)
        return MDT_E_NOMEM;
    if (mdt_convert_to_f32(t->dtype, t->data, *out, n) != MDT_OK)
        return MDT_FAIL(MDT_E_INVALID,
                        "inputs: tensor '%s' has dtype %s, which cannot be read as a number "
                        "(expected F32, BF16, F16, F64, I64 or I32)",
                        name, mdt_dtype_name(t->dtype));
    return check_finite(name, *out, n);
}

mdt_status mdt_input_f32_view(const mdt_tensor_set *in, const char *name, int ndim,
                              const int64_t *shape, mdt_arena *a, const float **out) {
    const mdt_tensor *t;
    MDT_TRY(input_tensor(in, name, ndim, shape, &t));
    if (t->dtype != MDT_F32) {
        float *conv;
        MDT_TRY(mdt_input_f32(in, name, ndim, shape, a, &conv));
        *out = conv;
        return MDT_OK;
    }
    const float *v = t->data;
    MDT_TRY(check_finite(name, v, mdt_tensor_numel(t)));
    *out = v;
    return MDT_OK;
}

mdt_status mdt_input_i64(const mdt_tensor_set *in, const char *name, int ndim, const int64_t *shape,
                         int64_t lo, int64_t hi, mdt_arena *a, int64_t **out) {
    const mdt_tensor *t;
    MDT_TRY(input_tensor(in, name, ndim, shape, &t));
    const int64_t n = mdt_tensor_numel(t);
    int64_t *v = (int64_t *)(void *)mdt_arena_floats(a, 2 * n);
    if (!v)
        return MDT_E_NOMEM;
    for (int64_t i = 0; i < n; i++) {
        switch (t->dtype) {
        case MDT_I64: v[i] = ((const int64_t *)t->data)[i]; break;
        case MDT_I32: v[i] = ((const int32_t *)t->data)[i]; break;
        case MDT_I16: v[i] = ((const int16_t *)t->data)[i]; break;
        case MDT_I8:
            v[i] = (int64_t)(int)((const int8_t *)t->data)[i];
            break; /* NOLINT(bugprone-signed-char-misuse) */
        case MDT_U8: v[i] = ((const uint8_t *)t->data)[i]; break;
        default:
            return MDT_FAIL(MDT_E_INVALID, "inputs: tensor '%s' has dtype %s, expected integers",
                            name, mdt_dtype_name(t->dtype));
        }
        if (v[i] < lo || v[i] >= hi)
            return MDT_FAIL(MDT_E_INVALID,
                            "inputs: tensor '%s' element %lld is %lld, outside [%lld, %lld)", name,
                            (long long)i, (long long)v[i], (long long)lo, (long long)hi);
    }
    *out = v;
    return MDT_OK;
}

int64_t mdt_input_dim(const mdt_tensor_set *in, const char *name, int dim) {
    const mdt_tensor *t = mdt_tensor_set_get(in, name);
    return t && t->ndim > dim ? t->shape[dim] : -1;
}

mdt_status mdt_row_linear(mdt_mesh *mesh, int T, const mdt_lin *l, const float *x, int64_t ldx,
                          int64_t K_local, float *y, int64_t M) {
    mdt_k_linear(x, ldx, l->w, l->wh, NULL, y, l->out, M, K_local, l->out); // [M, out] partial
    if (T > 1)
        MDT_TRY(mdt_allreduce_sum(mesh, MDT_GROUP_TP, y, M * l->out));
    if (l->b)
        mdt_k_add_bias(y, l->out, l->b, M, l->out); // [M, out] += b[out]
    return MDT_OK;
}

mdt_status mdt_cp_gather_rows(mdt_mesh *mesh, mdt_arena *ar, int P, int64_t B, int64_t S, int64_t O,
                              const float *loc, float *full) {
    if (P == 1) {
        mdt_k_copy2d(full, 0, loc, 0, 1, B * S * O);
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
        mdt_k_copy2d(full + r0 * O, S * O, src, n * O, B,
                     n * O); // [B, S, O] rows r0.. <- [B, n, O]
        src += B * n * O;
    }
    mdt_arena_rewind(ar, mk);
    return MDT_OK;
}

mdt_status mdt_model_check_promise(const mdt_model *m, const mdt_promise *p) {
    const mdt_counters *c0 = &m->fwd_c0;
    const int64_t *g0 = m->fwd_g0;
    const mdt_mesh *mesh = m->mesh;
    const mdt_counters *c1 = mdt_counters_get();
    const int64_t got_q = c1->attn_query_rows - c0->attn_query_rows;
    const int64_t got_kv = c1->attn_kv_rows - c0->attn_kv_rows;
    const int R = mesh ? mesh->R : 1, U = mesh ? mesh->U : 1;
    if (got_q != p->want_q || got_kv != p->want_kv) {
        const char *axis = got_q == p->whole_q && R * U > 1
                               ? "the sequence split (ring x ulysses) did nothing: this rank "
                                 "computed the whole sequence"
                           : U > 1 && got_q == p->unscattered_q
                               ? "ulysses did nothing: heads were not scattered"
                           : R > 1 && got_kv == p->ringless_kv
                               ? "ring did nothing: the other ring blocks were never attended"
                               : "the layout was not applied as configured";
        return MDT_FAIL(MDT_E_INVALID,
                        "no silent degrade: this rank attended %lld query rows x heads and %lld "
                        "key rows x heads per forward, but tp=%d ring=%d ulysses=%d promises %lld "
                        "and %lld: %s",
                        (long long)got_q, (long long)got_kv, m->T, R, U, (long long)p->want_q,
                        (long long)p->want_kv, axis);
    }
    if (mesh) {
        const int deg[MDT_GROUP_COUNT] = {mesh->T, R, U, R * U};
        for (int g = 0; g < MDT_GROUP_COUNT; g++)
            if (p->owes[g] && mesh->group_bytes[g] == g0[g])
                return MDT_FAIL(MDT_E_INVALID,
                                "no silent degrade: the %s group (degree %d) moved no bytes in a "
                                "forward: that axis did nothing",
                                mdt_group_name((mdt_group)g), deg[g]);
    }
    return MDT_OK;
}

/* ---- gen ---- */
/* Checkpoint files appear whole (staged beside the target, renamed), never in place of a
 * non-regular file, with the mode of a new file (0666 & ~umask): core/outfile.h. */
static mdt_status write_text(const char *path, const char *text) {
    mdt_out o;
    MDT_TRY(mdt_out_begin(&o, path));
    mdt_status st = mdt_out_write(&o, text, strlen(text));
    if (st != MDT_OK) {
        mdt_out_abort(&o, 1);
        return st;
    }
    return mdt_out_commit(&o, 1);
}

static mdt_status write_weights(const char *path, int n, const char *const *names,
                                const mdt_tensor *const *tensors) {
    return mdt_st_write(path, n, names, tensors, (const char *const[]){"format", "pt", NULL});
}

static void fill_random(const mdt_weight_spec *w, mdt_rng *rng, float *dst) {
    int64_t n = spec_numel(w);
    size_t len = strlen(w->name);
    int is_bias = len > 5 && strcmp(w->name + len - 5, ".bias") == 0;
    double std = is_bias ? 0.02 : w->ndim == 1 ? 0.1 : 1.0 / sqrt((double)w->shape[1]);
    double mean = (!is_bias && w->ndim == 1) ? 1.0 : 0.0;
    for (int64_t i = 0; i < n; i++)
        dst[i] = (float)(mean + std * mdt_rng_normal(rng));
}

mdt_status mdt_model_gen(const char *config_text, uint64_t seed, mdt_dtype dtype, int shards,
                         const char *dir) {
    mdt_status st = MDT_OK;
    mdt_model *m = NULL;
    mdt_tensor *ts = NULL;
    const mdt_tensor **tp = NULL;
    const char **names = NULL;
    cJSON *index = NULL;
    char *idx_txt = NULL;
    char path[4096];
    if (dtype != MDT_F32 && dtype != MDT_BF16 && dtype != MDT_F16)
        return MDT_FAIL(MDT_E_INVALID, "gen: --dtype must be f32, bf16 or f16");
    cJSON *cfg = cJSON_Parse(config_text);
    if (!cfg || !cJSON_IsObject(cfg)) {
        cJSON_Delete(cfg);
        return MDT_FAIL(MDT_E_FORMAT, "gen: config is not a JSON object");
    }
    st = mdt_model_describe(cfg, &m);
    cJSON_Delete(cfg);
    MDT_TRY(st);
    int n = m->table.n;
    if (shards < 1 || shards > n)
        MDT_CHECK(MDT_FAIL(MDT_E_INVALID, "gen: --shards must be between 1 and %d", n));
    if (mkdir(dir, 0777) != 0 && errno != EEXIST)
        MDT_CHECK(MDT_FAIL(MDT_E_IO, "%s: cannot create directory: %s", dir, strerror(errno)));
    snprintf(path, sizeof path, "%s/config.json", dir);
    MDT_CHECK(write_text(path, config_text));

    ts = mdt_calloc(sizeof *ts * (size_t)n);
    tp = mdt_calloc(sizeof(const mdt_tensor *) * (size_t)n);
    names = mdt_calloc(sizeof *names * (size_t)n);
    if (!ts || !tp || !names)
        MDT_CHECK(MDT_FAIL(MDT_E_NOMEM, "out of memory"));
    mdt_rng rng;
    mdt_rng_seed(&rng, seed);
    for (int i = 0; i < n; i++) {
        const mdt_weight_spec *w = &m->table.specs[i];
        int64_t numel = spec_numel(w);
        float *tmp = mdt_alloc(sizeof(float) * (size_t)numel);
        ts[i].dtype = dtype;
        ts[i].ndim = w->ndim;
        ts[i].shape[0] = w->shape[0];
        ts[i].shape[1] = w->shape[1];
        ts[i].data = mdt_alloc(mdt_dtype_size(dtype) * (size_t)numel);
        if (!tmp || !ts[i].data) {
            mdt_free(tmp);
            MDT_CHECK(MDT_FAIL(MDT_E_NOMEM, "out of memory"));
        }
        fill_random(w, &rng, tmp);
        st = mdt_convert_from_f32(dtype, tmp, ts[i].data, numel);
        mdt_free(tmp);
        MDT_CHECK(st);
        tp[i] = &ts[i];
        names[i] = w->name;
    }
    if (shards == 1) {
        snprintf(path, sizeof path, "%s/%s", dir, MDT_CKPT_WEIGHTS);
        MDT_CHECK(write_weights(path, n, names, tp));
    } else {
        index = cJSON_CreateObject();
        cJSON *meta = cJSON_AddObjectToObject(index, "metadata");
        cJSON *wm = cJSON_AddObjectToObject(index, "weight_map");
        int64_t total = 0;
        for (int s = 0; s < shards; s++) {
            int lo = (int)((int64_t)s * n / shards), hi = (int)((int64_t)(s + 1) * n / shards);
            char fname[128];
            snprintf(fname, sizeof fname, "diffusion_pytorch_model-%05d-of-%05d.safetensors", s + 1,
                     shards);
            snprintf(path, sizeof path, "%s/%s", dir, fname);
            MDT_CHECK(write_weights(path, hi - lo, names + lo, tp + lo));
            for (int i = lo; i < hi; i++) {
                cJSON_AddStringToObject(wm, names[i], fname);
                total += mdt_tensor_nbytes(&ts[i]);
            }
        }
        cJSON_AddNumberToObject(meta, "total_size", (double)total);
        idx_txt = cJSON_Print(index);
        if (!idx_txt)
            MDT_CHECK(MDT_FAIL(MDT_E_NOMEM, "out of memory"));
        snprintf(path, sizeof path, "%s/%s", dir, MDT_CKPT_INDEX);
        MDT_CHECK(write_text(path, idx_txt));
    }
fail:
    if (ts)
        for (int i = 0; i < n; i++)
            mdt_free(ts[i].data);
    mdt_free(ts);
    mdt_free((void *)tp);
    mdt_free((void *)names);
    cJSON_free(idx_txt);
    cJSON_Delete(index);
    mdt_model_free(m);
    return st;
}
