/* steal.c — see steal.h. */
#define _GNU_SOURCE /* sched_getcpu */
#include "core/steal.h"

#include <fcntl.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* One "cpuN ..." line (NUL-terminated): its steal, the eighth number, into out[N]; returns N,
 * or -1 for the aggregate "cpu " line, a malformed one or N past cap. */
static long parse_cpu_line(const char *line, double *out, int cap, double hz) {
    const char *p = line + 3;
    char *end;
    if (*p < '0' || *p > '9')
        return -1; /* the aggregate */
    const long cpu = strtol(p, &end, 10);
    /* user nice system idle iowait irq softirq steal */
    unsigned long long v = 0;
    int k = 0;
    for (p = end; k < 8; k++, p = end) {
        v = strtoull(p, &end, 10);
        if (end == p)
            break;
    }
    if (k < 8 || cpu < 0 || cpu >= cap)
        return -1;
    out[cpu] = (double)v / hz;
    return cpu;
}

int mdt_steal_read_all(const char *root, double *out, int cap) {
    char path[512], buf[4096];
    snprintf(path, sizeof path, "%s/proc/stat", root ? root : "");
    for (int i = 0; i < cap; i++)
        out[i] = -1.0;
    const int fd = open(path, O_RDONLY);
    if (fd < 0)
        return 0;
    const long tck = sysconf(_SC_CLK_TCK);
    const double hz = tck > 0 ? (double)tck : 100.0;
    int n = 0, done = 0;
    size_t have = 0; /* bytes of an unfinished line kept at the start of buf */
    /* the aggregate "cpu " line first, then one "cpuN" line per online vCPU; the file's other
     * lines (intr, ctxt, ...) come after them and are not read. Read in chunks into the stack
     * buffer (no allocation: this runs between forwards), a line split by a chunk carried over */
    while (!done) {
        const ssize_t got = read(fd, buf + have, sizeof buf - 1 - have);
        if (got <= 0)
            break;
        have += (size_t)got;
        buf[have] = '\0';
        char *line = buf, *nl;
        while ((nl = strchr(line, '\n')) != NULL) {
            *nl = '\0';
            if (strncmp(line, "cpu", 3) != 0) {
                done = 1;
                break;
            }
            const long cpu = parse_cpu_line(line, out, cap, hz);
            if (cpu >= n)
                n = (int)cpu + 1;
            line = nl + 1;
        }
        if (done)
            break;
        have = strlen(line);
        if (have == sizeof buf - 1) /* a line longer than the buffer: no cpu line is */
            break;
        memmove(buf, line, have);
    }
    close(fd);
    return n;
}

int mdt_steal_cpu_now(void) {
#ifdef __linux__
    return sched_getcpu();
#else
    return -1;
#endif
}

double mdt_steal_delta(int c0, const double *s0, int n0, int c1, const double *s1, int n1) {
    if (c0 < 0 || c1 < 0 || c0 >= n0 || c1 >= n1 || c0 >= n1 || c1 >= n0 || s0[c0] < 0 ||
        s1[c0] < 0 || s0[c1] < 0 || s1[c1] < 0)
        return -1.0;
    const double d0 = s1[c0] - s0[c0], d1 = s1[c1] - s0[c1], d = d0 > d1 ? d0 : d1;
    return d > 0 ? d : 0.0;
}

void mdt_steal_mark_now(const char *root, mdt_steal_mark *mk) {
    mk->cur = 0;
    mk->cpu = mdt_steal_cpu_now();
    mk->n = mdt_steal_read_all(root, mk->v[0], MDT_STEAL_CPUS);
}

double mdt_steal_since(const char *root, mdt_steal_mark *mk) {
    const int nxt = 1 - mk->cur, cpu = mdt_steal_cpu_now();
    const int n = mdt_steal_read_all(root, mk->v[nxt], MDT_STEAL_CPUS);
    const double d = mdt_steal_delta(mk->cpu, mk->v[mk->cur], mk->n, cpu, mk->v[nxt], n);
    mk->cur = nxt, mk->cpu = cpu, mk->n = n;
    return d;
}
