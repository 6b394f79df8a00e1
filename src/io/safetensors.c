/*
 * safetensors.c — see safetensors.h. Parsing uses cJSON; integers are read from `valuedouble`
 * (exact to 2^53, cJSON's valueint saturates at INT_MAX) and rejected when not integral.
 * Every string from the file (names, dtypes, metadata keys) and the path itself reach messages
 * through mdt_escape: a name holding a newline or a terminal escape stays one inert line.
 */
#define _POSIX_C_SOURCE 200809L
#include "safetensors.h"

#include "core/outfile.h"

#include "io/file.h"
#include "io/json.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* `path` as messages show it (mdt_escape), in a block of its own; NULL when out of memory. */
static char *dup_shown(const char *path) {
    size_t n = 4 * strlen(path) + 8; /* every byte as \xNN at worst */
    if (n > 4096)
        n = 4096;
    char *d = mdt_alloc(n);
    if (d)
        mdt_escape(path, d, n);
    return d;
}

/* A JSON number that is an exact non-negative integer below 2^53. */
static int json_uint(const cJSON *j, int64_t *out) {
    if (!cJSON_IsNumber(j))
        return 0;
    double d = j->valuedouble;
    if (!(d >= 0.0) || d > 9007199254740992.0 || floor(d) != d)
        return 0;
    *out = (int64_t)d;
    return 1;
}

static int cmp_entry_name(const void *a, const void *b) {
    return strcmp(((const mdt_st_entry *)a)->name, ((const mdt_st_entry *)b)->name);
}
static int cmp_entry_ptr_begin(const void *a, const void *b) {
    const mdt_st_entry *x = *(const mdt_st_entry *const *)a, *y = *(const mdt_st_entry *const *)b;
    if (x->begin != y->begin)
        return x->begin < y->begin ? -1 : 1;
    return x->end < y->end ? -1 : (x->end > y->end);
}

/* Reads `nbytes` at `off` of the file's bytes: pread()s for a file, a bounds-checked copy for a
 * blob in memory (mdt_st_open_mem). */
static mdt_status pread_all(const mdt_st_file *f, void *dst, int64_t nbytes, int64_t off,
                            const char *path, const char *what) {
    if (f->mem) {
        if (off < 0 || nbytes < 0 || off > f->file_size || nbytes > f->file_size - off)
            return MDT_FAIL(MDT_E_IO, "%s: %s: ends early", path, what);
        memcpy(dst, f->mem + off, (size_t)nbytes);
        return MDT_OK;
    }
    char *p = dst;
    while (nbytes > 0) {
        size_t chunk = nbytes > (1 << 30) ? (size_t)1 << 30 : (size_t)nbytes;
        ssize_t r = pread(f->fd, p, chunk, (off_t)off);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0)
            return MDT_FAIL(MDT_E_IO, "%s: %s: read failed: %s", path, what, strerror(errno));
        if (r == 0)
            return MDT_FAIL(MDT_E_IO, "%s: %s: file ends early (truncated after open?)", path,
                            what);
        p += r, nbytes -= r, off += r;
    }
    return MDT_OK;
}

