/*
 * proto.c — the server's messages (docs/serve.md): a request blob is a safetensors blob
 * read by the same validating reader as files (io/safetensors.h: mdt_st_open_mem), whose
 * __metadata__ names the operation; a reply is a safetensors blob with "status" and either the
 * outputs or a one-line "error". No socket, no MPI, no model here: this is what
 * tests/fuzz/fuzz_request.c feeds hostile bytes to.
 */
#include "serve/serve.h"

#include "models/cache.h"

#include "io/safetensors.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const struct {
    const char *name;
    mdt_serve_op op;
} k_ops[] = {{"info", MDT_SERVE_OP_INFO},
             {"forward", MDT_SERVE_OP_FORWARD},
             {"end_session", MDT_SERVE_OP_END_SESSION},
             {"close", MDT_SERVE_OP_CLOSE},
             {"lora_load", MDT_SERVE_OP_LORA_LOAD},
             {"lora_unload", MDT_SERVE_OP_LORA_UNLOAD}};

/* A name the protocol carries (session, id, kept tensor): 1..max bytes (max <= 1024) of text that
 * mdt_escape leaves as it is — printable ASCII and well-formed UTF-8 without control, C1,
 * line-separator or bidirectional code points, and no backslash — and no comma (the "keep"
 * separator). Such a name is echoed in a reply (valid JSON, one inert line) as sent. */
static int good_name(const char *s, size_t max) {
    char shown[1024 + 16];
    const size_t n = strlen(s);
    if (n == 0 || n > max || max > 1024 || strchr(s, ','))
        return 0;
    return strcmp(mdt_escape(s, shown, sizeof shown), s) == 0;
}

static mdt_status parse_keep(const char *v, mdt_serve_request *r) {
    char shown[MDT_ESC_NAME];
    const size_t n = strlen(v);
    if (r->keep_buf)
        return MDT_FAIL(MDT_E_INVALID, "request: \"keep\" appears twice");
    r->keep_buf = mdt_alloc(n + 1);
    if (!r->keep_buf)
        return MDT_FAIL(MDT_E_NOMEM, "out of memory");
    memcpy(r->keep_buf, v, n + 1);
    char *p = r->keep_buf;
    for (;;) {
        char *comma = strchr(p, ',');
        if (comma)
            *comma = 0;
        if (r->n_keep == MDT_SERVE_KEEP_MAX)
            return MDT_FAIL(MDT_E_INVALID, "request: \"keep\" names more than %d tensors",
                            MDT_SERVE_KEEP_MAX);
        if (!good_name(p, 1024))
            return MDT_FAIL(MDT_E_INVALID,
                            "request: \"keep\" must be tensor names separated by commas, got '%s'",
                            mdt_escape(v, shown, sizeof shown));
        for (int i = 0; i < r->n_keep; i++)
            if (strcmp(r->keep[i], p) == 0)
                return MDT_FAIL(MDT_E_INVALID, "request: \"keep\" names '%s' twice",
                                mdt_escape(p, shown, sizeof shown));
        r->keep[r->n_keep++] = p;
        if (!comma)
            return MDT_OK;
        p = comma + 1;
    }
}

/* "lora": NAME=WEIGHT entries separated by commas ("" for none), each name an adapter's as
 * good_name takes it (up to MDT_SERVE_ADAPTER_NAME_MAX bytes, split at its last '='), each
 * weight a finite decimal, no name twice. */
