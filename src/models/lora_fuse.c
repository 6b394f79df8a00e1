/*
 * lora_fuse.c — LoRA adapters on a loaded model (meshdit.h: mdt_model_lora_*,
 * mdt_model_set_adapters): the adapters a model holds, and the fused weights. Each rank folds
 * the active adapters into its own shards with no communication: for each adapted tensor,
 * W_local = W0_local + [w_1 s_1 B_1 | w_2 s_2 B_2 | ...]_local . [A_1; A_2; ...]_local (one
 * fp32 GEMM over the stacked ranks, in row tiles), then rounded once to the resident dtype.
 * W0 is the base as it is resident (bf16 values widened), so a fuse never depends on what was
 * fused before. The base comes back, bit for bit, from the checkpoint (the rank's own bytes read
 * again, by the load's own code and conversion; shard files are checked unchanged since the
 * load) or from a copy of the resident bytes kept at the first fuse (mdt_model_set_lora_base).
 * On a device the base and the fused shard go up through the load's upload path.
 * Not here: reading adapter files (lora.c).
 */
#define _POSIX_C_SOURCE 200809L
#include "models/lora.h"

#include "backend/backend.h"
#include "models/residency.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

/* ---- the state ---- */
mdt_lora_state *mdt_lora_state_of(mdt_model *m) {
    if (m->lora)
        return m->lora;
    mdt_lora_state *s = mdt_calloc(sizeof *s);
    const size_t n = (size_t)(m->table.n ? m->table.n : 1);
    if (s) {
        s->done = mdt_calloc(n);
        s->copy = mdt_calloc(sizeof(void *) * n);
    }
    if (!s || !s->done || !s->copy) {
        if (s)
            mdt_free(s->done), mdt_free((void *)s->copy);
        mdt_free(s);
        (void)MDT_FAIL(MDT_E_NOMEM, "out of memory");
        return NULL;
    }
    m->lora = s;
    return s;
}

static void file_id(int fd, mdt_lora_file_id *id) {
    struct stat sb;
    memset(id, 0, sizeof *id);
    if (fd >= 0 && fstat(fd, &sb) == 0) {
        id->dev = (long long)sb.st_dev, id->ino = (long long)sb.st_ino;
        id->size = (long long)sb.st_size;
        id->mtime_s = (long long)sb.st_mtim.tv_sec, id->mtime_ns = (long long)sb.st_mtim.tv_nsec;
    }
}

mdt_status mdt_lora_note_checkpoint(mdt_model *m, const mdt_ckpt *ck) {
    mdt_lora_state *s = mdt_lora_state_of(m);
    if (!s)
        return MDT_E_NOMEM;
    mdt_free(s->ckpt_dir);
    mdt_free(s->ids);
    const size_t len = strlen(ck->dir) + 1;
    s->ckpt_dir = mdt_alloc(len);
    s->ids = mdt_calloc(sizeof *s->ids * (size_t)(ck->nfiles ? ck->nfiles : 1));
    if (!s->ckpt_dir || !s->ids)
        return MDT_FAIL(MDT_E_NOMEM, "out of memory");
    memcpy(s->ckpt_dir, ck->dir, len);
    s->nfiles = ck->nfiles;
    for (int j = 0; j < ck->nfiles; j++)
        file_id(ck->files[j]->fd, &s->ids[j]);
    return MDT_OK;
}

static void drop_copy(mdt_lora_state *s, int i, int64_t bytes) {
    if (s->copy[i])
        s->copy_bytes -= bytes;
    mdt_free(s->copy[i]);
    s->copy[i] = NULL;
}

static int64_t numel(const mdt_model *m, int i) { return m->ws[i].local[0] * m->ws[i].local[1]; }
/* bytes of tensor i as it is resident: bf16 for linear weights under bf16, the CPU GEMM's packed
 * layout for packed ones (residency.h), else f32 */
static int64_t resident_bytes(const mdt_model *m, int i) {
    if (m->ws[i].packed)
        return 4 * m->ws[i].packed;
    return numel(m, i) * (m->ws[i].h || m->ws[i].devh ? 2 : 4);
}
/* 1: the host slot holds tensor i as plain f32, so it can be changed in place */
static int host_plain(const mdt_model *m, int i) {
    return !m->on_device && !m->ws[i].h && !m->ws[i].packed;
}

