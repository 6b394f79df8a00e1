/*
 * test_serve.c — the server's parts (serve/serve.h): request checks, reply blobs read back, the
 * session store's merge, replacement and limits, the ZMTP reader fed a client's bytes in pieces
 * of every size, and the listener against real libzmq clients in this process (its limits per
 * message, per client and in all, heartbeats, REQ and DEALER peers). The server itself is tested
 * end to end by tests/cli/test_serve.sh.
 */
#define _POSIX_C_SOURCE 200809L
#include "serve/serve.h"
#include "harness.h"
#include "models/cache.h"
#include "io/safetensors.h"
#include "serve/zmtp.h"

#include <errno.h>
#include <poll.h>
#include <stdlib.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

/* A request blob with `meta` and, when `n` > 0, tensors named `names`, each F32 [k] of value v. */
static unsigned char *request(const char *const *meta, int n, const char *const *names,
                              const int64_t *k, size_t *size) {
    static float data[8][64];
    mdt_tensor t[8];
    const mdt_tensor *ts[8];
    for (int i = 0; i < n; i++) {
        for (int j = 0; j < 64; j++)
            data[i][j] = (float)(i + 1);
        t[i] = (mdt_tensor){.dtype = MDT_F32, .ndim = 1, .shape = {k[i]}, .data = data[i]};
        ts[i] = &t[i];
    }
    unsigned char *b = NULL;
    EXPECT_OK(mdt_st_serialize(n, names, ts, meta, &b, size));
    return b;
}

static void test_request_checks(void) {
    static const struct {
        const char *meta[10];
        int ntensors;
        const char *want;
    } bad[] = {
        {{"id", "x", NULL}, 0, "has no \"op\""},
        {{"op", "nope", NULL}, 0, "unknown op 'nope'"},
        {{"op", "info", "colour", "red", NULL}, 0, "unknown metadata key 'colour'"},
        {{"op", "info", NULL}, 1, "op 'info' takes no tensors (got 1)"},
        {{"op", "close", "session", "s", NULL}, 0, "takes no \"session\""},
        {{"op", "forward", "keep", "a", NULL}, 1, "need a \"session\""},
        {{"op", "forward", "session", "s", "keep", "a,,b", NULL}, 1, "separated by commas"},
        {{"op", "forward", "session", "s", "keep", "a,a", NULL}, 1, "names 'a' twice"},
        {{"op", "forward", "session", "a\nb", NULL}, 0, "without control characters"},
        {{"op", "info", "id", "bad\xff\xfe-utf8", NULL}, 0, "UTF-8 text"},
        {{"op", "info", "id", "a\\b", NULL}, 0, "backslashes"},
        {{"op", "info", "id", "rtl\xe2\x80\xae-evil", NULL}, 0, "UTF-8 text"},
        {{"op", "info", "id", "\xc2\x85next-line", NULL}, 0, "UTF-8 text"},
        {{"op", "end_session", NULL}, 0, "needs a \"session\" or a \"cache_generation\""},
        {{"op", "forward", "cache", "first_block", NULL}, 1, "needs \"cache_context\""},
        {{"op", "forward", "cache", "first_block", "cache_context", "cond", NULL},
         1,
         "\"cache_generation\""},
        {{"op", "forward", "cache", "pab", NULL}, 1, "unknown cache 'pab'"},
        {{"op", "forward", "cache_context", "cond", NULL}, 1, "go with \"cache\""},
        {{"op", "forward", "cache", "none", "cache_context", "c", "cache_generation", "g", NULL},
         1,
         "go with \"cache\""},
        {{"op", "forward", "cache", "", NULL}, 1, "cache spec: empty"},
        {{"op", "forward", "cache", "fbc:threshold=0.1,threshold=0.2", NULL}, 1, "given twice"},
        {{"op", "info", "cache", "first_block", NULL}, 0, "go with a forward"},
        {{"op", "info", "cache_generation", "g", NULL}, 0, "takes no \"cache_generation\""},
        {{"op", "forward", "cache", "fbc", "cache_context", "a\nb", "cache_generation", "g", NULL},
         1,
         "without control characters"},
        {{"op", "forward", "session", "s", "end_session", "yes", NULL}, 0, "\"1\" or \"true\""},
        {{"op", "lora_load", NULL}, 1, "op 'lora_load' needs \"adapter_name\""},
        {{"op", "lora_load", "adapter_name", "a", NULL}, 0, "has none"},
        {{"op", "lora_unload", "adapter_name", "a", NULL}, 1, "takes no tensors"},
        {{"op", "forward", "adapter_name", "a", NULL}, 1, "takes no \"adapter_name\""},
        {{"op", "lora_load", "adapter_name", "a=b", NULL}, 1, "or '='"},
        {{"op", "lora_load", "adapter_name", "a,b", NULL}, 1, "commas"},
        {{"op", "forward", "lora_adapter_metadata", "{}", NULL}, 1, "go with op 'lora_load'"},
        {{"op", "info", "lora", "a=1", NULL}, 0, "\"lora\" goes with a forward"},
        {{"op", "info", "cfg_next", "s", NULL}, 0, "\"cfg_next\" goes with a forward"},
        {{"op", "forward", "cfg_next", "a\nb", NULL}, 1, "must be a session's token"},
        {{"op", "forward", "lora", "a", NULL}, 1, "NAME=WEIGHT entries"},
        {{"op", "forward", "lora", "a=", NULL}, 1, "NAME=WEIGHT entries"},
        {{"op", "forward", "lora", "a=1x", NULL}, 1, "NAME=WEIGHT entries"},
        {{"op", "forward", "lora", "a=nan", NULL}, 1, "magnitude at most 1e6"},
        {{"op", "forward", "lora", "a=1e7", NULL}, 1, "magnitude at most 1e6"},
        {{"op", "forward", "lora", "a= 1", NULL}, 1, "NAME=WEIGHT entries"},
        {{"op", "forward", "lora", "a=0x1p3", NULL}, 1, "NAME=WEIGHT entries"},
        {{"op", "forward", "lora", "a=1,,b=2", NULL}, 1, "NAME=WEIGHT entries"},
        {{"op", "forward", "lora", "=1", NULL}, 1, "NAME=WEIGHT entries"},
        {{"op", "forward", "lora", "a=1,a=2", NULL}, 1, "names adapter 'a' twice"},
    };
    const char *names[] = {"a"};
    const int64_t k[] = {4};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        size_t n = 0;
        unsigned char *b = request(bad[i].meta, bad[i].ntensors, names, k, &n);
        mdt_serve_request r;
        EXPECT_ERR(mdt_serve_request_parse(b, n, &r), MDT_E_INVALID, "request: ", bad[i].want);
        mdt_serve_request_free(&r);
        mdt_free(b);
    }
    /* a well-formed UTF-8 id passes and is kept as sent */
    {
        const char *meta[] = {"op", "info", "id", "step-\xc3\xbc-\xe6\x97\xa5", NULL};
        size_t n = 0;
        unsigned char *b = request(meta, 0, names, k, &n);
        mdt_serve_request r;
        EXPECT_OK(mdt_serve_request_parse(b, n, &r));
        EXPECT(strcmp(r.id, meta[3]) == 0, "id '%s'", r.id);
        mdt_serve_request_free(&r);
        mdt_free(b);
    }
    /* "lora" sets: names and weights in order ("" for none; a name may hold '=': split at the
     * last), the adapter's blob left to the adapter loader */
    {
        const char *sets[][2] = {{"", "0"}, {"x=0.5,y=-1e-3", "2"}, {"k=v=2", "1"}};
        for (int i = 0; i < 3; i++) {
            const char *meta[] = {"op", "forward", "lora", sets[i][0], NULL};
            size_t n = 0;
            unsigned char *b = request(meta, 1, names, k, &n);
            mdt_serve_request r;
            EXPECT_OK(mdt_serve_request_parse(b, n, &r));
            EXPECT(r.has_lora && r.n_lora == atoi(sets[i][1]), "'%s': %d", sets[i][0], r.n_lora);
            mdt_serve_request_free(&r);
            mdt_free(b);
        }
        const char *meta[] = {"op", "forward", "lora", "x=0.5,y=-1e-3", NULL};
        size_t n = 0;
        unsigned char *b = request(meta, 1, names, k, &n);
        mdt_serve_request r;
        EXPECT_OK(mdt_serve_request_parse(b, n, &r));
        EXPECT(strcmp(r.lora_names[1], "y") == 0 && r.lora_weights[1] == -1e-3 &&
                   r.lora_weights[0] == 0.5,
               "'%s' %g", r.lora_names[1], r.lora_weights[1]);
        mdt_serve_request_free(&r);
        mdt_free(b);
        const char *load[] = {"op",     "lora_load", "adapter_name",          "py-1",
                              "format", "pt",        "lora_adapter_metadata", "{}",
                              NULL};
        b = request(load, 1, names, k, &n);
        EXPECT_OK(mdt_serve_request_parse(b, n, &r));
        EXPECT(r.blob == b && !r.tensors && strcmp(r.adapter, "py-1") == 0,
               "lora_load keeps the blob for the adapter loader");
        mdt_serve_request_free(&r);
        mdt_free(b);
        char many[65 * 8 + 1];
        size_t off = 0;
        for (int i = 0; i <= MDT_SERVE_LORA_MAX; i++)
            off += (size_t)snprintf(many + off, sizeof many - off, "%sa%d=1", i ? "," : "", i);
        const char *lots[] = {"op", "forward", "lora", many, NULL};
        b = request(lots, 1, names, k, &n);
        EXPECT_ERR(mdt_serve_request_parse(b, n, &r), MDT_E_INVALID,
                   "request: ", "more than 64 adapters");
        mdt_serve_request_free(&r);
        mdt_free(b);
    }
    /* not a blob at all: the safetensors reader's message, naming "request" */
    mdt_serve_request r;
    EXPECT_ERR(mdt_serve_request_parse("{\"op\": \"info\"}", 14, &r), MDT_E_FORMAT,
               "request: ", "not a safetensors file");
    mdt_serve_request_free(&r);
}