static mdt_status parse_lora(const char *v, mdt_serve_request *r) {
    char shown[MDT_ESC_NAME];
    const size_t n = strlen(v);
    if (!(r->lora_buf = mdt_alloc(n + 1)))
        return MDT_FAIL(MDT_E_NOMEM, "out of memory");
    memcpy(r->lora_buf, v, n + 1);
    r->has_lora = 1;
    for (char *p = r->lora_buf; n > 0;) {
        char *comma = strchr(p, ','), *eq;
        if (comma)
            *comma = 0;
        eq = strrchr(p, '=');
        if (eq)
            *eq = 0;
        /* a plain decimal (no spaces, hex, inf or nan) of magnitude at most 1e6 */
        double w = 0;
        if (!eq || !good_name(p, MDT_SERVE_ADAPTER_NAME_MAX) || !mdt_decimal(eq + 1, 0, &w) ||
            !(fabs(w) <= 1e6))
            return MDT_FAIL(MDT_E_INVALID,
                            "request: \"lora\" must be NAME=WEIGHT entries separated by commas "
                            "(an adapter's name of 1 to %d bytes, a decimal weight of magnitude "
                            "at most 1e6; \"\" for none), got '%s'",
                            MDT_SERVE_ADAPTER_NAME_MAX, mdt_escape(v, shown, sizeof shown));
        if (r->n_lora == MDT_SERVE_LORA_MAX)
            return MDT_FAIL(MDT_E_INVALID, "request: \"lora\" names more than %d adapters",
                            MDT_SERVE_LORA_MAX);
        for (int i = 0; i < r->n_lora; i++)
            if (strcmp(r->lora_names[i], p) == 0)
                return MDT_FAIL(MDT_E_INVALID, "request: \"lora\" names adapter '%s' twice",
                                mdt_escape(p, shown, sizeof shown));
        r->lora_names[r->n_lora] = p, r->lora_weights[r->n_lora++] = w;
        if (!comma)
            break;
        p = comma + 1;
    }
    return MDT_OK;
}

