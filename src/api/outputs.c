/*
 * outputs.c — output files for a client (meshdit.h): checked before any work, written both or
 * neither (core/outfile.h: staged beside the target, renamed once all are written).
 */
#define _POSIX_C_SOURCE 200809L
#include "core/core.h"
#include "core/outfile.h"
#include "io/checkpoint.h"
#include "io/safetensors.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

mdt_status mdt_output_check(const char *path) { return mdt_out_check(path); }

/* Both paths name one file: the same directory (device and inode) and the same last name. */
static int same_file(const char *a, const char *b) {
    struct stat da, db;
    const char *sa = strrchr(a, '/'), *sb = strrchr(b, '/');
    const char *ba = sa ? sa + 1 : a, *bb = sb ? sb + 1 : b;
    char dira[4096], dirb[4096];
    snprintf(dira, sizeof dira, "%.*s", sa ? (int)(sa - a) + 1 : 1, sa ? a : ".");
    snprintf(dirb, sizeof dirb, "%.*s", sb ? (int)(sb - b) + 1 : 1, sb ? b : ".");
    return strcmp(ba, bb) == 0 && stat(dira, &da) == 0 && stat(dirb, &db) == 0 &&
           da.st_dev == db.st_dev && da.st_ino == db.st_ino;
}

mdt_status mdt_outputs_check(const char *out, const char *report) {
    mdt_status st = mdt_out_check(out);
    if (st != MDT_OK)
        return mdt_fail_prefix(st, "--out");
    if (!report)
        return MDT_OK;
    if ((st = mdt_out_check(report)) != MDT_OK)
        return mdt_fail_prefix(st, "--report");
    if (same_file(out, report))
        return MDT_FAIL(MDT_E_INVALID, "--out %s and --report %s name the same file", out, report);
    return MDT_OK;
}

/* `out` exists and is the very file `in` names (device and inode: links and symlinks too). */
static int is_input(const char *out, const char *in) {
    struct stat so, si;
    return in && stat(out, &so) == 0 && stat(in, &si) == 0 && S_ISREG(so.st_mode) &&
           so.st_dev == si.st_dev && so.st_ino == si.st_ino;
}

/* The name of the checkpoint file in `dir` that `out` is (config, weights, index or a shard the
 * index names), written to name [cap]; 0 when it is none of them. */
static int checkpoint_file(const char *out, const char *dir, char *name, size_t cap) {
    static const char *const fixed[] = {"config.json", MDT_CKPT_WEIGHTS, MDT_CKPT_INDEX};
    char path[4096];
    for (size_t i = 0; i < sizeof fixed / sizeof fixed[0]; i++) {
        snprintf(path, sizeof path, "%s/%s", dir, fixed[i]);
        if (is_input(out, path))
            return snprintf(name, cap, "%s", fixed[i]), 1;
    }
    cJSON *index = NULL; /* an index that cannot be read names no shard: the loader says why */
    snprintf(path, sizeof path, "%s/%s", dir, MDT_CKPT_INDEX);
    struct stat si;
    if (stat(path, &si) != 0 || mdt_config_load(path, &index) != MDT_OK) {
        mdt_error_clear();
        return 0;
    }
    int found = 0;
    const cJSON *wm = cJSON_GetObjectItemCaseSensitive(index, "weight_map");
    for (const cJSON *e = cJSON_IsObject(wm) ? wm->child : NULL; e; e = e->next) {
        if (!cJSON_IsString(e) || !e->valuestring)
            continue;
        snprintf(path, sizeof path, "%s/%s", dir, e->valuestring);
        if ((found = is_input(out, path)) != 0) {
            snprintf(name, cap, "%s", e->valuestring);
            break;
        }
    }
    cJSON_Delete(index);
    return found;
}

mdt_status mdt_output_not_input(const char *flag, const char *out, const char *checkpoint_dir,
                                const char *const *inputs, int n) {
    char name[256];
    if (!out)
        return MDT_OK;
    if (checkpoint_dir && checkpoint_file(out, checkpoint_dir, name, sizeof name))
        return MDT_FAIL(MDT_E_INVALID,
                        "%s %s is the checkpoint's %s (%s): an output never replaces what the "
                        "command reads",
                        flag, out, name, checkpoint_dir);
    for (int i = 0; i < n; i++)
        if (is_input(out, inputs[i]))
            return MDT_FAIL(MDT_E_INVALID,
                            "%s %s is the input file %s: an output never replaces what the "
                            "command reads",
                            flag, out, inputs[i]);
    return MDT_OK;
}

mdt_status mdt_outputs_write(const char *out, const mdt_tensor_set *set, const char *report,
                             const char *report_text) {
    mdt_out o[2];
    int n = 0;
    mdt_status st = mdt_tensor_set_stage(&o[0], set, out);
    if (st == MDT_OK)
        n = 1;
    if (st == MDT_OK && report) {
        st = mdt_out_begin(&o[1], report);
        if (st == MDT_OK)
            n = 2, st = mdt_out_write(&o[1], report_text, strlen(report_text));
    }
    if (st != MDT_OK) {
        mdt_out_abort(o, n);
        return st;
    }
    return mdt_out_commit(o, n);
}
