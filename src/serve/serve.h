/*
 * serve.h — the parts of the resident server (meshdit.h: mdt_serve) that need no socket and no
 * MPI: a request blob parsed and validated into an operation (proto.c), the reply blob, and
 * the sessions of constant tensors kept between forwards under fixed limits (session.c).
 * The loop itself (ZeroMQ on rank 0, requests broadcast over MPI) is serve.c. The protocol is
 * docs/serve.md.
 */
#ifndef MDT_API_SERVE_H
#define MDT_API_SERVE_H

#include "core/core.h"
#include "tensor/tensor.h"

#include <stddef.h>
#include <stdint.h>

/* The operations, as numbered in the request header broadcast from rank 0 (MDT_SERVE_OP_STOP and
 * MDT_SERVE_OP_HEARTBEAT are internal: rank 0 saw a stop signal and every rank leaves the loop;
 * rank 0 had no request for a while and every rank shows it is alive). */
typedef enum mdt_serve_op {
    MDT_SERVE_OP_STOP = 0,
    MDT_SERVE_OP_INFO,
    MDT_SERVE_OP_FORWARD,
    MDT_SERVE_OP_END_SESSION,
    MDT_SERVE_OP_CLOSE,
    MDT_SERVE_OP_HEARTBEAT,
    MDT_SERVE_OP_LORA_LOAD,   /* an adapter's factors (the blob) under "adapter_name" */
    MDT_SERVE_OP_LORA_UNLOAD, /* drops adapter "adapter_name" */
} mdt_serve_op;

#define MDT_SERVE_NAME_MAX 128        /* bytes of a session name or a request id */
#define MDT_SERVE_KEEP_MAX 64         /* names in one "keep" list */
#define MDT_SERVE_CACHE_NAME_MAX 63   /* bytes of a cache branch name (cache.h) */
#define MDT_SERVE_TENSORS_MAX 1024    /* tensors in one request (a forward takes about a dozen) */
#define MDT_SERVE_ADAPTER_NAME_MAX 63 /* bytes of an adapter's name (models/lora.h) */
#define MDT_SERVE_LORA_MAX 64         /* adapters named in one "lora" set, and loaded at once */
#define MDT_SERVE_ADAPTER_TENSORS_MAX 16384 /* tensors of one adapter (lora_load) */

/* One request, parsed. Tensors in their sent dtype, owned. */
typedef struct mdt_serve_request {
    mdt_serve_op op;
    char op_name[16];                     /* as sent ("forward") */
    char id[MDT_SERVE_NAME_MAX + 1];      /* "id" echoed in the reply, "" when absent */
    char session[MDT_SERVE_NAME_MAX + 1]; /* "" when absent; "new", then the token the server
                                             issued for it (serve.c) */
    int new_session;                      /* "session": "new": this forward opens one */
    int end_session;                      /* forward: drop the session after this forward */
    char cache[16384]; /* the step cache's spec ("" or "none": none; MDT_CACHE_SPEC_MAX) */
    char cache_context[MDT_SERVE_CACHE_NAME_MAX + 1]; /* its branch ("cond", "uncond", ...) */
    char cache_gen[MDT_SERVE_NAME_MAX + 1];           /* the generation its state belongs to */
    int64_t now_ms; /* rank 0's clock for this request (serve.c) */
    int n_keep;
    char *keep[MDT_SERVE_KEEP_MAX]; /* into keep_buf */
    char *keep_buf;
    mdt_tensor_set *tensors;
    int64_t bytes; /* the blob's size */
    /* lora_load / lora_unload: the adapter; lora_load's factors are the blob itself (read by
     * the adapter loader, not copied into `tensors`), valid while the caller holds it */
    char adapter[MDT_SERVE_ADAPTER_NAME_MAX + 1];
    const void *blob;
    int adapter_meta; /* "lora_adapter_metadata" or "format" was given */
    /* forward with "lora": the adapter set to fuse first (n_lora 0: the base weights) */
    /* forward on a --cfg 2 server: the session whose kept tensors, over this forward's inputs,
     * are the next forward's (the other branch of a guided step): the other cfg group computes
     * that forward now ("" : none) */
    char cfg_next[MDT_SERVE_NAME_MAX + 1];
    int has_lora, n_lora;
    char *lora_names[MDT_SERVE_LORA_MAX]; /* into lora_buf */
    double lora_weights[MDT_SERVE_LORA_MAX];
    char *lora_buf;
} mdt_serve_request;

/* Parses and validates a request blob (safetensors, the same checks and limits as a file): its
 * __metadata__ keys and values (docs/serve.md; no other key), tensors only with a forward (its
 * inputs) and a lora_load (the adapter's factors, left in the blob). *r is zeroed first;
 * mdt_serve_request_free(r) always. MDT_E_FORMAT for a bad blob, MDT_E_INVALID for a bad operation,
 * naming the problem in one line. */
mdt_status mdt_serve_request_parse(const void *blob, size_t size, mdt_serve_request *r);
void mdt_serve_request_free(mdt_serve_request *r);
/* The "op" and "id" of a request from the first `n` bytes of its blob (a request refused before
 * it was read whole, or never parsed), for its error reply: each "" unless the header lies
 * within those bytes and has it once, an op the server knows, an id as the parse takes it.
 * 1 when the header was within the bytes and parsed as a JSON object. */
