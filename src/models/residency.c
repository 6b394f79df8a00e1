/*
 * residency.c — where a loaded model's weights live: one host buffer of 64-byte f32 slots, a
 * second one of bf16 slots for the linear weights under CPU bf16 (the packed form), or device
 * buffers (f32 and bf16 slots, bf16 converted on the device). On the CPU in f32, token-row
 * linears' slots hold oneDNN's blocked layout (mdt_res_pack: the GEMM skips packing them per
 * call). Moves between the forms: repack (f32 <-> packed bf16, exact one way and rounded to
 * nearest even the other), pack / unpack in place (exact both ways), upload tensor by tensor
 * during the load, and back to the host for parallelize and gather.
 */
#include "models/residency.h"

#include "backend/backend.h"

#include <string.h>

static int64_t slot_floats(int64_t n) { return (n + 15) & ~(int64_t)15; /* 64-byte slots */ }
static int64_t slot_halves(int64_t n) { return (n + 31) & ~(int64_t)31; /* bf16, 64 bytes */ }
/* bf16 linear weights on the host: the CPU backend under --dtype bf16. */
int mdt_res_host_bf16(void) { return mdt_backend_bf16() && !mdt_backend_mem(); }

/* The floats tensor i takes in the CPU GEMM's packed layout at local shape loc [out, in], or 0
 * if it stays plain: f32 linears on the CPU backend that multiply token rows (conditioning
 * linears run on one row a sample, by the kernel sets' own row product over plain weights), and
 * that the forward does not view by row ranges. */
static int64_t pack_floats(const mdt_model *m, int i, const int64_t *loc) {
    const mdt_lin *l = m->table.lin[i];
    if (!l || l->views || m->table.specs[i].rows == MDT_ROWS_ONE || m->table.specs[i].ndim != 2 ||
        mdt_backend_mem() || mdt_res_host_bf16())
        return 0;
    return mdt_backend_packed_floats(loc[0], loc[1]);
}

/* Allocates the weights buffer for coordinate k of degree T and points every tensor's state at its
 * slot. With `hbuf_out` (CPU bf16), linear weights get slots in a second, bf16 buffer instead
 * (ws[i].h, ws[i].data NULL): the packed form, half their bytes. */
