/* outfile.c — see outfile.h. */
#define _POSIX_C_SOURCE 200809L
#include "outfile.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#ifndef NAME_MAX
#define NAME_MAX 255
#endif
#ifndef PATH_MAX
#define PATH_MAX 4096
#endif

/* The temporary's name: short and fixed-length, so it fits wherever the target's name fits. */
#define TMP_NAME ".mdt-XXXXXX"

static const char *kind_of(mode_t m) {
    return S_ISDIR(m)    ? "a directory"
           : S_ISCHR(m)  ? "a character device"
           : S_ISBLK(m)  ? "a block device"
           : S_ISFIFO(m) ? "a FIFO"
           : S_ISSOCK(m) ? "a socket"
                         : "not a regular file";
}

/* "<dir of path>/" + name (or just name when path has no '/'), malloc'd; NULL on no memory. */
static char *beside(const char *path, const char *name) {
    const char *slash = strrchr(path, '/');
    const size_t dl = slash ? (size_t)(slash - path) + 1 : 0, nl = strlen(name);
    char *s = malloc(dl + nl + 1);
    if (s) {
        memcpy(s, path, dl);
        memcpy(s + dl, name, nl + 1);
    }
    return s;
}

/* The directory part of `path` ("." when it has none), malloc'd; NULL on no memory. */
static char *dir_of(const char *path) {
    const char *slash = strrchr(path, '/');
    const size_t dl = !slash ? 1 : slash == path ? 1 : (size_t)(slash - path);
    char *s = malloc(dl + 1);
    if (s) {
        memcpy(s, slash ? path : ".", dl);
        s[dl] = 0;
    }
    return s;
}

/* The name rules and what is at `path` now: absent or a regular file. */
static mdt_status check_target(const char *path) {
    if (!*path)
        return MDT_FAIL(MDT_E_INVALID, "the output file name is empty");
    const char *slash = strrchr(path, '/'), *base = slash ? slash + 1 : path;
    if (!*base || strcmp(base, ".") == 0 || strcmp(base, "..") == 0)
        return MDT_FAIL(MDT_E_INVALID, "%s: names a directory, not an output file", path);
    if (strlen(path) >= PATH_MAX)
        return MDT_FAIL(MDT_E_INVALID, "%s: the path is %zu bytes, over the %d-byte limit", path,
                        strlen(path), PATH_MAX - 1);
    char *dir = dir_of(path);
    long max = dir ? pathconf(dir, _PC_NAME_MAX) : -1;
    free(dir);
    if (max <= 0)
        max = NAME_MAX;
    if ((long)strlen(base) > max)
        return MDT_FAIL(
            MDT_E_INVALID,
            "%s: the file name is %zu bytes, over the %ld-byte limit of its file system "
            "(NAME_MAX)",
            path, strlen(base), max);
    struct stat sb;
    if (lstat(path, &sb) != 0)
        return errno == ENOENT
                   ? MDT_OK
                   : MDT_FAIL(MDT_E_IO, "%s: cannot use as an output: %s", path, strerror(errno));
    if (S_ISLNK(sb.st_mode))
        return MDT_FAIL(
            MDT_E_INVALID,
            "%s: is a symbolic link; outputs never replace or follow one (name the file "
            "it points to)",
            path);
    if (!S_ISREG(sb.st_mode))
        return MDT_FAIL(MDT_E_INVALID,
                        "%s: exists and is %s, not a regular file; refusing to "
                        "replace it",
                        path, kind_of(sb.st_mode));
    return MDT_OK;
}

/* Creates the temporary beside `path`: *tmp (malloc'd) and its descriptor, or a failure naming
 * the directory's problem. */
static mdt_status make_tmp(const char *path, char **tmp, int *fd) {
    *tmp = beside(path, TMP_NAME);
    *fd = -1;
    if (!*tmp)
        return MDT_FAIL(MDT_E_NOMEM, "out of memory");
    *fd = mkstemp(*tmp);
    if (*fd >= 0)
        return MDT_OK;
    const int err = errno;
    free(*tmp);
    *tmp = NULL;
    char *dir = dir_of(path);
    mdt_status st = MDT_FAIL(MDT_E_IO, "%s: cannot create a file in its directory %s: %s", path,
                             dir ? dir : "", strerror(err));
    free(dir);
    return st;
}