int mdt_serve_request_peek(const void *head, size_t n, char op[16],
                           char id[MDT_SERVE_NAME_MAX + 1]);

/* A reply blob (*blob: mdt_free it): `meta` (NULL-terminated key, value pairs) after "status":
 * "ok", and `outputs` (optional) as tensors. */
mdt_status mdt_serve_reply_ok(const char *const *meta, const mdt_tensor_set *outputs,
                              unsigned char **blob, size_t *size);
/* An error reply: "status": "error", "error": `msg` made one line, `op`/`id` when known, and
 * "code": the status's name (mdt_status_str) when `code` is not MDT_OK, so a client can tell a
 * request the server cannot take (MDT_E_NOMEM: over --max-memory) from a fault. */
mdt_status mdt_serve_reply_error(const char *op, const char *id, const char *msg, mdt_status code,
                                 unsigned char **blob, size_t *size);

/* ---- session.c: tensors kept between forwards ---- */

#define MDT_SERVE_TOKEN_CHARS 32 /* a session's name: 128 random bits in hex, issued by rank 0 */

typedef struct mdt_serve_session {
    char name[MDT_SERVE_NAME_MAX + 1]; /* its token */
    mdt_tensor_set *set;
    int64_t bytes;
    int64_t last_ms; /* rank 0's clock when a forward last named it */
    char cache_context[MDT_SERVE_CACHE_NAME_MAX + 1]; /* its last forward's cache branch ("") */
} mdt_serve_session;

typedef struct mdt_serve_sessions {
    int max_sessions;
    int64_t max_bytes; /* over all sessions */
    int64_t idle_ms;   /* a session unused this long is dropped (0: never) */
    int n;
    int64_t bytes;
    mdt_serve_session *s; /* max_sessions slots */
} mdt_serve_sessions;

mdt_status mdt_serve_sessions_init(mdt_serve_sessions *ss, int max_sessions, int64_t max_bytes,
                                   int64_t idle_ms);
/* Drops every session unused for more than idle_ms at rank 0's clock `now_ms` (every rank runs
 * it with the clock of the same header, so every rank drops the same ones). Returns how many. */
int mdt_serve_sessions_expire(mdt_serve_sessions *ss, int64_t now_ms);
/* A fresh session token (MDT_SERVE_TOKEN_CHARS hex characters and a NUL) from the system's
 * random source, as two words for the header's broadcast, and its text. */
mdt_status mdt_serve_token_new(uint64_t words[2]);
void mdt_serve_token_text(const uint64_t words[2], char out[MDT_SERVE_TOKEN_CHARS + 1]);
void mdt_serve_sessions_free(mdt_serve_sessions *ss);
/* Before a forward: the session's kept tensors the request lacks are added to r->tensors, and
 * what r->keep would store is checked against the limits (MDT_E_INVALID naming the limit; an
 * unknown session without "keep" is MDT_E_NOTFOUND). Allocates only the merged copies. */
mdt_status mdt_serve_sessions_prepare(mdt_serve_sessions *ss, mdt_serve_request *r);
/* After a successful forward: stores r->keep from r->tensors under r->session (replacing
 * tensors of the same name), then drops the session if r->end_session. */
mdt_status mdt_serve_sessions_commit(mdt_serve_sessions *ss, const mdt_serve_request *r);
/* Drops a session (a no-op for an unknown name). */
void mdt_serve_sessions_end(mdt_serve_sessions *ss, const char *name);
/* The tensors kept under `name` (NULL if none). */
const mdt_tensor_set *mdt_serve_sessions_set_of(const mdt_serve_sessions *ss, const char *name);
/* Bytes kept under `name` (0 if none). */
int64_t mdt_serve_sessions_bytes_of(const mdt_serve_sessions *ss, const char *name);
/* The cache branch ("cache_context") of the last forward that named `name` and kept it ("" if
 * none or no cache): the branch a forward of its tensors would run as. */
const char *mdt_serve_sessions_context_of(const mdt_serve_sessions *ss, const char *name);

/* ---- caches.c: the step caches of generations, kept between forwards ---- */

struct mdt_cache;
#define MDT_SERVE_CACHES_GONE 64
typedef struct mdt_serve_cache {
    char gen[MDT_SERVE_NAME_MAX + 1]; /* the client's "cache_generation" */
    struct mdt_cache *cache;
    int64_t last_ms; /* rank 0's clock when a forward last used it */
    int64_t serial;  /* tells it from an earlier generation of the same name (from 1) */
} mdt_serve_cache;

typedef struct mdt_serve_caches {
    int max, n;
    int64_t idle_ms; /* unused this long: dropped (0: never) */
    mdt_serve_cache *e;
    char (*gone)[MDT_SERVE_NAME_MAX + 1]; /* the last MDT_SERVE_CACHES_GONE dropped names */
    int64_t ngone;
    int64_t made; /* generations made so far (the last one's serial) */
} mdt_serve_caches;

