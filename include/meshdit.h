/*
 * meshdit.h — the public API of meshdit, a C runtime for running one diffusion transformer
 * (DiT) across many ranks with tensor and context parallelism.
 *
 * What is here: status codes and the thread-local error message, tensors and named tensor sets
 * (the inputs/outputs of a forward), model load / forward / free.
 * What is not: MPI (the command owns MPI_Init/Finalize), kernel and file-format internals.
 *
 * Conventions: every fallible call returns mdt_status (MDT_OK = 0, negative on error) and sets a
 * thread-local message (mdt_last_error()). The creator frees; every _free(NULL) is a no-op.
 */
#ifndef MESHDIT_H
#define MESHDIT_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define MDT_VERSION_MAJOR 0
#define MDT_VERSION_MINOR 1
#define MDT_VERSION_PATCH 0

typedef enum mdt_status {
    MDT_OK = 0,
    MDT_E_INVALID = -1,     /* bad argument, shape or layout */
    MDT_E_IO = -2,          /* open/read/write failed */
    MDT_E_FORMAT = -3,      /* malformed file (safetensors, JSON, index) */
    MDT_E_NOMEM = -4,       /* allocation failed or over the allowed memory */
    MDT_E_MPI = -5,         /* a collective or communicator call failed */
    MDT_E_UNSUPPORTED = -6, /* valid request this build or model does not implement */
    MDT_E_NOTFOUND = -7,    /* a named tensor, file or key is missing */
    MDT_E_NUMERIC = -8,     /* a computation produced NaN or Inf from finite inputs */
} mdt_status;

/* Static name of a status code ("MDT_E_FORMAT"). */
const char *mdt_status_str(mdt_status s);
/* Message of the last failure on this thread ("" if none). Valid until the next failure. */
const char *mdt_last_error(void);
/* "file.c:123" of the last failure on this thread. */
const char *mdt_last_error_where(void);

typedef enum mdt_dtype {
    MDT_F32 = 0,
    MDT_F16,
    MDT_BF16,
    MDT_F64,
    MDT_I64,
    MDT_I32,
    MDT_I16,
    MDT_I8,
    MDT_U8,
    MDT_BOOL,
    MDT_DTYPE_COUNT
} mdt_dtype;

#define MDT_MAX_DIMS 8

/* A dense row-major tensor view. It does not own `data` unless it lives in an mdt_tensor_set. */
typedef struct mdt_tensor {
    mdt_dtype dtype;
    int ndim;
    int64_t shape[MDT_MAX_DIMS];
    void *data;
} mdt_tensor;

/* Number of elements (1 for a scalar, 0 if any dimension is 0). */
int64_t mdt_tensor_numel(const mdt_tensor *t);
/* Bytes of the data: numel x element size. */
int64_t mdt_tensor_nbytes(const mdt_tensor *t);

/* An owning list of named tensors: the inputs and outputs of a forward, the contents of a
 * safetensors file read whole. Names are unique. */
typedef struct mdt_tensor_set mdt_tensor_set;

mdt_status mdt_tensor_set_create(mdt_tensor_set **out);
void mdt_tensor_set_free(mdt_tensor_set *set);
/* Adds a tensor named `name` with the given dtype/shape and zeroed data owned by the set;
 * `*out` (optional) receives a view valid until the set is freed. Fails on a duplicate name. */
mdt_status mdt_tensor_set_add(mdt_tensor_set *set, const char *name, mdt_dtype dtype, int ndim,
                              const int64_t *shape, mdt_tensor **out);
/* Borrowed view of the tensor called `name`, or NULL. */
mdt_tensor *mdt_tensor_set_get(const mdt_tensor_set *set, const char *name);
int mdt_tensor_set_count(const mdt_tensor_set *set);
/* i-th tensor in insertion order (0 <= i < count); `*name` receives its name. */
mdt_tensor *mdt_tensor_set_at(const mdt_tensor_set *set, int i, const char **name);

