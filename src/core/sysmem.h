/*
 * sysmem.h — sizes in words and the memory this process may use: "8G" <-> bytes, and what
 * /proc/meminfo and the process's cgroups (v1 and v2) leave it. No MPI; the callers divide among
 * the ranks of a node.
 */
#ifndef MDT_CORE_SYSMEM_H
#define MDT_CORE_SYSMEM_H

#include "meshdit.h"

#include <stddef.h>
#include <stdint.h>

/* `b` bytes in binary units with one decimal ("2.4 MiB", "267.5 KiB") into buf; returns buf. */
const char *mdt_fmt_size(int64_t b, char *buf, size_t cap);

/* "512M", "8G", "1.5GiB", "1048576" -> bytes (binary units); -1 if malformed (meshdit.h). */
int64_t mdt_size_parse(const char *s);

/* Bytes this process may still allocate before the kernel's out-of-memory killer acts, or -1
 * when nothing can be read: the smallest of MemAvailable (/proc/meminfo) and, for every cgroup
 * of this process with a memory limit (v2: memory.max of its cgroup and each parent; v1:
 * memory.limit_in_bytes and hierarchical_memory_limit), the limit minus the usage plus the
 * cgroup's file cache (active + inactive file pages, which the kernel reclaims first). `root`
 * prefixes every path ("" for this system; a directory tree in tests). `what` receives the
 * source of the smallest ("MemAvailable", "cgroup memory.max", ...). */
int64_t mdt_mem_available(const char *root, char *what, size_t cap);

/* What this process may use for a check made before allocating: MESHDIT_MEM_AVAILABLE when set
 * (a size; anything else is MDT_E_INVALID naming it), else mdt_mem_available("") (-1: nothing
 * to go by). `what` receives the source's name. */
mdt_status mdt_mem_budget(int64_t *avail, char *what, size_t cap);

/* MDT_OK when `need` bytes fit that budget (or there is none to go by), else MDT_E_NOMEM:
 * "WHAT SIZE MID, more than the AVAIL this process may use (SOURCE)TAIL". A malformed
 * MESHDIT_MEM_AVAILABLE is refused whatever `need` (0 checks only that). */
mdt_status mdt_mem_fits(double need, const char *what, const char *mid, const char *tail);

#endif /* MDT_CORE_SYSMEM_H */