void mdt_lora_state_free(mdt_model *m) {
    mdt_lora_state *s = m->lora;
    if (!s)
        return;
    for (int i = 0; i < s->n; i++)
        mdt_lora_free(s->a[i]);
    for (int i = 0; i < m->table.n; i++)
        drop_copy(s, i, 0);
    mdt_free((void *)s->a);
    mdt_free(s->done);
    mdt_free((void *)s->copy);
    mdt_free(s->ckpt_dir);
    mdt_free(s->ids);
    mdt_free(s);
    m->lora = NULL;
}

/* ---- the base weights: read again, or kept ---- */
typedef struct {
    mdt_ckpt *ck;  /* the checkpoint opened again (re-read mode), on first need */
    float *f32;    /* scratch [largest touched shard] */
    uint16_t *u16; /* scratch for bf16 bytes from a device */
    int64_t cap;
} base_io;

static mdt_status io_scratch(base_io *io, int64_t n) {
    if (n <= io->cap)
        return MDT_OK;
    mdt_free(io->f32), mdt_free(io->u16);
    io->f32 = mdt_alloc(sizeof(float) * (size_t)n);
    io->u16 = mdt_alloc(2 * (size_t)n);
    io->cap = io->f32 && io->u16 ? n : 0;
    return io->cap ? MDT_OK
                   : MDT_FAIL(MDT_E_NOMEM, "out of memory for a %lld-value shard", (long long)n);
}

static void io_close(base_io *io) {
    mdt_ckpt_close(io->ck);
    mdt_free(io->f32), mdt_free(io->u16);
    memset(io, 0, sizeof *io);
}

/* The checkpoint the model was loaded from, opened again, its shard files unchanged. */
static mdt_status io_open(mdt_model *m, base_io *io) {
    const mdt_lora_state *s = m->lora;
    if (io->ck)
        return MDT_OK;
    if (!s->ckpt_dir)
        return MDT_FAIL(MDT_E_INVALID, "the model's checkpoint is not known: keep copies of the "
                                       "base weights instead (mdt_model_set_lora_base)");
    MDT_TRY(mdt_ckpt_open(s->ckpt_dir, &io->ck));
    int same = io->ck->nfiles == s->nfiles;
    int j = 0;
    for (; same && j < s->nfiles; j++) {
        mdt_lora_file_id id;
        file_id(io->ck->files[j]->fd, &id);
        same = memcmp(&id, &s->ids[j], sizeof id) == 0;
    }
    if (!same)
        return MDT_FAIL(MDT_E_IO,
                        "%s: checkpoint file %s changed since the model was loaded: the base "
                        "weights cannot be read again (reload the model)",
                        io->ck->dir_shown,
                        j > 0 && j <= io->ck->nfiles ? io->ck->files[j - 1]->path : "list");
    return MDT_OK;
}

/* Tensor i's base into dst [n] as the load made it, in f32: the checkpoint's values, rounded
 * to bf16 and widened again where the tensor lives in bf16. */
static mdt_status reread(mdt_model *m, base_io *io, int i, float *dst) {
    MDT_TRY(io_open(m, io));
    const mdt_ckpt_ref *ref;
    MDT_TRY(mdt_ckpt_find(io->ck, m->table.specs[i].name, &ref));
    const int64_t before = mdt_counters_get()->bytes_read;
    MDT_TRY(mdt_model_read_shard(ref, &m->table.specs[i], m->T, m->tp_index, dst));
    m->lora->reread_bytes += mdt_counters_get()->bytes_read - before;
    return MDT_OK;
}

static int is_bf16(const mdt_model *m, int i) { return m->ws[i].h || m->ws[i].devh; }

/* The resident bytes of tensor i into host memory (raw: f32 or bf16). */
static void resident_to_host(const mdt_model *m, int i, void *dst) {
    const size_t bytes = (size_t)resident_bytes(m, i);
    if (m->on_device)
        mdt_k_to_host(dst, m->ws[i].devh ? (const void *)m->ws[i].devh : (const void *)m->ws[i].dev,
                      bytes);
    else
        memcpy(dst, m->ws[i].h ? (const void *)m->ws[i].h : (const void *)m->ws[i].data, bytes);
}

