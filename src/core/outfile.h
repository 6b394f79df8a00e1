/*
 * outfile.h — output files that appear whole or not at all, a group of them together, and never
 * in place of something that is not a regular file.
 *
 * What it does: checks an output path before any work (a valid name, nothing there but a regular
 * file, a directory that accepts a new file), stages each output in a temporary file of its own
 * directory (".mdt-XXXXXX": short, so a target name of NAME_MAX bytes still works), and commits a
 * group by renaming every temporary over its target only once all of them are written, each
 * with the mode of a newly created file (0666 & ~umask, as any Unix tool). A failure before the
 * first rename removes the temporaries and leaves every old file untouched.
 * What it does not do: write any format (the caller writes the bytes, or replaces the temporary
 * by a file written whole at `tmp`, e.g. a safetensors writer), or follow a symbolic link: an
 * existing link at a target is refused, the file it points to stays as it was.
 * Depends on libc (POSIX) only.
 */
#ifndef MDT_OUTFILE_H
#define MDT_OUTFILE_H

#include "core.h"

#include <stddef.h>

typedef struct mdt_out {
    char *path; /* target (copied) */
    char *tmp;  /* "<dir of path>/.mdt-XXXXXX", NULL once committed or removed */
    int fd;     /* open on tmp until the first write finishes or commit; -1 otherwise */
} mdt_out;

/* Checks that `path` can be written as an output, before any work is done: a non-empty name
 * that does not end in '/', a last component of at most NAME_MAX bytes, no existing entry there
 * other than a regular file (a directory, device, FIFO, socket or symbolic link is refused, never
 * replaced), and a directory in which a file can be created (a temporary is created and
 * removed). MDT_E_INVALID (bad name, not a regular file) or MDT_E_IO (cannot create there), the
 * message naming the path. */
mdt_status mdt_out_check(const char *path);

/* Stages `path`: creates its temporary (mode 0600 while it is written) after the same checks as
 * mdt_out_check. `*o` is zeroed first; release it with mdt_out_commit or mdt_out_abort. */
mdt_status mdt_out_begin(mdt_out *o, const char *path);
/* Appends `n` bytes to the temporary. MDT_E_IO naming the target on a short write. */
mdt_status mdt_out_write(mdt_out *o, const void *buf, size_t n);

/* Commits the `n` staged outputs: flushes each temporary to disk, checks every target again
 * (still absent or a regular file), gives each temporary the mode 0666 & ~umask, then renames
 * them over their targets in order and syncs their directories. A failure before the first
 * rename removes every temporary and leaves every target as it was; a rename failing after an
 * earlier one succeeded (a concurrent change of the directory) says which outputs were already
 * replaced. Reads the umask with umask(2), which is process-wide: call it from one thread. The
 * outputs are released either way. */
mdt_status mdt_out_commit(mdt_out *o, int n);

/* Removes the temporaries of `n` outputs (staged or not) and releases them. Never fails. */
void mdt_out_abort(mdt_out *o, int n);

#endif /* MDT_OUTFILE_H */
