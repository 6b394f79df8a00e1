/*
 * test_steal.c — the hypervisor's steal per vCPU read from a fake /proc/stat (the eighth
 * number of each cpuN line, in USER_HZ ticks), offline and missing vCPUs, a file without
 * them, lines spread over several reads and one longer than the buffer, a forward's steal when
 * its thread stayed on one CPU or moved (the larger of the two), and consecutive intervals from
 * a mark.
 */
#define _POSIX_C_SOURCE 200809L
#include "harness.h"
#include "core/steal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static char g_root[256];

static void put_stat(const char *text) {
    char path[512];
    snprintf(path, sizeof path, "%s/proc", g_root);
    mkdir(path, 0777);
    snprintf(path, sizeof path, "%s/proc/stat", g_root);
    FILE *fp = fopen(path, "w");
    if (fp) {
        fputs(text, fp);
        fclose(fp);
    }
}

static void reading(void) {
    const double tick = 1.0 / (double)sysconf(_SC_CLK_TCK);
    double v[8];
    EXPECT(mdt_steal_read_all(g_root, v, 8) == 0, "no file: nothing known");
    /* cpu2 offline (absent); the aggregate line and the lines after the CPUs are not vCPUs */
    put_stat("cpu  10 0 5 100 0 0 0 700 0 0\n"
             "cpu0 4 0 2 50 0 0 0 300 0 0\n"
             "cpu1 6 0 3 50 0 0 0 400 0 0\n"
             "cpu3 1 2 3 4 5 6 7 8 9 10\n"
             "intr 12345 1 2 3\nctxt 99\n");
    int n = mdt_steal_read_all(g_root, v, 8);
    EXPECT(n == 4, "1 + the highest vCPU: %d", n);
    EXPECT(fabs(v[0] - 300 * tick) < 1e-9 && fabs(v[1] - 400 * tick) < 1e-9 && v[2] == -1 &&
               fabs(v[3] - 8 * tick) < 1e-9,
           "steal per vCPU: %g %g %g %g", v[0], v[1], v[2], v[3]);
    EXPECT(v[4] == -1 && v[7] == -1, "past the file's vCPUs: unknown");
    /* a cap below the vCPUs: only those that fit */
    n = mdt_steal_read_all(g_root, v, 2);
    EXPECT(n == 2 && fabs(v[1] - 400 * tick) < 1e-9, "cap 2: %d", n);
    /* 300 vCPUs: the cpu lines span several reads of the stack buffer, lines split between
     * them carried over */
    char *big = malloc(300 * 64 + 64), *w = big;
    w += sprintf(w, "cpu  1 2 3 4 5 6 7 8 9 10\n");
    for (int c = 0; c < 300; c++)
        w += sprintf(w, "cpu%d 11111 22222 33333 44444 0 0 0 %d 0 0\n", c, 1000 + c);
    sprintf(w, "intr 1 2 3\n");
    put_stat(big);
    free(big);
    double many[320];
    n = mdt_steal_read_all(g_root, many, 320);
    int bad = 0;
    for (int c = 0; c < 300; c++)
        bad += fabs(many[c] - (1000 + c) * tick) > 1e-9;
    EXPECT(n == 300 && bad == 0 && many[300] == -1, "300 vCPUs: %d read, %d wrong", n, bad);
    /* a first line longer than the buffer (no cpu line is): nothing read, no overrun */
    big = malloc(9000);
    strcpy(big, "cpu0"); /* its NUL overwritten next */
    memset(big + 4, '7', 8990);
    memcpy(big + 8994, " 1 2\n", 6);
    put_stat(big);
    free(big);
    EXPECT(mdt_steal_read_all(g_root, v, 8) == 0, "an overlong line: nothing read");
    /* a kernel without the steal column (fewer than eight numbers): not a reading */
    put_stat("cpu  1 2 3 4\ncpu0 1 2 3 4 5 6 7\n");
    EXPECT(mdt_steal_read_all(g_root, v, 8) == 0 && v[0] == -1, "no steal column");
    put_stat("intr 1 2\n");
    EXPECT(mdt_steal_read_all(g_root, v, 8) == 0, "no cpu lines");
}

static void delta(void) {
    const double s0[3] = {1.0, 2.0, -1}, s1[3] = {1.25, 2.5, -1};
    EXPECT(mdt_steal_delta(1, s0, 3, 1, s1, 3) == 0.5, "stayed on cpu1");
    EXPECT(mdt_steal_delta(0, s0, 3, 1, s1, 3) == 0.5 && mdt_steal_delta(1, s0, 3, 0, s1, 3) == 0.5,
           "moved: the larger of the two CPUs' steal");
    EXPECT(mdt_steal_delta(2, s0, 3, 2, s1, 3) == -1, "an offline CPU: unknown");
    EXPECT(mdt_steal_delta(-1, s0, 3, 0, s1, 3) == -1, "no CPU number: unknown");
    EXPECT(mdt_steal_delta(0, s0, 0, 0, s1, 3) == -1, "no first reading: unknown");
    EXPECT(mdt_steal_delta(1, s0, 3, 1, s1, 1) == -1, "past the second reading: unknown");
    /* a mark and consecutive intervals from it, one reading each (a fake file the same on every
     * CPU, so the CPU this thread is on does not matter) */
    const double tick = 1.0 / (double)sysconf(_SC_CLK_TCK);
    char text[64 * MDT_STEAL_CPUS + 64];
    long ncpu = sysconf(_SC_NPROCESSORS_CONF);
    ncpu = ncpu < 1 ? 1 : ncpu > MDT_STEAL_CPUS ? MDT_STEAL_CPUS : ncpu;
    static mdt_steal_mark mk; /* 8 KiB: off the stack */
    const int ticks[3] = {100, 130, 130};
    double got[2] = {-1, -1};
    for (int k = 0; k < 3; k++) {
        int w = 0;
        for (long c = 0; c < ncpu; c++)
            w += snprintf(text + w, sizeof text - (size_t)w, "cpu%ld 1 2 3 4 5 6 7 %d 0 0\n", c,
                          ticks[k]);
        put_stat(text);
        if (k == 0)
            mdt_steal_mark_now(g_root, &mk);
        else
            got[k - 1] = mdt_steal_since(g_root, &mk);
    }
    EXPECT(mdt_steal_cpu_now() < 0 || mdt_steal_cpu_now() >= ncpu ||
               (fabs(got[0] - 30 * tick) < 1e-9 && got[1] == 0),
           "consecutive intervals: %g then %g (30 ticks, then none)", got[0], got[1]);
    /* this system: a reading of the CPU this thread is on, never negative */
    double a[512], b[512];
    const int c = mdt_steal_cpu_now(), na = mdt_steal_read_all("", a, 512);
    const int nb = mdt_steal_read_all("", b, 512);
    const double d = mdt_steal_delta(c, a, na, mdt_steal_cpu_now(), b, nb);
    EXPECT(access("/proc/stat", R_OK) != 0 || c < 0 || c >= 512 || d >= 0,
           "this system's steal: cpu %d, %d vCPUs, %g", c, na, d);
}

int main(void) {
    snprintf(g_root, sizeof g_root, "/tmp/mdt_steal_XXXXXX");
    if (!mkdtemp(g_root))
        g_root[0] = 0;
    reading();
    delta();
    char cmd[512];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_root);
    if (g_root[0] && system(cmd) != 0)
        fprintf(stderr, "could not remove %s\n", g_root);
    TEST_END();
}
