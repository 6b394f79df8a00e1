/*
 * serve_client.c — a test client of `meshdit serve` (docs/serve.md) on libzmq directly, driven by
 * tests/cli/test_serve.sh. One request per run over a REQ socket; prints the reply's metadata as
 * `key=value` lines (the config's text left out) and writes its tensors to OUT.
 *
 *   serve_client EP info|close|OP                 [--id ID] [--timeout MS]
 *   serve_client EP forward IN OUT [--session S] [--keep a,b] [--omit a,b] [--end-session]
 *                                  [--truncate NAME] [--id ID] [--timeout MS]
 *   serve_client EP raw FILE                      the file's bytes as the request blob
 *   serve_client EP leave IN                      a forward, then gone before the reply
 *   serve_client EP frames N BYTES                a DEALER message: the delimiter, then N frames
 *                                                 of BYTES each (the reply's metadata printed)
 *   serve_client EP flood N IN                    a DEALER sends N forwards of IN at once, then
 *                                                 reads N replies: prints ok=K error=E and the
 *                                                 first error (exit 0 when all N came)
 *
 * Exit: 0 reply "ok", 1 reply "error" (its message on stdout as error=...), 3 no reply in time,
 * 4 the reply is not a valid safetensors blob, 2 usage or local failure.
 */
#define _POSIX_C_SOURCE 200809L
#include "io/safetensors.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

static int listed(const char *list, const char *name) {
    size_t n = strlen(name);
    for (const char *p = list; p && *p;) {
        const char *c = strchr(p, ',');
        size_t len = c ? (size_t)(c - p) : strlen(p);
        if (len == n && strncmp(p, name, n) == 0)
            return 1;
        p = c ? c + 1 : NULL;
    }
    return 0;
}

static unsigned char *read_file(const char *path, size_t *n) {
    FILE *fp = fopen(path, "rb");
    if (!fp)
        return NULL;
    fseek(fp, 0, SEEK_END);
    long len = ftell(fp);
    rewind(fp);
    unsigned char *b = mdt_alloc(len > 0 ? (size_t)len : 1); /* freed with mdt_free */
    *n = b ? fread(b, 1, (size_t)len, fp) : 0;
    fclose(fp);
    return b;
}

/* The forward request: IN's tensors less --omit, with --truncate's last dimension one shorter. */
static int build_forward(const char *in, const char *omit, const char *truncate,
                         const char *const *meta, unsigned char **blob, size_t *n) {
    mdt_tensor_set *set = NULL;
    if (mdt_tensor_set_load(in, &set) != MDT_OK) {
        fprintf(stderr, "serve_client: %s\n", mdt_last_error());
        return 2;
    }
    const char *names[64];
    const mdt_tensor *ts[64];
    mdt_tensor cut[64];
    int k = 0;
    for (int i = 0; i < mdt_tensor_set_count(set) && k < 64; i++) {
        const char *name;
        const mdt_tensor *t = mdt_tensor_set_at(set, i, &name);
        if (listed(omit, name))
            continue;
        cut[k] = *t;
        if (truncate && strcmp(truncate, name) == 0 && t->ndim > 0 && t->shape[t->ndim - 1] > 1)
            cut[k].shape[t->ndim - 1]--; /* a prefix of the data: shape is what is checked */
        names[k] = name, ts[k] = &cut[k], k++;
    }
    mdt_status st = mdt_st_serialize(k, names, ts, meta, blob, n);
    mdt_tensor_set_free(set);
    return st == MDT_OK ? 0 : 2;
}

static int print_reply(const unsigned char *b, size_t n, const char *out) {
    mdt_st_file *f = NULL;
    if (mdt_st_open_mem(b, n, "reply", &f) != MDT_OK) {
        printf("bad reply: %s\n", mdt_last_error());
        return 4;
    }
    for (int i = 0; i < f->n_meta; i++)
        if (strcmp(f->meta_keys[i], "config") != 0)
            printf("%s=%s\n", f->meta_keys[i], f->meta_vals[i]);
        else
            printf("config_bytes=%zu\n", strlen(f->meta_vals[i]));
    const char *status = mdt_st_meta(f, "status");
    const int ok = status && strcmp(status, "ok") == 0;
    int rc = ok ? 0 : 1;
    if (ok && out) {
        mdt_tensor_set *set = NULL;
        if (mdt_st_read_set(f, &set) != MDT_OK || mdt_tensor_set_save(set, out) != MDT_OK) {
            printf("cannot write %s: %s\n", out, mdt_last_error());
            rc = 2;
        }
        mdt_tensor_set_free(set);
    }
    mdt_st_close(f);
    return rc;
}