/* One __metadata__ key of a request into *r. */
static mdt_status parse_meta(const char *k, const char *v, mdt_serve_request *r) {
    char shown[MDT_ESC_NAME], key[MDT_ESC_NAME];
    if (strcmp(k, "op") == 0) {
        for (size_t i = 0; i < sizeof k_ops / sizeof k_ops[0]; i++)
            if (strcmp(v, k_ops[i].name) == 0) {
                r->op = k_ops[i].op;
                strcpy(r->op_name, k_ops[i].name);
                return MDT_OK;
            }
        return MDT_FAIL(MDT_E_INVALID,
                        "request: unknown op '%s' (info, forward, end_session, close, lora_load "
                        "or lora_unload)",
                        mdt_escape(v, shown, sizeof shown));
    }
    if (strcmp(k, "cfg_next") == 0) {
        if (!good_name(v, MDT_SERVE_NAME_MAX))
            return MDT_FAIL(MDT_E_INVALID,
                            "request: \"cfg_next\" must be a session's token, got '%s'",
                            mdt_escape(v, shown, sizeof shown));
        strcpy(r->cfg_next, v);
        return MDT_OK;
    }
    if (strcmp(k, "id") == 0 || strcmp(k, "session") == 0) {
        if (!good_name(v, MDT_SERVE_NAME_MAX))
            return MDT_FAIL(MDT_E_INVALID,
                            "request: \"%s\" must be 1 to %d bytes of UTF-8 text without "
                            "control characters, backslashes or commas, got '%s'",
                            k, MDT_SERVE_NAME_MAX, mdt_escape(v, shown, sizeof shown));
        strcpy(k[0] == 'i' ? r->id : r->session, v);
        if (k[0] == 's')
            r->new_session = strcmp(v, "new") == 0;
        return MDT_OK;
    }
    if (strcmp(k, "cache_context") == 0 || strcmp(k, "cache_generation") == 0) {
        char *dst = k[6] == 'c' ? r->cache_context : r->cache_gen;
        const int max = k[6] == 'c' ? MDT_SERVE_CACHE_NAME_MAX : MDT_SERVE_NAME_MAX;
        if (!good_name(v, max))
            return MDT_FAIL(MDT_E_INVALID,
                            "request: \"%s\" must be 1 to %d bytes of UTF-8 text without "
                            "control characters, backslashes or commas, got '%s'",
                            k, max, mdt_escape(v, shown, sizeof shown));
        strcpy(dst, v);
        return MDT_OK;
    }
    if (strcmp(k, "cache") == 0) {
        int on = 0;
        if (strlen(v) >= sizeof r->cache)
            return MDT_FAIL(MDT_E_INVALID, "request: \"cache\" is longer than %zu bytes",
                            sizeof r->cache - 1);
        if (mdt_cache_spec_check(v, &on) != MDT_OK) {
            char why[256]; /* the message is rewritten below: copied first */
            snprintf(why, sizeof why, "%s", mdt_last_error());
            return MDT_FAIL(MDT_E_INVALID, "request: \"cache\": %s", why);
        }
        strcpy(r->cache, v);
        return MDT_OK;
    }
    if (strcmp(k, "keep") == 0)
        return parse_keep(v, r);
    if (strcmp(k, "lora") == 0) {
        if (r->has_lora)
            return MDT_FAIL(MDT_E_INVALID, "request: \"lora\" appears twice");
        return parse_lora(v, r);
    }
    if (strcmp(k, "adapter_name") == 0) {
        if (!good_name(v, MDT_SERVE_ADAPTER_NAME_MAX) || strchr(v, '='))
            return MDT_FAIL(MDT_E_INVALID,
                            "request: \"adapter_name\" must be 1 to %d bytes of UTF-8 text "
                            "without control characters, backslashes, commas or '=', got '%s'",
                            MDT_SERVE_ADAPTER_NAME_MAX, mdt_escape(v, shown, sizeof shown));
        strcpy(r->adapter, v);
        return MDT_OK;
    }
    /* an adapter file's own metadata (read by the adapter loader) */
    if (strcmp(k, "lora_adapter_metadata") == 0 || strcmp(k, "format") == 0) {
        r->adapter_meta = 1;
        return MDT_OK;
    }
    if (strcmp(k, "end_session") == 0) {
        if (strcmp(v, "1") != 0 && strcmp(v, "true") != 0)
            return MDT_FAIL(MDT_E_INVALID, "request: \"end_session\" must be \"1\" or \"true\"");
        r->end_session = 1;
        return MDT_OK;
    }
    return MDT_FAIL(MDT_E_INVALID,
                    "request: unknown metadata key '%s' (op, id, session, keep, end_session, "
                    "cache, cache_context, cache_generation, lora, cfg_next, adapter_name, "
                    "lora_adapter_metadata, format)",
                    mdt_escape(k, key, sizeof key));
}