/* An error reply is one line and carries op and id; an ok reply carries its tensors. */
static void test_replies(void) {
    unsigned char *b = NULL;
    size_t n = 0;
    mdt_st_file *f = NULL;
    EXPECT_OK(mdt_serve_reply_error("forward", "7", "first\nsecond\r", MDT_E_NOMEM, &b, &n));
    EXPECT_OK(mdt_st_open_mem(b, n, "reply", &f));
    if (f) {
        EXPECT(strcmp(mdt_st_meta(f, "status"), "error") == 0, "status");
        EXPECT(strcmp(mdt_st_meta(f, "error"), "first second ") == 0, "'%s'",
               mdt_st_meta(f, "error"));
        EXPECT(strcmp(mdt_st_meta(f, "id"), "7") == 0 && f->n == 0, "id, no tensors");
        EXPECT(mdt_st_meta(f, "code") && strcmp(mdt_st_meta(f, "code"), "MDT_E_NOMEM") == 0,
               "code '%s'", mdt_st_meta(f, "code") ? mdt_st_meta(f, "code") : "(none)");
        mdt_st_close(f);
    }
    mdt_free(b);
}

/* Parses a request as every rank does: a "session": "new" gets `token` (serve.c draws it on rank
 * 0 and broadcasts it), at rank 0's clock `now_ms`. */
static void parse_as(const char *const *meta, int nt, const char *const *names, const int64_t *k,
                     const char *token, int64_t now_ms, mdt_serve_request *r) {
    size_t n = 0;
    unsigned char *b = request(meta, nt, names, k, &n);
    EXPECT_OK(mdt_serve_request_parse(b, n, r));
    mdt_free(b);
    if (r->new_session)
        snprintf(r->session, sizeof r->session, "%s", token);
    r->now_ms = now_ms;
}

static void test_sessions(void) {
    mdt_serve_sessions ss; /* 2 sessions, 100 bytes over both, dropped after 1 s unused */
    EXPECT_OK(mdt_serve_sessions_init(&ss, 2, 100, 1000));
    const char *names[] = {"a", "b", "x"};
    const int64_t k[] = {4, 8, 2}; /* 16, 32 and 8 bytes */
    const char *keep_ab[] = {"op", "forward", "session", "new", "keep", "a,b", NULL};
    mdt_serve_request r;
    parse_as(keep_ab, 3, names, k, "s1", 0, &r);
    EXPECT(r.new_session, "a new session");
    EXPECT_OK(mdt_serve_sessions_prepare(&ss, &r));
    EXPECT_OK(mdt_serve_sessions_commit(&ss, &r));
    EXPECT(mdt_serve_sessions_bytes_of(&ss, "s1") == 48 && ss.bytes == 48, "%lld",
           (long long)ss.bytes);
    mdt_serve_request_free(&r);
    /* a later forward sends only x: a and b are merged in, with their kept values */
    const char *use[] = {"op", "forward", "session", "s1", NULL};
    parse_as(use, 1, names + 2, k + 2, NULL, 500, &r);
    EXPECT_OK(mdt_serve_sessions_prepare(&ss, &r));
    const mdt_tensor *tb = mdt_tensor_set_get(r.tensors, "b");
    EXPECT(mdt_tensor_set_count(r.tensors) == 3 && tb && tb->shape[0] == 8 &&
               ((const float *)tb->data)[0] == 2.0f,
           "merged");
    mdt_serve_request_free(&r);
    /* a name the server did not issue opens nothing, even with keep ("s9" is no one's) */
    const char *guess[] = {"op", "forward", "session", "s9", "keep", "a", NULL};
    parse_as(guess, 1, names, k, NULL, 500, &r);
    EXPECT_ERR(mdt_serve_sessions_prepare(&ss, &r), MDT_E_NOTFOUND, "session 's9' is not open",
               "\"session\": \"new\"");
    mdt_serve_request_free(&r);
    /* a second session over the byte limit: 48 + 64 > 100, refused, nothing stored */
    const char *big[] = {"op", "forward", "session", "new", "keep", "a", NULL};
    const int64_t k16[] = {16};
    parse_as(big, 1, names, k16, "s2", 500, &r);
    EXPECT_ERR(mdt_serve_sessions_prepare(&ss, &r), MDT_E_INVALID, "a new session",
               "--max-session-bytes 100");
    EXPECT(ss.n == 1 && ss.bytes == 48, "nothing stored");
    mdt_serve_request_free(&r);
    /* replacing a kept tensor counts the difference: b (32 bytes) becomes 8 bytes */
    const char *repl[] = {"op", "forward", "session", "s1", "keep", "b", NULL};
    const int64_t k2[] = {2};
    parse_as(repl, 1, names + 1, k2, NULL, 600, &r);
    EXPECT_OK(mdt_serve_sessions_prepare(&ss, &r));
    EXPECT_OK(mdt_serve_sessions_commit(&ss, &r));
    EXPECT(ss.bytes == 24 && mdt_serve_sessions_bytes_of(&ss, "s1") == 24, "%lld",
           (long long)ss.bytes);
    EXPECT(strcmp(mdt_serve_sessions_context_of(&ss, "s1"), "") == 0, "no cache branch yet");
    mdt_serve_request_free(&r);
    /* a cached forward: the session remembers its branch (the branch a --cfg 2 server computes
     * its tensors as), until a later forward names another */
    const char *cached[] = {
        "op",     "forward",          "session", "s1", "cache", "fbc", "cache_context",
        "uncond", "cache_generation", "g",       NULL};
    parse_as(cached, 1, names + 2, k + 2, NULL, 600, &r);
    EXPECT_OK(mdt_serve_sessions_prepare(&ss, &r));
    EXPECT_OK(mdt_serve_sessions_commit(&ss, &r));
    EXPECT(strcmp(mdt_serve_sessions_context_of(&ss, "s1"), "uncond") == 0 &&
               strcmp(mdt_serve_sessions_context_of(&ss, "nobody"), "") == 0,
           "branch kept");
    mdt_serve_request_free(&r);
    /* the session count: s2 and s3 would make three */
    const char *opn[] = {"op", "forward", "session", "new", "keep", "x", NULL};
    parse_as(opn, 1, names + 2, k + 2, "s2", 900, &r);
    EXPECT_OK(mdt_serve_sessions_prepare(&ss, &r));
    EXPECT_OK(mdt_serve_sessions_commit(&ss, &r));
    mdt_serve_request_free(&r);
    parse_as(opn, 1, names + 2, k + 2, "s3", 900, &r);
    EXPECT_ERR(mdt_serve_sessions_prepare(&ss, &r), MDT_E_INVALID, "--max-sessions 2");
    mdt_serve_request_free(&r);
    /* ending frees the bytes; a forward naming an ended session is refused */
    mdt_serve_sessions_end(&ss, "s1");
    EXPECT(ss.n == 1 && ss.bytes == 8, "%d %lld", ss.n, (long long)ss.bytes);
    parse_as(use, 1, names + 2, k + 2, NULL, 1000, &r);
    EXPECT_ERR(mdt_serve_sessions_prepare(&ss, &r), MDT_E_NOTFOUND, "session 's1' is not open");
    mdt_serve_request_free(&r);
    /* expiry: s2 was last used at 900 ms; at 1900 it is 1000 ms old (kept), at 1901 dropped */
    EXPECT(mdt_serve_sessions_expire(&ss, 1900) == 0 && ss.n == 1, "kept at the limit");
    EXPECT(mdt_serve_sessions_expire(&ss, 1901) == 1 && ss.n == 0 && ss.bytes == 0, "dropped");
    mdt_serve_sessions_free(&ss);
    /* "new" goes with a forward that keeps something */
    const char *bare[] = {"op", "forward", "session", "new", NULL};
    size_t n = 0;
    unsigned char *b = request(bare, 1, names, k, &n);
    EXPECT_ERR(mdt_serve_request_parse(b, n, &r), MDT_E_INVALID, "\"session\": \"new\" opens");
    mdt_serve_request_free(&r);
    mdt_free(b);
    /* tokens: 32 hex characters, two draws differ */
    uint64_t w1[2], w2[2];
    char t1[MDT_SERVE_TOKEN_CHARS + 1], t2[MDT_SERVE_TOKEN_CHARS + 1];
    EXPECT_OK(mdt_serve_token_new(w1));
    EXPECT_OK(mdt_serve_token_new(w2));
    mdt_serve_token_text(w1, t1), mdt_serve_token_text(w2, t2);
    EXPECT(strlen(t1) == 32 && strspn(t1, "0123456789abcdef") == 32 && strcmp(t1, t2) != 0,
           "'%s' '%s'", t1, t2);
}