static mdt_status parse_entry(mdt_st_file *f, const cJSON *item, mdt_st_entry *e,
                              int64_t data_size) {
    char what[4096 + MDT_ESC_NAME], nm[MDT_ESC_NAME], dts[64];
    snprintf(what, sizeof what, "%s: tensor '%s'", f->path,
             mdt_escape(item->string, nm, sizeof nm));
    if (!cJSON_IsObject(item))
        return MDT_FAIL(MDT_E_FORMAT, "%s: entry is not a JSON object", what);
    static const char *const keys[3] = {"dtype", "shape", "data_offsets"};
    int seen[3] = {0, 0, 0};
    for (const cJSON *a = item->child; a; a = a->next) /* a repeated key is ambiguous */
        for (int k = 0; k < 3; k++)
            if (a->string && strcmp(a->string, keys[k]) == 0 && seen[k]++)
                return MDT_FAIL(MDT_E_FORMAT, "%s: key '%s' appears twice in its entry", what,
                                keys[k]);
    const cJSON *dt = cJSON_GetObjectItemCaseSensitive(item, "dtype");
    const cJSON *sh = cJSON_GetObjectItemCaseSensitive(item, "shape");
    const cJSON *off = cJSON_GetObjectItemCaseSensitive(item, "data_offsets");
    if (!cJSON_IsString(dt))
        return MDT_FAIL(MDT_E_FORMAT, "%s: missing or non-string 'dtype'", what);
    e->dtype = mdt_dtype_parse(dt->valuestring);
    if (e->dtype == MDT_DTYPE_COUNT)
        return MDT_FAIL(MDT_E_FORMAT, "%s: unknown or unsupported dtype '%s'", what,
                        mdt_escape(dt->valuestring, dts, sizeof dts));
    if (!cJSON_IsArray(sh))
        return MDT_FAIL(MDT_E_FORMAT, "%s: missing or non-array 'shape'", what);
    int nd = cJSON_GetArraySize(sh);
    if (nd > MDT_MAX_DIMS)
        return MDT_FAIL(MDT_E_FORMAT, "%s: rank %d exceeds the supported %d", what, nd,
                        MDT_MAX_DIMS);
    e->ndim = nd;
    int64_t numel = 1;
    int overflow = 0;
    for (int i = 0; i < nd; i++) {
        int64_t d;
        if (!json_uint(cJSON_GetArrayItem(sh, i), &d))
            return MDT_FAIL(MDT_E_FORMAT, "%s: shape[%d] is not a non-negative integer", what, i);
        e->shape[i] = d;
        if (d != 0 && numel > INT64_MAX / 16 / d)
            overflow = 1;
        else
            numel *= d;
    }
    if (!cJSON_IsArray(off) || cJSON_GetArraySize(off) != 2 ||
        !json_uint(cJSON_GetArrayItem(off, 0), &e->begin) ||
        !json_uint(cJSON_GetArrayItem(off, 1), &e->end))
        return MDT_FAIL(MDT_E_FORMAT, "%s: 'data_offsets' must be two non-negative integers", what);
    if (e->end < e->begin)
        return MDT_FAIL(MDT_E_FORMAT, "%s: data_offsets [%lld, %lld] end before they begin", what,
                        (long long)e->begin, (long long)e->end);
    if (e->end > data_size)
        return MDT_FAIL(MDT_E_FORMAT,
                        "%s: data_offsets [%lld, %lld] run past the end of the data section "
                        "(%lld bytes; file truncated?)",
                        what, (long long)e->begin, (long long)e->end, (long long)data_size);
    char sbuf[160];
    if (overflow)
        return MDT_FAIL(MDT_E_FORMAT,
                        "%s: shape %s of %s has more than 2^59 elements (no file holds "
                        "that)",
                        what, mdt_shape_str(e->ndim, e->shape, sbuf, sizeof sbuf),
                        mdt_dtype_name(e->dtype));
    if (numel * (int64_t)mdt_dtype_size(e->dtype) != e->end - e->begin)
        return MDT_FAIL(
            MDT_E_FORMAT,
            "%s: data_offsets [%lld, %lld] hold %lld bytes but shape %s of %s needs "
            "%lld",
            what, (long long)e->begin, (long long)e->end, (long long)(e->end - e->begin),
            mdt_shape_str(e->ndim, e->shape, sbuf, sizeof sbuf), mdt_dtype_name(e->dtype),
            (long long)(numel * (int64_t)mdt_dtype_size(e->dtype)));
    return MDT_OK;
}

/* Copies `s` into the file's string block (sized by pool_size beforehand). One block per file
 * instead of one allocation per name keeps a file's tables near its header's size. */
static char *pool_put(mdt_st_file *f, size_t *used, const char *s) {
    size_t n = strlen(s) + 1;
    char *d = f->strings + *used;
    memcpy(d, s, n);
    *used += n;
    return d;
}

/* Bytes of every name, metadata key and metadata value in the header, with their NULs. */
static size_t pool_size(const cJSON *root) {
    size_t n = 1;
    const cJSON *item, *kv;
    cJSON_ArrayForEach(item, root) {
        n += strlen(item->string) + 1;
        if (strcmp(item->string, "__metadata__") == 0 && cJSON_IsObject(item))
            cJSON_ArrayForEach(kv, item) {
                n +=
                    strlen(kv->string) + 1 + (cJSON_IsString(kv) ? strlen(kv->valuestring) + 1 : 0);
            }
    }
    return n;
}