/* What each operation may carry. */
static mdt_status check_request(const mdt_serve_request *r, int ntensors) {
    if (!r->op_name[0])
        return MDT_FAIL(MDT_E_INVALID, "request: __metadata__ has no \"op\"");
    const int adapter_op = r->op == MDT_SERVE_OP_LORA_LOAD || r->op == MDT_SERVE_OP_LORA_UNLOAD;
    if (r->op != MDT_SERVE_OP_FORWARD && r->op != MDT_SERVE_OP_LORA_LOAD && ntensors > 0)
        return MDT_FAIL(MDT_E_INVALID, "request: op '%s' takes no tensors (got %d)", r->op_name,
                        ntensors);
    if (adapter_op != !!r->adapter[0])
        return MDT_FAIL(MDT_E_INVALID,
                        adapter_op ? "request: op '%s' needs \"adapter_name\""
                                   : "request: op '%s' takes no \"adapter_name\" (lora_load and "
                                     "lora_unload do)",
                        r->op_name);
    if (r->op == MDT_SERVE_OP_LORA_LOAD && ntensors == 0)
        return MDT_FAIL(MDT_E_INVALID, "request: op 'lora_load' carries the adapter's factors as "
                                       "its tensors, and this one has none");
    if (r->op != MDT_SERVE_OP_LORA_LOAD && r->adapter_meta)
        return MDT_FAIL(MDT_E_INVALID, "request: \"lora_adapter_metadata\" and \"format\" go "
                                       "with op 'lora_load' (an adapter file's metadata)");
    if (r->op != MDT_SERVE_OP_FORWARD && r->has_lora)
        return MDT_FAIL(MDT_E_INVALID, "request: \"lora\" goes with a forward");
    if (r->op != MDT_SERVE_OP_FORWARD && r->cfg_next[0])
        return MDT_FAIL(MDT_E_INVALID, "request: \"cfg_next\" goes with a forward");
    if (r->op != MDT_SERVE_OP_FORWARD && (r->n_keep || r->end_session))
        return MDT_FAIL(MDT_E_INVALID, "request: \"keep\" and \"end_session\" go with a forward");
    if (r->op != MDT_SERVE_OP_FORWARD && r->op != MDT_SERVE_OP_END_SESSION && r->session[0])
        return MDT_FAIL(MDT_E_INVALID, "request: op '%s' takes no \"session\"", r->op_name);
    if (r->op == MDT_SERVE_OP_END_SESSION && !r->session[0] && !r->cache_gen[0])
        return MDT_FAIL(MDT_E_INVALID,
                        "request: op 'end_session' needs a \"session\" or a \"cache_generation\"");
    if (r->op != MDT_SERVE_OP_FORWARD && (r->cache[0] || r->cache_context[0]))
        return MDT_FAIL(MDT_E_INVALID,
                        "request: \"cache\" and \"cache_context\" go with a forward");
    if (r->op != MDT_SERVE_OP_FORWARD && r->op != MDT_SERVE_OP_END_SESSION && r->cache_gen[0])
        return MDT_FAIL(MDT_E_INVALID, "request: op '%s' takes no \"cache_generation\"",
                        r->op_name);
    if (r->cache[0] && strcmp(r->cache, "none") != 0 && (!r->cache_context[0] || !r->cache_gen[0]))
        return MDT_FAIL(MDT_E_INVALID,
                        "request: a cached forward needs \"cache_context\" (the branch: \"cond\", "
                        "\"uncond\", ...) and \"cache_generation\" (the generation's name)");
    const int uncached = !r->cache[0] || strcmp(r->cache, "none") == 0;
    if (uncached && (r->cache_context[0] || (r->cache_gen[0] && r->op == MDT_SERVE_OP_FORWARD)))
        return MDT_FAIL(MDT_E_INVALID,
                        "request: \"cache_context\" and \"cache_generation\" go with \"cache\"");
    if ((r->n_keep || r->end_session) && !r->session[0])
        return MDT_FAIL(MDT_E_INVALID, "request: \"keep\" and \"end_session\" need a \"session\"");
    if (r->new_session && (r->op != MDT_SERVE_OP_FORWARD || !r->n_keep))
        return MDT_FAIL(MDT_E_INVALID,
                        "request: \"session\": \"new\" opens a session with a forward that names "
                        "what to keep (\"keep\"); the reply's \"session\" is its token");
    return MDT_OK;
}

mdt_status mdt_serve_request_parse(const void *blob, size_t size, mdt_serve_request *r) {
    mdt_st_file *f = NULL;
    mdt_status st = MDT_OK;
    memset(r, 0, sizeof *r);
    r->bytes = (int64_t)size;
    MDT_TRY(mdt_st_open_mem(blob, size, "request", &f));
    for (int i = 0; i < f->n_meta; i++)
        MDT_CHECK(parse_meta(f->meta_keys[i], f->meta_vals[i], r));
    MDT_CHECK(check_request(r, f->n));
    if (r->op == MDT_SERVE_OP_LORA_LOAD && f->n > MDT_SERVE_ADAPTER_TENSORS_MAX)
        MDT_CHECK(MDT_FAIL(MDT_E_INVALID,
                           "request: an adapter of %d tensors, over the limit of %d per adapter",
                           f->n, MDT_SERVE_ADAPTER_TENSORS_MAX));
    else if (r->op == MDT_SERVE_OP_LORA_LOAD) /* the adapter loader reads the blob itself */
        r->blob = blob;
    else if (f->n > MDT_SERVE_TENSORS_MAX) /* a forward has a dozen inputs: refused unread */
        MDT_CHECK(MDT_FAIL(MDT_E_INVALID, "request: %d tensors, over the limit of %d per request",
                           f->n, MDT_SERVE_TENSORS_MAX));
    else
        MDT_CHECK(mdt_st_read_set(f, &r->tensors));
fail:
    mdt_st_close(f);
    return st;
}

