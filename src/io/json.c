/*
 * json.c — see json.h. The pass is a small lexer: it tracks whether it is inside a string (and
 * after a backslash there) and the nesting depth, and counts what cJSON will allocate. A tree
 * holds one value per container plus one per comma-separated element, so 1 + commas + containers
 * bounds its size, whether or not the text is valid.
 */
#define _POSIX_C_SOURCE 200809L
#include "json.h"

#include "io/file.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* 1-based line and column of byte `at` of text. */
static void line_col(const char *text, size_t at, int64_t *line, int64_t *col) {
    *line = 1, *col = 1;
    for (size_t i = 0; i < at; i++) {
        if (text[i] == '\n')
            ++*line, *col = 1;
        else
            ++*col;
    }
}

/* Stops at the first value over the limit: refusing a hostile text costs a pass over the first
 * ~MDT_JSON_MAX_VALUES values of it, not over all of it. */
static mdt_status too_many(const char *shown, size_t at, size_t len) {
    return MDT_FAIL(MDT_E_FORMAT,
                    "%s: more than %lld JSON values, the limit per file (a parse tree over ~%lld "
                    "MiB); counted by byte %zu of %zu",
                    shown, MDT_JSON_MAX_VALUES,
                    (long long)((MDT_JSON_MAX_VALUES * MDT_JSON_VALUE_BYTES) >> 20), at, len);
}

mdt_status mdt_json_check(const char *text, size_t len, const char *shown, mdt_json_stats *st) {
    int64_t commas = 0, containers = 0, top_commas = 0, depth = 0;
    int in_str = 0, top_any = 0;
    size_t str_start = 0;
    st->values = st->top_members = 0;
    for (size_t i = 0; i < len; i++) {
        const char c = text[i];
        if (c == 0) {
            int64_t l, co;
            line_col(text, i, &l, &co);
            return MDT_FAIL(MDT_E_FORMAT,
                            "%s: holds a NUL byte at line %lld, column %lld (byte %zu): not a JSON "
                            "text",
                            shown, (long long)l, (long long)co, i);
        }
        if (in_str) {
            if (c == '"') {
                in_str = 0;
            } else if (c == '\\' && i + 1 < len) {
                if (text[i + 1] == 'u' && i + 6 <= len && memcmp(text + i + 2, "0000", 4) == 0) {
                    /* the string up to the NUL, as C code would see it after cJSON */
                    char raw[MDT_ESC_NAME], esc[MDT_ESC_NAME];
                    size_t n =
                        i - str_start - 1 < sizeof raw - 1 ? i - str_start - 1 : sizeof raw - 1;
                    int64_t l, co;
                    memcpy(raw, text + str_start + 1, n);
                    raw[n] = 0;
                    line_col(text, i, &l, &co);
                    return MDT_FAIL(MDT_E_FORMAT,
                                    "%s: string '%s' continues past a NUL character (\\u0000 at "
                                    "line %lld, column %lld): names and values must not hold NUL",
                                    shown, mdt_escape(raw, esc, sizeof esc), (long long)l,
                                    (long long)co);
                }
                i++; /* the escaped character, whatever it is */
            }
            continue;
        }
        switch (c) {
        case '"':
            in_str = 1, str_start = i;
            top_any |= depth == 1;
            break;
        case '{':
        case '[':
            containers++;
            top_any |= depth == 1;
            depth++;
            if (1 + commas + containers > MDT_JSON_MAX_VALUES)
                return too_many(shown, i, len);
            if (depth > CJSON_NESTING_LIMIT) { /* valid JSON, but cJSON stops there */
                int64_t l, co;
                line_col(text, i, &l, &co);
                return MDT_FAIL(MDT_E_FORMAT,
                                "%s: JSON nested more than %d levels deep (at line %lld, column "
                                "%lld), the most this reader takes",
                                shown, CJSON_NESTING_LIMIT, (long long)l, (long long)co);
            }
            break;
        case '}':
        case ']': depth--; break;
        case ',':
            commas++;
            top_commas += depth == 1;
            if (1 + commas + containers > MDT_JSON_MAX_VALUES)
                return too_many(shown, i, len);
            break;
        case ' ':
        case '\t':
        case '\r':
        case '\n':
        case ':': break;
        default: top_any |= depth == 1; break;
        }
    }
    st->values = 1 + commas + containers;
    st->top_members = top_any ? top_commas + 1 : 0;
    return MDT_OK;
}

mdt_status mdt_json_build(const char *text, size_t len, const char *shown, const char *err,
                          int64_t base, const char *pad, cJSON **out) {
    const char *endp = NULL;
    int64_t l, co;
    *out = cJSON_ParseWithLengthOpts(text, len, &endp, 0);
    if (!*out) {
        /* cJSON points at (or just after) the byte where the grammar broke; without a pointer
         * (out of memory inside cJSON) there is no position to give */
        if (!endp)
            endp = cJSON_GetErrorPtr();
        if (!endp || endp < text || endp > text + len)
            return MDT_FAIL(MDT_E_NOMEM, "%s: out of memory parsing JSON", shown);
        size_t at = (size_t)(endp - text);
        line_col(text, at, &l, &co);
        return MDT_FAIL(MDT_E_FORMAT, "%s: %s near line %lld, column %lld (byte %lld)", shown, err,
                        (long long)l, (long long)co, (long long)(base + (int64_t)at));
    }
    for (const char *p = endp; p && p < text + len; p++)
        if (*p == 0 || !strchr(pad, *p)) {
            size_t at = (size_t)(p - text);
            cJSON_Delete(*out);
            *out = NULL;
            line_col(text, at, &l, &co);
            return MDT_FAIL(MDT_E_FORMAT,
                            "%s: bytes other than %s after the JSON, at line %lld, column %lld "
                            "(byte %lld)",
                            shown, pad[1] ? "white space" : "space padding", (long long)l,
                            (long long)co, (long long)(base + (int64_t)at));
        }
    return MDT_OK;
}