static int cmp_str_ptr(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* JSON lets a key repeat and a reader would keep one of them ({"op": "info", "op": "close"} read
 * as a close): a repeated __metadata__ key is refused, found by sorting (n log n for any n). */
static mdt_status unique_meta_keys(const mdt_st_file *f) {
    if (f->n_meta < 2)
        return MDT_OK;
    const char **k = mdt_alloc(sizeof(char *) * (size_t)f->n_meta);
    if (!k)
        return MDT_FAIL(MDT_E_NOMEM, "out of memory");
    memcpy(k, f->meta_keys, sizeof(char *) * (size_t)f->n_meta);
    qsort(k, (size_t)f->n_meta, sizeof *k, cmp_str_ptr);
    mdt_status st = MDT_OK;
    for (int i = 1; st == MDT_OK && i < f->n_meta; i++)
        if (strcmp(k[i - 1], k[i]) == 0) {
            char key[MDT_ESC_NAME];
            st = MDT_FAIL(MDT_E_FORMAT, "%s: __metadata__ key '%s' appears twice", f->path,
                          mdt_escape(k[i], key, sizeof key));
        }
    mdt_free(k);
    return st;
}

static mdt_status parse_metadata(mdt_st_file *f, const cJSON *item, size_t *used) {
    if (!cJSON_IsObject(item))
        return MDT_FAIL(MDT_E_FORMAT, "%s: __metadata__ is not a JSON object", f->path);
    int n = cJSON_GetArraySize(item);
    f->meta_keys = mdt_calloc(sizeof(char *) * (size_t)(n + 1));
    f->meta_vals = mdt_calloc(sizeof(char *) * (size_t)(n + 1));
    if (!f->meta_keys || !f->meta_vals)
        return MDT_FAIL(MDT_E_NOMEM, "out of memory");
    const cJSON *kv;
    cJSON_ArrayForEach(kv, item) {
        char key[MDT_ESC_NAME];
        if (!cJSON_IsString(kv))
            return MDT_FAIL(MDT_E_FORMAT, "%s: __metadata__ value for '%s' is not a string",
                            f->path, mdt_escape(kv->string, key, sizeof key));
        f->meta_keys[f->n_meta] = pool_put(f, used, kv->string);
        f->meta_vals[f->n_meta] = pool_put(f, used, kv->valuestring);
        f->n_meta++;
    }
    return unique_meta_keys(f);
}

/* Checks that the entries tile the data section: sorted by offset, each begins where the previous
 * ended (zero-size tensors may sit anywhere inside), and the last ends at the end of the file. */
static mdt_status check_tiling(mdt_st_file *f, int64_t data_size) {
    mdt_status st = MDT_OK;
    const mdt_st_entry **by_off =
        mdt_alloc(sizeof(const mdt_st_entry *) * (size_t)(f->n ? f->n : 1));
    if (!by_off)
        return MDT_FAIL(MDT_E_NOMEM, "out of memory");
    for (int i = 0; i < f->n; i++)
        by_off[i] = &f->entries[i];
    qsort(by_off, (size_t)f->n, sizeof(const mdt_st_entry *), cmp_entry_ptr_begin);
    int64_t pos = 0;
    const mdt_st_entry *prev = NULL;
    char n1[MDT_ESC_NAME], n2[MDT_ESC_NAME];
    for (int i = 0; i < f->n; i++) {
        const mdt_st_entry *e = by_off[i];
        if (e->begin == e->end && e->begin <= pos)
            continue; /* empty tensor */
        if (e->begin < pos) {
            st = MDT_FAIL(MDT_E_FORMAT,
                          "%s: tensor '%s': data_offsets [%lld, %lld] overlap tensor '%s' "
                          "[%lld, %lld]",
                          f->path, mdt_escape(e->name, n1, sizeof n1), (long long)e->begin,
                          (long long)e->end, prev ? mdt_escape(prev->name, n2, sizeof n2) : "?",
                          prev ? (long long)prev->begin : 0LL, (long long)pos);
            goto done;
        }
        if (e->begin > pos) {
            st = MDT_FAIL(MDT_E_FORMAT,
                          "%s: tensor '%s': data_offsets begin at %lld, leaving a hole after "
                          "byte %lld of the data section",
                          f->path, mdt_escape(e->name, n1, sizeof n1), (long long)e->begin,
                          (long long)pos);
            goto done;
        }
        pos = e->end;
        prev = e;
    }
    if (pos != data_size)
        st = MDT_FAIL(MDT_E_FORMAT,
                      "%s: tensors cover %lld bytes but the data section has %lld (trailing or "
                      "missing bytes)",
                      f->path, (long long)pos, (long long)data_size);
done:
    mdt_free(by_off);
    return st;
}

mdt_status mdt_st_open(const char *path, mdt_st_file **out) {
    mdt_st_budget b = {0, 0, 0};
    return mdt_st_open_budget(path, &b, out);
}

mdt_status mdt_st_open_budget(const char *path, mdt_st_budget *budget, mdt_st_file **out) {
    int fd;
    *out = NULL;
    MDT_TRY(mdt_file_open_read(path, MDT_E_IO, &fd));
    return mdt_st_open_fd_budget(fd, path, budget, out);
}

mdt_status mdt_st_open_fd(int fd, const char *path, mdt_st_file **out) {
    mdt_st_budget b = {0, 0, 0};
    return mdt_st_open_fd_budget(fd, path, &b, out);
}

/* Fails when `n` more tensor entries would pass the per-file or the per-budget limit. */
static mdt_status check_entries(const char *path, int64_t n, const mdt_st_budget *budget) {
    if (n > MDT_ST_MAX_ENTRIES)
        return MDT_FAIL(MDT_E_FORMAT, "%s: %lld tensor entries exceed the limit of %d per file",
                        path, (long long)n, MDT_ST_MAX_ENTRIES);
    if (budget->entries + n > MDT_ST_MAX_TOTAL_ENTRIES)
        return MDT_FAIL(MDT_E_FORMAT,
                        "%s: %lld tensor entries bring the checkpoint to %lld, over the limit of "
                        "%d over all its shards",
                        path, (long long)n, (long long)(budget->entries + n),
                        MDT_ST_MAX_TOTAL_ENTRIES);
    return MDT_OK;
}

static mdt_status st_parse(mdt_st_file *f, mdt_st_budget *budget);

mdt_status mdt_st_open_fd_budget(int fd, const char *path, mdt_st_budget *budget,
                                 mdt_st_file **out) {
    mdt_status st = MDT_OK;
    *out = NULL;
    mdt_st_file *f = mdt_calloc(sizeof *f);
    if (!f) {
        close(fd);
        return MDT_FAIL(MDT_E_NOMEM, "out of memory");
    }
    f->fd = fd;
    f->path = dup_shown(path);
    if (!f->path)
        MDT_CHECK(MDT_FAIL(MDT_E_NOMEM, "out of memory"));
    struct stat sb;
    if (fstat(f->fd, &sb) != 0 || !S_ISREG(sb.st_mode))
        MDT_CHECK(MDT_FAIL(MDT_E_IO, "%s: not a regular file", f->path));
    f->file_size = (int64_t)sb.st_size;
    MDT_CHECK(st_parse(f, budget));
    *out = f;
    return MDT_OK;
fail:
    mdt_st_close(f);
    return st;
}

mdt_status mdt_st_open_mem(const void *data, size_t size, const char *name, mdt_st_file **out) {
    mdt_status st = MDT_OK;
    mdt_st_budget budget = {0, 0, 0};
    *out = NULL;
    mdt_st_file *f = mdt_calloc(sizeof *f);
    if (!f)
        return MDT_FAIL(MDT_E_NOMEM, "out of memory");
    f->fd = -1;
    f->mem = data ? data : (const void *)"";
    f->file_size = (int64_t)size;
    f->path = dup_shown(name);
    if (!f->path)
        MDT_CHECK(MDT_FAIL(MDT_E_NOMEM, "out of memory"));
    MDT_CHECK(st_parse(f, &budget));
    *out = f;
    return MDT_OK;
fail:
    mdt_st_close(f);
    return st;
}

/* Validates the header of `f` (its bytes, size and shown path set) and builds its tables;
 * on failure the caller closes `f`. */
static mdt_status st_parse(mdt_st_file *f, mdt_st_budget *budget) {
    mdt_status st = MDT_OK;
    char *hdr = NULL;
    cJSON *root = NULL;
    const char *path = f->path; /* only messages use it */
    if (f->file_size < 8)
        MDT_CHECK(MDT_FAIL(MDT_E_FORMAT,
                           "%s: %lld bytes is too short for a safetensors file (needs an 8-byte "
                           "header length)",
                           path, (long long)f->file_size));
    /* The 8-byte length and the first header byte, which must open a JSON object: a file where
     * either is impossible is not a safetensors file at all, and its bytes are never echoed. */
    unsigned char lenb[9];
    const int64_t nlen = f->file_size >= 9 ? 9 : 8;
    MDT_CHECK(pread_all(f, lenb, nlen, 0, path, "header length"));
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--)
        hlen = (hlen << 8) | lenb[i];
    const int json_next = nlen == 9 && lenb[8] == '{';
    if ((int64_t)hlen > f->file_size - 8 || hlen > (uint64_t)f->file_size) {
        if (json_next && hlen <= (uint64_t)MDT_ST_MAX_HEADER)
            MDT_CHECK(MDT_FAIL(MDT_E_FORMAT,
                               "%s: header length %llu runs past the end of the file (%lld bytes; "
                               "truncated?)",
                               path, (unsigned long long)hlen, (long long)f->file_size));
        MDT_CHECK(
            MDT_FAIL(MDT_E_FORMAT,
                     "%s: not a safetensors file: header length %llu is impossible for a "
                     "file of %lld bytes%s",
                     path, (unsigned long long)hlen, (long long)f->file_size,
                     hlen > (uint64_t)MDT_ST_MAX_HEADER ? " (and over the 100 MB limit)" : ""));
    }
    if (hlen > (uint64_t)MDT_ST_MAX_HEADER)
        MDT_CHECK(MDT_FAIL(MDT_E_FORMAT, "%s: header length %llu exceeds the 100 MB limit", path,
                           (unsigned long long)hlen));
    if (budget->header_bytes + (int64_t)hlen > MDT_ST_MAX_TOTAL_HEADER)
        MDT_CHECK(MDT_FAIL(MDT_E_FORMAT,
                           "%s: a header of %llu bytes brings the checkpoint's headers to %lld "
                           "bytes, over the limit of %lld MiB over all its shards",
                           path, (unsigned long long)hlen,
                           (long long)(budget->header_bytes + (int64_t)hlen),
                           MDT_ST_MAX_TOTAL_HEADER >> 20));
    if (hlen >= 1 && !json_next)
        MDT_CHECK(MDT_FAIL(MDT_E_FORMAT,
                           "%s: not a safetensors file: the header is not a JSON object (must "
                           "start with '{')",
                           path));
    if (hlen < 2)
        MDT_CHECK(MDT_FAIL(MDT_E_FORMAT, "%s: header of %llu bytes cannot hold a JSON object", path,
                           (unsigned long long)hlen));
    f->data_start = 8 + (int64_t)hlen;
    hdr = mdt_alloc((size_t)hlen + 1);
    if (!hdr)
        MDT_CHECK(MDT_FAIL(MDT_E_NOMEM, "%s: out of memory for header", path));
    MDT_CHECK(pread_all(f, hdr, (int64_t)hlen, 8, path, "header"));
    hdr[hlen] = 0;
    if (hdr[0] != '{')
        MDT_CHECK(
            MDT_FAIL(MDT_E_FORMAT, "%s: header is not a JSON object (must start with '{')", path));
    char shown[4096 + 16];
    snprintf(shown, sizeof shown, "%s: header", path);
    mdt_json_stats js;
    MDT_CHECK(mdt_json_check(hdr, hlen, shown, &js));
    /* top-level members, less a __metadata__ that may be among them: a bound before the tree
     * (exact unless the key is spelt with escapes; the count after parsing is always exact) */
    MDT_CHECK(
        check_entries(path, js.top_members - (strstr(hdr, "\"__metadata__\"") != NULL), budget));
    if (budget->json_values + js.values > MDT_ST_MAX_TOTAL_VALUES)
        MDT_CHECK(MDT_FAIL(MDT_E_FORMAT,
                           "%s: %lld JSON values in the header bring the checkpoint to %lld, over "
                           "the limit of %lld over all its shards",
                           path, (long long)js.values, (long long)(budget->json_values + js.values),
                           MDT_ST_MAX_TOTAL_VALUES));
    MDT_CHECK(mdt_json_build(hdr, hlen, path, "header is not valid JSON", 8, " ", &root));
    if (!cJSON_IsObject(root))
        MDT_CHECK(
            MDT_FAIL(MDT_E_FORMAT, "%s: header is not a JSON object (must start with '{')", path));
    int64_t data_size = f->file_size - f->data_start;
    int nitems = cJSON_GetArraySize(root);
    f->entries = mdt_calloc(sizeof(mdt_st_entry) * (size_t)(nitems ? nitems : 1));
    f->strings = mdt_alloc(pool_size(root));
    if (!f->entries || !f->strings)
        MDT_CHECK(MDT_FAIL(MDT_E_NOMEM, "out of memory"));
    const cJSON *item;
    int saw_meta = 0;
    size_t used = 0;
    cJSON_ArrayForEach(item, root) {
        if (strcmp(item->string, "__metadata__") == 0) {
            if (saw_meta++)
                MDT_CHECK(MDT_FAIL(MDT_E_FORMAT, "%s: duplicate __metadata__", path));
            MDT_CHECK(parse_metadata(f, item, &used));
            continue;
        }
        mdt_st_entry *e = &f->entries[f->n];
        e->name = pool_put(f, &used, item->string);
        f->n++;
        MDT_CHECK(parse_entry(f, item, e, data_size));
    }
    MDT_CHECK(check_entries(path, f->n, budget)); /* exact, now that __metadata__ is known */
    qsort(f->entries, (size_t)f->n, sizeof *f->entries, cmp_entry_name);
    char nm[MDT_ESC_NAME];
    for (int i = 1; i < f->n; i++)
        if (strcmp(f->entries[i - 1].name, f->entries[i].name) == 0)
            MDT_CHECK(MDT_FAIL(MDT_E_FORMAT, "%s: tensor '%s' appears twice in the header", path,
                               mdt_escape(f->entries[i].name, nm, sizeof nm)));
    MDT_CHECK(check_tiling(f, data_size));
    budget->header_bytes += (int64_t)hlen;
    budget->entries += f->n;
    budget->json_values += js.values;
fail:
    cJSON_Delete(root);
    mdt_free(hdr);
    return st;
}

