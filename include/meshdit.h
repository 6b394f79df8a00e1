/*
 * meshdit.h — the public API of meshdit, a C runtime for running one diffusion transformer
 * (DiT) across many ranks with tensor and context parallelism.
 *
 * What is here: status codes and the thread-local error message, tensors and named tensor sets
 * (the inputs/outputs of a forward), the device mesh and device selection, model load / forward /
 * sample / free, run statistics and the run report, describe-only model views (inspect, random
 * inputs, layout planning), random-weight checkpoints, tensor comparison, atomic output files.
 * What is not: MPI (the caller owns MPI_Init/Finalize), kernel and file-format internals.
 * A typical client (docs/api.md): mdt_mesh_create_world, mdt_device_select, mdt_model_load once,
 * then mdt_sample or mdt_model_forward per request, mdt_run_stats_* / mdt_run_report_json,
 * mdt_model_free, mdt_mesh_free.
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
    MDT_E_STOPPED = -9,     /* a stop was asked (SIGTERM to a server) while the work ran */
} mdt_status;

/* Static name of a status code ("MDT_E_FORMAT"). */
const char *mdt_status_str(mdt_status s);
/* Message of the last failure on this thread ("" if none). Valid until the next failure. */
const char *mdt_last_error(void);
/* "file.c:123" of the last failure on this thread. */
const char *mdt_last_error_where(void);
/* Records a printf-style message as this thread's last error and returns `code`: for a status
 * that a client's callback hands back to the library (e.g. a test hook). */
