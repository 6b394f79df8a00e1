/* sysmem.c — see sysmem.h. */
#define _POSIX_C_SOURCE 200809L
#include "core/sysmem.h"

#include "core/core.h"

#include <limits.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char *mdt_fmt_size(int64_t b, char *buf, size_t cap) {
    static const char *const unit[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    double v = (double)b;
    int u = 0;
    while (v >= 1024.0 && u < 4)
        v /= 1024.0, u++;
    snprintf(buf, cap, "%.1f %s", v, unit[u]);
    return buf;
}

int64_t mdt_size_parse(const char *s) {
    char *end, num[64];
    double v = strtod(s, &end);
    /* the number a plain decimal, as every number option takes (no blanks, sign or hex) */
    if (end == s || end - s >= (ptrdiff_t)sizeof num || *s == '-')
        return -1;
    memcpy(num, s, (size_t)(end - s));
    num[end - s] = '\0';
    if (!mdt_decimal(num, 0, &v) || !(v > 0))
        return -1;
    double mul = 1;
    switch (*end) {
    case 'k':
    case 'K': mul = 1024.0, end++; break;
    case 'm':
    case 'M': mul = 1048576.0, end++; break;
    case 'g':
    case 'G': mul = 1073741824.0, end++; break;
    case 't':
    case 'T': mul = 1099511627776.0, end++; break;
    default: break;
    }
    if (strcmp(end, "iB") == 0 || strcmp(end, "B") == 0 || strcmp(end, "b") == 0)
        end += strlen(end);
    if (*end || v * mul > 9.0e18)
        return -1;
    return (int64_t)(v * mul);
}

/* The first number in `path` ("max" = no limit: INT64_MAX), or -1 when unreadable. */
static int64_t read_num(const char *path) {
    FILE *fp = fopen(path, "r");
    char buf[64] = "";
    if (!fp)
        return -1;
    const int got = fgets(buf, sizeof buf, fp) != NULL;
    fclose(fp);
    if (!got)
        return -1;
    if (strncmp(buf, "max", 3) == 0)
        return INT64_MAX;
    char *end;
    const long long v = strtoll(buf, &end, 10);
    return end == buf || v < 0 ? -1 : (int64_t)v;
}

/* The value of line "key value" in a memory.stat-like file, or -1. */
static int64_t stat_field(const char *path, const char *key) {
    FILE *fp = fopen(path, "r");
    char line[256];
    int64_t v = -1;
    const size_t kl = strlen(key);
    while (fp && v < 0 && fgets(line, sizeof line, fp))
        if (strncmp(line, key, kl) == 0 && line[kl] == ' ')
            v = (int64_t)strtoll(line + kl + 1, NULL, 10);
    if (fp)
        fclose(fp);
    return v;
}

/* limit - usage + reclaimable file cache, within [0, limit]; -1 when unknown or unlimited. */
static int64_t headroom(int64_t limit, int64_t usage, int64_t active, int64_t inactive) {
    if (limit < 0 || limit >= ((int64_t)1 << 60) || usage < 0)
        return -1;
    const int64_t v = limit - usage + (active > 0 ? active : 0) + (inactive > 0 ? inactive : 0);
    return v < 0 ? 0 : v > limit ? limit : v;
}

static void take_min(int64_t v, const char *src, int64_t *best, char *what, size_t cap) {
    if (v >= 0 && (*best < 0 || v < *best)) {
        *best = v;
        snprintf(what, cap, "%s", src);
    }
}

/* cgroup v2: the cgroup at `dir` and each parent down to `base` (a prefix of dir). */
static void cgroup_v2(char *dir, size_t base_len, int64_t *best, char *what, size_t cap) {
    char p[PATH_MAX + 32];
    for (;;) {
        snprintf(p, sizeof p, "%s/memory.max", dir);
        const int64_t max = read_num(p);
        if (max >= 0 && max != INT64_MAX) {
            snprintf(p, sizeof p, "%s/memory.current", dir);
            const int64_t cur = read_num(p);
            snprintf(p, sizeof p, "%s/memory.stat", dir);
            take_min(
                headroom(max, cur, stat_field(p, "active_file"), stat_field(p, "inactive_file")),
                "cgroup memory.max", best, what, cap);
        }
        char *slash = strrchr(dir, '/');
        if (!slash || (size_t)(slash - dir) < base_len)
            break;
        *slash = 0;
    }
}

