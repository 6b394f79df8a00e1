/*
 * file.h — opening the files meshdit reads (config.json, the index, shards, --inputs) so that no
 * file can make a rank wait: a FIFO, device, socket or directory is refused with a one-line error
 * before anything blocks, and a rank that returns that error is agreed on by the others at the
 * next phase boundary like any failure. A symlink to a regular file is followed (Hugging Face
 * caches link every shard to a blob). No parsing, no MPI here.
 */
#ifndef MDT_FILE_H
#define MDT_FILE_H

#include "core/core.h"

/* Opens `path` read-only (close-on-exec, blocking reads) into *fd, or fails without blocking:
 * `missing` when no such file exists (MDT_E_NOTFOUND or MDT_E_IO, as the caller reports it),
 * MDT_E_IO when it cannot be opened or is not a regular file ("PATH: not a regular file (a FIFO)").
 * Messages show `path` escaped (mdt_escape). *fd is -1 on failure. */
mdt_status mdt_file_open_read(const char *path, mdt_status missing, int *fd);

#endif /* MDT_FILE_H */
