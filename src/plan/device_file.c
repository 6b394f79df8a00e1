/*
 * device_file.c — the planner's device file (meshdit.h: mdt_device_spec_load / _save): what
 * `meshdit plan --calibrate` measured, read back by `meshdit plan --device-file`. JSON:
 *   {"meshdit_device": 1, "name", "calibrated", "source",
 *    "flops": {"linear", "attention", "other"}, "memory_bytes", "devices_per_node",
 *    "bandwidth": {"intra", "inter"}, "latency_s",
 *    "collectives": {"intra"|"inter": {"allreduce"|"alltoall"|"sendrecv"|"allgather":
 *        {"latency_s", "bytes_per_s", "overlap"}}}}
 * Rates in FLOP/s and bytes sent per rank per second; overlap (optional, default 1) in [0, 1].
 * A key the format does not have is refused (a misspelt one would silently fall back). Anything
 * missing, non-finite or out of range is refused with the file and the field named.
 */
#include "core/core.h"
#include "core/outfile.h"
#include "io/json.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* indexed by mdt_coll_cost_kind and by link; NULL-terminated for only_keys */
static const char *const k_kind[MDT_COST_KIND_COUNT + 1] = {"allreduce", "alltoall", "sendrecv",
                                                            "allgather", NULL};
static const char *const k_link[MDT_LINK_COUNT + 1] = {"intra", "inter", NULL};

/* The number at obj.key into *v, within [lo, hi]; absent: *v = def when optional, else an
 * error naming path, where and key. */
static mdt_status num(const char *path, const cJSON *obj, const char *where, const char *key,
                      int optional, double def, double lo, double hi, double *v) {
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(obj, key);
    if (!it) {
        *v = def;
        return optional
                   ? MDT_OK
                   : MDT_FAIL(MDT_E_FORMAT, "%s: device file: %s%s is missing", path, where, key);
    }
    if (!cJSON_IsNumber(it) || !isfinite(it->valuedouble) || it->valuedouble < lo ||
        it->valuedouble > hi)
        return MDT_FAIL(MDT_E_FORMAT, "%s: device file: %s%s must be a number in [%g, %g]", path,
                        where, key, lo, hi);
    *v = it->valuedouble;
    return MDT_OK;
}

/* Every key of obj is one of `keys` (NULL-terminated), and none comes twice (the lookup would
 * take the first and ignore the second: a silent choice). */
static mdt_status only_keys(const char *path, const cJSON *obj, const char *where,
                            const char *const *keys) {
    for (const cJSON *it = obj ? obj->child : NULL; it; it = it->next) {
        int known = 0;
        for (const char *const *k = keys; *k && !known; k++)
            known = it->string && strcmp(it->string, *k) == 0;
        if (!known)
            return MDT_FAIL(MDT_E_FORMAT, "%s: device file: unknown key %s%s", path, where,
                            it->string ? it->string : "?");
        for (const cJSON *e = obj->child; e != it; e = e->next)
            if (strcmp(e->string, it->string) == 0)
                return MDT_FAIL(MDT_E_FORMAT, "%s: device file: key %s%s given twice", path, where,
                                it->string);
    }
    return MDT_OK;
}

/* A string the plan prints as it is: what mdt_escape would leave unchanged (no control bytes,
 * C1 or bidirectional code points, malformed UTF-8 or backslashes: a file must not write to the
 * terminal). */
static int printable(const char *t) {
    char shown[1024];
    return strcmp(mdt_escape(t, shown, sizeof shown), t) == 0;
}

/* obj.key into *out when it is an object with only `keys`; absent: NULL if optional, else an
 * error. `where` names obj's path ("collectives."). */
static mdt_status sub_object(const char *path, const cJSON *obj, const char *where, const char *key,
                             int optional, const char *const *keys, const cJSON **out) {
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(obj, key);
    *out = it;
    if (!it && optional)
        return MDT_OK;
    if (!cJSON_IsObject(it))
        return MDT_FAIL(MDT_E_FORMAT, "%s: device file: %s%s must be an object", path, where, key);
    char inner[64];
    snprintf(inner, sizeof inner, "%s%s.", where, key);
    return only_keys(path, it, inner, keys);
}