/* A forward of more tensors than MDT_SERVE_TENSORS_MAX is refused (after its id is read, which
 * the reply echoes) before any tensor is copied; at the limit it parses. */
static void test_tensor_cap(void) {
    for (int extra = 0; extra <= 1; extra++) {
        const int n = MDT_SERVE_TENSORS_MAX + extra;
        const char **names = mdt_alloc(sizeof(char *) * (size_t)n);
        const mdt_tensor **ts = mdt_alloc(sizeof(mdt_tensor *) * (size_t)n);
        char *buf = mdt_alloc((size_t)n * 16);
        const mdt_tensor zero = {.dtype = MDT_F32, .ndim = 1, .shape = {0}};
        for (int i = 0; i < n; i++) {
            snprintf(buf + 16 * i, 16, "t%d", i);
            names[i] = buf + 16 * i, ts[i] = &zero;
        }
        const char *meta[] = {"op", "forward", "id", "many", NULL};
        unsigned char *b = NULL;
        size_t size = 0;
        EXPECT_OK(mdt_st_serialize(n, names, ts, meta, &b, &size));
        mdt_serve_request r;
        if (extra)
            EXPECT_ERR(mdt_serve_request_parse(b, size, &r), MDT_E_INVALID, "1025 tensors",
                       "limit of 1024 per request");
        else
            EXPECT_OK(mdt_serve_request_parse(b, size, &r));
        EXPECT(strcmp(r.id, "many") == 0, "id '%s' kept for the reply", r.id);
        mdt_serve_request_free(&r);
        mdt_free(b), mdt_free(buf), mdt_free(names), mdt_free(ts);
    }
}

/* ---- the ZMTP reader ---- */

/* What a libzmq DEALER sends: greeting, READY, a PING, the message [empty, "abc"], and a long
 * frame of 300 bytes as a one-frame message. */
static size_t client_stream(unsigned char *b) {
    size_t n = 0;
    memset(b, 0, 64);
    b[0] = 0xff, b[9] = 0x7f, b[10] = 3, b[11] = 1;
    b[12] = 'N', b[13] = 'U', b[14] = 'L', b[15] = 'L';
    n = 64;
    static const unsigned char ready[] = {4,   41,  5,   'R', 'E', 'A', 'D', 'Y', 11,  'S', 'o',
                                          'c', 'k', 'e', 't', '-', 'T', 'y', 'p', 'e', 0,   0,
                                          0,   6,   'D', 'E', 'A', 'L', 'E', 'R', 8,   'I', 'd',
                                          'e', 'n', 't', 'i', 't', 'y', 0,   0,   0,   0};
    memcpy(b + n, ready, sizeof ready), n += sizeof ready;
    static const unsigned char ping[] = {4, 9, 4, 'P', 'I', 'N', 'G', 0, 30, 'c', 'x'};
    memcpy(b + n, ping, sizeof ping), n += sizeof ping;
    static const unsigned char msg[] = {1, 0, 0, 3, 'a', 'b', 'c'};
    memcpy(b + n, msg, sizeof msg), n += sizeof msg;
    n += mdt_zmtp_frame_header(300, 0, b + n);
    memset(b + n, 'z', 300), n += 300;
    return n;
}

static void test_zmtp_reader(void) {
    unsigned char in[1024];
    const size_t total = client_stream(in);
    for (size_t chunk = 1; chunk <= total; chunk += chunk < 8 ? 1 : 37) {
        mdt_zmtp_reader r;
        mdt_zmtp_reader_init(&r);
        char log[256] = "";
        size_t body = 0, pos = 0;
        int errors = 0;
        while (pos <= total) {
            const size_t n = total - pos < chunk ? total - pos : chunk;
            const unsigned char *p = in + pos;
            size_t left = n;
            for (;;) {
                mdt_zmtp_event ev;
                const size_t used = mdt_zmtp_step(&r, p, left, &ev);
                p += used, left -= used;
                char e[32] = "";
                switch (ev.kind) {
                case MDT_ZMTP_EV_READY: snprintf(e, sizeof e, "R(%s)", r.peer_type); break;
                case MDT_ZMTP_EV_PING: snprintf(e, sizeof e, "P%zu", r.ping_ctx_len); break;
                case MDT_ZMTP_EV_FRAME_START:
                    snprintf(e, sizeof e, "S%llu%s", (unsigned long long)ev.size,
                             ev.more ? "+" : "");
                    break;
                case MDT_ZMTP_EV_BODY: body += ev.len; break;
                case MDT_ZMTP_EV_FRAME_END: snprintf(e, sizeof e, "E%s", ev.more ? "+" : ""); break;
                case MDT_ZMTP_EV_ERROR: errors++; break;
                case MDT_ZMTP_EV_NONE: break;
                }
                strncat(log, e, sizeof log - strlen(log) - 1);
                if ((ev.kind == MDT_ZMTP_EV_NONE && used == 0) || ev.kind == MDT_ZMTP_EV_ERROR)
                    break;
            }
            if (pos == total)
                break;
            pos += n;
        }
        EXPECT(!errors && strcmp(log, "R(DEALER)P2S0+E+S3ES300E") == 0 && body == 303,
               "chunk %zu: '%s', %zu body bytes, %s", chunk, log, body, r.error);
    }
    /* broken peers: each is an error naming the problem, and stays one */
    static const struct {
        size_t at;
        unsigned char byte;
        const char *want;
    } bad[] = {{0, 0x00, "not a ZMTP peer"},
               {10, 2, "ZMTP 1 or 2"},
               {12, 'C', "security mechanism 'CULL'"},
               {64, 0x44, "reserved flag bits"},
               {67, 'X', "first command is not READY"},
               {64 + 43 + 11, 0x05, "command frame with MORE"}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        unsigned char b[1024];
        const size_t n = client_stream(b);
        b[bad[i].at] = bad[i].byte;
        mdt_zmtp_reader r;
        mdt_zmtp_reader_init(&r);
        mdt_zmtp_event ev = {0};
        const unsigned char *p = b;
        size_t left = n;
        for (int k = 0; k < 100 && ev.kind != MDT_ZMTP_EV_ERROR; k++) {
            const size_t used = mdt_zmtp_step(&r, p, left, &ev);
            p += used, left -= used;
        }
        EXPECT(ev.kind == MDT_ZMTP_EV_ERROR && strstr(r.error, bad[i].want), "case %zu: '%s'", i,
               r.error);
        EXPECT(mdt_zmtp_step(&r, p, left, &ev) == 0 && ev.kind == MDT_ZMTP_EV_ERROR,
               "stays failed");
    }
}

/* ---- the listener against libzmq clients ---- */

/* A client socket; heartbeat_ms > 0: it pings that often and drops the connection after 4 times
 * as long without an answer (options before the connect: they apply to its connections). */
static void *zsock(void *ctx, int type, const char *ep, int heartbeat_ms) {
    void *s = zmq_socket(ctx, type);
    const int zero = 0, tmo = 10000, hb_timeout = 4 * heartbeat_ms;
    zmq_setsockopt(s, ZMQ_LINGER, &zero, sizeof zero);
    zmq_setsockopt(s, ZMQ_RCVTIMEO, &tmo, sizeof tmo);
    if (heartbeat_ms > 0) {
        zmq_setsockopt(s, ZMQ_HEARTBEAT_IVL, &heartbeat_ms, sizeof heartbeat_ms);
        zmq_setsockopt(s, ZMQ_HEARTBEAT_TIMEOUT, &hb_timeout, sizeof hb_timeout);
        zmq_socket_monitor(s, "inproc://mon", ZMQ_EVENT_DISCONNECTED);
    }
    zmq_connect(s, ep);
    return s;
}