void mdt_st_close(mdt_st_file *f) {
    if (!f)
        return;
    if (f->fd >= 0)
        close(f->fd);
    mdt_free(f->strings);
    mdt_free(f->meta_keys);
    mdt_free(f->meta_vals);
    mdt_free(f->entries);
    mdt_free(f->path);
    mdt_free(f);
}

const mdt_st_entry *mdt_st_find(const mdt_st_file *f, const char *name) {
    mdt_st_entry key = {.name = (char *)(uintptr_t)name};
    return bsearch(&key, f->entries, (size_t)f->n, sizeof key, cmp_entry_name);
}

const char *mdt_st_meta(const mdt_st_file *f, const char *key) {
    for (int i = 0; i < f->n_meta; i++)
        if (strcmp(f->meta_keys[i], key) == 0)
            return f->meta_vals[i];
    return NULL;
}

mdt_status mdt_st_read_range(const mdt_st_file *f, const mdt_st_entry *e, int64_t offset,
                             int64_t nbytes, void *dst) {
    char nm[MDT_ESC_NAME], what[MDT_ESC_NAME + 16];
    mdt_escape(e->name, nm, sizeof nm);
    if (offset < 0 || nbytes < 0 || offset + nbytes > e->end - e->begin)
        return MDT_FAIL(MDT_E_INVALID,
                        "%s: tensor '%s': byte range [%lld, %lld) lies outside its %lld bytes",
                        f->path, nm, (long long)offset, (long long)(offset + nbytes),
                        (long long)(e->end - e->begin));
    snprintf(what, sizeof what, "tensor '%s'", nm);
    MDT_TRY(pread_all(f, dst, nbytes, f->data_start + e->begin + offset, f->path, what));
    mdt_counters_get()->bytes_read += nbytes;
    return MDT_OK;
}