/* Raw resident bytes (from a copy) back into tensor i. */
static mdt_status host_to_resident(mdt_model *m, int i, const void *src) {
    const size_t bytes = (size_t)resident_bytes(m, i);
    if (!m->on_device) {
        memcpy(m->ws[i].h ? (void *)m->ws[i].h : (void *)m->ws[i].data, src, bytes);
        return MDT_OK;
    }
    mdt_backend_device_ops()->to_device(
        m->ws[i].devh ? (void *)m->ws[i].devh : (void *)m->ws[i].dev, src, bytes);
    return mdt_backend_check();
}

/* An f32 shard into tensor i, rounded once to its resident dtype: on the host by the loader's
 * conversion, on a device by the load's upload (the device rounds bf16 slots). */
static mdt_status f32_to_resident(mdt_model *m, int i, const float *src) {
    const int64_t n = numel(m, i);
    if (m->on_device) {
        mdt_res_dev_upload_from(m, i, src);
        return mdt_backend_check();
    }
    if (m->ws[i].h)
        return mdt_convert_from_f32(MDT_BF16, src, m->ws[i].h, n);
    if (m->ws[i].packed) /* src is a scratch, never the slot itself */
        return mdt_backend_pack(src, m->ws[i].data, m->ws[i].local[0], m->ws[i].local[1]);
    if (!m->ws[i].data || !src)
        return MDT_FAIL(MDT_E_INVALID, "'%s' has no host weights", m->table.specs[i].name);
    if (src != m->ws[i].data)
        memcpy(m->ws[i].data, src, sizeof(float) * (size_t)n);
    return MDT_OK;
}

/* Tensor i's base into dst [n] f32, exactly as it is resident (bf16 values widened). */
static mdt_status base_f32(mdt_model *m, base_io *io, int i, float *dst) {
    mdt_lora_state *s = m->lora;
    const int64_t n = numel(m, i);
    const void *raw = s->done[i] ? s->copy[i] : NULL;
    if (s->done[i] && !raw) { /* re-read, then as the load rounded it */
        MDT_TRY(reread(m, io, i, dst));
        if (is_bf16(m, i)) {
            MDT_TRY(mdt_convert_from_f32(MDT_BF16, dst, io->u16, n));
            MDT_TRY(mdt_convert_to_f32(MDT_BF16, io->u16, dst, n));
        }
        return MDT_OK;
    }
    if (!raw) { /* the resident shard is the base */
        if (host_plain(m, i)) {
            if (dst != m->ws[i].data)
                memcpy(dst, m->ws[i].data, sizeof(float) * (size_t)n);
            return MDT_OK;
        }
        if (m->ws[i].packed) { /* unpacked below, from the slot */
            raw = m->ws[i].data;
        } else {
            resident_to_host(m, i, is_bf16(m, i) ? (void *)io->u16 : (void *)dst);
            raw = is_bf16(m, i) ? (const void *)io->u16 : (const void *)dst;
        }
    }
    if (m->ws[i].packed) /* raw: the packed layout (the slot, or a copy of its bytes) */
        return mdt_backend_unpack((const float *)raw, dst, m->ws[i].local[0], m->ws[i].local[1]);
    if (is_bf16(m, i))
        return mdt_convert_to_f32(MDT_BF16, raw, dst, n);
    if (raw != dst)
        memcpy(dst, raw, sizeof(float) * (size_t)n);
    return MDT_OK;
}

/* Tensor i back to its base, bit for bit. */
static mdt_status restore(mdt_model *m, base_io *io, int i) {
    mdt_lora_state *s = m->lora;
    if (!s->done[i])
        return MDT_OK;
    if (s->copy[i]) {
        MDT_TRY(host_to_resident(m, i, s->copy[i]));
    } else { /* the load's own read and rounding */
        const int host_f32 = host_plain(m, i);
        MDT_TRY(io_scratch(io, numel(m, i)));
        float *dst = host_f32 ? m->ws[i].data : io->f32;
        MDT_TRY(reread(m, io, i, dst));
        MDT_TRY(f32_to_resident(m, i, dst));
    }
    s->done[i] = 0;
    drop_copy(s, i, resident_bytes(m, i));
    return MDT_OK;
}

mdt_status mdt_lora_restore_all(mdt_model *m) {
    base_io io = {0};
    mdt_status st = MDT_OK;
    for (int i = 0; m->lora && i < m->table.n; i++) {
        const mdt_status s1 = restore(m, &io, i);
        st = st == MDT_OK ? s1 : st; /* every tensor is tried */
    }
    io_close(&io);
    return st;
}