/* A DEALER request: the delimiter and one blob of `n` bytes (content irrelevant here). */
static void zsend(void *s, size_t n) {
    unsigned char *b = calloc(1, n ? n : 1);
    zmq_send(s, "", 0, ZMQ_SNDMORE);
    zmq_send(s, b, n, 0);
    free(b);
}

/* The reply's "error" (or "ok"), received within the socket's timeout, into out; its "id" ("" if
 * none) into id when id is not NULL. */
static const char *zreply_id(void *s, char *out, size_t cap, char *id, size_t id_cap) {
    zmq_msg_t m;
    zmq_msg_init(&m);
    snprintf(out, cap, "(no reply)");
    for (int more = 1; more;) {
        if (zmq_msg_recv(&m, s, 0) < 0)
            break;
        more = zmq_msg_more(&m);
        mdt_st_file *f = NULL;
        if (!more && mdt_st_open_mem(zmq_msg_data(&m), zmq_msg_size(&m), "reply", &f) == MDT_OK) {
            const char *e = mdt_st_meta(f, "error"), *rid = mdt_st_meta(f, "id");
            snprintf(out, cap, "%s", e ? e : "ok");
            if (id)
                snprintf(id, id_cap, "%s", rid ? rid : "");
            mdt_st_close(f);
        }
    }
    zmq_msg_close(&m);
    return out;
}

static const char *zreply(void *s, char *out, size_t cap) {
    return zreply_id(s, out, cap, NULL, 0);
}

static void nap_ms(long ms) {
    const struct timespec t = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&t, NULL);
}

static void test_listener(void) {
    char ep[128], path[120], got[512];
    snprintf(path, sizeof path, "/tmp/mdt_test_serve_%ld.sock", (long)getpid());
    snprintf(ep, sizeof ep, "ipc://%s", path);
    mdt_serve_params p = mdt_serve_params_default();
    p.endpoint = ep, p.max_request_bytes = 1 << 20, p.max_queue_bytes = 3 << 19; /* 1, 1.5 MiB */
    mdt_serve_listener *l = NULL;
    EXPECT_OK(mdt_serve_listen(&p, &l));
    if (!l)
        return;
    struct stat sb;
    EXPECT(stat(path, &sb) == 0 && (sb.st_mode & 0777) == 0600, "socket mode");
    mdt_serve_listener *twice = NULL;
    EXPECT_ERR(mdt_serve_listen(&p, &twice), MDT_E_INVALID, "a running server listens there");
    void *ctx = zmq_ctx_new();
    /* B pings every 50 ms and gives up after 200 ms without an answer: it must stay connected */
    void *b = zsock(ctx, ZMQ_DEALER, ep, 50);
    void *mon = zmq_socket(ctx, ZMQ_PAIR);
    const int mtmo = 0;
    zmq_setsockopt(mon, ZMQ_RCVTIMEO, &mtmo, sizeof mtmo);
    zmq_connect(mon, "inproc://mon");
    void *a = zsock(ctx, ZMQ_DEALER, ep, 0), *c = zsock(ctx, ZMQ_DEALER, ep, 0);
    void *req = zsock(ctx, ZMQ_REQ, ep, 0);
    /* the loop is "busy" (nothing is taken): A's 900 KB are held; B's 900 KB would pass the
     * 1.5 MiB in all and are refused at once */
    zsend(a, 900000);
    nap_ms(300);
    const int64_t base = mdt_mem_live();
    zsend(b, 900000);
    EXPECT(strstr(zreply(b, got, sizeof got), "the server is busy") &&
               strstr(got, "--max-queue-bytes 1572864"),
           "'%s'", got);
    /* 128 frames of 1 MiB - 64: answered after the last, never more than one frame held */
    mdt_mem_reset_peak();
    {
        unsigned char *f = calloc(1, (1 << 20) - 64);
        zmq_send(c, "", 0, ZMQ_SNDMORE);
        for (int i = 0; i < 128; i++)
            zmq_send(c, f, (1 << 20) - 64, i < 127 ? ZMQ_SNDMORE : 0);
        free(f);
    }
    EXPECT(strstr(zreply(c, got, sizeof got), "request: 129 frames"), "'%s'", got);
    EXPECT(mdt_mem_peak() - base < (2 << 20), "peak %lld bytes over the base while 128 MiB came",
           (long long)(mdt_mem_peak() - base));
    /* a blob over --max-request-bytes, and a message without the delimiter */
    zsend(c, (1 << 20) + 1);
    EXPECT(strstr(zreply(c, got, sizeof got), "over the server's --max-request-bytes 1048576"),
           "'%s'", got);
    zmq_send(c, "x", 1, 0);
    EXPECT(strstr(zreply(c, got, sizeof got), "request: 1 frame;"), "'%s'", got);
    /* two frames whose first is not empty: the reply says so (it said "2 frames", the number a
     * request has) */
    zmq_send(c, "xyz", 3, ZMQ_SNDMORE);
    zmq_send(c, "blob", 4, 0);
    EXPECT(strstr(zreply(c, got, sizeof got),
                  "request: the delimiter frame (the first of 2) has 3 bytes: it must be empty"),
           "'%s'", got);
    /* per client: 8 requests waiting, the 9th refused */
    for (int i = 0; i < 9; i++)
        zsend(c, 10);
    EXPECT(strstr(zreply(c, got, sizeof got), "has 8 requests waiting"), "'%s'", got);
    /* a REQ client's request, then a client that leaves before its request is taken */
    zmq_send(req, "req", 3, 0);
    void *gone = zsock(ctx, ZMQ_DEALER, ep, 0);
    zsend(gone, 5);
    nap_ms(200);
    zmq_close(gone);
    nap_ms(300);
    /* the loop takes them in arrival order: A's, C's eight, the REQ's (the leaver's was dropped) */
    mdt_serve_incoming in;
    int taken = 0, from_req = 0;
    size_t sizes[16];
    while (taken < 16 && mdt_serve_listener_next(l, 500, &in)) {
        sizes[taken++] = in.size;
        from_req += in.size == 3;
        unsigned char *r = NULL;
        size_t rn = 0;
        const char *meta[] = {NULL};
        EXPECT_OK(mdt_serve_reply_ok(meta, NULL, &r, &rn));
        mdt_serve_listener_reply(l, in.conn, r, rn);
        mdt_serve_listener_done(l, &in);
    }
    EXPECT(taken == 10 && sizes[0] == 900000 && sizes[1] == 10 && sizes[8] == 10 && from_req == 1,
           "%d taken", taken);
    EXPECT(strcmp(zreply(a, got, sizeof got), "ok") == 0, "A: '%s'", got);
    int oks = 0;
    for (int i = 0; i < 8; i++)
        oks += strcmp(zreply(c, got, sizeof got), "ok") == 0;
    EXPECT(oks == 8, "C: %d ok", oks);
    {
        zmq_msg_t m;
        zmq_msg_init(&m);
        EXPECT(zmq_msg_recv(&m, req, 0) > 0 && !zmq_msg_more(&m), "the REQ client's reply");
        zmq_msg_close(&m);
    }
    /* a second of heartbeats later, B never lost its connection, and the budget is free again */
    nap_ms(1000);
    zmq_msg_t ev;
    zmq_msg_init(&ev);
    EXPECT(zmq_msg_recv(&ev, mon, 0) < 0, "B was disconnected: its pings went unanswered");
    zmq_msg_close(&ev);
    zsend(b, 900000);
    EXPECT(mdt_serve_listener_next(l, 2000, &in) && in.size == 900000, "B's request now fits");
    mdt_serve_listener_fail_all(l, "the server is ending", 1.0);
    mdt_serve_listener_done(l, &in);
    zmq_socket_monitor(b, NULL, 0);
    void *socks[] = {a, b, c, req, mon};
    for (size_t i = 0; i < sizeof socks / sizeof socks[0]; i++)
        zmq_close(socks[i]);
    zmq_ctx_term(ctx);
    mdt_serve_listener_free(l);
    EXPECT(stat(path, &sb) != 0, "the socket file is removed");
    /* binding refuses a missing directory and a busy port before anything else */
    p.endpoint = "ipc:///nonexistent-dir-mdt/s.sock";
    EXPECT_ERR(mdt_serve_listen(&p, &l), MDT_E_IO,
               "the directory '/nonexistent-dir-mdt' does "
               "not exist");
    p.endpoint = "tcp://127.0.0.1:*";
    EXPECT_OK(mdt_serve_listen(&p, &l));
    if (l) {
        char busy[64];
        snprintf(busy, sizeof busy, "%s", mdt_serve_listener_endpoint(l));
        mdt_serve_listener *l2 = NULL;
        p.endpoint = busy;
        EXPECT_ERR(mdt_serve_listen(&p, &l2), MDT_E_IO, "cannot bind: Address already in use");
        mdt_serve_listener_free(l);
    }
    p.endpoint = "tcp://::1:*";
    EXPECT_OK(mdt_serve_listen(&p, &l));
    EXPECT(l && strncmp(mdt_serve_listener_endpoint(l), "tcp://[::1]:", 12) == 0, "'%s'",
           l ? mdt_serve_listener_endpoint(l) : "");
    mdt_serve_listener_free(l);
}