mdt_status mdt_serve_caches_init(mdt_serve_caches *cs, int max, int64_t idle_ms);
void mdt_serve_caches_free(mdt_serve_caches *cs);
/* Drops the generations unused for more than idle_ms at `now_ms`; returns how many. */
int mdt_serve_caches_expire(mdt_serve_caches *cs, int64_t now_ms);
/* The generation of r->cache_gen (made on first use, the least recently used one dropped when
 * all max are taken) with r->cache_context selected, in *out; NULL when r asks for no cache.
 * MDT_E_INVALID when the generation runs another spec than r->cache. */
mdt_status mdt_serve_caches_use(mdt_serve_caches *cs, const mdt_serve_request *r,
                                struct mdt_cache **out);
/* The state of generation `gen` (NULL if none is held), and its serial (0 if none). */
struct mdt_cache *mdt_serve_caches_find(const mdt_serve_caches *cs, const char *gen);
int64_t mdt_serve_caches_serial_of(const mdt_serve_caches *cs, const char *gen);
/* Drops a generation its client ended (a no-op for an unknown name). */
void mdt_serve_caches_end(mdt_serve_caches *cs, const char *gen);

/* ---- budget.c: the memory a request's forward may take on one rank ---- */

typedef struct mdt_serve_budget {
    int64_t limit;  /* bytes of weights + activations per rank (0: no check) */
    int is_default; /* measured at the start, not --max-memory: `what` says how */
    char what[320];
} mdt_serve_budget;

/* The budget of this rank: p->max_memory, else the share of what the process may use (run's
 * default), measured now (after the load). Local. */
mdt_status mdt_serve_budget_init(mdt_serve_budget *b, const mdt_model *m,
                                 const mdt_serve_params *p);
/* MDT_E_NOMEM (run's message: the need, the limit) when this forward's inputs would pass it. */
mdt_status mdt_serve_budget_check(const mdt_serve_budget *b, const mdt_model *m,
                                  const mdt_tensor_set *inputs, int device_activations);

/* ---- endpoint.c: binding the endpoint ---- */

/* Checks `ep` (mdt_serve_endpoint_check) and binds a listening socket for it (non-blocking,
 * close-on-exec): an ipc path under an exclusive lock on its directory (a stale socket file is
 * replaced, a live one refused), created owner-only; a tcp host resolved to one address (port *
 * picks a free one). *fd the socket, `bound` the endpoint as bound, `ipc_path` the socket file
 * this call created ("" for tcp), for the caller to remove. MDT_E_INVALID / MDT_E_IO naming the
 * endpoint. */
mdt_status mdt_serve_endpoint_bind(const char *ep, int listen_any, int *fd, char *bound,
                                   size_t bound_cap, char *ipc_path, size_t path_cap);

/* ---- listener.c: rank 0's connections, on a thread of their own ---- */

#define MDT_SERVE_CLIENT_QUEUE 8 /* requests of one connection waiting, running or unanswered */
/* connections at once; a newcomer to a full table takes the place of the one idle longest */
#define MDT_SERVE_MAX_CLIENTS 256
#define MDT_SERVE_PEEK_BYTES 8192 /* the bytes of a blob read for a refused request's op, id */

/* A request as received: the blob (mdt_alloc'd, owned by the listener until ..._done) and the
 * connection its reply goes to. */
typedef struct mdt_serve_incoming {
    uint64_t conn;
    unsigned char *blob;
    size_t size;
    int64_t reserved; /* bytes of the queue budget it holds */
} mdt_serve_incoming;

/* Waits up to timeout_ms for the next request: 1 and *in filled, or 0. */
int mdt_serve_listener_next(mdt_serve_listener *l, int timeout_ms, mdt_serve_incoming *in);
/* Hands a reply blob (mdt_alloc'd; the listener frees it) to connection `conn`; dropped when the
 * connection is gone. Its bytes count against --max-queue-bytes until they are written. */
void mdt_serve_listener_reply(mdt_serve_listener *l, uint64_t conn, unsigned char *blob, size_t n);
/* The request has been answered: its blob and its share of the queue budget are released. */
void mdt_serve_listener_done(mdt_serve_listener *l, mdt_serve_incoming *in);
/* Answers every request still queued with an error reply carrying `msg` (the server is ending)
 * and the request's op and id (mdt_serve_request_peek), and every request that arrives from
 * now on as it ends, then waits up to `seconds` for the replies already handed over to be
 * written. The listener stays that way: it serves no other loop afterwards. */
void mdt_serve_listener_fail_all(mdt_serve_listener *l, const char *msg, double seconds);
/* The loop runs a request of `conn` (busy 1; its `op` and `id`, "" or NULL when none, name it
 * in a reply the listener writes) or has finished it (0): while it runs, a stop that is not
 * obeyed within MDT_SERVE_STOP_GRACE_S ends the server from the listener's thread, its client
 * and every queued one answered. */
void mdt_serve_listener_busy(mdt_serve_listener *l, uint64_t conn, const char *op, const char *id,
                             int busy);

#endif /* MDT_API_SERVE_H */
