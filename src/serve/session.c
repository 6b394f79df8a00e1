/*
 * session.c — the server's sessions (docs/serve.md): tensors that stay constant during one
 * generation (text embeddings, pooled projections, ids, guidance) are sent once with "keep" and
 * merged into the inputs of later forwards of the same session. A fixed number of sessions and a
 * fixed number of bytes over all of them, checked before anything is stored: nothing a client
 * sends makes the store grow past the limits the server was started with. Every rank holds the
 * same store (the same requests in the same order), so every rank reaches the same verdicts.
 *
 * A session's name is a token the server issues when a forward opens it ("session": "new"):
 * 128 random bits, known only to the client it was sent to, so no other client can use, replace
 * or end it (client-chosen names collided across clients). A session unused for idle_ms (rank
 * 0's clock, carried by every header) is dropped, so clients that vanish do not fill the store.
 */
#define _DEFAULT_SOURCE
#include "serve/serve.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/random.h>
#include <unistd.h>

mdt_status mdt_serve_token_new(uint64_t words[2]) {
    unsigned char b[16];
    size_t got = 0;
    while (got < sizeof b) {
        const ssize_t k = getrandom(b + got, sizeof b - got, 0);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0)
            return MDT_FAIL(MDT_E_IO, "serve: no random bytes for a session token: %s",
                            strerror(errno));
        got += (size_t)k;
    }
    memcpy(words, b, sizeof b);
    return MDT_OK;
}

void mdt_serve_token_text(const uint64_t words[2], char out[MDT_SERVE_TOKEN_CHARS + 1]) {
    static const char hex[] = "0123456789abcdef";
    unsigned char b[16];
    memcpy(b, words, sizeof b);
    for (int i = 0; i < 16; i++)
        out[2 * i] = hex[b[i] >> 4], out[2 * i + 1] = hex[b[i] & 15];
    out[MDT_SERVE_TOKEN_CHARS] = 0;
}

/* How the messages name the request's session: its token, or "a new session" (the client does
 * not know the token before the reply). */
static const char *shown_name(const mdt_serve_request *r, char *buf, size_t cap) {
    char esc[MDT_ESC_NAME];
    if (r->new_session)
        snprintf(buf, cap, "a new session");
    else
        snprintf(buf, cap, "session '%s'", mdt_escape(r->session, esc, sizeof esc));
    return buf;
}

mdt_status mdt_serve_sessions_init(mdt_serve_sessions *ss, int max_sessions, int64_t max_bytes,
                                   int64_t idle_ms) {
    memset(ss, 0, sizeof *ss);
    ss->max_sessions = max_sessions > 0 ? max_sessions : 0;
    ss->max_bytes = max_bytes > 0 ? max_bytes : 0;
    ss->idle_ms = idle_ms > 0 ? idle_ms : 0;
    if (ss->max_sessions) {
        ss->s = mdt_calloc(sizeof *ss->s * (size_t)ss->max_sessions);
        if (!ss->s)
            return MDT_FAIL(MDT_E_NOMEM, "out of memory");
    }
    return MDT_OK;
}

void mdt_serve_sessions_free(mdt_serve_sessions *ss) {
    if (!ss)
        return;
    for (int i = 0; i < ss->n; i++)
        mdt_tensor_set_free(ss->s[i].set);
    mdt_free(ss->s);
    memset(ss, 0, sizeof *ss);
}

static mdt_serve_session *find(const mdt_serve_sessions *ss, const char *name) {
    for (int i = 0; i < ss->n; i++)
        if (strcmp(ss->s[i].name, name) == 0)
            return &ss->s[i];
    return NULL;
}

const mdt_tensor_set *mdt_serve_sessions_set_of(const mdt_serve_sessions *ss, const char *name) {
    const mdt_serve_session *s = find(ss, name);
    return s ? s->set : NULL;
}

int64_t mdt_serve_sessions_bytes_of(const mdt_serve_sessions *ss, const char *name) {
    const mdt_serve_session *s = find(ss, name);
    return s ? s->bytes : 0;
}

const char *mdt_serve_sessions_context_of(const mdt_serve_sessions *ss, const char *name) {
    const mdt_serve_session *s = find(ss, name);
    return s ? s->cache_context : "";
}

void mdt_serve_sessions_end(mdt_serve_sessions *ss, const char *name) {
    mdt_serve_session *s = find(ss, name);
    if (!s)
        return;
    ss->bytes -= s->bytes;
    mdt_tensor_set_free(s->set);
    *s = ss->s[--ss->n]; /* order does not matter */
    memset(&ss->s[ss->n], 0, sizeof ss->s[ss->n]);
}

int mdt_serve_sessions_expire(mdt_serve_sessions *ss, int64_t now_ms) {
    int n = 0;
    for (int i = ss->n - 1; ss->idle_ms > 0 && i >= 0; i--)
        if (now_ms - ss->s[i].last_ms > ss->idle_ms) {
            char name[MDT_SERVE_NAME_MAX + 1];
            snprintf(name, sizeof name, "%s", ss->s[i].name);
            mdt_serve_sessions_end(ss, name);
            n++;
        }
    return n;
}