/* ---- raw peers: bytes on a socket, no libzmq ---- */

/* A connection to the listener's socket file (blocking). -1 on failure. */
static int raw_connect(const char *path) {
    struct sockaddr_un a;
    memset(&a, 0, sizeof a);
    a.sun_family = AF_UNIX;
    snprintf(a.sun_path, sizeof a.sun_path, "%.100s", path);
    const int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    if (fd >= 0 && connect(fd, (const struct sockaddr *)&a, sizeof a) != 0) {
        close(fd);
        return -1;
    }
    return fd;
}

static void raw_send(int fd, const void *b, size_t n) {
    for (const char *p = b; n > 0;) {
        const ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
        if (w <= 0)
            return;
        p += w, n -= (size_t)w;
    }
}

/* What a DEALER says first: its greeting and its READY. */
static void raw_handshake(int fd) {
    unsigned char b[1024];
    const size_t n = client_stream(b);
    raw_send(fd, b, 64 + 43); /* the greeting and READY of client_stream */
    (void)n;
}

/* The message [empty, blob of `n` bytes] (the blob's bytes are irrelevant to the listener). */
static void raw_message(int fd, size_t n) {
    unsigned char h[16];
    size_t k = mdt_zmtp_frame_header(0, 1, h);
    k += mdt_zmtp_frame_header(n, 0, h + k);
    raw_send(fd, h, k);
    unsigned char *b = calloc(1, n ? n : 1);
    raw_send(fd, b, n);
    free(b);
}

/* 1 when the server closed the connection within `ms` (reading and dropping what it sent: all
 * of it each time, so bytes it wrote before closing do not hide the close). */
static int raw_closed_within(int fd, long ms) {
    unsigned char b[4096];
    for (long waited = 0; waited <= ms; waited += 10) {
        struct pollfd pf = {fd, POLLIN, 0};
        if (poll(&pf, 1, 10) <= 0)
            continue;
        ssize_t r;
        while ((r = recv(fd, b, sizeof b, MSG_DONTWAIT)) > 0)
            ;
        if (r == 0 || (errno != EAGAIN && errno != EINTR))
            return 1;
    }
    return 0;
}

/* 1 when the server closed the connection within `ms`, reading nothing of what it sent (a
 * Unix socket whose peer closed reports POLLHUP with its unread bytes still queued). */
static int raw_hup_within(int fd, long ms) {
    for (long waited = 0; waited <= ms; waited += 10) {
        struct pollfd pf = {fd, 0, 0};
        if (poll(&pf, 1, 10) > 0 && (pf.revents & (POLLHUP | POLLERR)))
            return 1;
    }
    return 0;
}

/* Connections without deadlines and a full table (MDT_SERVE_MAX_CLIENTS): a peer that never
 * finishes its handshake is closed after the handshake timeout, and a newcomer to a full table
 * takes the place of the connection idle longest, unless every connection has something under
 * way. Before, 256 silent connections locked every client out for as long as they stayed. */
static void test_listener_connections(void) {
    char ep[128], path[120];
    snprintf(path, sizeof path, "/tmp/mdt_test_serve_conn_%ld.sock", (long)getpid());
    snprintf(ep, sizeof ep, "ipc://%s", path);
    mdt_serve_params p = mdt_serve_params_default();
    p.endpoint = ep, p.handshake_timeout = 0.3;
    mdt_serve_listener *l = NULL;
    EXPECT_OK(mdt_serve_listen(&p, &l));
    if (!l)
        return;
    /* silent, and half a greeting: both closed after 0.3 s; one that finished its handshake
     * stays */
    const int silent = raw_connect(path), half = raw_connect(path), good = raw_connect(path);
    raw_send(half, "\xff\0\0\0", 4);
    raw_handshake(good);
    EXPECT(raw_closed_within(silent, 1500) && raw_closed_within(half, 100),
           "a connection without its handshake stayed open past the handshake timeout");
    EXPECT(!raw_closed_within(good, 200), "a connection that finished its handshake was closed");
    close(silent), close(half), close(good);
    /* a full table of idle connections: a newcomer's request is taken, the oldest idle
     * connection made room */
    int fds[MDT_SERVE_MAX_CLIENTS];
    for (int i = 0; i < MDT_SERVE_MAX_CLIENTS; i++) {
        fds[i] = raw_connect(path);
        raw_handshake(fds[i]);
        nap_ms(i == 0 ? 20 : 0); /* the first is the oldest by a margin */
    }
    nap_ms(200);
    void *ctx = zmq_ctx_new();
    void *z = zsock(ctx, ZMQ_DEALER, ep, 0);
    zsend(z, 7);
    mdt_serve_incoming in;
    const int got = mdt_serve_listener_next(l, 3000, &in);
    EXPECT(got && in.size == 7, "a newcomer to a table of %d idle connections was locked out",
           MDT_SERVE_MAX_CLIENTS);
    if (got)
        mdt_serve_listener_done(l, &in); /* its connection has a request running: not idle */
    EXPECT(raw_closed_within(fds[0], 500), "the connection idle longest was not the one closed");
    int others = 0;
    for (int i = 1; i < MDT_SERVE_MAX_CLIENTS; i++)
        others += raw_closed_within(fds[i], 0);
    EXPECT(others == 0, "%d other connections were closed", others);
    /* every connection busy (a request queued on each): a newcomer is refused, none closed */
    for (int i = 1; i < MDT_SERVE_MAX_CLIENTS; i++)
        raw_message(fds[i], 3);
    nap_ms(300);
    const int late = raw_connect(path);
    EXPECT(raw_closed_within(late, 1000), "a newcomer to a table of busy connections was kept");
    others = 0;
    for (int i = 1; i < MDT_SERVE_MAX_CLIENTS; i++)
        others += raw_closed_within(fds[i], 0);
    EXPECT(others == 0, "%d busy connections were closed for a newcomer", others);
    close(late);
    for (int i = 0; i < MDT_SERVE_MAX_CLIENTS; i++)
        close(fds[i]);
    zmq_close(z);
    zmq_ctx_term(ctx);
    mdt_serve_listener_free(l);
}

/* Peers that announce large blobs and stall (slowloris): nothing is reserved or allocated for
 * what a frame header only announces, so two such peers leave the queue budget to the others,
 * and a message that gets no byte for the message timeout closes its connection and releases
 * what it held. Before, each stalled peer reserved (and allocated) its announced size, and two
 * of them made every other request "busy" for as long as they stayed. */