/* Reads a whole safetensors file (every tensor, in its stored dtype). */
mdt_status mdt_tensor_set_load(const char *path, mdt_tensor_set **out);
/* Writes a safetensors file atomically: a temporary file in the same directory, fsync, rename.
 * A failed write leaves no file at `path` (and an old file there untouched). */
mdt_status mdt_tensor_set_save(const mdt_tensor_set *set, const char *path);

/* The device mesh: world = tp x ring x ulysses ranks over MPI_COMM_WORLD (MPI must be
 * initialised by the caller). `order` is a permutation of "tp,ring,ulysses", outermost first
 * (NULL = that default: Ulysses groups on contiguous ranks). Collective; the same verdict on
 * every rank. MDT_E_INVALID if tp x ring x ulysses differs from the world size. */
typedef struct mdt_mesh mdt_mesh;
mdt_status mdt_mesh_create_world(int tp, int ring, int ulysses, const char *order, mdt_mesh **out);
void mdt_mesh_free(mdt_mesh *m);
int mdt_mesh_rank(const mdt_mesh *m); /* world rank (0 for NULL) */
int mdt_mesh_size(const mdt_mesh *m); /* world size (1 for NULL) */

/* A loaded model (weights resident on this rank, ready for forward). */
typedef struct mdt_model mdt_model;

typedef struct mdt_load_params {
    const char *checkpoint_dir; /* diffusers layout: config.json + safetensors (+ index.json) */
    mdt_mesh *mesh;             /* borrowed; NULL = single rank. Weights are read shard-on-read */
    int64_t max_weight_bytes;   /* > 0: refuse (MDT_E_NOMEM, before reading) a layout whose
                                   per-rank f32 weights exceed it */
} mdt_load_params;

mdt_load_params mdt_load_params_default(void);

/* Loads config and weights: with a mesh, each rank reads from disk only the bytes of its TP
 * shards (converted to f32 after slicing). Collective over the mesh; every rank returns the same
 * status (a failing rank's message is reported by all). Errors: MDT_E_IO, MDT_E_FORMAT (malformed
 * checkpoint), MDT_E_NOTFOUND (missing tensor/shard), MDT_E_INVALID (shape mismatch, bad config,
 * layout the model cannot take), MDT_E_UNSUPPORTED (unknown model family, or a parallel axis this
 * build does not implement yet -- never run silently on fewer axes). */
mdt_status mdt_model_load(const mdt_load_params *p, mdt_model **out);
/* In-memory path: a model loaded whole (mesh NULL, every rank holding every weight) is sharded
 * for `mesh`: the state of TP coordinate 0 is broadcast so ranks agree, each rank keeps its
 * slices and frees the rest. Fails on a model that was loaded sharded (parallelism was already
 * applied at load time). Collective. */
mdt_status mdt_model_parallelize(mdt_model *m, mdt_mesh *mesh);
/* Gathers the TP shards back into full tensors and writes an ordinary single-file checkpoint
 * (config.json + diffusion_pytorch_model.safetensors, in each tensor's stored dtype) to `dir` on
 * world rank 0. Collective. */
mdt_status mdt_model_gather(mdt_model *m, const char *dir);
void mdt_model_free(mdt_model *m);

/* Runs one forward. `inputs` uses the reference implementation's argument names (e.g. Flux:
 * hidden_states, encoder_hidden_states, pooled_projections, timestep, img_ids, txt_ids[,
 * guidance]). Adds the outputs (Flux: "sample") to `outputs` (created by the caller). Errors:
 * MDT_E_INVALID naming the tensor and the expectation for a bad input. */
mdt_status mdt_model_forward(mdt_model *m, const mdt_tensor_set *inputs, mdt_tensor_set *outputs);

/* Model family name ("flux"). */
const char *mdt_model_family(const mdt_model *m);

#ifdef __cplusplus
}
#endif
#endif /* MESHDIT_H */