/* cgroup v1: memory.limit_in_bytes and the hierarchy's limit of the cgroup at `dir`. */
static void cgroup_v1(const char *dir, int64_t *best, char *what, size_t cap) {
    char p[PATH_MAX + 32];
    snprintf(p, sizeof p, "%s/memory.limit_in_bytes", dir);
    int64_t limit = read_num(p);
    snprintf(p, sizeof p, "%s/memory.stat", dir);
    const int64_t hier = stat_field(p, "hierarchical_memory_limit");
    const int64_t act = stat_field(p, "total_active_file"),
                  inact = stat_field(p, "total_inactive_file");
    if (hier >= 0 && (limit < 0 || hier < limit))
        limit = hier;
    snprintf(p, sizeof p, "%s/memory.usage_in_bytes", dir);
    take_min(headroom(limit, read_num(p), act, inact), "cgroup memory.limit_in_bytes", best, what,
             cap);
}

int64_t mdt_mem_available(const char *root, char *what, size_t cap) {
    int64_t best = -1;
    char path[PATH_MAX], line[PATH_MAX];
    snprintf(what, cap, "%s", "unknown");
    snprintf(path, sizeof path, "%s/proc/meminfo", root);
    FILE *fp = fopen(path, "r");
    while (fp && fgets(line, sizeof line, fp)) {
        long long kb;
        if (sscanf(line, "MemAvailable: %lld kB", &kb) == 1 && kb >= 0)
            take_min((int64_t)kb * 1024, "MemAvailable", &best, what, cap);
    }
    if (fp)
        fclose(fp);
    /* "0::/path" (v2) and "N:ctrl,ctrl:/path" (v1) lines, mounted where systemd mounts them */
    snprintf(path, sizeof path, "%s/proc/self/cgroup", root);
    fp = fopen(path, "r");
    while (fp && fgets(line, sizeof line, fp)) {
        line[strcspn(line, "\n")] = 0;
        char *c1 = strchr(line, ':'), *c2 = c1 ? strchr(c1 + 1, ':') : NULL;
        if (!c2 || c2[1] != '/')
            continue;
        *c1 = 0, *c2 = 0;
        const char *ctrls = c1 + 1, *cg = c2 + 1;
        char dir[PATH_MAX];
        if (strcmp(line, "0") == 0 && *ctrls == 0) {
            static const char *const bases[] = {"/sys/fs/cgroup", "/sys/fs/cgroup/unified"};
            for (int b = 0; b < 2; b++) {
                const int base_len = snprintf(dir, sizeof dir, "%s%s", root, bases[b]);
                snprintf(dir, sizeof dir, "%s%s%s", root, bases[b], strcmp(cg, "/") ? cg : "");
                cgroup_v2(dir, (size_t)base_len, &best, what, cap);
            }
            continue;
        }
        int is_memory = 0;
        for (const char *t = ctrls; *t; t += strcspn(t, ",") + (t[strcspn(t, ",")] ? 1 : 0))
            is_memory |= strncmp(t, "memory", 6) == 0 && (t[6] == ',' || t[6] == 0);
        if (!is_memory)
            continue;
        char probe[PATH_MAX + 32];
        snprintf(dir, sizeof dir, "%s/sys/fs/cgroup/memory%s", root, strcmp(cg, "/") ? cg : "");
        snprintf(probe, sizeof probe, "%s/memory.limit_in_bytes", dir);
        if (read_num(probe) < 0) /* a container that sees its own cgroup as the mount's root */
            snprintf(dir, sizeof dir, "%s/sys/fs/cgroup/memory", root);
        cgroup_v1(dir, &best, what, cap);
    }
    if (fp)
        fclose(fp);
    return best;
}

mdt_status mdt_mem_budget(int64_t *avail, char *what, size_t cap) {
    const char *env = getenv("MESHDIT_MEM_AVAILABLE");
    if (env && *env) {
        if ((*avail = mdt_size_parse(env)) <= 0)
            return MDT_FAIL(MDT_E_INVALID,
                            "MESHDIT_MEM_AVAILABLE='%.64s' is not a size like 512M, 8G or 1048576",
                            env);
        snprintf(what, cap, "MESHDIT_MEM_AVAILABLE");
        return MDT_OK;
    }
    *avail = mdt_mem_available("", what, cap);
    return MDT_OK;
}

mdt_status mdt_mem_fits(double need, const char *what, const char *mid, const char *tail) {
    char src[64], b1[32], b2[32];
    int64_t avail;
    MDT_TRY(mdt_mem_budget(&avail, src, sizeof src));
    if (avail < 0 || need <= (double)avail)
        return MDT_OK;
    return MDT_FAIL(MDT_E_NOMEM, "%s %s%s, more than the %s this process may use (%s)%s", what,
                    mdt_fmt_size(need > 9e18 ? INT64_MAX : (int64_t)need, b1, sizeof b1), mid,
                    mdt_fmt_size(avail, b2, sizeof b2), src, tail);
}
