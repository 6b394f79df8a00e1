/* steal.c — see steal.h. */
#define _GNU_SOURCE /* sched_getcpu */
#include "core/steal.h"

#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int mdt_cpu_steal_all(const char *root, double *out, int cap) {
    char path[512], line[512];
    snprintf(path, sizeof path, "%s/proc/stat", root ? root : "");
    FILE *fp = fopen(path, "r");
    if (!fp)
        return 0;
    const long hz = sysconf(_SC_CLK_TCK);
    for (int i = 0; i < cap; i++)
        out[i] = -1.0;
    int n = 0;
    /* the aggregate "cpu " line first, then one "cpuN" line per online vCPU; the file's other
     * lines (intr, ctxt, ...) come after them and are not read */
    while (fgets(line, sizeof line, fp)) {
        if (strncmp(line, "cpu", 3) != 0)
            break;
        char *p = line + 3, *end;
        if (*p < '0' || *p > '9')
            continue; /* the aggregate */
        const long cpu = strtol(p, &end, 10);
        /* user nice system idle iowait irq softirq steal: the eighth number */
        unsigned long long v = 0;
        int k = 0;
        for (p = end; k < 8; k++, p = end) {
            v = strtoull(p, &end, 10);
            if (end == p)
                break;
        }
        if (k == 8 && cpu >= 0 && cpu < cap) {
            out[cpu] = (double)v / (double)(hz > 0 ? hz : 100);
            if (cpu + 1 > n)
                n = (int)cpu + 1;
        }
    }
    fclose(fp);
    return n;
}

int mdt_cpu_current(void) {
#ifdef __linux__
    return sched_getcpu();
#else
    return -1;
#endif
}

double mdt_cpu_steal_delta(int c0, const double *s0, int n0, int c1, const double *s1, int n1) {
    if (c0 < 0 || c1 < 0 || c0 >= n0 || c1 >= n1 || c0 >= n1 || c1 >= n0 || s0[c0] < 0 ||
        s1[c0] < 0 || s0[c1] < 0 || s1[c1] < 0)
        return -1.0;
    const double d0 = s1[c0] - s0[c0], d1 = s1[c1] - s0[c1], d = d0 > d1 ? d0 : d1;
    return d > 0 ? d : 0.0;
}