/* Bytes of the named tensor in `set`, or 0. */
static int64_t bytes_in(const mdt_tensor_set *set, const char *name) {
    const mdt_tensor *t = set ? mdt_tensor_set_get(set, name) : NULL;
    return t ? mdt_tensor_nbytes(t) : 0;
}

mdt_status mdt_serve_sessions_prepare(mdt_serve_sessions *ss, mdt_serve_request *r) {
    char nm[MDT_ESC_NAME], sn[MDT_ESC_NAME + 16];
    if (!r->session[0])
        return MDT_OK;
    shown_name(r, sn, sizeof sn);
    mdt_serve_session *s = r->new_session ? NULL : find(ss, r->session);
    if (!s && !r->new_session)
        return MDT_FAIL(MDT_E_NOTFOUND,
                        "%s is not open (ended, dropped after %lld s without use, or never "
                        "opened: open one with \"session\": \"new\" and \"keep\")",
                        sn, (long long)(ss->idle_ms / 1000));
    if (s)
        s->last_ms = r->now_ms;
    /* what the store would hold after this forward */
    int64_t after = ss->bytes;
    for (int i = 0; i < r->n_keep; i++) {
        const mdt_tensor *t = mdt_tensor_set_get(r->tensors, r->keep[i]);
        if (!t && !(s && mdt_tensor_set_get(s->set, r->keep[i])))
            return MDT_FAIL(MDT_E_INVALID,
                            "%s: \"keep\" names '%s', which the request does not carry", sn,
                            mdt_escape(r->keep[i], nm, sizeof nm));
        if (t)
            after += mdt_tensor_nbytes(t) - bytes_in(s ? s->set : NULL, r->keep[i]);
    }
    if (!s && ss->n >= ss->max_sessions)
        return MDT_FAIL(MDT_E_INVALID,
                        "%s: %d sessions are open, the server's limit "
                        "(--max-sessions %d); end one first",
                        sn, ss->n, ss->max_sessions);
    if (after > ss->max_bytes)
        return MDT_FAIL(MDT_E_INVALID,
                        "%s: keeping these tensors would hold %lld bytes over all "
                        "sessions, over the server's limit (--max-session-bytes %lld)",
                        sn, (long long)after, (long long)ss->max_bytes);
    /* the kept tensors the request lacks join its inputs */
    for (int i = 0; s && i < mdt_tensor_set_count(s->set); i++) {
        const char *name;
        const mdt_tensor *t = mdt_tensor_set_at(s->set, i, &name);
        if (!mdt_tensor_set_get(r->tensors, name))
            MDT_TRY(mdt_tensor_set_add_copy(r->tensors, name, t));
    }
    return MDT_OK;
}

mdt_status mdt_serve_sessions_commit(mdt_serve_sessions *ss, const mdt_serve_request *r) {
    if (!r->session[0])
        return MDT_OK;
    mdt_serve_session *s = find(ss, r->session);
    if (r->n_keep > 0) {
        /* the new set: the tensors kept before that this request does not replace, then the
         * request's kept tensors (prepare checked the limits on exactly these bytes) */
        mdt_tensor_set *set = NULL;
        mdt_status st = mdt_tensor_set_create(&set);
        for (int i = 0; st == MDT_OK && s && i < mdt_tensor_set_count(s->set); i++) {
            const char *name;
            const mdt_tensor *t = mdt_tensor_set_at(s->set, i, &name);
            int replaced = 0;
            for (int k = 0; k < r->n_keep; k++)
                replaced |= strcmp(r->keep[k], name) == 0;
            if (!replaced)
                st = mdt_tensor_set_add_copy(set, name, t);
        }
        for (int k = 0; st == MDT_OK && k < r->n_keep; k++)
            st = mdt_tensor_set_add_copy(set, r->keep[k],
                                         mdt_tensor_set_get(r->tensors, r->keep[k]));
        if (st != MDT_OK) {
            mdt_tensor_set_free(set);
            return st;
        }
        int64_t bytes = 0;
        for (int i = 0; i < mdt_tensor_set_count(set); i++)
            bytes += mdt_tensor_nbytes(mdt_tensor_set_at(set, i, NULL));
        if (!s) {
            s = &ss->s[ss->n++];
            snprintf(s->name, sizeof s->name, "%s", r->session);
            s->last_ms = r->now_ms;
        } else {
            ss->bytes -= s->bytes;
            mdt_tensor_set_free(s->set);
        }
        s->set = set, s->bytes = bytes;
        ss->bytes += bytes;
    }
    if ((s = find(ss, r->session)) != NULL)
        snprintf(s->cache_context, sizeof s->cache_context, "%s", r->cache_context);
    if (r->end_session)
        mdt_serve_sessions_end(ss, r->session);
    return MDT_OK;
}