/* " of TP rank k's shard" where tensor i is cut over TP (an index in it is the shard's), else
 * "". */
static const char *shard_of(const mdt_model *m, int i, char *buf, size_t cap) {
    buf[0] = 0;
    if (m->T > 1 && m->table.specs[i].style != MDT_TP_REPLICATED)
        snprintf(buf, cap, " of TP rank %d's shard", m->tp_index);
    return buf;
}

/* ---- fusing one tensor ---- */
typedef struct {
    const mdt_lora_target *t;
    double coef;      /* adapter weight x module scale */
    const char *name; /* the adapter's */
} term;

/* Tensor i (a weight, or the bias of adapted linears) := base + the terms' sum. */
static mdt_status fuse_tensor(mdt_model *m, base_io *io, int i, const term *tt, int nt, int bias) {
    mdt_lora_state *s = m->lora;
    const int64_t rows = m->ws[i].local[0], cols = m->ws[i].local[1], n = rows * cols;
    MDT_TRY(io_scratch(io, n));
    if (!s->done[i] && s->keep_copy) { /* the base as resident, kept before the first change */
        s->copy[i] = mdt_alloc((size_t)resident_bytes(m, i));
        if (!s->copy[i])
            return MDT_FAIL(MDT_E_NOMEM, "out of memory for a copy of '%s'",
                            m->table.specs[i].name);
        s->copy_bytes += resident_bytes(m, i);
        resident_to_host(m, i, s->copy[i]);
    }
    const double t0 = mdt_now();
    const int in_place = host_plain(m, i);
    float *w = in_place ? m->ws[i].data : io->f32; /* [rows, cols] */
    if (!w)
        return MDT_FAIL(MDT_E_INVALID, "'%s' has no host weights", m->table.specs[i].name);
    if (in_place && s->done[i]) {
        if (s->copy[i])
            memcpy(w, s->copy[i], sizeof(float) * (size_t)n);
        else
            MDT_TRY(reread(m, io, i, w));
    } else {
        MDT_TRY(base_f32(m, io, i, w));
    }
    const double t1 = mdt_now();
    s->base_s += s->done[i] ? t1 - t0 : 0;
    if (bias) { /* b += sum coef lora_B.bias */
        for (int j = 0; j < nt; j++)
            for (int64_t r = 0; r < rows; r++)
                w[r] += (float)tt[j].coef * tt[j].t->bias[r];
    } else { /* w += [coef_j B_j] . [A_j], the ranks stacked */
        int64_t R = 0;
        for (int j = 0; j < nt; j++)
            R += tt[j].t->rank;
        float *bs = mdt_alloc(sizeof(float) * (size_t)(rows * R)); /* [rows, R] */
        float *at = mdt_alloc(sizeof(float) * (size_t)(cols * R)); /* [cols, R] */
        int64_t tile = ((int64_t)1 << 20) / (cols > 0 ? cols : 1);
        tile = tile < 1 ? 1 : tile > rows ? rows : tile;
        float *d = mdt_alloc(sizeof(float) * (size_t)(tile * cols + 1)); /* [tile, cols] */
        if (!bs || !at || !d) {
            mdt_free(bs), mdt_free(at), mdt_free(d);
            return MDT_FAIL(MDT_E_NOMEM, "out of memory fusing '%s'", m->table.specs[i].name);
        }
        int64_t off = 0;
        for (int j = 0; j < nt; j++) {
            const int64_t r = tt[j].t->rank;
            for (int64_t x = 0; x < rows; x++)
                for (int64_t c = 0; c < r; c++)
                    bs[x * R + off + c] = (float)tt[j].coef * tt[j].t->b[x * r + c];
            for (int64_t x = 0; x < cols; x++)
                memcpy(at + x * R + off, tt[j].t->at + x * r, sizeof(float) * (size_t)r);
            off += r;
        }
        for (int64_t r0 = 0; r0 < rows; r0 += tile) {
            const int64_t nr = rows - r0 < tile ? rows - r0 : tile;
            /* d [nr, cols] = bs[r0:r0+nr] [nr, R] . at^T [R, cols] */
            mdt_k_host()->linear(bs + r0 * R, R, at, NULL, NULL, d, cols, nr, R, cols);
            float *wr = w + r0 * cols;
            for (int64_t e = 0; e < nr * cols; e++)
                wr[e] += d[e];
        }
        mdt_free(bs), mdt_free(at), mdt_free(d);
    }
    if (in_place) /* the resident weight is changed: a failure from here on restores the base */
        s->done[i] = 1;
    for (int64_t e = 0; e < n; e++) /* factors and weights are finite; their sum may not be */
        if (!isfinite(w[e])) {
            char names[256] = "", where[48];
            size_t len = 0;
            for (int j = 0; j < nt; j++) { /* 'a', 'b': the adapters in this sum, each once */
                const size_t k = strlen(tt[j].name);
                if (strstr(names, tt[j].name) || len + k + 5 >= sizeof names)
                    continue;
                if (len)
                    memcpy(names + len, ", ", 2), len += 2;
                names[len++] = '\'';
                memcpy(names + len, tt[j].name, k), len += k;
                names[len++] = '\'', names[len] = '\0';
            }
            return MDT_FAIL(
                MDT_E_INVALID,
                "LoRA: fusing adapter %s into '%s' gives a non-finite value at "
                "[%lld, %lld]%s (the factors times the weight and scale overflow float32)",
                names, m->table.specs[i].name, (long long)(e / (cols ? cols : 1)),
                (long long)(e % (cols ? cols : 1)), shard_of(m, i, where, sizeof where));
        }
    mdt_status st = f32_to_resident(m, i, w);
    s->fuse_s += mdt_now() - t1;
    if (st == MDT_OK)
        s->done[i] = 1;
    return st;
}