mdt_status mdt_st_read_f32(const mdt_st_file *f, const mdt_st_entry *e, int64_t elem_off, int64_t n,
                           float *dst) {
    size_t es = mdt_dtype_size(e->dtype);
    char nm[MDT_ESC_NAME];
    if (!mdt_dtype_is_float(e->dtype))
        return MDT_FAIL(MDT_E_FORMAT, "%s: tensor '%s': dtype %s is not a float type", f->path,
                        mdt_escape(e->name, nm, sizeof nm), mdt_dtype_name(e->dtype));
    if (e->dtype == MDT_F32)
        return mdt_st_read_range(f, e, elem_off * 4, n * 4, dst);
    /* Other dtypes go through a bounded bounce buffer: memory stays O(chunk), not O(tensor). */
    enum { CHUNK = 1 << 16 };
    void *buf = mdt_alloc(CHUNK * es);
    if (!buf)
        return MDT_FAIL(MDT_E_NOMEM, "out of memory");
    mdt_status st = MDT_OK;
    for (int64_t i = 0; i < n && st == MDT_OK; i += CHUNK) {
        int64_t m = n - i < CHUNK ? n - i : CHUNK;
        st = mdt_st_read_range(f, e, (elem_off + i) * (int64_t)es, m * (int64_t)es, buf);
        if (st == MDT_OK)
            st = mdt_convert_to_f32(e->dtype, buf, dst + i, m);
    }
    mdt_free(buf);
    return st;
}