int mdt_serve_request_peek(const void *head, size_t n, char op[16],
                           char id[MDT_SERVE_NAME_MAX + 1]) {
    const unsigned char *b = head;
    op[0] = id[0] = 0;
    if (n < 8)
        return 0;
    uint64_t len = 0;
    for (int i = 7; i >= 0; i--)
        len = len << 8 | b[i];
    if (len > n - 8)
        return 0; /* the header goes on past what is here */
    cJSON *j = cJSON_ParseWithLength((const char *)b + 8, (size_t)len);
    const cJSON *md = cJSON_GetObjectItemCaseSensitive(j, "__metadata__");
    int n_op = 0, n_id = 0;
    const char *vop = NULL, *vid = NULL;
    for (const cJSON *e = cJSON_IsObject(md) ? md->child : NULL; e; e = e->next) {
        if (e->string && strcmp(e->string, "op") == 0)
            n_op++, vop = cJSON_GetStringValue(e);
        else if (e->string && strcmp(e->string, "id") == 0)
            n_id++, vid = cJSON_GetStringValue(e);
    }
    /* as the request's parse would take them: once, an op it knows, an id it would echo */
    for (size_t i = 0; n_op == 1 && vop && i < sizeof k_ops / sizeof k_ops[0]; i++)
        if (strcmp(vop, k_ops[i].name) == 0)
            strcpy(op, k_ops[i].name);
    if (n_id == 1 && vid && good_name(vid, MDT_SERVE_NAME_MAX))
        strcpy(id, vid);
    const int parsed = cJSON_IsObject(j);
    cJSON_Delete(j);
    return parsed;
}

void mdt_serve_request_free(mdt_serve_request *r) {
    if (!r)
        return;
    mdt_tensor_set_free(r->tensors);
    mdt_free(r->keep_buf);
    mdt_free(r->lora_buf);
    memset(r, 0, sizeof *r);
}

mdt_status mdt_serve_reply_ok(const char *const *meta, const mdt_tensor_set *outputs,
                              unsigned char **blob, size_t *size) {
    enum { MAX_META = 64 };
    const char *kv[2 * MAX_META + 3] = {"status", "ok"};
    int n = 2;
    for (int i = 0; meta && meta[i] && meta[i + 1] && n < 2 * MAX_META; i += 2)
        if (meta[i + 1][0]) /* an empty value (no "id" sent) is left out */
            kv[n++] = meta[i], kv[n++] = meta[i + 1];
    kv[n] = NULL;
    return mdt_tensor_set_serialize(outputs, kv, blob, size);
}

mdt_status mdt_serve_reply_error(const char *op, const char *id, const char *msg, mdt_status code,
                                 unsigned char **blob, size_t *size) {
    char line[1024];
    snprintf(line, sizeof line, "%s", msg && msg[0] ? msg : "unknown error");
    for (char *c = line; *c; c++) /* one line, whatever the message held */
        if (*c == '\n' || *c == '\r')
            *c = ' ';
    const char *kv[11] = {"status", "error", "error", line};
    int n = 4;
    if (code != MDT_OK)
        kv[n++] = "code", kv[n++] = mdt_status_str(code);
    if (op && op[0])
        kv[n++] = "op", kv[n++] = op;
    if (id && id[0])
        kv[n++] = "id", kv[n++] = id;
    kv[n] = NULL;
    return mdt_st_serialize(0, NULL, NULL, kv, blob, size);
}
