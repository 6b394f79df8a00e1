/*
 * outputs.c — output files for a client (meshdit.h): checked before any work, written both or
 * neither (core/outfile.h: staged beside the target, renamed once all are written).
 */
#define _POSIX_C_SOURCE 200809L
#include "core/core.h"
#include "core/outfile.h"
#include "io/safetensors.h"

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