static void test_listener_stalled_messages(void) {
    char ep[128], path[120];
    snprintf(path, sizeof path, "/tmp/mdt_test_serve_slow_%ld.sock", (long)getpid());
    snprintf(ep, sizeof ep, "ipc://%s", path);
    mdt_serve_params p = mdt_serve_params_default();
    p.endpoint = ep, p.max_request_bytes = 1 << 20, p.max_queue_bytes = 3 << 19; /* 1, 1.5 MiB */
    p.message_timeout = 0.5;
    p.min_rate = 0; /* the pauses alone (test_listener_min_rate has the rate) */
    mdt_serve_listener *l = NULL;
    EXPECT_OK(mdt_serve_listen(&p, &l));
    if (!l)
        return;
    const int64_t base = mdt_mem_live();
    int slow[2];
    for (int i = 0; i < 2; i++) { /* [empty, a 1 MiB blob announced], 100 of its bytes, silence */
        slow[i] = raw_connect(path);
        raw_handshake(slow[i]);
        unsigned char h[16], body[100] = {0};
        size_t k = mdt_zmtp_frame_header(0, 1, h);
        k += mdt_zmtp_frame_header(1 << 20, 0, h + k);
        raw_send(slow[i], h, k);
        raw_send(slow[i], body, sizeof body);
    }
    nap_ms(150);
    EXPECT(mdt_mem_live() - base < (256 << 10), "two stalled peers hold %lld bytes",
           (long long)(mdt_mem_live() - base));
    void *ctx = zmq_ctx_new();
    void *z = zsock(ctx, ZMQ_DEALER, ep, 0);
    zsend(z, 900000);
    mdt_serve_incoming in;
    int got = mdt_serve_listener_next(l, 1000, &in);
    char why[512] = "";
    if (!got)
        zreply(z, why, sizeof why);
    EXPECT(got && in.size == 900000, "a request beside two stalled peers: '%s'", why);
    if (got)
        mdt_serve_listener_done(l, &in);
    /* the stalled peers are closed once 0.5 s pass without a byte; a peer that keeps sending
     * slowly (a byte every 0.1 s) is not */
    const int steady = raw_connect(path);
    raw_handshake(steady);
    unsigned char h[16];
    size_t k = mdt_zmtp_frame_header(0, 1, h);
    k += mdt_zmtp_frame_header(40, 0, h + k);
    raw_send(steady, h, k);
    int closed = 0;
    for (int t = 0; t < 10; t++) {
        raw_send(steady, "", 1);
        nap_ms(100);
    }
    for (int i = 0; i < 2; i++)
        closed += raw_closed_within(slow[i], 500);
    EXPECT(closed == 2, "%d of 2 stalled peers closed 1 s after their last byte", closed);
    EXPECT(!raw_closed_within(steady, 0), "a slow but steady peer was closed");
    /* what they held is free again: the largest request fits beside the steady peer's bytes */
    zsend(z, 1 << 20);
    got = mdt_serve_listener_next(l, 1000, &in);
    EXPECT(got && in.size == (1 << 20), "the stalled peers' bytes were not released");
    if (got)
        mdt_serve_listener_done(l, &in);
    close(slow[0]), close(slow[1]), close(steady);
    zmq_close(z);
    zmq_ctx_term(ctx);
    mdt_serve_listener_free(l);
}

/* The frame headers of [empty, blob of `n` bytes announced], sent without the blob. */
static void raw_announce(int fd, uint64_t n) {
    unsigned char h[16];
    size_t k = mdt_zmtp_frame_header(0, 1, h);
    k += mdt_zmtp_frame_header(n, 0, h + k);
    raw_send(fd, h, k);
}

/* Peers that send a byte just inside each message timeout (a slowloris the pause rule alone
 * never closes): a connection that falls behind the minimum rate by more than the grace is
 * closed, while one above it gets its message through; the rate is the connection's, so
 * neither opening a new message each time nor banking a burst buys time; and a table full of
 * messages already refused (announced over the bound, fed at any rate) lets a newcomer in, in
 * place of the one refused earliest among those with nothing else under way. Before, 256 such
 * peers locked every client out for as long as they kept sending; then, with a grace per
 * message, peers that re-opened a message each 25 s did, and the eviction closed a connection
 * with a request running. */
static void test_listener_min_rate(void) {
    char ep[128], path[120];
    snprintf(path, sizeof path, "/tmp/mdt_test_serve_rate_%ld.sock", (long)getpid());
    snprintf(ep, sizeof ep, "ipc://%s", path);
    mdt_serve_params p = mdt_serve_params_default();
    p.endpoint = ep, p.max_request_bytes = 1 << 20, p.message_timeout = 0.4;
    p.min_rate = 2000; /* bytes per second */
    mdt_serve_listener *l = NULL;
    EXPECT_OK(mdt_serve_listen(&p, &l));
    if (!l)
        return;
    /* a trickler (a byte each 0.1 s: never a pause of 0.4 s) and a peer at 5000 bytes a second
     * (500 each 0.1 s) that sends 6000 bytes */
    const int trickle = raw_connect(path), steady = raw_connect(path);
    raw_handshake(trickle), raw_handshake(steady);
    raw_announce(trickle, 6000), raw_announce(steady, 6000);
    static const unsigned char zeros[500];
    int trickle_closed = 0;
    for (int t = 0; t < 12; t++) {
        raw_send(trickle, zeros, 1);
        raw_send(steady, zeros, 500);
        nap_ms(100);
        trickle_closed |= raw_closed_within(trickle, 0);
    }
    EXPECT(trickle_closed, "a peer at 10 bytes a second (minimum 2000) stayed 1.2 s");
    mdt_serve_incoming in;
    const int got = mdt_serve_listener_next(l, 1000, &in);
    EXPECT(got && in.size == 6000, "a message at 5000 bytes a second (minimum 2000) was lost");
    if (got)
        mdt_serve_listener_done(l, &in);
    EXPECT(!raw_closed_within(steady, 0), "the peer above the minimum rate was closed");
    close(trickle), close(steady);
    /* the rate is the connection's, not each message's: a peer that ends a message and starts
     * the next each 0.3 s (never a message older than the grace, no body byte) is closed, and
     * so is one that banks 10 s worth of bytes in a burst and then trickles; a peer sending
     * 500-byte requests back to back (5000 bytes a second) stays */
    const int pipe_fd = raw_connect(path), bank = raw_connect(path), busy = raw_connect(path);
    raw_handshake(pipe_fd), raw_handshake(bank), raw_handshake(busy);
    raw_announce(bank, 100000);
    raw_send(bank, zeros, 500);
    unsigned char h[32];
    const size_t open_n = mdt_zmtp_frame_header(0, 1, h); /* [empty, MORE]: a message begins */
    raw_send(pipe_fd, h, open_n), raw_send(busy, h, open_n);
    for (int i = 0; i < 40; i++)
        raw_send(bank, zeros, 500); /* 20500 bytes: 10 s at 2000 bytes a second */
    int pipe_closed = 0, bank_closed = 0, served = 0;
    for (int t = 0; t < 16; t++) {
        if (t % 3 == 2) { /* an empty last frame ends the message, [empty, MORE] opens the next */
            size_t k = mdt_zmtp_frame_header(0, 0, h);
            k += mdt_zmtp_frame_header(0, 1, h + k);
            raw_send(pipe_fd, h, k);
        }
        size_t k = mdt_zmtp_frame_header(500, 0, h); /* busy: its blob ends the message... */
        raw_send(busy, h, k);
        raw_send(busy, zeros, 500);
        raw_send(busy, h, mdt_zmtp_frame_header(0, 1, h)); /* ...and the next begins */
        raw_send(bank, zeros, 1);
        nap_ms(100);
        while (mdt_serve_listener_next(l, 0, &in)) {
            served += in.size == 500;
            mdt_serve_listener_reply(l, in.conn, NULL, 0); /* ends it: not one in flight */
            mdt_serve_listener_done(l, &in);
        }
        pipe_closed |= raw_closed_within(pipe_fd, 0);
        bank_closed |= raw_closed_within(bank, 0);
    }
    EXPECT(pipe_closed, "a peer opening a message each 0.3 s with no byte stayed 1.6 s");
    EXPECT(bank_closed, "a peer that banked 20500 bytes and then sent 10 a second stayed 1.6 s");
    EXPECT(served >= 12 && !raw_closed_within(busy, 0),
           "a peer sending requests back to back at 5000 bytes a second was closed (%d served)",
           served);
    close(pipe_fd), close(bank), close(busy);
    mdt_serve_listener_free(l);
    /* no deadlines at all: a full table of peers whose blobs (announced over the bound) are
     * refused; a newcomer's request is taken, the peer refused first made room */
    p.message_timeout = 0, p.min_rate = 0;
    EXPECT_OK(mdt_serve_listen(&p, &l));
    if (!l)
        return;
    int fds[MDT_SERVE_MAX_CLIENTS];
    for (int i = 0; i < MDT_SERVE_MAX_CLIENTS; i++) {
        fds[i] = raw_connect(path);
        raw_handshake(fds[i]);
        if (i == 0) /* the first has a request running too: closing it would lose that */
            raw_message(fds[i], 3);
        raw_announce(fds[i], (uint64_t)1 << 30);
        raw_send(fds[i], zeros, 1);
        nap_ms(i < 2 ? 20 : 0); /* the first two are refused earliest by a margin */
    }
    const int got1 = mdt_serve_listener_next(l, 1000, &in);
    EXPECT(got1 && in.size == 3, "the first peer's request was not taken");
    mdt_serve_incoming running = in; /* taken, no reply yet: in flight */
    nap_ms(200);
    void *ctx = zmq_ctx_new();
    void *z = zsock(ctx, ZMQ_DEALER, ep, 0);
    zsend(z, 7);
    const int got2 = mdt_serve_listener_next(l, 3000, &in);
    EXPECT(got2 && in.size == 7, "a newcomer to a table of %d refused messages was locked out",
           MDT_SERVE_MAX_CLIENTS);
    if (got2)
        mdt_serve_listener_done(l, &in);
    if (got1)
        mdt_serve_listener_done(l, &running);
    EXPECT(raw_closed_within(fds[1], 500),
           "the message refused earliest with nothing else under way was not the one closed");
    EXPECT(!raw_closed_within(fds[0], 0), "a peer with a request running was closed for room");
    int others = 0;
    for (int i = 2; i < MDT_SERVE_MAX_CLIENTS; i++)
        others += raw_closed_within(fds[i], 0);
    EXPECT(others == 0, "%d other connections were closed", others);
    for (int i = 0; i < MDT_SERVE_MAX_CLIENTS; i++)
        close(fds[i]);
    zmq_close(z);
    zmq_ctx_term(ctx);
    mdt_serve_listener_free(l);
    /* every refused peer has a request running too: none is closed for a newcomer (it would
     * lose that request's reply), the newcomer is */
    EXPECT_OK(mdt_serve_listen(&p, &l));
    if (!l)
        return;
    static mdt_serve_incoming run_all[MDT_SERVE_MAX_CLIENTS];
    int taken = 0;
    for (int i = 0; i < MDT_SERVE_MAX_CLIENTS; i++) {
        fds[i] = raw_connect(path);
        raw_handshake(fds[i]);
        raw_message(fds[i], 3);
        raw_announce(fds[i], (uint64_t)1 << 30);
        raw_send(fds[i], zeros, 1);
        taken += mdt_serve_listener_next(l, 1000, &run_all[taken]);
    }
    EXPECT(taken == MDT_SERVE_MAX_CLIENTS, "%d of %d requests taken", taken, MDT_SERVE_MAX_CLIENTS);
    nap_ms(200);
    const int late = raw_connect(path);
    EXPECT(raw_closed_within(late, 1000), "a newcomer to a table of refusals with requests "
                                          "running was kept");
    others = 0;
    for (int i = 0; i < MDT_SERVE_MAX_CLIENTS; i++)
        others += raw_closed_within(fds[i], 0);
    EXPECT(others == 0, "%d peers with a request running were closed for a newcomer", others);
    close(late);
    for (int i = 0; i < taken; i++)
        mdt_serve_listener_done(l, &run_all[i]);
    for (int i = 0; i < MDT_SERVE_MAX_CLIENTS; i++)
        close(fds[i]);
    mdt_serve_listener_free(l);
}