static mdt_status parse(const char *path, const cJSON *j, mdt_device_spec *d) {
    static const char *const k_top[] = {
        "meshdit_device",   "name",      "calibrated", "source",      "flops", "memory_bytes",
        "devices_per_node", "bandwidth", "latency_s",  "collectives", NULL};
    static const char *const k_flops[] = {"linear", "attention", "other", NULL};
    static const char *const k_cost[] = {"latency_s", "bytes_per_s", "overlap", NULL};
    double v;
    if (!cJSON_IsObject(j))
        return MDT_FAIL(MDT_E_FORMAT, "%s: device file: not a JSON object", path);
    MDT_TRY(only_keys(path, j, "", k_top));
    MDT_TRY(num(path, j, "", "meshdit_device", 0, 0, 1, 1, &v));
    const cJSON *name = cJSON_GetObjectItemCaseSensitive(j, "name");
    if (!cJSON_IsString(name) || !name->valuestring[0] ||
        strlen(name->valuestring) >= sizeof d->name || !printable(name->valuestring))
        return MDT_FAIL(MDT_E_FORMAT,
                        "%s: device file: name must be a string of 1 to %zu printable bytes", path,
                        sizeof d->name - 1);
    snprintf(d->name, sizeof d->name, "%s", name->valuestring);
    const cJSON *src = cJSON_GetObjectItemCaseSensitive(j, "source");
    if (src && (!cJSON_IsString(src) || strlen(src->valuestring) >= sizeof d->source ||
                !printable(src->valuestring)))
        return MDT_FAIL(MDT_E_FORMAT,
                        "%s: device file: source must be a string of at most %zu printable bytes",
                        path, sizeof d->source - 1);
    snprintf(d->source, sizeof d->source, "%s", src ? src->valuestring : path);
    const cJSON *cal = cJSON_GetObjectItemCaseSensitive(j, "calibrated");
    if (cal && !cJSON_IsBool(cal))
        return MDT_FAIL(MDT_E_FORMAT, "%s: device file: calibrated must be true or false", path);
    d->calibrated = cJSON_IsTrue(cal);
    const cJSON *fl, *bw, *co;
    MDT_TRY(sub_object(path, j, "", "flops", 0, k_flops, &fl));
    MDT_TRY(num(path, fl, "flops.", "linear", 0, 0, 1e3, 1e18, &d->flops));
    MDT_TRY(num(path, fl, "flops.", "attention", 1, 0, 0, 1e18, &d->flops_attn));
    MDT_TRY(num(path, fl, "flops.", "other", 1, 0, 0, 1e18, &d->flops_other));
    /* 0 (or absent): the linear rate; else a rate as plausible as the linear one's lower bound
     * (1e-300 FLOP/s made every layout's step take inf seconds) */
    const double rates[2] = {d->flops_attn, d->flops_other};
    for (int r = 0; r < 2; r++)
        if (rates[r] > 0 && rates[r] < 1e3)
            return MDT_FAIL(MDT_E_FORMAT,
                            "%s: device file: flops.%s must be 0 (the linear rate) or a number in "
                            "[1000, 1e+18]",
                            path, r ? "other" : "attention");
    MDT_TRY(num(path, j, "", "memory_bytes", 0, 0, 1e6, 1e16, &d->mem_bytes));
    MDT_TRY(num(path, j, "", "devices_per_node", 0, 0, 1, 1 << 20, &v));
    if (v != floor(v))
        return MDT_FAIL(MDT_E_FORMAT, "%s: device file: devices_per_node must be an integer", path);
    d->node_size = (int)v;
    MDT_TRY(sub_object(path, j, "", "bandwidth", 0, k_link, &bw));
    MDT_TRY(num(path, bw, "bandwidth.", "intra", 0, 0, 1e3, 1e15, &d->bw_intra));
    MDT_TRY(num(path, bw, "bandwidth.", "inter", 0, 0, 1e3, 1e15, &d->bw_inter));
    MDT_TRY(num(path, j, "", "latency_s", 0, 0, 0, 10, &d->latency));
    MDT_TRY(sub_object(path, j, "", "collectives", 1, k_link, &co));
    for (int l = 0; co && l < MDT_LINK_COUNT; l++) {
        const cJSON *lo;
        MDT_TRY(sub_object(path, co, "collectives.", k_link[l], 1, k_kind, &lo));
        char lwhere[32];
        snprintf(lwhere, sizeof lwhere, "collectives.%s.", k_link[l]);
        for (int k = 0; lo && k < MDT_COST_KIND_COUNT; k++) {
            const cJSON *c;
            char where[64];
            snprintf(where, sizeof where, "%s%s.", lwhere, k_kind[k]);
            MDT_TRY(sub_object(path, lo, lwhere, k_kind[k], 1, k_cost, &c));
            if (!c)
                continue;
            MDT_TRY(num(path, c, where, "latency_s", 0, 0, 0, 10, &d->coll[l][k].latency));
            MDT_TRY(num(path, c, where, "bytes_per_s", 0, 0, 1e3, 1e15, &d->coll[l][k].bw));
            MDT_TRY(num(path, c, where, "overlap", 1, 1.0, 0, 1, &d->coll[l][k].overlap));
        }
    }
    return MDT_OK;
}