/* Every tensor to base + its active terms, the rest to base. Local. */
static mdt_status apply(mdt_model *m) {
    mdt_lora_state *s = m->lora;
    base_io io = {0};
    mdt_status st = MDT_OK;
    int cap = 0;
    for (int a = 0; a < s->n; a++)
        cap += s->a[a]->n;
    term *tt = mdt_alloc(sizeof(term) * (size_t)(cap ? cap : 1));
    if (!tt)
        return MDT_FAIL(MDT_E_NOMEM, "out of memory");
    s->fuse_s = s->base_s = 0;
    for (int i = 0; st == MDT_OK && i < m->table.n; i++) {
        int nt = 0, bias = 0;
        for (int a = 0; a < s->n; a++) {
            const mdt_lora *l = s->a[a];
            if (!l->active || l->weight == 0)
                continue; /* weight 0 changes nothing: its tensors keep their base bits */
            for (int j = 0; j < l->n; j++)
                if (l->t[j].wi == i || l->t[j].bi == i) {
                    bias = l->t[j].bi == i;
                    tt[nt].t = &l->t[j], tt[nt].name = l->name;
                    tt[nt++].coef = l->weight * l->t[j].scale;
                }
        }
        if (nt) {
            st = fuse_tensor(m, &io, i, tt, nt, bias);
        } else if (s->done[i]) {
            const double t0 = mdt_now();
            st = restore(m, &io, i);
            s->base_s += mdt_now() - t0;
        }
    }
    mdt_free(tt);
    io_close(&io);
    return st;
}

/* Applies the active set on every rank; after a failure anywhere, every rank goes back to its
 * base weights with nothing active. */
static mdt_status apply_agreed(mdt_model *m) {
    mdt_status st = mdt_mesh_agree(m->mesh, apply(m));
    if (st == MDT_OK)
        return MDT_OK;
    char msg[2048];
    snprintf(msg, sizeof msg, "%s", mdt_last_error());
    for (int a = 0; a < m->lora->n; a++)
        m->lora->a[a]->active = 0;
    const mdt_status back = mdt_mesh_agree(m->mesh, mdt_lora_restore_all(m));
    if (back != MDT_OK)
        return back;
    mdt_error_clear();
    return MDT_FAIL(st, "%s", msg);
}

/* ---- the public calls ---- */
static mdt_lora *find(const mdt_lora_state *s, const char *name, int *at) {
    for (int i = 0; s && i < s->n; i++)
        if (strcmp(s->a[i]->name, name) == 0) {
            if (at)
                *at = i;
            return s->a[i];
        }
    return NULL;
}

