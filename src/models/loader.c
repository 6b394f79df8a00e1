/*
 * loader.c — a model's life: described from its config (family + weight table), its layout
 * checked, its weights read shard-on-read from a diffusers checkpoint (every planned tensor's
 * presence, shape and dtype validated before any byte is read; each rank reads only the bytes
 * of its TP shards, converted to f32 after slicing), and freed. Where the weights then live is
 * residency.c's business.
 */
#include "models/inputs.h"
#include "models/lora.h"
#include "models/residency.h"

#include "backend/backend.h"
#include "core/sysmem.h"
#include "core/testhooks.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
    MDT_CHECK(mdt_wtable_check(&m->table)); /* every linear says which rows it runs on */
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

/* Reads this rank's shard of `w` straight into `dst` (f32), touching only its bytes for
 * replicated and dim-0 tensors; dim-1 pieces go through a bounded window when they are small. */
mdt_status mdt_model_read_shard(const mdt_ckpt_ref *ref, const mdt_weight_spec *w, int T, int k,
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

static int name_cmp(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* The checkpoint holds tensors the model does not read: how many, and the first by name. */
static void warn_unused(const mdt_model *m, const mdt_ckpt *ck) {
    const int n = m->table.n;
    const char **names = mdt_alloc(sizeof *names * (size_t)(n ? n : 1)), *first = NULL;
    for (int i = 0; names && i < n; i++)
        names[i] = m->table.specs[i].name;
    if (names)
        qsort((void *)names, (size_t)n, sizeof *names, name_cmp);
    for (int j = 0; names && j < ck->n && !first; j++)
        if (!bsearch(&ck->refs[j].name, (void *)names, (size_t)n, sizeof *names, name_cmp))
            first = ck->refs[j].name;
    char shown[MDT_ESC_NAME];
    mdt_log(MDT_LOG_WARN, "%s: %d tensors in the checkpoint are not used by the model%s%s%s",
            ck->dir_shown, ck->n - n, first ? " (the first by name: '" : "",
            first ? mdt_escape(first, shown, sizeof shown) : "", first ? "')" : "");
    mdt_free((void *)names);
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
        int64_t want[MDT_MAX_DIMS];
        const int nd = mdt_weight_stored_shape(w, want);
        int same = e->ndim == nd;
        for (int d = 0; same && d < nd; d++)
            same = e->shape[d] == want[d];
        if (!same)
            return MDT_FAIL(MDT_E_INVALID, "%s: tensor '%s': shape %s but config.json implies %s",
                            ref->file->path, w->name, mdt_shape_str(e->ndim, e->shape, sb1, 96),
                            mdt_shape_str(nd, want, sb2, 96));
        if (!mdt_dtype_is_float(e->dtype))
            return MDT_FAIL(MDT_E_INVALID, "%s: tensor '%s': dtype %s is not a float type",
                            ref->file->path, w->name, mdt_dtype_name(e->dtype));
        m->ws[i].stored = e->dtype;
    }
    MDT_TRY(mdt_res_alloc(m, T, k, &m->weights, mdt_res_host_bf16() ? &m->hbf16 : NULL, m->ws));
    const int dev = mdt_backend_mem() != NULL;
    if (dev)
        MDT_TRY(mdt_res_dev_prepare(m));
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
            st = mdt_model_read_shard(ref, &m->table.specs[i], T, k, dst);
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
            mdt_res_dev_upload(m, i); /* on its way while the next tensor is read */
        if (st == MDT_OK && i == m->table.n / 2)
            st = mdt_test_point("load", mesh ? mesh->world_rank : 0); /* test seam */
    }
    mdt_free(scratch);
    MDT_TRY(st);
    if (ck->n > m->table.n)
        warn_unused(m, ck);
    mdt_res_bind(m);
    MDT_TRY(mdt_res_reserve_linear(m));
    return dev ? mdt_res_dev_finish(m) : mdt_res_pack(m);
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
    /* where a LoRA's unfuse reads the base weights again (lora_fuse.c) */
    return mdt_mesh_agree(mesh, mdt_lora_note_checkpoint(m, ck));
}

/* Resident weight bytes per rank at degree T (0 if the layout is invalid): 4 per weight, 2 for
 * linear weights under bf16, on coordinate 0 (the largest where a tensor splits unevenly). */