/* Bytes waiting to be read on `fd`. */
static int raw_pending(int fd) {
    int n = 0;
    return ioctl(fd, FIONREAD, &n) == 0 ? n : -1;
}

/* A peer that reads its replies a few hundred bytes at a time, just often enough that a byte is
 * written within every message timeout: its output waits behind a full socket, and the minimum
 * rate applies to what it reads as to what it sends (a leaky bucket on each side), so it is
 * closed; a peer with the same requests that reads what it is sent is not. Before, only "a byte
 * written within the message timeout" bounded the output, and 256 such peers, each reading 300
 * bytes a quarter second, kept every newcomer out (none is idle, none has a refused message). */
static void test_listener_slow_reader(void) {
    char ep[128], path[120];
    snprintf(path, sizeof path, "/tmp/mdt_test_serve_slowrd_%ld.sock", (long)getpid());
    snprintf(ep, sizeof ep, "ipc://%s", path);
    mdt_serve_params p = mdt_serve_params_default();
    p.endpoint = ep, p.message_timeout = 0.4;
    p.min_rate = 2000; /* bytes per second */
    mdt_serve_listener *l = NULL;
    EXPECT_OK(mdt_serve_listen(&p, &l));
    if (!l)
        return;
    const int slow = raw_connect(path), reader = raw_connect(path);
    raw_handshake(slow), raw_handshake(reader);
    static const unsigned char one_frame[2] = {0, 0}; /* [empty]: refused, a ~250-byte reply */
    /* the slow peer fills its socket with refusals: until what waits for it stops growing, and
     * ten more, which wait in the listener */
    int still = 0, last = -1;
    for (int i = 0; i < 4000 && still < 3; i++) {
        raw_send(slow, one_frame, sizeof one_frame);
        nap_ms(2);
        const int now = raw_pending(slow);
        still = now == last ? still + 1 : 0;
        last = now;
    }
    EXPECT(still >= 3, "the slow peer's socket never filled (%d bytes waiting)", last);
    for (int i = 0; i < 10; i++)
        raw_send(slow, one_frame, sizeof one_frame);
    int slow_closed = 0, reader_closed = 0;
    unsigned char buf[1 << 16];
    for (int t = 0; t < 12; t++) { /* 300 bytes each 0.25 s: 1200 a second, minimum 2000 */
        nap_ms(250);
        ssize_t r = recv(slow, buf, 300, MSG_DONTWAIT);
        slow_closed |= r == 0 || (r < 0 && errno != EAGAIN && errno != EINTR);
        raw_send(slow, one_frame, sizeof one_frame); /* one more reply waits */
        raw_send(reader, one_frame, sizeof one_frame);
        while ((r = recv(reader, buf, sizeof buf, MSG_DONTWAIT)) > 0)
            ;
        reader_closed |= r == 0 || (r < 0 && errno != EAGAIN && errno != EINTR);
    }
    ssize_t r; /* what waits for the slow peer is read at last: then its end, if closed */
    while ((r = recv(slow, buf, sizeof buf, MSG_DONTWAIT)) > 0)
        ;
    slow_closed |= r == 0 || (r < 0 && errno != EAGAIN && errno != EINTR);
    EXPECT(slow_closed, "a peer reading 1200 bytes a second of its replies (minimum 2000) stayed "
                        "3 s with its output waiting");
    EXPECT(!reader_closed && !raw_closed_within(reader, 0),
           "a peer that reads its replies was closed");
    close(slow), close(reader);
    mdt_serve_listener_free(l);
}

/* A listener on `path` (max request 1 MiB, queue 1.5 MiB, the message timeout `msg_s`) and a raw
 * peer R that sent a request and got a 1.2 MiB reply it has not read; *r gets R's socket. */
static mdt_serve_listener *listener_with_unread_reply(const char *tag, char *ep, size_t epn,
                                                      char *path, size_t pathn, double msg_s,
                                                      int *r) {
    snprintf(path, pathn, "/tmp/mdt_test_serve_%s_%ld.sock", tag, (long)getpid());
    snprintf(ep, epn, "ipc://%s", path);
    mdt_serve_params p = mdt_serve_params_default();
    p.endpoint = ep, p.max_request_bytes = 1 << 20, p.max_queue_bytes = 3 << 19; /* 1, 1.5 MiB */
    if (msg_s > 0)
        p.message_timeout = msg_s;
    mdt_serve_listener *l = NULL;
    EXPECT_OK(mdt_serve_listen(&p, &l));
    if (!l)
        return NULL;
    *r = raw_connect(path);
    raw_handshake(*r);
    raw_message(*r, 10);
    mdt_serve_incoming in;
    EXPECT(mdt_serve_listener_next(l, 1000, &in) && in.size == 10, "R's request");
    const size_t big = 1200 << 10;
    mdt_serve_listener_reply(l, in.conn, mdt_calloc(big), big);
    mdt_serve_listener_done(l, &in);
    return l;
}

/* A client that never reads its replies is closed once none of its output has been taken for
 * the message timeout, and its replies' share of the queue budget is released: otherwise four
 * such clients (each up to a quarter of the bound) would keep every other request "busy". */
static void test_listener_reply_deadline(void) {
    char ep[128], path[120], got[512];
    int r = -1;
    mdt_serve_listener *l =
        listener_with_unread_reply("wdl", ep, sizeof ep, path, sizeof path, 0.5, &r);
    if (!l)
        return;
    mdt_serve_incoming in;
    void *ctx = zmq_ctx_new();
    void *z = zsock(ctx, ZMQ_DEALER, ep, 0);
    zsend(z, 500000); /* refused while R's reply waits unread */
    EXPECT(strstr(zreply(z, got, sizeof got), "the server is busy"), "beside R's reply: '%s'", got);
    EXPECT(raw_hup_within(r, 1500), "a peer that read nothing for 0.5 s was kept");
    zsend(z, 500000);
    const int fits = mdt_serve_listener_next(l, 1000, &in);
    EXPECT(fits && in.size == 500000, "the closed peer's reply still held the budget");
    if (fits)
        mdt_serve_listener_done(l, &in);
    close(r);
    zmq_close(z);
    zmq_ctx_term(ctx);
    mdt_serve_listener_free(l);
}

/* A client that never reads its replies: a reply not yet written counts against
 * --max-queue-bytes until its last byte is written, and a connection whose unwritten replies
 * pass a quarter of the bound is not read until they are. Before, the request's bytes were
 * released as its reply was handed over, so unread replies were held outside every bound. */
