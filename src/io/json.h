/*
 * json.h — every JSON text meshdit reads (config.json, the index, safetensors headers) goes
 * through here: one linear pass over the raw bytes refuses NUL before cJSON builds anything, then
 * cJSON parses, and a syntax error is reported by line, column and byte.
 *
 * Why a pass of our own: cJSON keeps "\u0000" inside a string as a NUL byte, which C string
 * functions then silently cut ("x_embedder.weight\u0000junk" would read as "x_embedder.weight");
 * the pass finds it. No file access, no MPI, no knowledge of what the JSON means here.
 */
#ifndef MDT_JSON_H
#define MDT_JSON_H

#include "core/core.h"

#include <stddef.h>

typedef struct cJSON cJSON;

typedef struct mdt_json_stats {
    int64_t values;      /* upper bound on the values the text holds */
    int64_t top_members; /* upper bound on the members of the top-level object or array */
} mdt_json_stats;

/* One pass over text[0:len]: fills *st, and fails (MDT_E_FORMAT, message "SHOWN: ...") on a NUL
 * byte or on "\u0000" inside a string (names and values must not hold NUL). Never reads past
 * len; the text need not be valid JSON. */
mdt_status mdt_json_check(const char *text, size_t len, const char *shown, mdt_json_stats *st);

/* Parses text[0:len] (after mdt_json_check) into *out. Only bytes of `pad` may follow the value
 * (" \t\r\n" for files, " " for safetensors headers). A syntax error says "SHOWN: ERR at line L,
 * column C (byte B)", B counted from `base` (where the text starts in its file). MDT_E_FORMAT;
 * MDT_E_NOMEM if cJSON runs out of memory on valid text. */
mdt_status mdt_json_build(const char *text, size_t len, const char *shown, const char *err,
                          int64_t base, const char *pad, cJSON **out);

#endif /* MDT_JSON_H */
