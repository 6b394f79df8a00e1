/*
 * safetensors.h — validated safetensors reader (header index + ranged reads) and atomic writer.
 *
 * The reader checks everything the format promises before any tensor byte is used: 8-byte
 * little-endian header length, header <= 100 MB, a JSON object, known dtypes, shapes, offsets
 * inside the data section that tile it exactly (no overlap, no hole, nothing past the end),
 * byte size = product(shape) x element size, `__metadata__` with string values only.
 * Reads are pread()s of any byte range of one tensor, so a rank can read just its shard.
 * No MPI, no model knowledge here.
 */
#ifndef MDT_SAFETENSORS_H
#define MDT_SAFETENSORS_H

#include "core/outfile.h"
#include "tensor/tensor.h"

/* What opening files may cost, checked on the 8-byte length and on a count over the raw header
 * before any parse tree is built (json.h), so that memory and time stay bounded however hostile
 * the file: per file, the format's 100 MB header, 65,536 tensors (real DiT checkpoints have about
 * 1,000; the largest published models fewer than 100,000 over all their shards) and 2^20 JSON
 * values (MDT_JSON_MAX_VALUES); per checkpoint (mdt_st_budget), over all its shards, 128 MiB of
 * headers, 262,144 tensors and 2^22 JSON values (15 per tensor at most). docs/errors.md states
 * the resulting bound on memory and time. */
#define MDT_ST_MAX_HEADER 100000000LL
#define MDT_ST_MAX_ENTRIES 65536
#define MDT_ST_MAX_TOTAL_HEADER (128LL << 20)
#define MDT_ST_MAX_TOTAL_ENTRIES 262144
#define MDT_ST_MAX_TOTAL_VALUES (1LL << 22)

typedef struct mdt_st_entry {
    char *name; /* in the file's string block */
    mdt_dtype dtype;
    int ndim;
    int64_t shape[MDT_MAX_DIMS];
    int64_t begin, end; /* byte offsets relative to the data section */
} mdt_st_entry;

typedef struct mdt_st_file {
    char *path; /* as messages show it: escaped (mdt_escape), so never used to open a file */
    int fd;     /* -1 for a blob in memory */
    const unsigned char *mem; /* the blob (mdt_st_open_mem), borrowed; NULL for a file */
    int64_t file_size;
    int64_t data_start; /* 8 + header length */
    int n;
    mdt_st_entry *entries; /* sorted by name */
    int n_meta;
    char **meta_keys, **meta_vals;
    char *strings; /* one block holding every entry name and metadata string */
} mdt_st_file;

/* Opens and validates `path`. Errors name the file, the tensor and the problem:
 * MDT_E_IO (cannot open/read), MDT_E_FORMAT (anything malformed). */
mdt_status mdt_st_open(const char *path, mdt_st_file **out);
/* What the files opened so far with one budget hold: a checkpoint opens its shards with one
 * budget, and a shard over what is left of MDT_ST_MAX_TOTAL_* fails before its header is parsed
 * (MDT_E_FORMAT, naming the file and the limit). Zero-initialise it. */
typedef struct mdt_st_budget {
    int64_t header_bytes, entries, json_values;
} mdt_st_budget;
mdt_status mdt_st_open_budget(const char *path, mdt_st_budget *budget, mdt_st_file **out);
/* The same on an open descriptor (taken over: closed by mdt_st_close or on failure); `path`
 * names it in messages. */
mdt_status mdt_st_open_fd(int fd, const char *path, mdt_st_file **out);
mdt_status mdt_st_open_fd_budget(int fd, const char *path, mdt_st_budget *budget,
                                 mdt_st_file **out);
/* The same validation and limits on a blob in memory (a request of `meshdit serve`), borrowed:
 * it must outlive the handle. `name` names it in messages. Reads copy out of the blob. */
mdt_status mdt_st_open_mem(const void *data, size_t size, const char *name, mdt_st_file **out);
void mdt_st_close(mdt_st_file *f);
/* Entry called `name`, or NULL. */
const mdt_st_entry *mdt_st_find(const mdt_st_file *f, const char *name);
/* Value of __metadata__[key], or NULL. */
const char *mdt_st_meta(const mdt_st_file *f, const char *key);

/* Reads `nbytes` bytes starting `offset` bytes into tensor `e` into dst. The range must lie inside
 * the tensor. MDT_E_IO on a short read (file changed or truncated after open). */
mdt_status mdt_st_read_range(const mdt_st_file *f, const mdt_st_entry *e, int64_t offset,
                             int64_t nbytes, void *dst);
/* Reads elements [elem_off, elem_off + n) of float tensor `e` and converts them to f32 into dst.
 * Reads through a bounded buffer for non-f32 dtypes (never the whole tensor at once). */
mdt_status mdt_st_read_f32(const mdt_st_file *f, const mdt_st_entry *e, int64_t elem_off, int64_t n,
                           float *dst);

/* Writes tensors atomically through core/outfile.h (a short temporary in the same directory,
 * fsync, rename, mode 0666 & ~umask, never over a non-regular file). `meta` is an optional
 * NULL-terminated list of key, value, key, value, ... strings. */
mdt_status mdt_st_write(const char *path, int n, const char *const *names,
                        const mdt_tensor *const *tensors, const char *const *meta);
/* The same, staged only: *o holds the written temporary; the caller commits it (with others:
 * mdt_out_commit) or aborts it. On failure nothing is left staged. */
mdt_status mdt_st_stage(mdt_out *o, const char *path, int n, const char *const *names,
                        const mdt_tensor *const *tensors, const char *const *meta);
/* The same bytes as mdt_st_write, into one block of memory: *blob (mdt_free it) of *size bytes. */
mdt_status mdt_st_serialize(int n, const char *const *names, const mdt_tensor *const *tensors,
                            const char *const *meta, unsigned char **blob, size_t *size);
/* Every tensor of an open file, in its stored dtype, into a new set (*out; the caller frees). */
mdt_status mdt_st_read_set(const mdt_st_file *f, mdt_tensor_set **out);
/* mdt_tensor_set_save, staged only (as mdt_st_stage). */
mdt_status mdt_tensor_set_stage(mdt_out *o, const mdt_tensor_set *set, const char *path);
/* The whole set (NULL: none) as one safetensors blob with `meta` as __metadata__, as
 * mdt_st_serialize. */
mdt_status mdt_tensor_set_serialize(const mdt_tensor_set *set, const char *const *meta,
                                    unsigned char **blob, size_t *size);

#endif /* MDT_SAFETENSORS_H */