static int64_t weight_bytes_at(const mdt_model *m, int T) {
    int64_t bytes = 0, loc[2];
    if (mdt_model_check_layout(m, T, 1, 1) != MDT_OK)
        return 0;
    for (int i = 0; i < m->table.n; i++) {
        mdt_shard_local_shape(&m->table.specs[i], T, 0, loc);
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
    char cpath[4096];
    snprintf(cpath, sizeof cpath, "%s/config.json", p->checkpoint_dir);
    if (st == MDT_OK && (st = mdt_model_describe(ck->config, &m)) != MDT_OK)
        (void)mdt_config_error_at(st, cpath); /* the message names the file */
    if (st == MDT_OK && p->max_weight_bytes > 0)
        st = check_memory(m, mesh ? mesh->T : 1, p->max_weight_bytes);
    st = mdt_mesh_agree(mesh, st);
    if (st == MDT_OK && !m) /* a rank without a model has failed, so the agreement has too */
        st = MDT_FAIL(MDT_E_INVALID, "%s: no model was described", p->checkpoint_dir);
    MDT_CHECK(st);
    MDT_CHECK(mdt_model_load_ckpt(m, ck, mesh));
    mdt_ckpt_close(ck);
    *out = m;
    return MDT_OK;
fail:
    mdt_ckpt_close(ck);
    mdt_model_free(m);
    return st;
}

void mdt_model_free(mdt_model *m) {
    if (!m)
        return;
    mdt_lora_state_free(m);
    mdt_res_forget_packed(m); /* (reads the table: before it is freed) */
    mdt_arena_release(&m->arena);
    mdt_arena_release(&m->harena);
    mdt_wtable_free(&m->table);
    mdt_res_dev_release(m);
    mdt_res_free_host(m, m->weights);
    mdt_free(m->hbf16);
    mdt_free(m->ws);
    mdt_free(m->impl);
    cJSON_Delete(m->config);
    mdt_free(m);
    mdt_backend_release_scratch(); /* the next model reserves its own */
}

const char *mdt_model_family(const mdt_model *m) { return m->fam->name; }

/* negative_X for each branch input X of `out`: fresh N(0, 1) draws for float inputs that vary
 * (text embeddings), a copy of the others (ids, masks: the same layout in both branches). */
static mdt_status add_negatives(const mdt_model *m, mdt_rng *rng, mdt_tensor_set *out) {
    const int n = mdt_tensor_set_count(out);
    for (int i = 0; i < n; i++) {
        const char *name;
        const mdt_tensor *t = mdt_tensor_set_at(out, i, &name);
        const mdt_input_decl *d = mdt_model_input(m, name);
        if (!d || !(d->flags & MDT_IN_BRANCH))
            continue;
        char nn[MDT_NAME_MAX + 16];
        snprintf(nn, sizeof nn, "negative_%s", name);
        const int64_t k = mdt_tensor_numel(t);
        int varies = 0;
        for (int64_t j = 1; t->dtype == MDT_F32 && j < k && !varies; j++)
            varies = ((const float *)t->data)[j] != ((const float *)t->data)[0];
        if (!varies) {
            MDT_TRY(mdt_tensor_set_add_copy(out, nn, t));
            continue;
        }
        MDT_TRY(mdt_inputs_add_normal(out, nn, t->ndim, t->shape, rng));
    }
    return MDT_OK;
}

/* Inputs of batch B and token counts n[3] (image, text, audio) grow linearly in B times one of
 * the counts: made at batch 1 and at most 64 of each, their bytes scaled by B times the largest
 * ratio bound the whole set from above. Refused when that is more than this process may use. */
static mdt_status check_inputs_size(const mdt_model *m, const mdt_inputs_params *q) {
    const int64_t n[3] = {q->img_tokens, q->txt_tokens, q->audio_tokens};
    int64_t k[3];
    double ratio = 1;
    for (int i = 0; i < 3; i++) {
        k[i] = n[i] > 64 ? 64 : n[i];
        if (k[i] > 0 && (double)n[i] / (double)k[i] > ratio)
            ratio = (double)n[i] / (double)k[i];
    }
    if (q->batch <= 1 && ratio <= 1) /* a malformed MESHDIT_MEM_AVAILABLE is refused still */
        return mdt_mem_fits(0, "", "", "");
    mdt_inputs_params s = *q;
    s.batch = 1, s.img_tokens = k[0], s.txt_tokens = k[1], s.audio_tokens = k[2];
    mdt_tensor_set *t = NULL;
    mdt_rng rng;
    mdt_rng_seed(&rng, 0);
    MDT_TRY(mdt_tensor_set_create(&t));
    mdt_status st = m->fam->make_inputs(m->impl, &s, &rng, t);
    double bytes = 0;
    for (int i = 0; st == MDT_OK && i < mdt_tensor_set_count(t); i++)
        bytes += (double)mdt_tensor_nbytes(mdt_tensor_set_at(t, i, &(const char *){NULL}));
    mdt_tensor_set_free(t);
    MDT_TRY(st);
    const double need = bytes * (double)q->batch * ratio * (q->negative ? 2.0 : 1.0);
    char what[128];
    snprintf(what, sizeof what,
             "inputs of batch %lld and %lld tokens in their longest stream take up to",
             (long long)q->batch,
             (long long)(n[0] > n[1] ? (n[0] > n[2] ? n[0] : n[2]) : (n[1] > n[2] ? n[1] : n[2])));
    return mdt_mem_fits(need, what, "", "");
}

mdt_status mdt_model_random_inputs(const mdt_model *m, const mdt_inputs_params *p,
                                   mdt_tensor_set *out) {
    mdt_inputs_params q = *p;
    mdt_rng rng;
    q.batch = q.batch > 0 ? q.batch : 1;
    MDT_TRY(check_inputs_size(m, &q));
    mdt_rng_seed(&rng, q.seed);
    MDT_TRY(m->fam->make_inputs(m->impl, &q, &rng, out));
    return q.negative ? add_negatives(m, &rng, out) : MDT_OK;
}

mdt_model_dims mdt_model_dims_of(const mdt_model *m) {
    mdt_model_dims d = {.heads = 1, .head_dim = 1, .hidden = 1, .ffn = 1};
    m->fam->dims(m->impl, &d);
    return d;
}

int mdt_model_cross_attention(const mdt_model *m) { return mdt_model_dims_of(m).text_cross; }

int mdt_model_guides(const mdt_model *m) {
    for (const mdt_input_decl *d = m->fam->inputs(m->impl); d->name; d++)
        if (d->flags & MDT_IN_BRANCH)
            return 1;
    return 0;
}
