/*
 * test_serve.c — the server's messages and sessions without a socket (api/serve.h): request
 * checks, reply blobs read back, and the session store's merge, replacement and limits. The
 * server itself is tested end to end by tests/cli/test_serve.sh.
 */
#include "serve/serve.h"
#include "harness.h"
#include "io/safetensors.h"

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
        const char *meta[8];
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
        {{"op", "info", "id", "bad\xff\xfe" "utf8", NULL}, 0, "UTF-8 text"},
        {{"op", "info", "id", "a\\b", NULL}, 0, "backslashes"},
        {{"op", "info", "id", "rtl\xe2\x80\xae" "evil", NULL}, 0, "UTF-8 text"},
        {{"op", "info", "id", "\xc2\x85next-line", NULL}, 0, "UTF-8 text"},
        {{"op", "end_session", NULL}, 0, "needs a \"session\""},
        {{"op", "forward", "session", "s", "end_session", "yes", NULL}, 0, "\"1\" or \"true\""},
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
    EXPECT_OK(mdt_serve_reply_error("forward", "7", "first\nsecond\r", &b, &n));
    EXPECT_OK(mdt_st_open_mem(b, n, "reply", &f));
    if (f) {
        EXPECT(strcmp(mdt_st_meta(f, "status"), "error") == 0, "status");
        EXPECT(strcmp(mdt_st_meta(f, "error"), "first second ") == 0, "'%s'",
               mdt_st_meta(f, "error"));
        EXPECT(strcmp(mdt_st_meta(f, "id"), "7") == 0 && f->n == 0, "id, no tensors");
        mdt_st_close(f);
    }
    mdt_free(b);
}

static void test_sessions(void) {
    mdt_serve_sessions ss;
    EXPECT_OK(mdt_serve_sessions_init(&ss, 2, 100)); /* 2 sessions, 100 bytes over both */
    const char *names[] = {"a", "b", "x"};
    const int64_t k[] = {4, 8, 2}; /* 16, 32 and 8 bytes */
    const char *keep_ab[] = {"op", "forward", "session", "s1", "keep", "a,b", NULL};
    size_t n = 0;
    unsigned char *b = request(keep_ab, 3, names, k, &n);
    mdt_serve_request r;
    EXPECT_OK(mdt_serve_request_parse(b, n, &r));
    EXPECT_OK(mdt_serve_sessions_prepare(&ss, &r));
    EXPECT_OK(mdt_serve_sessions_commit(&ss, &r));
    EXPECT(mdt_serve_sessions_bytes_of(&ss, "s1") == 48 && ss.bytes == 48, "%lld",
           (long long)ss.bytes);
    mdt_serve_request_free(&r);
    mdt_free(b);
    /* a later forward sends only x: a and b are merged in, with their kept values */
    const char *use[] = {"op", "forward", "session", "s1", NULL};
    b = request(use, 1, names + 2, k + 2, &n);
    EXPECT_OK(mdt_serve_request_parse(b, n, &r));
    EXPECT_OK(mdt_serve_sessions_prepare(&ss, &r));
    const mdt_tensor *tb = mdt_tensor_set_get(r.tensors, "b");
    EXPECT(mdt_tensor_set_count(r.tensors) == 3 && tb && tb->shape[0] == 8 &&
               ((const float *)tb->data)[0] == 2.0f,
           "merged");
    mdt_serve_request_free(&r);
    mdt_free(b);
    /* a second session over the byte limit: 48 + 64 > 100, refused, nothing stored */
    const char *big[] = {"op", "forward", "session", "s2", "keep", "a", NULL};
    const int64_t k16[] = {16};
    b = request(big, 1, names, k16, &n);
    EXPECT_OK(mdt_serve_request_parse(b, n, &r));
    EXPECT_ERR(mdt_serve_sessions_prepare(&ss, &r), MDT_E_INVALID, "session 's2'",
               "--max-session-bytes 100");
    EXPECT(ss.n == 1 && ss.bytes == 48, "nothing stored");
    mdt_serve_request_free(&r);
    mdt_free(b);
    /* replacing a kept tensor counts the difference: b (32 bytes) becomes 8 bytes */
    const char *repl[] = {"op", "forward", "session", "s1", "keep", "b", NULL};
    const int64_t k2[] = {2};
    b = request(repl, 1, names + 1, k2, &n);
    EXPECT_OK(mdt_serve_request_parse(b, n, &r));
    EXPECT_OK(mdt_serve_sessions_prepare(&ss, &r));
    EXPECT_OK(mdt_serve_sessions_commit(&ss, &r));
    EXPECT(ss.bytes == 24 && mdt_serve_sessions_bytes_of(&ss, "s1") == 24, "%lld",
           (long long)ss.bytes);
    mdt_serve_request_free(&r);
    mdt_free(b);
    /* the session count: s2 and s3 would make three */
    const char *s2[] = {"op", "forward", "session", "s2", "keep", "x", NULL};
    const char *s3[] = {"op", "forward", "session", "s3", "keep", "x", NULL};
    b = request(s2, 1, names + 2, k + 2, &n);
    EXPECT_OK(mdt_serve_request_parse(b, n, &r));
    EXPECT_OK(mdt_serve_sessions_prepare(&ss, &r));
    EXPECT_OK(mdt_serve_sessions_commit(&ss, &r));
    mdt_serve_request_free(&r);
    mdt_free(b);
    b = request(s3, 1, names + 2, k + 2, &n);
    EXPECT_OK(mdt_serve_request_parse(b, n, &r));
    EXPECT_ERR(mdt_serve_sessions_prepare(&ss, &r), MDT_E_INVALID, "--max-sessions 2");
    mdt_serve_request_free(&r);
    mdt_free(b);
    /* ending frees the bytes; a forward naming an ended session without keep is refused */
    mdt_serve_sessions_end(&ss, "s1");
    EXPECT(ss.n == 1 && ss.bytes == 8, "%d %lld", ss.n, (long long)ss.bytes);
    b = request(use, 1, names + 2, k + 2, &n);
    EXPECT_OK(mdt_serve_request_parse(b, n, &r));
    EXPECT_ERR(mdt_serve_sessions_prepare(&ss, &r), MDT_E_NOTFOUND, "session 's1' is not open");
    mdt_serve_request_free(&r);
    mdt_free(b);
    mdt_serve_sessions_free(&ss);
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

int main(void) {
    test_request_checks();
    test_tensor_cap();
    test_replies();
    test_sessions();
    TEST_END();
}
