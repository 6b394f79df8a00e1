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

/* The operations, as numbered in the request header broadcast from rank 0 (MDT_SERVE_OP_STOP is
 * internal: rank 0 saw a stop signal and every rank leaves the loop). */
typedef enum mdt_serve_op {
    MDT_SERVE_OP_STOP = 0,
    MDT_SERVE_OP_INFO,
    MDT_SERVE_OP_FORWARD,
    MDT_SERVE_OP_END_SESSION,
    MDT_SERVE_OP_CLOSE,
} mdt_serve_op;

#define MDT_SERVE_NAME_MAX 128     /* bytes of a session name or a request id */
#define MDT_SERVE_KEEP_MAX 64      /* names in one "keep" list */
#define MDT_SERVE_TENSORS_MAX 1024 /* tensors in one request (a forward takes about a dozen) */

/* One request, parsed. Tensors in their sent dtype, owned. */
typedef struct mdt_serve_request {
    mdt_serve_op op;
    char op_name[16];                     /* as sent ("forward") */
    char id[MDT_SERVE_NAME_MAX + 1];      /* "id" echoed in the reply, "" when absent */
    char session[MDT_SERVE_NAME_MAX + 1]; /* "" when absent */
    int end_session;                      /* forward: drop the session after this forward */
    int n_keep;
    char *keep[MDT_SERVE_KEEP_MAX]; /* into keep_buf */
    char *keep_buf;
    mdt_tensor_set *tensors;
    int64_t bytes; /* the blob's size */
} mdt_serve_request;

/* Parses and validates a request blob (safetensors, the same checks and limits as a file): its
 * __metadata__ keys and values (op, id, session, keep, end_session; no other key), tensors only
 * with a forward. *r is zeroed first; mdt_serve_request_free(r) always. MDT_E_FORMAT for a bad
 * blob, MDT_E_INVALID for a bad operation, naming the problem in one line. */
mdt_status mdt_serve_request_parse(const void *blob, size_t size, mdt_serve_request *r);
void mdt_serve_request_free(mdt_serve_request *r);

/* A reply blob (*blob: mdt_free it): `meta` (NULL-terminated key, value pairs) after "status":
 * "ok", and `outputs` (optional) as tensors. */
mdt_status mdt_serve_reply_ok(const char *const *meta, const mdt_tensor_set *outputs,
                              unsigned char **blob, size_t *size);
/* An error reply: "status": "error", "error": `msg` made one line, and `op`/`id` when known. */
mdt_status mdt_serve_reply_error(const char *op, const char *id, const char *msg,
                                 unsigned char **blob, size_t *size);

/* ---- session.c: tensors kept between forwards ---- */
typedef struct mdt_serve_session {
    char name[MDT_SERVE_NAME_MAX + 1];
    mdt_tensor_set *set;
    int64_t bytes;
} mdt_serve_session;

typedef struct mdt_serve_sessions {
    int max_sessions;
    int64_t max_bytes; /* over all sessions */
    int n;
    int64_t bytes;
    mdt_serve_session *s; /* max_sessions slots */
} mdt_serve_sessions;

mdt_status mdt_serve_sessions_init(mdt_serve_sessions *ss, int max_sessions, int64_t max_bytes);
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
/* Bytes kept under `name` (0 if none). */
int64_t mdt_serve_sessions_bytes_of(const mdt_serve_sessions *ss, const char *name);

#endif /* MDT_API_SERVE_H */