/* ---- writer ---- */
/* The header of n tensors laid out in order (JSON text, free with cJSON_free) and its length
 * padded to 8 bytes, so that the data section starts aligned. */
static mdt_status st_header(int n, const char *const *names, const mdt_tensor *const *tensors,
                            const char *const *meta, char **json, size_t *padded) {
    mdt_status st = MDT_OK;
    *json = NULL;
    cJSON *root = cJSON_CreateObject();
    if (!root)
        return MDT_FAIL(MDT_E_NOMEM, "out of memory");
    if (meta && meta[0]) {
        cJSON *m = cJSON_AddObjectToObject(root, "__metadata__");
        for (int i = 0; m && meta[i] && meta[i + 1]; i += 2)
            cJSON_AddStringToObject(m, meta[i], meta[i + 1]);
    }
    int64_t off = 0;
    for (int i = 0; i < n; i++) {
        const mdt_tensor *t = tensors[i];
        cJSON *e = cJSON_AddObjectToObject(root, names[i]);
        if (!e)
            MDT_CHECK(MDT_FAIL(MDT_E_NOMEM, "out of memory"));
        cJSON_AddStringToObject(e, "dtype", mdt_dtype_name(t->dtype));
        cJSON *sh = cJSON_AddArrayToObject(e, "shape");
        for (int d = 0; d < t->ndim; d++)
            cJSON_AddItemToArray(sh, cJSON_CreateNumber((double)t->shape[d]));
        cJSON *of = cJSON_AddArrayToObject(e, "data_offsets");
        int64_t nb = mdt_tensor_nbytes(t);
        cJSON_AddItemToArray(of, cJSON_CreateNumber((double)off));
        cJSON_AddItemToArray(of, cJSON_CreateNumber((double)(off + nb)));
        off += nb;
    }
    *json = cJSON_PrintUnformatted(root);
    if (!*json)
        MDT_CHECK(MDT_FAIL(MDT_E_NOMEM, "out of memory"));
    *padded = (strlen(*json) + 7) & ~(size_t)7;
fail:
    cJSON_Delete(root);
    return st;
}