/* The reply blob of a DEALER message (frames [empty, blob]) into *msg; 0 or -1 (timeout). */
static int dealer_recv(void *sock, zmq_msg_t *msg) {
    for (int more = 1; more;) {
        zmq_msg_close(msg);
        zmq_msg_init(msg);
        if (zmq_msg_recv(msg, sock, 0) < 0)
            return -1;
        more = zmq_msg_more(msg);
    }
    return 0;
}

/* frames: one message of N frames; flood: N forwards at once, then their replies. */
static int dealer(const char *ep, const char *op, const char *const *pos, int timeout_ms) {
    void *ctx = zmq_ctx_new(), *sock = zmq_socket(ctx, ZMQ_DEALER);
    const int zero = 0;
    zmq_setsockopt(sock, ZMQ_LINGER, &zero, sizeof zero);
    zmq_setsockopt(sock, ZMQ_RCVTIMEO, &timeout_ms, sizeof timeout_ms);
    int rc = 2;
    if (!pos[0] || !pos[1] || zmq_connect(sock, ep) != 0) {
        fprintf(stderr, "serve_client: %s needs N and BYTES (or IN), and a reachable EP\n", op);
        goto out;
    }
    const long n = atol(pos[0]);
    zmq_msg_t msg;
    zmq_msg_init(&msg);
    if (strcmp(op, "frames") == 0) {
        const size_t bytes = (size_t)atol(pos[1]);
        unsigned char *frame = mdt_calloc(bytes ? bytes : 1);
        zmq_send(sock, "", 0, ZMQ_SNDMORE);
        for (long i = 0; frame && i < n; i++)
            zmq_send(sock, frame, bytes, i + 1 < n ? ZMQ_SNDMORE : 0);
        mdt_free(frame);
        rc = dealer_recv(sock, &msg) == 0
                 ? print_reply(zmq_msg_data(&msg), zmq_msg_size(&msg), NULL)
                 : (printf("no reply within %d ms\n", timeout_ms), 3);
    } else {
        unsigned char *blob = NULL;
        size_t size = 0;
        const char *meta[] = {"op", "forward", "id", "flood", NULL};
        if ((rc = build_forward(pos[1], NULL, NULL, meta, &blob, &size)) != 0)
            goto out;
        for (long i = 0; i < n; i++) {
            zmq_send(sock, "", 0, ZMQ_SNDMORE);
            zmq_send(sock, blob, size, 0);
        }
        mdt_free(blob);
        long ok = 0, err = 0;
        char first[512] = "";
        for (long i = 0; i < n && dealer_recv(sock, &msg) == 0; i++) {
            mdt_st_file *f = NULL;
            if (mdt_st_open_mem(zmq_msg_data(&msg), zmq_msg_size(&msg), "reply", &f) != MDT_OK)
                continue;
            const char *status = mdt_st_meta(f, "status"), *e = mdt_st_meta(f, "error");
            if (status && strcmp(status, "ok") == 0)
                ok++;
            else if (err++ == 0 && e)
                snprintf(first, sizeof first, "%s", e);
            mdt_st_close(f);
        }
        printf("ok=%ld\nerror=%ld\nfirst_error=%s\n", ok, err, first);
        rc = ok + err == n ? 0 : 3;
    }
    zmq_msg_close(&msg);
out:
    zmq_close(sock);
    zmq_ctx_term(ctx);
    return rc;
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: serve_client EP OP [ARGS] [options]\n");
        return 2;
    }
    const char *ep = argv[1], *op = argv[2], *session = NULL, *keep = NULL, *omit = NULL;
    const char *truncate = NULL, *pos[2] = {NULL, NULL}, *id = NULL;
    int end_session = 0, timeout_ms = 30000, npos = 0;
    for (int i = 3; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(a, "--end-session") == 0)
            end_session = 1;
        else if (strncmp(a, "--", 2) == 0 && !v)
            return fprintf(stderr, "serve_client: %s needs a value\n", a), 2;
        else if (strcmp(a, "--session") == 0)
            session = v, i++;
        else if (strcmp(a, "--keep") == 0)
            keep = v, i++;
        else if (strcmp(a, "--omit") == 0)
            omit = v, i++;
        else if (strcmp(a, "--truncate") == 0)
            truncate = v, i++;
        else if (strcmp(a, "--id") == 0)
            id = v, i++;
        else if (strcmp(a, "--timeout") == 0)
            timeout_ms = v ? atoi(v) : timeout_ms, i++;
        else if (npos < 2)
            pos[npos++] = a;
        else
            return fprintf(stderr, "serve_client: unexpected '%s'\n", a), 2;
    }
    unsigned char *blob = NULL;
    size_t n = 0;
    int rc = 0;
    const int leave = strcmp(op, "leave") == 0;
    if (strcmp(op, "raw") == 0) {
        if (!pos[0] || !(blob = read_file(pos[0], &n)))
            return fprintf(stderr, "serve_client: raw needs a readable FILE\n"), 2;
    } else if (strcmp(op, "forward") == 0 || leave) {
        const char *meta[12] = {"op", "forward"};
        int k = 2;
        if (session)
            meta[k++] = "session", meta[k++] = session;
        if (keep)
            meta[k++] = "keep", meta[k++] = keep;
        if (end_session)
            meta[k++] = "end_session", meta[k++] = "1";
        meta[k++] = "id", meta[k++] = id ? id : "test";
        meta[k] = NULL;
        if (!pos[0])
            return fprintf(stderr, "serve_client: forward needs IN\n"), 2;
        if ((rc = build_forward(pos[0], omit, truncate, meta, &blob, &n)) != 0)
            return rc;
    } else {
        const char *meta[7] = {"op", op};
        int k = 2;
        if (session)
            meta[k++] = "session", meta[k++] = session;
        if (id)
            meta[k++] = "id", meta[k++] = id;
        meta[k] = NULL;
        if (mdt_st_serialize(0, NULL, NULL, meta, &blob, &n) != MDT_OK)
            return 2;
    }
    if (strcmp(op, "frames") == 0 || strcmp(op, "flood") == 0)
        return dealer(ep, op, pos, timeout_ms);
    void *ctx = zmq_ctx_new();
    void *sock = zmq_socket(ctx, ZMQ_REQ);
    const int one = 1;
    if (strncmp(ep, "tcp://[", 7) == 0)
        zmq_setsockopt(sock, ZMQ_IPV6, &one, sizeof one);
    const int linger = leave ? 5000 : 0; /* a leaving client still delivers its request */
    zmq_setsockopt(sock, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(sock, ZMQ_RCVTIMEO, &timeout_ms, sizeof timeout_ms);
    zmq_setsockopt(sock, ZMQ_SNDTIMEO, &timeout_ms, sizeof timeout_ms);
    if (zmq_connect(sock, ep) != 0 || zmq_send(sock, blob, n, 0) < 0) {
        printf("send failed: %s\n", zmq_strerror(zmq_errno()));
        rc = 3;
    } else if (leave) {
        printf("sent %zu bytes, leaving\n", n);
    } else {
        zmq_msg_t msg;
        zmq_msg_init(&msg);
        if (zmq_msg_recv(&msg, sock, 0) < 0) {
            printf("no reply within %d ms: %s\n", timeout_ms, zmq_strerror(zmq_errno()));
            rc = 3;
        } else {
            rc = print_reply(zmq_msg_data(&msg), zmq_msg_size(&msg),
                             strcmp(op, "forward") == 0 ? pos[1] : NULL);
        }
        zmq_msg_close(&msg);
    }
    zmq_close(sock);
    zmq_ctx_term(ctx);
    mdt_free(blob);
    return rc;
}
