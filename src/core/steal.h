/*
 * steal.h — the seconds a hypervisor ran something else while a vCPU of this guest wanted to
 * run (the steal column of /proc/stat's cpuN lines), and the CPU the calling thread is on: what
 * a run report puts beside each forward, so a slow step on a shared host is told from a slow
 * mesh. Linux; elsewhere nothing is known (-1, 0 CPUs). No MPI; no allocation (a forward's
 * statistics read it inside the step loop). Counts and seconds, not statuses: an unreadable file
 * is an unknown reading, never an error.
 */
#ifndef MDT_CORE_STEAL_H
#define MDT_CORE_STEAL_H

/* Each vCPU's stolen seconds since boot, /proc/stat's steal in USER_HZ ticks (10 ms on most
 * kernels), into out[cpu] for cpu < cap; a vCPU missing from the file (offline) reads -1.
 * Returns how many it filled (1 + the highest cpuN seen, at most cap), or 0 when the file
 * cannot be read or names no vCPU. `root` prefixes the path ("" for this system; a directory
 * tree in tests). */
int mdt_steal_read_all(const char *root, double *out, int cap);

/* The CPU the calling thread runs on now, or -1 when the system cannot say. */
int mdt_steal_cpu_now(void);

/* The steal of a forward that began on CPU `c0` with `s0` (mdt_steal_read_all's vector, n0
 * entries) and ended on `c1` with `s1` (n1): the seconds taken from the CPU it ran on; when the
 * thread moved, the larger of the two CPUs' (when it moved is not known, so an estimate: each
 * CPU's count covers the whole forward, part of it spent on the other). -1 when either reading
 * is missing. */
double mdt_steal_delta(int c0, const double *s0, int n0, int c1, const double *s1, int n1);

/* A reading to measure the next interval's steal from: the CPU and its vector, and a second
 * vector for the next reading (the two swap, so each reading is taken once). */
enum { MDT_STEAL_CPUS = 512 }; /* vCPUs past these read as unknown */
typedef struct mdt_steal_mark {
    int cpu, n, cur;             /* the CPU, mdt_steal_read_all's count, the row in v */
    double v[2][MDT_STEAL_CPUS]; /* [2, MDT_STEAL_CPUS] */
} mdt_steal_mark;

/* Takes a reading into *mk (from `root`, as mdt_steal_read_all). */
void mdt_steal_mark_now(const char *root, mdt_steal_mark *mk);

/* The steal since *mk (mdt_steal_delta of the two readings; -1 unknown), and *mk becomes this
 * reading: consecutive calls give consecutive intervals, one /proc/stat read each. */
double mdt_steal_since(const char *root, mdt_steal_mark *mk);

#endif /* MDT_CORE_STEAL_H */