static void put_len(unsigned char lenb[8], size_t padded) {
    for (int i = 0; i < 8; i++)
        lenb[i] = (unsigned char)(((uint64_t)padded >> (8 * i)) & 0xffu);
}

mdt_status mdt_st_stage(mdt_out *out, const char *path, int n, const char *const *names,
                        const mdt_tensor *const *tensors, const char *const *meta) {
    mdt_status st = MDT_OK;
    char *json = NULL;
    size_t padded = 0;
    int staged = 0;
    MDT_TRY(st_header(n, names, tensors, meta, &json, &padded));
    const size_t jl = strlen(json);
    /* staged beside the target (a short temporary: a NAME_MAX-byte name works), committed by
     * rename with the mode of a new file (0666 & ~umask), never over a non-regular file */
    MDT_CHECK(mdt_out_begin(out, path));
    staged = 1;
    unsigned char lenb[8];
    put_len(lenb, padded);
    MDT_CHECK(mdt_out_write(out, lenb, 8));
    MDT_CHECK(mdt_out_write(out, json, jl));
    MDT_CHECK(mdt_out_write(out, "        ", padded - jl));
    for (int i = 0; i < n; i++)
        MDT_CHECK(mdt_out_write(out, tensors[i]->data, (size_t)mdt_tensor_nbytes(tensors[i])));
    cJSON_free(json);
    return MDT_OK;
fail:
    if (staged)
        mdt_out_abort(out, 1);
    cJSON_free(json);
    return st;
}

