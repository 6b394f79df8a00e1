/*
 * json.h — every JSON text meshdit reads (config.json, the index, safetensors headers, device
 * files) goes
 * through here: one linear pass over the raw bytes bounds what parsing will cost and refuses NUL
 * before cJSON builds anything, then cJSON parses, and a syntax error is reported by line,
 * column and byte.
 *
 * Why a pass of our own: cJSON's tree costs ~100 bytes per value however short the text, so a
 * header of 1.7 M empty entries under the 100 MB cap would cost gigabytes; counting values first
 * keeps any tree under MDT_JSON_MAX_VALUES. And cJSON keeps "\u0000" inside a string as a NUL
 * byte, which C string functions then silently cut ("x_embedder.weight\u0000junk" would read as
 * "x_embedder.weight"); the pass finds it. No MPI and no knowledge of what the JSON means here;
 * files are opened through file.h.
 */
#ifndef MDT_JSON_H
#define MDT_JSON_H

#include "core/core.h"

#include <stddef.h>

typedef struct cJSON cJSON;

/* Most values one JSON text may hold (objects, arrays, strings, numbers, literals). A safetensors
 * header needs at most 15 per tensor (object, dtype, shape array, 8 dims, offsets array, 2 offsets)
 * so MDT_ST_MAX_ENTRIES tensors fit; an index needs 2 per tensor. */
#define MDT_JSON_MAX_VALUES (1LL << 20)
/* What cJSON spends per value, besides string bytes: an 80-byte glibc chunk for its 64-byte node
 * and at least 32 for its key and its string (measured: 75-120 bytes per value). For messages
 * and the bound stated in docs/errors.md. */
#define MDT_JSON_VALUE_BYTES 144

typedef struct mdt_json_stats {
    int64_t values;      /* upper bound on the values the text holds */
    int64_t top_members; /* upper bound on the members of the top-level object or array */
} mdt_json_stats;

/* One pass over text[0:len]: fills *st, and fails (MDT_E_FORMAT, message "SHOWN: ...") on a NUL
 * byte, on "\u0000" inside a string (names and values must not hold NUL), or on more than
 * MDT_JSON_MAX_VALUES values. Never reads past len; the text need not be valid JSON. */
mdt_status mdt_json_check(const char *text, size_t len, const char *shown, mdt_json_stats *st);

/* Parses text[0:len] (after mdt_json_check) into *out. Only bytes of `pad` may follow the value
 * (" \t\r\n" for files, " " for safetensors headers). A syntax error says "SHOWN: ERR at line L,
 * column C (byte B)", B counted from `base` (where the text starts in its file). MDT_E_FORMAT;
 * MDT_E_NOMEM if cJSON runs out of memory on valid text. */
mdt_status mdt_json_build(const char *text, size_t len, const char *shown, const char *err,
                          int64_t base, const char *pad, cJSON **out);

/* Reads the JSON file `path` (a regular file of at most max_bytes; symlinks followed) through
 * mdt_json_check and mdt_json_build: its top level must be an object. Errors name the file:
 * MDT_E_NOTFOUND (no such file), MDT_E_IO (not a regular file, unreadable), MDT_E_FORMAT (too
 * large, not JSON, text after the value, not an object). */
mdt_status mdt_json_load_file(const char *path, int64_t max_bytes, cJSON **out);

/* Every object in `root` (nested ones too) names each key once. JSON allows a repeated key and
 * readers disagree on it (cJSON returns the first, Python's json and so diffusers and peft the
 * last), so a config or metadata object with one would mean one thing here and another upstream:
 * MDT_E_FORMAT "SHOWN: key 'K' appears twice in one object (...)". */
mdt_status mdt_json_unique_keys(const cJSON *root, const char *shown);

#endif /* MDT_JSON_H */