static mdt_status load_local(mdt_model *m, const char *name, const mdt_st_file *f,
                             const char *src) {
    mdt_lora_state *s = mdt_lora_state_of(m);
    if (!s)
        return MDT_E_NOMEM;
    if (!name || !*name || strlen(name) >= MDT_LORA_NAME_MAX)
        return MDT_FAIL(MDT_E_INVALID, "an adapter's name must have 1 to %d characters",
                        MDT_LORA_NAME_MAX - 1);
    if (find(s, name, NULL))
        return MDT_FAIL(MDT_E_INVALID, "an adapter named '%s' is already loaded", name);
    mdt_lora *l = mdt_calloc(sizeof *l);
    if (!l)
        return MDT_FAIL(MDT_E_NOMEM, "out of memory");
    snprintf(l->name, sizeof l->name, "%s", name);
    snprintf(l->source, sizeof l->source, "%s", src);
    mdt_status st = mdt_lora_map(&m->table, f, src, &l->t, &l->n);
    if (st == MDT_OK)
        st = mdt_lora_read(&m->table, f, m->T, m->tp_index, l);
    if (st == MDT_OK && s->n == s->cap) {
        const int cap = s->cap ? 2 * s->cap : 4;
        mdt_lora **a = mdt_alloc(sizeof(mdt_lora *) * (size_t)cap);
        if (a) {
            if (s->n)
                memcpy((void *)a, (const void *)s->a, sizeof(mdt_lora *) * (size_t)s->n);
            mdt_free((void *)s->a);
            s->a = a, s->cap = cap;
        } else {
            st = MDT_FAIL(MDT_E_NOMEM, "out of memory");
        }
    }
    if (st != MDT_OK) {
        mdt_lora_free(l);
        return st;
    }
    s->a[s->n++] = l;
    return MDT_OK;
}

/* Agrees on the load; a rank that loaded while another failed drops what it loaded. */
static mdt_status load_agreed(mdt_model *m, const char *name, mdt_status local) {
    const mdt_status st = mdt_mesh_agree(m->mesh, local);
    int at;
    if (st != MDT_OK && local == MDT_OK && find(m->lora, name, &at)) {
        mdt_lora_free(m->lora->a[at]);
        m->lora->a[at] = m->lora->a[--m->lora->n];
    }
    return st;
}

mdt_status mdt_model_lora_load(mdt_model *m, const char *name, const char *path) {
    mdt_st_file *f = NULL;
    mdt_status st = mdt_st_open(path, &f);
    if (st == MDT_OK)
        st = load_local(m, name, f, f->path);
    mdt_st_close(f);
    return load_agreed(m, name, st);
}

mdt_status mdt_model_lora_load_mem(mdt_model *m, const char *name, const void *data, size_t size,
                                   const char *shown) {
    mdt_st_file *f = NULL;
    mdt_status st = mdt_st_open_mem(data, size, shown ? shown : "adapter", &f);
    if (st == MDT_OK)
        st = load_local(m, name, f, f->path);
    mdt_st_close(f);
    return load_agreed(m, name, st);
}

mdt_status mdt_model_set_adapters(mdt_model *m, int n, const char *const *names,
                                  const double *weights) {
    mdt_lora_state *s = n > 0 ? mdt_lora_state_of(m) : m->lora;
    mdt_status st = n < 0 ? MDT_FAIL(MDT_E_INVALID, "set_adapters: %d adapters", n) : MDT_OK;
    for (int i = 0; st == MDT_OK && i < n; i++) {
        if (!s || !names[i] || !find(s, names[i], NULL))
            st = MDT_FAIL(MDT_E_NOTFOUND, "no adapter named '%s' is loaded",
                          names[i] ? names[i] : "(null)");
        else if (!isfinite(weights[i]))
            st = MDT_FAIL(MDT_E_INVALID, "adapter '%s': weight %g is not finite", names[i],
                          weights[i]);
        for (int j = 0; st == MDT_OK && j < i; j++)
            if (strcmp(names[i], names[j]) == 0)
                st = MDT_FAIL(MDT_E_INVALID, "set_adapters names '%s' twice", names[i]);
    }
    MDT_TRY(mdt_mesh_agree(m->mesh, st));
    if (!s)
        return MDT_OK; /* nothing loaded, nothing fused */
    for (int a = 0; a < s->n; a++)
        s->a[a]->active = 0, s->a[a]->weight = 0;
    for (int i = 0; i < n; i++) {
        mdt_lora *l = find(s, names[i], NULL);
        l->active = 1, l->weight = weights[i];
    }
    return apply_agreed(m);
}