mdt_status mdt_device_spec_load(const char *path, mdt_device_spec *out) {
    memset(out, 0, sizeof *out);
    cJSON *j = NULL;
    MDT_TRY(mdt_json_load_file(path, 65536, &j)); /* a device file is a few KiB */
    mdt_device_spec d = {0};
    const mdt_status st = parse(path, j, &d);
    cJSON_Delete(j);
    if (st == MDT_OK)
        *out = d;
    return st;
}

mdt_status mdt_device_spec_save(const mdt_device_spec *d, const char *path) {
    cJSON *j = cJSON_CreateObject();
    if (!j)
        return MDT_FAIL(MDT_E_NOMEM, "out of memory");
    cJSON_AddNumberToObject(j, "meshdit_device", 1);
    cJSON_AddStringToObject(j, "name", d->name);
    cJSON_AddBoolToObject(j, "calibrated", d->calibrated);
    cJSON_AddStringToObject(j, "source", d->source);
    cJSON *fl = cJSON_AddObjectToObject(j, "flops");
    cJSON_AddNumberToObject(fl, "linear", d->flops);
    cJSON_AddNumberToObject(fl, "attention", d->flops_attn);
    cJSON_AddNumberToObject(fl, "other", d->flops_other);
    cJSON_AddNumberToObject(j, "memory_bytes", d->mem_bytes);
    cJSON_AddNumberToObject(j, "devices_per_node", d->node_size);
    cJSON *bw = cJSON_AddObjectToObject(j, "bandwidth");
    cJSON_AddNumberToObject(bw, "intra", d->bw_intra);
    cJSON_AddNumberToObject(bw, "inter", d->bw_inter);
    cJSON_AddNumberToObject(j, "latency_s", d->latency);
    cJSON *co = cJSON_AddObjectToObject(j, "collectives");
    for (int l = 0; l < MDT_LINK_COUNT; l++) {
        cJSON *lo = cJSON_AddObjectToObject(co, k_link[l]);
        for (int k = 0; k < MDT_COST_KIND_COUNT; k++) {
            if (!(d->coll[l][k].bw > 0))
                continue; /* not measured */
            cJSON *c = cJSON_AddObjectToObject(lo, k_kind[k]);
            cJSON_AddNumberToObject(c, "latency_s", d->coll[l][k].latency);
            cJSON_AddNumberToObject(c, "bytes_per_s", d->coll[l][k].bw);
            if (k == MDT_COST_SENDRECV)
                cJSON_AddNumberToObject(c, "overlap", d->coll[l][k].overlap);
        }
    }
    char *text = cJSON_Print(j);
    cJSON_Delete(j);
    if (!text)
        return MDT_FAIL(MDT_E_NOMEM, "out of memory");
    mdt_out o;
    mdt_status st = mdt_out_begin(&o, path);
    if (st == MDT_OK && (st = mdt_out_write(&o, text, strlen(text))) == MDT_OK)
        st = mdt_out_write(&o, "\n", 1);
    if (st == MDT_OK)
        st = mdt_out_commit(&o, 1);
    else
        mdt_out_abort(&o, 1);
    free(text);
    return st;
}