mdt_status mdt_st_serialize(int n, const char *const *names, const mdt_tensor *const *tensors,
                            const char *const *meta, unsigned char **blob, size_t *size) {
    char *json = NULL;
    size_t padded = 0;
    *blob = NULL, *size = 0;
    MDT_TRY(st_header(n, names, tensors, meta, &json, &padded));
    size_t total = 8 + padded;
    for (int i = 0; i < n; i++)
        total += (size_t)mdt_tensor_nbytes(tensors[i]);
    unsigned char *b = mdt_alloc(total);
    if (!b) {
        cJSON_free(json);
        return MDT_FAIL(MDT_E_NOMEM, "out of memory for a %zu-byte safetensors blob", total);
    }
    const size_t jl = strlen(json);
    put_len(b, padded);
    for (size_t i = 0; i < padded; i++) /* the header, then space padding */
        b[8 + i] = i < jl ? (unsigned char)json[i] : ' ';
    size_t off = 8 + padded;
    for (int i = 0; i < n; i++) {
        const size_t nb = (size_t)mdt_tensor_nbytes(tensors[i]);
        if (nb)
            memcpy(b + off, tensors[i]->data, nb);
        off += nb;
    }
    cJSON_free(json);
    *blob = b, *size = total;
    return MDT_OK;
}

mdt_status mdt_st_write(const char *path, int n, const char *const *names,
                        const mdt_tensor *const *tensors, const char *const *meta) {
    mdt_out out;
    MDT_TRY(mdt_st_stage(&out, path, n, names, tensors, meta));
    return mdt_out_commit(&out, 1);
}

/* ---- public whole-file helpers on mdt_tensor_set ---- */
mdt_status mdt_st_read_set(const mdt_st_file *f, mdt_tensor_set **out) {
    mdt_tensor_set *set = NULL;
    mdt_status st;
    *out = NULL;
    MDT_CHECK(mdt_tensor_set_create(&set));
    for (int i = 0; i < f->n; i++) {
        const mdt_st_entry *e = &f->entries[i];
        mdt_tensor *t;
        MDT_CHECK(mdt_tensor_set_add(set, e->name, e->dtype, e->ndim, e->shape, &t));
        MDT_CHECK(mdt_st_read_range(f, e, 0, e->end - e->begin, t->data));
    }
    *out = set;
    return MDT_OK;
fail:
    mdt_tensor_set_free(set);
    return st;
}

mdt_status mdt_tensor_set_load(const char *path, mdt_tensor_set **out) {
    mdt_st_file *f = NULL;
    *out = NULL;
    MDT_TRY(mdt_st_open(path, &f));
    const mdt_status st = mdt_st_read_set(f, out);
    mdt_st_close(f);
    return st;
}

/* The set as parallel arrays of names and tensors (borrowed), then `fn` on them: the one
 * flattening the file stager and the in-memory serializer share. */
typedef struct set_sink {
    mdt_out *o;
    const char *path;
    const char *const *meta;
    unsigned char **blob;
    size_t *size;
} set_sink;

static mdt_status set_write(const mdt_tensor_set *set, const set_sink *k) {
    const int n = set ? mdt_tensor_set_count(set) : 0;
    const char **names = mdt_alloc(sizeof(char *) * (size_t)(n ? n : 1));
    const mdt_tensor **ts = mdt_alloc(sizeof(mdt_tensor *) * (size_t)(n ? n : 1));
    mdt_status st = MDT_OK;
    if (!names || !ts)
        st = MDT_FAIL(MDT_E_NOMEM, "out of memory");
    for (int i = 0; st == MDT_OK && i < n; i++)
        ts[i] = mdt_tensor_set_at(set, i, &names[i]);
    if (st == MDT_OK)
        st = k->o ? mdt_st_stage(k->o, k->path, n, names, ts, k->meta)
                  : mdt_st_serialize(n, names, ts, k->meta, k->blob, k->size);
    mdt_free(names);
    mdt_free((void *)ts);
    return st;
}

mdt_status mdt_tensor_set_stage(mdt_out *o, const mdt_tensor_set *set, const char *path) {
    const set_sink k = {.o = o, .path = path};
    return set_write(set, &k);
}

mdt_status mdt_tensor_set_serialize(const mdt_tensor_set *set, const char *const *meta,
                                    unsigned char **blob, size_t *size) {
    const set_sink k = {.meta = meta, .blob = blob, .size = size};
    return set_write(set, &k);
}

mdt_status mdt_tensor_set_save(const mdt_tensor_set *set, const char *path) {
    mdt_out o;
    MDT_TRY(mdt_tensor_set_stage(&o, set, path));
    return mdt_out_commit(&o, 1);
}