mdt_status mdt_out_check(const char *path) {
    char *tmp;
    int fd;
    MDT_TRY(check_target(path));
    MDT_TRY(make_tmp(path, &tmp, &fd));
    close(fd);
    unlink(tmp);
    free(tmp);
    return MDT_OK;
}

mdt_status mdt_out_begin(mdt_out *o, const char *path) {
    memset(o, 0, sizeof *o);
    o->fd = -1;
    MDT_TRY(check_target(path));
    o->path = malloc(strlen(path) + 1);
    if (!o->path)
        return MDT_FAIL(MDT_E_NOMEM, "out of memory");
    memcpy(o->path, path, strlen(path) + 1);
    mdt_status st = make_tmp(path, &o->tmp, &o->fd);
    if (st != MDT_OK) {
        free(o->path);
        o->path = NULL;
    }
    return st;
}

mdt_status mdt_out_write(mdt_out *o, const void *buf, size_t n) {
    const char *p = buf;
    if (o->fd < 0)
        return MDT_FAIL(MDT_E_INVALID, "%s: the output is not open for writing", o->path);
    while (n > 0) {
        ssize_t w = write(o->fd, p, n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return MDT_FAIL(MDT_E_IO, "%s: write failed: %s", o->path,
                            w < 0 ? strerror(errno) : "no progress");
        p += w, n -= (size_t)w;
    }
    return MDT_OK;
}

/* The mode `open(..., 0666)` would give a new file under this process's umask. */
static mode_t new_file_mode(void) {
    const mode_t mask = umask(0);
    umask(mask);
    return (mode_t)0666 & ~mask;
}

/* Flushes and closes the descriptor (the caller's writes), then gives the temporary the mode of
 * a new file. The temporary may have been replaced by a file written whole at its name. */
static mdt_status finish_tmp(mdt_out *o, mode_t mode) {
    if (o->fd >= 0) {
        const int bad = fsync(o->fd) != 0;
        const int err = errno;
        const int cbad = close(o->fd) != 0;
        o->fd = -1;
        if (bad || cbad)
            return MDT_FAIL(MDT_E_IO, "%s: writing failed: %s", o->path,
                            strerror(bad ? err : errno));
    }
    const int fd = open(o->tmp, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    struct stat sb;
    if (fd < 0 || fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode) || fchmod(fd, mode) != 0) {
        const int err = errno;
        if (fd >= 0)
            close(fd);
        return MDT_FAIL(MDT_E_IO, "%s: the finished temporary file %s is gone or changed: %s",
                        o->path, o->tmp, strerror(err));
    }
    close(fd);
    return MDT_OK;
}

static void sync_dir(const char *path) {
    char *dir = dir_of(path);
    const int fd = dir ? open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC) : -1;
    if (fd >= 0) {
        (void)fsync(fd); /* best effort: some file systems cannot sync a directory */
        close(fd);
    }
    free(dir);
}

static void release(mdt_out *o) {
    if (o->fd >= 0)
        close(o->fd);
    if (o->tmp)
        unlink(o->tmp);
    free(o->tmp);
    free(o->path);
    o->tmp = o->path = NULL;
    o->fd = -1;
}

void mdt_out_abort(mdt_out *o, int n) {
    for (int i = 0; i < n; i++)
        release(&o[i]);
}

mdt_status mdt_out_commit(mdt_out *o, int n) {
    mdt_status st = MDT_OK;
    const mode_t mode = new_file_mode();
    for (int i = 0; i < n && st == MDT_OK; i++)
        st = o[i].tmp ? finish_tmp(&o[i], mode)
                      : MDT_FAIL(MDT_E_INVALID, "%s: the output was not staged", o[i].path);
    for (int i = 0; i < n && st == MDT_OK; i++)
        st = check_target(o[i].path); /* nothing has changed kind since the work began */
    for (int i = 0; i < n && st == MDT_OK; i++) {
        if (rename(o[i].tmp, o[i].path) != 0) {
            const int err = errno;
            st = i == 0 ? MDT_FAIL(MDT_E_IO, "%s: rename failed: %s", o[i].path, strerror(err))
                        : MDT_FAIL(MDT_E_IO,
                                   "%s: rename failed: %s (%d output%s before it, first %s, "
                                   "already replaced)",
                                   o[i].path, strerror(err), i, i > 1 ? "s" : "", o[0].path);
            break;
        }
        free(o[i].tmp);
        o[i].tmp = NULL;
        sync_dir(o[i].path);
    }
    mdt_out_abort(o, n);
    return st;
}