mdt_status mdt_model_lora_unload(mdt_model *m, const char *name) {
    mdt_lora_state *s = m->lora;
    int at = -1;
    mdt_status st = MDT_OK;
    if (name && !find(s, name, &at))
        st = MDT_FAIL(MDT_E_NOTFOUND, "no adapter named '%s' is loaded", name);
    MDT_TRY(mdt_mesh_agree(m->mesh, st));
    if (!s)
        return MDT_OK;
    for (int a = 0; a < s->n; a++)
        if (!name || a == at)
            s->a[a]->active = 0;
    st = apply_agreed(m);
    for (int a = s->n - 1; a >= 0; a--)
        if (!name || a == at) {
            mdt_lora_free(s->a[a]);
            memmove((void *)&s->a[a], (const void *)&s->a[a + 1],
                    sizeof(mdt_lora *) * (size_t)(s->n - a - 1));
            s->n--;
        }
    return st;
}

mdt_status mdt_model_set_lora_base(mdt_model *m, mdt_lora_base how) {
    mdt_lora_state *s = mdt_lora_state_of(m);
    if (!s)
        return MDT_E_NOMEM;
    for (int i = 0; i < m->table.n; i++)
        if (s->done[i])
            return MDT_FAIL(MDT_E_INVALID, "the base of the weights cannot change while an "
                                           "adapter is fused (mdt_model_set_adapters with none "
                                           "first)");
    if (how != MDT_LORA_BASE_REREAD && how != MDT_LORA_BASE_COPY)
        return MDT_FAIL(MDT_E_INVALID, "unknown LoRA base %d", (int)how);
    s->keep_copy = how == MDT_LORA_BASE_COPY;
    return MDT_OK;
}

int mdt_model_lora_count(const mdt_model *m) { return m->lora ? m->lora->n : 0; }

mdt_status mdt_model_lora_info(const mdt_model *m, int i, mdt_lora_info *out) {
    if (i < 0 || i >= mdt_model_lora_count(m))
        return MDT_FAIL(MDT_E_INVALID, "adapter %d of %d", i, mdt_model_lora_count(m));
    const mdt_lora *l = m->lora->a[i];
    memset(out, 0, sizeof *out);
    out->name = l->name, out->source = l->source, out->targets = l->n;
    out->active = l->active, out->weight = l->weight;
    out->bytes = l->bytes, out->bytes_read = l->bytes_read;
    for (int j = 0; j < l->n; j++) {
        if (j == 0 || l->t[j].rank < out->rank_min)
            out->rank_min = l->t[j].rank;
        if (l->t[j].rank > out->rank_max)
            out->rank_max = l->t[j].rank;
    }
    return MDT_OK;
}

void mdt_model_lora_costs(const mdt_model *m, double *fuse_s, double *base_s, int64_t *reread_bytes,
                          int64_t *copy_bytes) {
    const mdt_lora_state *s = m->lora;
    *fuse_s = s ? s->fuse_s : 0, *base_s = s ? s->base_s : 0;
    *reread_bytes = s ? s->reread_bytes : 0, *copy_bytes = s ? s->copy_bytes : 0;
}

void mdt_lora_report(const mdt_model *m, struct cJSON *report) {
    cJSON *arr = cJSON_AddArrayToObject(report, "adapters");
    for (int i = 0; i < mdt_model_lora_count(m); i++) {
        mdt_lora_info li;
        mdt_model_lora_info(m, i, &li);
        cJSON *a = cJSON_CreateObject();
        cJSON_AddItemToArray(arr, a);
        cJSON_AddStringToObject(a, "name", li.name);
        cJSON_AddStringToObject(a, "file", li.source);
        cJSON_AddBoolToObject(a, "fused", li.active);
        cJSON_AddNumberToObject(a, "weight", li.weight);
        cJSON_AddNumberToObject(a, "linear_weights", li.targets);
        cJSON_AddNumberToObject(a, "rank_min", (double)li.rank_min);
        cJSON_AddNumberToObject(a, "rank_max", (double)li.rank_max);
        cJSON_AddNumberToObject(a, "factor_bytes_rank", (double)li.bytes);
        cJSON_AddNumberToObject(a, "bytes_read_rank", (double)li.bytes_read);
    }
    if (m->lora) {
        cJSON_AddNumberToObject(report, "lora_fuse_seconds", m->lora->fuse_s);
        cJSON_AddNumberToObject(report, "lora_base_seconds", m->lora->base_s);
    }
}