mdt_status mdt_res_alloc(mdt_model *m, int T, int k, float **buf_out, uint16_t **hbuf_out,
                         mdt_wstate *ws) {
    int64_t total = 0, htotal = 0, bytes = 0;
    for (int i = 0; i < m->table.n; i++) {
        int64_t loc[2];
        MDT_TRY(mdt_shard_local_shape(&m->table.specs[i], T, k, loc));
        ws[i].local[0] = loc[0], ws[i].local[1] = m->table.specs[i].ndim > 1 ? loc[1] : 1;
        const int64_t n = ws[i].local[0] * ws[i].local[1];
        const int64_t p = hbuf_out ? 0 : pack_floats(m, i, ws[i].local); /* room to pack */
        ws[i].slot = slot_floats(p > n ? p : n);
        if (hbuf_out && m->table.lin[i])
            htotal += slot_halves(n), bytes += n * 2, ws[i].slot = 0;
        else
            total += ws[i].slot, bytes += n * 4;
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
    mdt_backend_packed_forget_range(buf, (int64_t)nbytes); /* new memory: nothing packed in it */
    float *slot = buf;
    uint16_t *hslot = hbuf;
    for (int i = 0; i < m->table.n; i++) {
        const int64_t n = ws[i].local[0] * ws[i].local[1];
        ws[i].data = NULL, ws[i].h = NULL, ws[i].packed = 0;
        if (hbuf && m->table.lin[i])
            ws[i].h = hslot, hslot += slot_halves(n);
        else
            ws[i].data = slot, slot += ws[i].slot;
    }
    *buf_out = buf;
    if (hbuf_out)
        *hbuf_out = hbuf;
    m->weight_bytes = bytes;
    m->weights_pinned = dev != NULL;
    return MDT_OK;
}

/* Every bf16 linear's widening scratch, reserved now so a forward never runs out (CPU bf16). */
mdt_status mdt_res_reserve_linear(const mdt_model *m) {
    for (int i = 0; i < m->table.n; i++)
        if (m->ws[i].h)
            MDT_TRY(mdt_backend_reserve_linear(m->ws[i].local[1], m->ws[i].local[0]));
    return MDT_OK;
}

void mdt_res_free_host(mdt_model *m, float *buf) {
    const mdt_mem_source *dev = mdt_backend_mem();
    if (m->weights_pinned && dev)
        dev->host_free(buf);
    else
        mdt_free(buf);
}

/* CPU bf16: from the plain f32 form (every tensor in `weights`) to the packed form (linear
 * weights rounded to bf16, to nearest even) and back (exact: a bf16 value widens to the same f32),
 * so parallelize and gather work on plain f32 and a packed model round-trips unchanged. */
static mdt_status unpack(mdt_model *m);

static mdt_status repack(mdt_model *m, int to_packed) {
    if (to_packed ? m->hbf16 != NULL || !mdt_res_host_bf16() : m->hbf16 == NULL)
        return MDT_OK;
    MDT_TRY(unpack(m)); /* f32 weights in the GEMM's layout: plain first */
    mdt_wstate *ws = mdt_calloc(sizeof(mdt_wstate) * (size_t)(m->table.n ? m->table.n : 1));
    float *buf = NULL;
    uint16_t *hbuf = NULL;
    mdt_status st = ws ? mdt_res_alloc(m, m->T, m->tp_index, &buf, to_packed ? &hbuf : NULL, ws)
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
    mdt_res_free_host(m, m->weights);
    mdt_free(m->hbf16);
    mdt_free(m->ws);
    m->weights = buf, m->hbf16 = hbuf, m->ws = ws;
    mdt_res_bind(m);
    return to_packed ? mdt_res_reserve_linear(m) : MDT_OK;
}

/* ---- CPU f32: the linears' weights in the GEMM's packed layout (backend.h) ----
 * In place: each slot was made large enough for either layout (mdt_res_alloc), a scratch holds
 * one tensor at a time. A failure leaves the tensor as it was (plain, or packed). */
mdt_status mdt_res_pack(mdt_model *m) {
    if (!m->weights || m->on_device || m->hbf16)
        return MDT_OK;
    int64_t big = 0;
    for (int i = 0; i < m->table.n; i++) {
        const int64_t n = m->ws[i].local[0] * m->ws[i].local[1];
        if (!m->ws[i].packed && n > big && pack_floats(m, i, m->ws[i].local) > 0)
            big = n;
    }
    float *tmp = big ? mdt_alloc(sizeof(float) * (size_t)big) : NULL; // [largest packed tensor]
    if (big && !tmp)
        return MDT_FAIL(MDT_E_NOMEM, "out of memory for a %lld-value weight", (long long)big);
    mdt_status st = MDT_OK;
    for (int i = 0; st == MDT_OK && i < m->table.n; i++) {
        mdt_wstate *w = &m->ws[i];
        const int64_t n = w->local[0] * w->local[1], p = pack_floats(m, i, w->local);
        if (w->packed || p <= 0 || p > w->slot || !w->data || !tmp)
            continue;
        memcpy(tmp, w->data, sizeof(float) * (size_t)n); // [out, in] plain
        st = mdt_backend_pack(tmp, w->data, w->local[0], w->local[1]);
        if (st == MDT_OK)
            w->packed = p;
        else
            memcpy(w->data, tmp, sizeof(float) * (size_t)n);
    }
    mdt_free(tmp);
    return st;
}

/* Every packed tensor back to plain row-major f32. */
static mdt_status unpack(mdt_model *m) {
    int64_t big = 0;
    for (int i = 0; i < m->table.n; i++)
        if (m->ws[i].packed && m->ws[i].local[0] * m->ws[i].local[1] > big)
            big = m->ws[i].local[0] * m->ws[i].local[1];
    if (!big)
        return MDT_OK;
    float *tmp = mdt_alloc(sizeof(float) * (size_t)big); // [largest packed tensor]
    if (!tmp)
        return MDT_FAIL(MDT_E_NOMEM, "out of memory for a %lld-value weight", (long long)big);
    mdt_status st = MDT_OK;
    for (int i = 0; st == MDT_OK && i < m->table.n; i++) {
        mdt_wstate *w = &m->ws[i];
        if (!w->packed)
            continue;
        st = mdt_backend_unpack(w->data, tmp, w->local[0], w->local[1]); // [out, in]
        if (st != MDT_OK)
            break;
        mdt_backend_packed_forget(w->data);
        memcpy(w->data, tmp, sizeof(float) * (size_t)(w->local[0] * w->local[1]));
        w->packed = 0;
    }
    mdt_free(tmp);
    return st;
}

void mdt_res_forget_packed(mdt_model *m) {
    for (int i = 0; m->ws && i < m->table.n; i++)
        if (m->ws[i].packed)
            mdt_backend_packed_forget(m->ws[i].data), m->ws[i].packed = 0;
}

/* ---- weights on the device: prepare (allocate), upload tensor by tensor, finish ---- */
static int bf16_slot(const mdt_model *m, int i) { return mdt_backend_bf16() && m->table.lin[i]; }

mdt_status mdt_res_dev_prepare(mdt_model *m) {
    const mdt_device_ops *ops = mdt_backend_device_ops();
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
void mdt_res_dev_upload(mdt_model *m, int i) { mdt_res_dev_upload_from(m, i, m->ws[i].data); }

void mdt_res_dev_upload_from(mdt_model *m, int i, const float *src) {
    const mdt_device_ops *ops = mdt_backend_device_ops();
    const int64_t n = m->ws[i].local[0] * m->ws[i].local[1];
    if (n == 0)
        return;
    if (m->ws[i].devh) {
        float *scratch = m->dev_f32;
        for (int j = 0; j < m->table.n; j++) /* the scratch begins after the last f32 slot */
            if (m->ws[j].dev &&
                m->ws[j].dev + slot_floats(m->ws[j].local[0] * m->ws[j].local[1]) > scratch)
                scratch = m->ws[j].dev + slot_floats(m->ws[j].local[0] * m->ws[j].local[1]);
        ops->to_device_async(scratch, src, sizeof(float) * (size_t)n);
        ops->to_bf16(m->ws[i].devh, scratch, n);
    } else {
        ops->to_device_async(m->ws[i].dev, src, sizeof(float) * (size_t)n);
    }
}

/* Waits for the copies, frees the host weights and points every binding at the device. */
mdt_status mdt_res_dev_finish(mdt_model *m) {
    MDT_TRY(mdt_backend_check());
    mdt_res_free_host(m, m->weights);
    m->weights = NULL;
    for (int i = 0; i < m->table.n; i++) {
        m->ws[i].data = NULL;
        if (m->ws[i].devh) {
            m->table.lin[i]->w = NULL;
            m->table.lin[i]->wh = m->ws[i].devh;
        } else if (m->table.bind[i]) {
            *m->table.bind[i] = m->ws[i].dev;
        }
        if (m->table.lin[i]) /* (as mdt_res_bind: the local shape does not depend on where) */
            m->table.lin[i]->out_local = m->ws[i].local[0],
            m->table.lin[i]->in_local = m->ws[i].local[1];
    }
    m->on_device = 1;
    return MDT_OK;
}

void mdt_res_dev_release(mdt_model *m) {
    const mdt_device_ops *ops = mdt_backend_device_ops();
    if (ops) {
        ops->free(m->dev_f32);
        ops->free(m->dev_bf16);
    }
    m->dev_f32 = NULL, m->dev_bf16 = NULL, m->dev_scratch = NULL, m->on_device = 0;
}

/* Brings device weights back to a host buffer (for parallelize and gather). */
mdt_status mdt_res_to_host(mdt_model *m) {
    if (!m->on_device)
        return m->hbf16 ? repack(m, 0) : unpack(m);
    if (m->dev_bf16)
        return MDT_FAIL(MDT_E_UNSUPPORTED,
                        "the weights are on the device in bf16: parallelize or gather a model "
                        "loaded in f32");
    MDT_TRY(mdt_res_alloc(m, m->T, m->tp_index, &m->weights, NULL, m->ws));
    for (int i = 0; i < m->table.n; i++)
        mdt_k_to_host(m->ws[i].data, m->ws[i].dev,
                      sizeof(float) * (size_t)(m->ws[i].local[0] * m->ws[i].local[1]));
    mdt_res_dev_release(m);
    mdt_res_bind(m);
    return MDT_OK;
}

/* Puts host weights on the device backend, if there is one (CPU: packs them, bf16 or f32). */
mdt_status mdt_res_to_device(mdt_model *m) {
    if (!mdt_backend_mem())
        return mdt_res_host_bf16() ? repack(m, 1) : mdt_res_pack(m);
    if (m->on_device)
        return MDT_OK;
    MDT_TRY(mdt_res_dev_prepare(m));
    for (int i = 0; i < m->table.n; i++)
        mdt_res_dev_upload(m, i);
    return mdt_res_dev_finish(m);
}

void mdt_res_bind(mdt_model *m) {
    for (int i = 0; i < m->table.n; i++) {
        if (m->table.bind[i])
            *m->table.bind[i] = m->ws[i].data;
        if (m->table.lin[i]) {
            m->table.lin[i]->wh = m->ws[i].h;
            m->table.lin[i]->out_local = m->ws[i].local[0];
            m->table.lin[i]->in_local = m->ws[i].local[1];
        }
    }
}