static void test_listener_unread_replies(void) {
    char ep[128], path[120], got[512];
    /* R sends a request and reads nothing: its 1.2 MiB reply stays mostly unwritten (the
     * socket's buffers take a few hundred KiB) */
    int r = -1;
    mdt_serve_listener *l =
        listener_with_unread_reply("unread", ep, sizeof ep, path, sizeof path, 0, &r);
    if (!l)
        return;
    const size_t big = 1200 << 10;
    mdt_serve_incoming in;
    nap_ms(200);
    /* the unwritten reply counts: 500 KB more would pass the 1.5 MiB */
    void *ctx = zmq_ctx_new();
    void *z = zsock(ctx, ZMQ_DEALER, ep, 0);
    zsend(z, 500000);
    EXPECT(strstr(zreply(z, got, sizeof got), "the server is busy"),
           "a request beside an unread 1.2 MiB reply: '%s'", got);
    /* R's next request is not read while its reply waits */
    raw_message(r, 11);
    const int early = mdt_serve_listener_next(l, 300, &in);
    EXPECT(!early, "a request of a connection with an unread reply was taken (%zu bytes)",
           early ? in.size : 0);
    if (early)
        mdt_serve_listener_done(l, &in);
    /* R reads: its reply is written, its request taken, the budget free for Z again */
    size_t drained = 0;
    for (int t = 0; t < 200 && drained < big; t++) {
        unsigned char b[65536];
        struct pollfd pf = {r, POLLIN, 0};
        if (poll(&pf, 1, 10) > 0) {
            const ssize_t k = recv(r, b, sizeof b, MSG_DONTWAIT);
            drained += k > 0 ? (size_t)k : 0;
        }
    }
    EXPECT(drained >= big, "R read %zu bytes of its reply", drained);
    const int later = mdt_serve_listener_next(l, 1000, &in);
    EXPECT(later && in.size == 11, "R's second request once its reply was read");
    if (later)
        mdt_serve_listener_done(l, &in);
    zsend(z, 500000);
    const int fits = mdt_serve_listener_next(l, 1000, &in);
    EXPECT(fits && in.size == 500000, "Z's request once R's reply was written");
    if (fits)
        mdt_serve_listener_done(l, &in);
    close(r);
    zmq_close(z);
    zmq_ctx_term(ctx);
    mdt_serve_listener_free(l);
}

/* A DEALER request: the delimiter and the blob of an "info" request with id `id`, followed by
 * `pad` bytes (its data section: a request that pad makes invalid or too large), its header
 * padded with spaces to at least `header` bytes. */
static void zsend_id(void *s, const char *id, size_t pad, size_t header) {
    char h[16384];
    int hn = snprintf(h, sizeof h, "{\"__metadata__\":{\"op\":\"info\",\"id\":\"%s\"}}", id);
    while ((size_t)hn < header && hn < (int)sizeof h - 1)
        h[hn++] = ' ';
    const size_t n = 8 + (size_t)hn + pad;
    unsigned char *b = calloc(1, n);
    for (int i = 0; i < 8; i++)
        b[i] = (unsigned char)((uint64_t)hn >> (8 * i));
    memcpy(b + 8, h, (size_t)hn);
    zmq_send(s, "", 0, ZMQ_SNDMORE);
    zmq_send(s, b, n, 0);
    free(b);
}

/* mdt_serve_request_peek: the op and id as the parse would take them, from a blob's first bytes */
static void test_request_peek(void) {
    static const struct {
        const char *header, *op, *id;
    } cases[] = {
        {"{\"__metadata__\":{\"op\":\"forward\",\"id\":\"a1\"},\"x\":{}}", "forward", "a1"},
        {"{\"__metadata__\":{\"op\":\"bogus\",\"id\":\"a1\"}}", "", "a1"},
        {"{\"__metadata__\":{\"op\":\"info\",\"id\":\"a\\u0007b\"}}", "info", ""},
        {"{\"__metadata__\":{\"op\":\"info\",\"id\":\"a\",\"id\":\"b\"}}", "info", ""},
        {"{\"__metadata__\":{\"op\":\"info\",\"id\":7}}", "info", ""},
        {"{\"__metadata__\":[\"op\",\"info\"]}", "", ""},
        {"not json", "", ""},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        unsigned char b[256] = {0};
        const size_t hn = strlen(cases[i].header);
        b[0] = (unsigned char)hn;
        memcpy(b + 8, cases[i].header, hn);
        char op[16], id[MDT_SERVE_NAME_MAX + 1];
        mdt_serve_request_peek(b, 8 + hn, op, id);
        EXPECT(strcmp(op, cases[i].op) == 0 && strcmp(id, cases[i].id) == 0,
               "case %zu: op '%s' id '%s'", i, op, id);
        /* a header that goes on past the bytes at hand names nothing */
        mdt_serve_request_peek(b, 8 + hn - 1, op, id);
        EXPECT(!op[0] && !id[0], "case %zu cut short: op '%s' id '%s'", i, op, id);
    }
}

/* Error replies the listener writes itself name the request's op and id when its header lies
 * within the blob's first MDT_SERVE_PEEK_BYTES: the ninth request queued by one client, a blob
 * over --max-request-bytes, the requests still queued when the server ends (fail_all); one
 * whose header is longer carries none. Before, none of them had an id, so a client matching
 * replies by id could not tell which request was refused. */
static void test_listener_refusal_ids(void) {
    char ep[128], path[120], got[512], id[160];
    snprintf(path, sizeof path, "/tmp/mdt_test_serve_ids_%ld.sock", (long)getpid());
    snprintf(ep, sizeof ep, "ipc://%s", path);
    mdt_serve_params p = mdt_serve_params_default();
    p.endpoint = ep, p.max_request_bytes = 1 << 20;
    mdt_serve_listener *l = NULL;
    EXPECT_OK(mdt_serve_listen(&p, &l));
    if (!l)
        return;
    void *ctx = zmq_ctx_new();
    void *z = zsock(ctx, ZMQ_DEALER, ep, 0), *y = zsock(ctx, ZMQ_DEALER, ep, 0);
    for (int i = 1; i <= 9; i++) {
        char rid[16];
        snprintf(rid, sizeof rid, "q%d", i);
        zsend_id(z, rid, 0, 0);
    }
    zreply_id(z, got, sizeof got, id, sizeof id);
    EXPECT(strstr(got, "has 8 requests waiting") && strcmp(id, "q9") == 0,
           "the ninth request's refusal: '%s', id '%s'", got, id);
    zsend_id(y, "big", (1 << 20) + 1, 0);
    zreply_id(y, got, sizeof got, id, sizeof id);
    EXPECT(strstr(got, "--max-request-bytes") && strcmp(id, "big") == 0,
           "a blob over the limit: '%s', id '%s'", got, id);
    zsend_id(y, "long", (1 << 20) + 1, MDT_SERVE_PEEK_BYTES);
    zreply_id(y, got, sizeof got, id, sizeof id);
    EXPECT(strstr(got, "--max-request-bytes") && id[0] == 0,
           "a header past the first %d bytes: '%s', id '%s'", MDT_SERVE_PEEK_BYTES, got, id);
    /* the server ends with z's eight requests queued: each answered with its own id */
    nap_ms(200);
    mdt_serve_listener_fail_all(l, "the server is ending", 1.0);
    int named = 0;
    for (int i = 1; i <= 8; i++) {
        char rid[16];
        snprintf(rid, sizeof rid, "q%d", i);
        zreply_id(z, got, sizeof got, id, sizeof id);
        named += strstr(got, "the server is ending") && strcmp(id, rid) == 0;
    }
    EXPECT(named == 8, "%d of 8 queued requests answered with their id at the end", named);
    /* a request that arrives once the server is ending is answered as it arrives, not queued
     * for a loop that will never take it */
    zsend_id(y, "late", 0, 0);
    zreply_id(y, got, sizeof got, id, sizeof id);
    EXPECT(strstr(got, "the server is ending") && strcmp(id, "late") == 0,
           "a request after the end: '%s', id '%s'", got, id);
    zmq_close(z), zmq_close(y);
    zmq_ctx_term(ctx);
    mdt_serve_listener_free(l);
}

int main(void) {
    test_request_checks();
    test_zmtp_reader();
    test_listener();
    test_listener_connections();
    test_listener_stalled_messages();
    test_listener_min_rate();
    test_listener_slow_reader();
    test_listener_unread_replies();
    test_listener_reply_deadline();
    test_request_peek();
    test_listener_refusal_ids();
    test_tensor_cap();
    test_replies();
    test_sessions();
    TEST_END();
}