/* Reads a whole small text file (JSON) into a NUL-terminated buffer; *len is its length. */
static mdt_status read_text(const char *path, int64_t max_bytes, char **out, size_t *len) {
    char shown[4096];
    struct stat sb;
    int fd;
    *out = NULL;
    MDT_TRY(mdt_file_open_read(path, MDT_E_NOTFOUND, &fd));
    mdt_escape(path, shown, sizeof shown);
    if (fstat(fd, &sb) != 0) {
        close(fd);
        return MDT_FAIL(MDT_E_IO, "%s: cannot stat: %s", shown, strerror(errno));
    }
    if (sb.st_size > max_bytes) {
        close(fd);
        const int mib = max_bytes % (1 << 20) == 0, kib = max_bytes % 1024 == 0;
        return MDT_FAIL(MDT_E_FORMAT, "%s: %lld bytes is over the %lld %s limit for a JSON file",
                        shown, (long long)sb.st_size,
                        (long long)(mib   ? max_bytes >> 20
                                    : kib ? max_bytes >> 10
                                          : max_bytes),
                        mib   ? "MiB"
                        : kib ? "KiB"
                              : "byte");
    }
    size_t n = (size_t)sb.st_size, got = 0;
    char *buf = mdt_alloc(n + 1);
    if (!buf) {
        close(fd);
        return MDT_FAIL(MDT_E_NOMEM, "out of memory");
    }
    while (got < n) {
        ssize_t r = read(fd, buf + got, n - got);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0) {
            mdt_status st =
                MDT_FAIL(MDT_E_IO, "%s: %s", shown,
                         r < 0 ? strerror(errno) : "file ends early (changed while read?)");
            close(fd);
            mdt_free(buf);
            return st;
        }
        got += (size_t)r;
    }
    close(fd);
    buf[n] = 0;
    *out = buf;
    *len = n;
    return MDT_OK;
}

static int key_cmp(const void *a, const void *b) {
    return strcmp((*(const cJSON *const *)a)->string, (*(const cJSON *const *)b)->string);
}

/* The first key of `obj` that appears twice, or NULL (small objects pairwise, large ones sorted).
 */
static const char *repeated_key(const cJSON *obj, mdt_status *st) {
    int n = 0;
    for (const cJSON *e = obj->child; e; e = e->next)
        n++;
    if (n <= 32) {
        for (const cJSON *e = obj->child; e; e = e->next)
            for (const cJSON *f = e->next; f; f = f->next)
                if (e->string && f->string && strcmp(e->string, f->string) == 0)
                    return e->string;
        return NULL;
    }
    const cJSON **keys = mdt_alloc(sizeof(const cJSON *) * (size_t)n);
    if (!keys) {
        *st = MDT_FAIL(MDT_E_NOMEM, "out of memory checking a JSON object's keys");
        return NULL;
    }
    int k = 0;
    for (const cJSON *e = obj->child; e; e = e->next)
        if (e->string)
            keys[k++] = e;
    qsort((void *)keys, (size_t)k, sizeof(const cJSON *), key_cmp);
    const char *dup = NULL;
    for (int i = 1; i < k && !dup; i++)
        if (strcmp(keys[i - 1]->string, keys[i]->string) == 0)
            dup = keys[i]->string;
    mdt_free((void *)keys);
    return dup;
}

mdt_status mdt_json_unique_keys(const cJSON *root, const char *shown) {
    if (!root)
        return MDT_OK;
    mdt_status st = MDT_OK;
    if (cJSON_IsObject(root)) {
        const char *dup = repeated_key(root, &st);
        MDT_TRY(st);
        if (dup) {
            char key[MDT_ESC_NAME];
            mdt_escape(dup, key, sizeof key);
            return MDT_FAIL(MDT_E_FORMAT,
                            "%s: key '%s' appears twice in one object (this reader would take the "
                            "first, Python's json and diffusers the last)",
                            shown, key);
        }
    }
    for (const cJSON *e = root->child; e; e = e->next)
        MDT_TRY(mdt_json_unique_keys(e, shown));
    return MDT_OK;
}

mdt_status mdt_json_load_file(const char *path, int64_t max_bytes, cJSON **out) {
    char *txt, shown[MDT_ESC_NAME];
    size_t len;
    mdt_json_stats js;
    *out = NULL;
    MDT_TRY(read_text(path, max_bytes, &txt, &len));
    mdt_escape(path, shown, sizeof shown);
    mdt_status st = mdt_json_check(txt, len, shown, &js);
    if (st == MDT_OK)
        st = mdt_json_build(txt, len, shown, "invalid JSON", 0, " \t\r\n", out);
    mdt_free(txt);
    MDT_TRY(st);
    if (!cJSON_IsObject(*out)) {
        cJSON_Delete(*out);
        *out = NULL;
        return MDT_FAIL(MDT_E_FORMAT, "%s: top level is not a JSON object", shown);
    }
    return MDT_OK;
}