mdt_status mdt_error_set(mdt_status code, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
/* A message line as it may be printed: control bytes, malformed UTF-8 and the code points
 * terminals act on (C1, line separators, bidirectional overrides) as \xNN, so a value echoed
 * in it (a command-line argument) cannot split the line or drive the terminal. Backslashes are
 * kept, so a message whose names the library escaped already is unchanged. Fits `n` bytes (n >=
 * 8; a longer rendering ends in "..."); returns buf. */
const char *mdt_escape_line(const char *s, char *buf, size_t n);

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

/* A layout: world = cfg x tp x ring x ulysses ranks. cfg (1 or 2) runs the two branches of a
 * step's classifier-free guidance at once (or the two halves of its batch), each cfg group on a
 * tp x ring x ulysses layout of its own; `order` is a permutation of "cfg,tp,ring,ulysses"
 * (cfg may be left out: then it is outermost), outermost first (NULL = "cfg,tp,ring,ulysses":
 * Ulysses groups on contiguous ranks, the cfg groups on the two halves of the world). */
typedef struct mdt_layout {
    int cfg, tp, ring, ulysses;
    const char *order;
} mdt_layout;
/* A rank's coordinates in a layout. */
typedef struct mdt_coords {
    int cfg, tp, ring, ulysses;
} mdt_coords;

/* The device mesh of `l` over MPI_COMM_WORLD (MPI must be initialised by the caller).
 * Collective; the same verdict on every rank. MDT_E_INVALID if the degrees' product differs
 * from the world size, a degree is < 1 or cfg > 2. */
typedef struct mdt_mesh mdt_mesh;
mdt_status mdt_mesh_create_world(const mdt_layout *l, mdt_mesh **out);
void mdt_mesh_free(mdt_mesh *m);
int mdt_mesh_rank(const mdt_mesh *m); /* world rank (0 for NULL) */
int mdt_mesh_size(const mdt_mesh *m); /* world size (1 for NULL) */
/* Collective agreement on a status: every rank passes its own and every rank returns MDT_OK
 * only if all passed MDT_OK; otherwise the failure (and the message of the lowest failing rank)
 * on every rank. NULL mesh: returns `local`. */
mdt_status mdt_mesh_agree(mdt_mesh *m, mdt_status local);
/* The same before any mesh exists (process set-up): over MPI_COMM_WORLD, blocking and unwatched;
 * `local` itself when MPI is not initialised or the world is one rank. */
mdt_status mdt_world_agree(mdt_status local);
/* 1 when a failure could not be agreed on (this rank failed inside a step while its peers wait in
 * a collective): the caller must end the whole job (MPI_Abort), after printing the message. */
int mdt_mesh_peers_stuck(const mdt_mesh *m);
/* Watches every later collective wait and agreement of `m` as the step watchdog does (0: wait as
 * long as it takes): a rank that does not arrive within `seconds` ends the wait with one line
 * naming it ("step watchdog: rank K did not reach the failure agreement within S s ...; OPTION
 * sets the bound") and mdt_mesh_peers_stuck set. `option` names the bound in that line
 * ("--load-timeout"; NULL: "--step-timeout"). NULL mesh: a no-op. */
void mdt_mesh_watch(mdt_mesh *m, double seconds, const char *option);
/* Coordinates of world rank `rank` in the mesh of `l`, without creating it. Not collective.
 * MDT_E_INVALID naming the bad axis for a malformed order. */
mdt_status mdt_mesh_coords_of(const mdt_layout *l, int rank, mdt_coords *out);

/* ---- process set-up and devices (the caller owns MPI) ---- */

/* Prefixes this process's log lines with its world rank (call once after MPI_Init, world > 1). */
void mdt_set_log_rank(int world_rank);
/* Picks the CPU kernel set (`isa`: a name of MESHDIT_CPU_ISA) and the CPU GEMM path (`gemm`: a
 * name of MESHDIT_CPU_GEMM); NULL or "" leaves either to its default. Local, before any work.
 * MDT_E_UNSUPPORTED/MDT_E_INVALID naming the choice this CPU cannot run. */
mdt_status mdt_cpu_kernels_select(const char *isa, const char *gemm);
/* "512M", "8G", "1.5GiB", "1048576" -> bytes (binary units); -1 if malformed. */
int64_t mdt_size_parse(const char *s);
/* Selects the compute backend on every rank of `mesh`: `device` "cpu" or "cuda" (the GPU of the
 * rank's node-local index modulo the GPUs), `dtype` "f32" or "bf16" (compute with bf16 weights),
 * `comm` "auto", "mpi" or "nccl" (device collectives: NCCL communicators per mesh group; auto uses
 * them when every rank has a GPU of its own). Collective over MPI_COMM_WORLD even with a NULL
 * mesh (it finds the node-local ranks); same verdict everywhere. Call before mdt_model_load. */
mdt_status mdt_device_select(mdt_mesh *mesh, const char *device, const char *dtype,
                             const char *comm);

/* The compute backend in force on this rank (after mdt_device_select). */
typedef struct mdt_device_info {
    const char *backend;     /* "cpu", "cuda" */
    int gpu;                 /* 1 on a device backend */
    char description[256];   /* the GPU in words (gpu only) */
    int bf16;                /* compute with bf16 weights */
    int bf16_operands;       /* CPU bf16: bf16 x bf16 GEMM operands (else widened to f32) */
    const char *bf16_why;    /* CPU bf16: which of the two and why (measured at the start) */
    const char *cpu_kernels; /* the CPU kernel set ("avx2") */
    char cpu_gemm[96];       /* the CPU GEMM path in words */
    int64_t scratch_bytes;   /* CPU bf16: operand or widening scratch */
    int64_t device_mem_peak; /* gpu: most device bytes allocated at once */
} mdt_device_info;
void mdt_device_info_get(mdt_device_info *out);

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

/* Runs one forward, guarded, watched and agreed — the one forward `run`, `serve` and the
 * sampler share. `inputs` uses the reference implementation's argument names (e.g. Flux:
 * hidden_states, encoder_hidden_states, pooled_projections, timestep, img_ids, txt_ids[,
 * guidance]). Adds the outputs (Flux: "sample") to `outputs` (created by the caller). Guarded:
 * every stage's rows and every output are checked finite (MDT_E_NUMERIC naming the first stage
 * that went non-finite, or the output and element; no NaN is ever handed back). Watched: a rank
 * that does not reach one of the forward's collectives within the step timeout
 * (mdt_model_set_step_timeout) ends the job with one line naming it. Agreed: every rank returns
 * the same status, from one agreement at the end, except when mdt_mesh_peers_stuck is set (then
 * the caller must end the job). Errors: MDT_E_INVALID naming the tensor and the expectation for a
 * bad input. Collective over the model's mesh. */
mdt_status mdt_model_forward(mdt_model *m, const mdt_tensor_set *inputs, mdt_tensor_set *outputs);
/* What a cfg group that has no forward to run calls while the other group runs one
 * (mdt_model_forward there): it joins that forward's agreement, under the watchdog, with its own
 * status `local`; the same status as the forward's ranks. Collective over the model's mesh. */
mdt_status mdt_model_sit_out(mdt_model *m, mdt_status local);
/* The step watchdog's bound for the forwards of `m`, in seconds; 0 (the default): 10 x the
 * longest forward so far, at least 60 s. Local (set it to the same value on every rank). */
void mdt_model_set_step_timeout(mdt_model *m, double seconds);

/* Model family name ("flux"). */
const char *mdt_model_family(const mdt_model *m);

/* One weight tensor of a model's table, shape [d0] or [d0, d1]. */
typedef struct mdt_weight_info {
    const char *name;       /* checkpoint name; borrowed from the model */
    const char *tp_style;   /* "colwise", "rowwise", "replicated", ... */
    int ndim;               /* 1 or 2 */
    int64_t shape[2];       /* full shape */
    int64_t local_shape[2]; /* this rank's shard (loaded model) or the shard under the asked tp */
    const char *stored;     /* dtype in the checkpoint ("BF16"), "MISSING", or "-" if unknown */
    int64_t bytes_read;     /* loaded model: checkpoint bytes this rank read for it; else 0 */
} mdt_weight_info;

/* Accessors of a loaded model on this rank (not collective). */
int mdt_model_weight_count(const mdt_model *m);
/* The i-th weight (0 <= i < count) with this rank's local shape and bytes read. */
mdt_status mdt_model_weight(const mdt_model *m, int i, mdt_weight_info *out);
/* The layout the model runs under (1 x 1 x 1 without a mesh). */
void mdt_model_layout(const mdt_model *m, int *tp, int *ring, int *ulysses);
int64_t mdt_model_weight_bytes(const mdt_model *m); /* resident weight bytes on this rank */
int64_t mdt_model_bytes_read(const mdt_model *m);   /* checkpoint bytes this rank read */

/* ---- LoRA adapters (docs/lora.md) ---- */

/* Reads the LoRA adapter in the safetensors file `path` under `name` (1..63 characters, unique
 * among the model's adapters), in diffusers/peft form: `[transformer.|base_model.model.]MODULE.
 * lora_A.weight` and `.lora_B.weight` (or `lora_down` / `lora_up`), optional `MODULE.alpha` or
 * diffusers' `lora_adapter_metadata` (lora_alpha, alpha_pattern, rank_pattern, use_rslora),
 * optional `lora_B.bias`, with MODULE.weight a linear weight of the checkpoint (a Conv3d kept as
 * a linear takes peft's conv factors). Each rank maps every key, checks every shape and reads only
 * its slices of the factors (cut as the weight is). Nothing is applied yet: see
 * mdt_model_set_adapters. Collective; every rank returns the same status. Errors: MDT_E_NOTFOUND
 * / MDT_E_IO / MDT_E_FORMAT (the file), MDT_E_INVALID (keys that map to no weight of the model,
 * all listed in one message; a module with one factor; a factor whose shape does not fit, naming
 * the tensor and both shapes; a name in use), MDT_E_UNSUPPORTED (an adapter kind other than LoRA,
 * named: DoRA, LoKr, LoHa, OFT, weight differences; a LoRA on a norm or another non-linear). */
mdt_status mdt_model_lora_load(mdt_model *m, const char *name, const char *path);
/* The same from a safetensors blob in memory (a server request), `shown` naming it. */
mdt_status mdt_model_lora_load_mem(mdt_model *m, const char *name, const void *data, size_t size,
                                   const char *shown);
/* Makes the resident weights W0 + sum_i weights[i] s_i B_i A_i over the `n` named adapters
 * (diffusers' set_adapters(names, weights) then fuse_lora; s_i the adapter's per-module scale),
 * shard by shard without communication: computed in fp32 from the base weights W0 and rounded
 * once to the resident dtype (f32, or bf16 under --dtype bf16; on a device the fused shard is
 * uploaded by the load's own path). n = 0 brings every base weight back bit for bit (unfuse);
 * so does an adapter at weight 0 for the tensors only it touches. Collective; every rank returns
 * the same status, and after a failure every rank holds the base weights. MDT_E_NOTFOUND for a
 * name not loaded, MDT_E_INVALID for a name given twice or a non-finite weight. */
mdt_status mdt_model_set_adapters(mdt_model *m, int n, const char *const *names,
                                  const double *weights);
/* Unloads adapter `name` (NULL: every adapter), first taking it out of the fused weights (the
 * other active adapters stay fused). Collective. MDT_E_NOTFOUND for a name not loaded. */
mdt_status mdt_model_lora_unload(mdt_model *m, const char *name);
/* Where mdt_model_set_adapters takes the base weights back from: re-read from the checkpoint
 * (the rank's own bytes, shard-on-read; the default: no memory, refused if a shard file changed
 * since the load) or a copy of each touched shard kept at its first fuse (its resident bytes
 * again: faster, costs those bytes). Local; MDT_E_INVALID while any adapter is fused. */
typedef enum mdt_lora_base { MDT_LORA_BASE_REREAD = 0, MDT_LORA_BASE_COPY = 1 } mdt_lora_base;
mdt_status mdt_model_set_lora_base(mdt_model *m, mdt_lora_base how);

/* One loaded adapter on this rank. */
typedef struct mdt_lora_info {
    const char *name, *source; /* borrowed from the model */
    int targets;               /* linear weights it adapts */
    int64_t rank_min, rank_max;
    int active;         /* in the fused set */
    double weight;      /* its weight there */
    int64_t bytes;      /* host bytes of this rank's factor slices */
    int64_t bytes_read; /* adapter bytes this rank read */
} mdt_lora_info;
int mdt_model_lora_count(const mdt_model *m);
mdt_status mdt_model_lora_info(const mdt_model *m, int i, mdt_lora_info *out);
/* What the last mdt_model_set_adapters cost on this rank: seconds fusing (the factor products
 * and the rounding), seconds bringing base weights back, checkpoint bytes re-read for them, and
 * host bytes of kept copies (MDT_LORA_BASE_COPY). */
void mdt_model_lora_costs(const mdt_model *m, double *fuse_s, double *base_s, int64_t *reread_bytes,
                          int64_t *copy_bytes);

/* Random inputs of a model's family (the `meshdit inputs` command); a family reads the fields
 * it understands. */
typedef struct mdt_random_inputs {
    uint64_t seed;
    int64_t batch;
    int64_t img_tokens, txt_tokens;
    double timestep, guidance;
    int64_t audio_tokens; /* MiniMax-H3 */
    int negative;         /* also the unconditional branch's negative_NAME inputs (guidance) */
} mdt_random_inputs;
/* Adds the family's inputs, drawn from p->seed, to `out` (created by the caller). Local. */
mdt_status mdt_model_make_inputs(const mdt_model *m, const mdt_random_inputs *p,
                                 mdt_tensor_set *out);

/* ---- sampling, run statistics and the report ---- */

typedef struct mdt_sample_params {
    int steps;           /* > 0: the Euler flow-matching sampler over `steps` steps;
                            0: `repeat` forwards of the same inputs (a benchmark) */
    int repeat;          /* forwards when steps = 0 (>= 1) */
    double step_timeout; /* the step watchdog, seconds; 0: 10 x the longest step so far, >= 60 */
    /* > 0: classifier-free guidance at this scale, with the unconditional branch's inputs in
     * the inputs as negative_NAME (docs/models.md): each step combines the two branches'
     * predictions by the family's formula; with cfg 2 each cfg group runs one branch */
    double guidance_scale;
    /* a step cache for the run (docs/cache.md): "first_block[:threshold=X]", as diffusers'
     * FirstBlockCacheConfig; NULL or "none": every block of every step */
    const char *cache;
    /* optional, on every rank after each step or forward (1-based), with its seconds */
    void (*on_step)(void *user, int step, int nsteps, double seconds);
    void *user;
} mdt_sample_params;
mdt_sample_params mdt_sample_params_default(void);
/* Checks a step cache's spec (mdt_sample_params.cache): MDT_E_INVALID naming the unknown cache,
 * key or bad value; *enabled 1 when it turns a cache on. */
mdt_status mdt_cache_spec_check(const char *spec,
                                int *enabled); /* steps 0, repeat 1, no timeout, no callback */

/* What the last mdt_sample did: per-rank facts (on world rank 0: every rank's; elsewhere only
 * this rank's) and the step times. Opaque; mdt_run_stats_free frees it. */
typedef struct mdt_run_stats mdt_run_stats;

/* Runs the model: with p->steps > 0, the Euler flow-matching sampler: for i = 0..N-1, sigma_i =
 * 1 - i/N, the family's timestep input (Flux: "timestep") set to sigma_i, one forward, then the
 * latent input (Flux: "hidden_states") x <- x + (sigma_{i+1} - sigma_i) v with v the forward's
 * output; the result is the final latent under the output name (Flux: "sample"). They are the
 * sampler's state, converted to F32 once (the latent from any float dtype, the timestep from any
 * number dtype: its values are overwritten, a per-token timestep's zeros kept) and overwritten
 * (the latent ends as the result, in F32).
 * With steps = 0, `repeat` forwards; the result is the last one's outputs. `outputs` (created by
 * the caller, empty) receives the result. Every output is checked finite (MDT_E_NUMERIC naming
 * the tensor and element otherwise; a latent that goes non-finite is named with its step). With
 * `stats` (optional; every rank passes one or none: gathering them is collective), *stats
 * receives the run statistics (gathered to world rank 0).
 * Collective over the model's mesh; every rank returns the same status, except when
 * mdt_mesh_peers_stuck is set afterwards (then the caller must end the job). */
mdt_status mdt_sample(mdt_model *m, mdt_tensor_set *inputs, const mdt_sample_params *p,
                      mdt_tensor_set *outputs, mdt_run_stats **stats);
void mdt_run_stats_free(mdt_run_stats *s);

/* What one rank did in the last step (or forward) of a run. */
typedef struct mdt_rank_stats {
    int rank, cfg, tp, ring, ulysses, cp_index; /* world rank, mesh coordinates, CP chunk */
    int node_rank, node_size; /* rank among the ranks sharing its host's memory (picks the GPU) */
    int64_t heads_local;      /* attention heads on this rank's TP shard */
    int64_t weight_bytes, peak_bytes, max_rss_kib, bytes_read;
    double flops_linear, flops_attn, flops_other;
    double seconds_linear, seconds_attn, seconds_other; /* in those kernels (CPU: host wall time;
                                                           a GPU: the launches only) */
    int64_t attn_calls, attn_query_rows, attn_kv_rows;  /* rows x heads */
    int64_t bytes_tp, bytes_ring, bytes_ulysses, bytes_cfg, bytes_cp; /* sent per mesh group */
    double ring_compute_s, ring_wait_s, prep_s;
    int64_t world_collectives; /* over the whole world in the step (agreements, barriers): 1 */
} mdt_rank_stats;

int mdt_run_stats_steps(const mdt_run_stats *s);           /* steps or forwards run */
int mdt_run_stats_sampled(const mdt_run_stats *s);         /* 1 if the sampler ran */
double mdt_run_stats_step_seconds(const mdt_run_stats *s); /* median seconds per step */
int mdt_run_stats_rank_count(const mdt_run_stats *s);      /* world on rank 0, else 1 */
/* The run's step cache (mdt_sample_params.cache): the forwards it saw (0: no cache), and
 * whether forward i skipped its remaining blocks (1), computed them (0), or -1 out of range. */
int64_t mdt_run_stats_cache_forwards(const mdt_run_stats *s);
int mdt_run_stats_cache_skipped(const mdt_run_stats *s, int64_t i);
/* The i-th rank's facts (0 <= i < rank_count), or NULL. */
const mdt_rank_stats *mdt_run_stats_rank(const mdt_run_stats *s, int i);
/* The run report as JSON text (free() it): model, world, layout and mesh order, device, weights
 * dtype, CPU kernels and GEMM path, `load_seconds` (as the caller measured the load), step times
 * and every rank's facts, plus on world rank 0 each tensor's style, local shape and bytes read.
 * Local; call on world rank 0 for every rank's facts. */
mdt_status mdt_run_report_json(const mdt_model *m, const mdt_run_stats *s, double load_seconds,
                               char **json);

/* ---- the resident server (docs/serve.md) ---- */

typedef struct mdt_serve_listener mdt_serve_listener;

typedef struct mdt_serve_params {
    const char
        *endpoint;    /* "ipc://PATH" or "tcp://HOST:PORT"; NULL: ipc:///tmp/meshdit-UID-PID.sock */
    int listen_any;   /* allow a tcp host that is not loopback (no authentication!) */
    int max_sessions; /* sessions open at once (default 4) */
    int64_t max_session_bytes; /* bytes kept over all sessions (default 1 GiB) */
    double session_idle;       /* seconds a session may go unused before it is dropped
                                  (default 300; 0: never) */
    int64_t max_request_bytes; /* a larger request is refused as it arrives (default 2 GiB) */
    int64_t max_queue_bytes;   /* requests rank 0 holds at once, received or being received, over
                                  all clients (0: twice max_request_bytes) */
    double step_timeout;       /* the step watchdog (mdt_sample_params), 0: its default */
    int64_t max_memory;        /* > 0: a forward whose weights plus activations per rank would
                                  exceed it gets an error reply before it runs (--max-memory);
                                  0: the same check against what the process may use, as run's
                                  default, measured when the server starts */
    const char *mem_available; /* with max_memory 0: a size that replaces the system's figure
                                  (MESHDIT_MEM_AVAILABLE), or NULL */
    int owner_stdin;           /* rank 0 stops the server when its standard input ends (the
                                  process that started it is gone: --owner-stdin) */
    double handshake_timeout;  /* seconds a connection has for its ZMTP greeting and READY
                                  before it is closed (default 5; 0: no bound) */
    double message_timeout;    /* seconds a partly received message may go without a byte,
                                  or a connection's output without one taken, before the
                                  connection is closed (default 30; 0: no bound) */
    int64_t min_rate;          /* bytes per second a connection must keep up while it has a
                                  message partly received, and while output waits for it: one
                                  that falls behind in either by more than message_timeout
                                  seconds (30 when that is 0) is closed (default 64 KiB; 0: no
                                  bound) */
    /* world rank 0: the endpoint bound before the load (mdt_serve_listen; the caller frees it);
     * NULL: mdt_serve binds `endpoint` itself */
    mdt_serve_listener *listener;
    /* optional, on world rank 0 once the endpoint is bound, with the endpoint as bound */
    void (*on_ready)(void *user, const char *endpoint);
    /* optional, on world rank 0, from the listener's thread: a stop was asked while a request
     * ran and the request did not end within MDT_SERVE_STOP_GRACE_S; its client and every
     * queued one got `msg` as their reply and the ipc socket file is removed. The caller ends
     * the process (the library does not). */
    void (*on_stop_stuck)(void *user, const char *msg);
    void *user;
} mdt_serve_params;
mdt_serve_params mdt_serve_params_default(void);

/* Refuses an endpoint the server would not bind: a scheme other than ipc:// and tcp://, an ipc
 * path that is too long, exists and is not a socket, or is the socket of a running server, a tcp
 * host that is not loopback (127.0.0.0/8, ::1, localhost) unless `listen_any`. MDT_E_INVALID
 * naming the problem. Local (call it before the load to fail early). */
mdt_status mdt_serve_endpoint_check(const char *endpoint, int listen_any);

/* World rank 0, before the load: checks p->endpoint (mdt_serve_endpoint_check), binds it — an
 * ipc socket file owner-only, checked and bound under a lock on its directory so that two
 * servers started at once on one path cannot both bind it — and answers connections on a thread
 * of its own (requests wait in its queue, under p's limits, until mdt_serve takes them). Errors
 * (MDT_E_INVALID, MDT_E_IO) name the endpoint: a missing directory, a busy port, a refused host.
 * Local. */
mdt_status mdt_serve_listen(const mdt_serve_params *p, mdt_serve_listener **out);
/* The endpoint as bound ("tcp://127.0.0.1:*" names the port chosen). */
const char *mdt_serve_listener_endpoint(const mdt_serve_listener *l);
/* Stops the thread, closes every connection and removes the ipc socket file. NULL: a no-op. */
void mdt_serve_listener_free(mdt_serve_listener *l);
/* 1 when the server stopped because its standard input ended (p->owner_stdin). */
int mdt_serve_listener_owner_gone(const mdt_serve_listener *l);

/* Serves `m` until a "close" request or mdt_serve_stop: world rank 0 answers ZeroMQ clients on
 * the endpoint (p->listener, or one it binds), validates each request and broadcasts it over the
 * mesh's world; every rank runs it; rank 0 replies. A bad request gets an error reply and the
 * server goes on. Collective over the model's mesh (every rank calls it); MDT_OK on close or
 * stop, on every rank. A failure that ends the server (the endpoint cannot be bound, MPI fails)
 * is returned on every rank, except when mdt_mesh_peers_stuck is set (a rank failed inside a
 * step: the caller must end the job). */
mdt_status mdt_serve(mdt_model *m, const mdt_serve_params *p);
/* Seconds a request under way may run on after a stop was asked (see on_stop_stuck). */
#define MDT_SERVE_STOP_GRACE_S 5
/* Asks mdt_serve to stop (async-signal-safe: a SIGTERM/SIGINT handler calls it on any rank).
 * Every rank leaves within about a second of the first rank that was asked. */
void mdt_serve_stop(void);

/* ---- checks before a run, output files ---- */

typedef struct mdt_memory_limit {
    int64_t max_bytes;         /* > 0: the limit per rank (--max-memory); 0: what the process may
                                  use (MemAvailable and the cgroup's limit) over the node's ranks */
    const char *mem_available; /* with max_bytes 0: a size that replaces the system's figure
                                  (MESHDIT_MEM_AVAILABLE), or NULL */
    int device_activations;    /* activations live on a GPU: not counted */
} mdt_memory_limit;
/* Before any weight is read: this rank's weights plus the activations of `inputs` under the
 * mesh's layout must fit the limit (MDT_E_NOMEM naming the need, the limit and the smallest TP
 * degree that would fit). A checkpoint, inputs or layout the model cannot take pass (the loader
 * names the problem). Collective over MPI_COMM_WORLD even with a NULL mesh (it counts the ranks
 * sharing this node's memory); same verdict everywhere. */
mdt_status mdt_check_memory(const char *checkpoint_dir, mdt_mesh *mesh,
                            const mdt_tensor_set *inputs, const mdt_memory_limit *lim);
/* `path` can be written (its directory exists and is writable, it is not a directory). Local. */
mdt_status mdt_output_check(const char *path);
/* The same for a run's --out and (optional) --report, named in the message, which must differ. */
mdt_status mdt_outputs_check(const char *out, const char *report);
/* The output `out` (shown with its flag) is none of the files the command reads: the config,
 * weights, index or a shard of `checkpoint_dir` (NULL: none), nor any of `inputs` [n] (NULL
 * entries skipped). The same file is found through links (device and inode); a path that does
 * not exist yet passes. MDT_E_INVALID naming both. Local. */
mdt_status mdt_output_not_input(const char *flag, const char *out, const char *checkpoint_dir,
                                const char *const *inputs, int n);
/* Writes `set` to `out` (safetensors) and, with `report`, `report_text` to it: both or neither
 * (each staged beside its target and renamed only once both are written). Local. */
mdt_status mdt_outputs_write(const char *out, const mdt_tensor_set *set, const char *report,
                             const char *report_text);

/* ---- describe-only model views: config and weight table, no weights ---- */

typedef struct mdt_model_info mdt_model_info;
/* Opens the view of exactly one of `checkpoint_dir` (its config.json; with `read_index` also the
 * safetensors headers, so each weight's stored dtype is known) or `config_path` (a config.json).
 * Local. Errors: MDT_E_NOTFOUND (no such file), MDT_E_IO, MDT_E_FORMAT, MDT_E_INVALID (bad
 * config), MDT_E_UNSUPPORTED (unknown family). */
mdt_status mdt_model_info_open(const char *checkpoint_dir, const char *config_path, int read_index,
                               mdt_model_info **out);
void mdt_model_info_free(mdt_model_info *info);
const char *mdt_model_info_family(const mdt_model_info *info);     /* "flux" */
const char *mdt_model_info_class_name(const mdt_model_info *info); /* "FluxTransformer2DModel" */
/* Attention heads as the family configures them (its default where config.json has none). */
int64_t mdt_model_info_heads(const mdt_model_info *info);
int mdt_model_info_weight_count(const mdt_model_info *info);
/* The i-th weight with its local shape under TP degree `tp` (MDT_E_INVALID if the model cannot
 * take it) on TP coordinate 0 and, for a view with the index, its stored dtype. */
mdt_status mdt_model_info_weight(const mdt_model_info *info, int i, int tp, mdt_weight_info *out);
/* The same on TP coordinate k (0 <= k < tp): shapes differ by coordinate only where a tensor
 * splits unevenly (an FFN's hidden features tp does not divide: the first n mod tp coordinates
 * hold one row or column more; *uneven, optional, says so). */
mdt_status mdt_model_info_weight_at(const mdt_model_info *info, int i, int tp, int k,
                                    mdt_weight_info *out, int *uneven);
/* The family's context-parallel plan, the one its forward runs: `gather` 0 = the inputs split
 * over the CP group, 1 = the outputs gathered. Count, then the i-th entry's tensor name, its
 * sequence dimension and (`by`, optional) the input whose values pick an output's rows from the
 * gathered packed sequence (NULL: the chunks concatenated in order). */
int mdt_model_info_cp_count(const mdt_model_info *info, int gather);
const char *mdt_model_info_cp_entry(const mdt_model_info *info, int gather, int i, int *dim,
                                    const char **by);
/* MDT_E_INVALID naming the constraint when the model cannot run under tp x ring x ulysses. */
mdt_status mdt_model_info_check_layout(const mdt_model_info *info, int tp, int ring, int ulysses);
mdt_status mdt_model_info_make_inputs(const mdt_model_info *info, const mdt_random_inputs *p,
                                      mdt_tensor_set *out);
/* What the LoRA adapter at `path` adapts under TP degree `tp`, without loading weights (inspect):
 * one entry per adapted linear, in the model's table order, with the slices of its factors each
 * rank holds. *out (mdt_lora_targets_free it) gets *n entries; names are borrowed from `info`.
 * Errors as mdt_model_lora_load's. Local. */
typedef struct mdt_lora_target_info {
    const char *weight;   /* the adapted weight */
    const char *tp_style; /* its TP style */
    int64_t rank;
    double scale;        /* alpha / r */
    int64_t a_local[2];  /* this rank's slice of A [r, in] */
    int64_t b_local[2];  /* and of B [out, r] */
    int has_bias;        /* the adapter has lora_B.bias for it */
    int64_t bytes_local; /* f32 bytes of both slices (and the bias's) per rank */
} mdt_lora_target_info;
mdt_status mdt_model_info_lora(const mdt_model_info *info, const char *path, int tp,
                               mdt_lora_target_info **out, int *n);
void mdt_lora_targets_free(mdt_lora_target_info *t);

/* ---- layout planning: the scaling model's estimate of every layout of N devices ---- */

/* The collectives a layout's step time is made of: TP all-reduce, Ulysses all-to-all, Ring
 * send/receive, the CP output all-gather. */
typedef enum mdt_coll_cost_kind {
    MDT_COST_ALLREDUCE = 0,
    MDT_COST_ALLTOALL,
    MDT_COST_SENDRECV,
    MDT_COST_ALLGATHER,
    MDT_COST_KIND_COUNT
} mdt_coll_cost_kind;
enum { MDT_LINK_INTRA = 0, MDT_LINK_INTER = 1, MDT_LINK_COUNT = 2 };

/* One collective over one kind of link: seconds = calls x latency + bytes sent per rank / bw.
 * bw 0: not measured (the spec's flat bw_intra / bw_inter and latency are used). */
typedef struct mdt_link_cost {
    double latency; /* seconds per call */
    double bw;      /* bytes sent per rank per second */
    double overlap; /* send/recv: the fraction of a transfer that hides behind compute started
                       after it (the ring's next block; 0 where the transport only moves data
                       inside MPI calls) */
} mdt_link_cost;

typedef struct mdt_device_spec {
    char name[64];
    double flops;       /* sustained FLOP/s of the linears (GEMM) */
    double flops_attn;  /* of attention; 0: flops */
    double flops_other; /* of the element-wise kernels (norms, gates, activations); 0: ignored */
    double bw_intra;    /* bus bandwidth inside a node, bytes/s */
    double bw_inter;    /* between nodes */
    double latency;     /* seconds per collective call */
    double mem_bytes;   /* memory per device */
    int node_size;      /* devices per node */
    int calibrated;     /* 1: measured on the machine (mdt_calibrate); 0: published figures */
    char source[192];   /* where the numbers come from */
    mdt_link_cost coll[MDT_LINK_COUNT][MDT_COST_KIND_COUNT]; /* measured per collective */
} mdt_device_spec;
/* The preset `name` ("cpu", "h100", "h200", "trn2"); MDT_E_NOTFOUND for another name. */
mdt_status mdt_device_spec_preset(const char *name, mdt_device_spec *out);
/* A device file written by mdt_calibrate / `meshdit plan --calibrate` (README: Several hosts); an
 * error naming the file and the field for anything missing, non-finite or out of range. Local. */
mdt_status mdt_device_spec_load(const char *path, mdt_device_spec *out);
/* Writes `dev` as a device file (atomically: a temporary file renamed over `path`). Local. */
mdt_status mdt_device_spec_save(const mdt_device_spec *dev, const char *path);
/* Measures this machine for the planner, collective over MPI_COMM_WORLD (launch it the way the
 * model will run, e.g. across the hosts): on every rank at once the kernels' sustained f32 rates
 * at the shapes of `info`'s model for `tokens` tokens (linears, attention, element-wise), then
 * each collective between the ranks of one host and between hosts at the forward's message sizes
 * (latency and bandwidth fitted from two sizes; for the ring's send/recv, how much of a transfer
 * hides behind compute). A link the launch does not have (one host, one rank per host) stays
 * unmeasured. Rates and link costs are the slowest rank's, memory the smallest host's share.
 * Every rank returns the same spec and status, except when *end_job is set: this rank failed
 * while its peers wait in a collective, and the caller must end the job (MPI_Abort). */
mdt_status mdt_calibrate(const mdt_model_info *info, int64_t tokens, mdt_device_spec *out,
                         int *end_job);

typedef struct mdt_layout_estimate {
    int cfg, tp, ring, ulysses;
    int valid;
    char why[256];                                        /* why the layout is rejected */
    double weight_bytes, act_bytes;                       /* per rank */
    double flops_linear, flops_attn, flops_other;         /* per rank, one step */
    double bytes_tp, bytes_ulysses, bytes_ring, bytes_cp; /* sent per rank, one step */
    double bytes_cfg;                                     /* the cfg exchange, one step */
    double t_compute, t_comm, t_step;                     /* seconds */
} mdt_layout_estimate;
/* What to plan: a step of `tokens` tokens (the attention sequence) of which `txt_tokens` are the
 * text stream's (joint models: part of `tokens`; cross-attention models: the encoder sequence),
 * at `elem_bytes` per element, on `devices` devices; `guided`: the step runs two forwards
 * (classifier-free guidance), so cfg 2 layouts (one branch per half of the devices, one
 * exchange) are ranked beside cfg 1 (both branches in turn); a family whose pipeline does not
 * guide (no negative_ inputs: MiniMax-H3) gets no cfg 2 layouts. */
typedef struct mdt_plan_request {
    int devices;
    int64_t tokens, txt_tokens;
    double elem_bytes;
    int guided;
} mdt_plan_request;
/* Every layout of the request's devices on `dev`, valid layouts first, fastest step first.
 * *out (free() it) gets *n entries. Local. */
mdt_status mdt_plan_layouts(const mdt_model_info *info, const mdt_device_spec *dev,
                            const mdt_plan_request *rq, mdt_layout_estimate **out, int *n);

/* ---- random-weight checkpoints ---- */

int mdt_family_exists(const char *family);                         /* "flux", "minimax-h3" */
int mdt_family_has_preset(const char *family, const char *preset); /* "tiny", ... */
/* The families ("flux, flux2, ...") and every preset by family ("flux: tiny, medium; ..."), for
 * messages; truncated to cap. */
void mdt_family_names(char *buf, size_t cap);
void mdt_preset_names(char *buf, size_t cap);
/* Writes a random-weight checkpoint in diffusers layout into `dir` (created if absent) for
 * exactly one of `family`'s `preset` or the config.json at `config_path`: weights as one file or
 * `shards` files plus an index, stored in `dtype` (MDT_F32, MDT_BF16, MDT_F16), from `seed`.
 * With a config, a non-NULL `family` must be the config's (its _class_name), else MDT_E_INVALID. */
mdt_status mdt_checkpoint_gen(const char *family, const char *preset, const char *config_path,
                              uint64_t seed, mdt_dtype dtype, int shards, const char *dir);

/* ---- tensor comparison ---- */

typedef struct mdt_tensor_diff {
    int comparable;      /* same shape, and both float or both integer/bool dtypes; the rest
                          * is set only then */
    double max_abs_diff; /* max |a - b| over elements, in each side's own precision */
    double max_abs_b;    /* max |b| */
    int nonfinite;       /* a NaN or Inf in either */
} mdt_tensor_diff;
/* Compares `a` with the reference `b`, elementwise (F64 as F64, integers exactly). MDT_OK. */
mdt_status mdt_tensor_compare(const mdt_tensor *a, const mdt_tensor *b, mdt_tensor_diff *d);
const char *mdt_dtype_str(mdt_dtype dt); /* "F32" */
/* "[2, 3]" into buf; returns buf. */
const char *mdt_tensor_shape_str(const mdt_tensor *t, char *buf, size_t cap);

#ifdef __cplusplus
}
#endif
#endif /* MESHDIT_H */
