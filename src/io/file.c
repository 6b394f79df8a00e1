/*
 * file.c — see file.h. The mode is checked twice: stat() first, so that a FIFO or a device is
 * never opened at all (opening one can block, or act: a tape rewinds), then fstat() on the open
 * descriptor, because the name may have been swapped between the two calls; the open itself uses
 * O_NONBLOCK so that even a swapped-in FIFO cannot block it. O_NONBLOCK is cleared afterwards
 * (it means nothing for regular files, but the readers expect plain blocking reads).
 */
#define _POSIX_C_SOURCE 200809L
#include "file.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#ifndef O_NOCTTY
#define O_NOCTTY 0
#endif

static const char *kind_of(mode_t m) {
    if (S_ISDIR(m))
        return "a directory";
    if (S_ISFIFO(m))
        return "a FIFO";
    if (S_ISSOCK(m))
        return "a socket";
    if (S_ISCHR(m))
        return "a character device";
    if (S_ISBLK(m))
        return "a block device";
    return "not a file";
}

static mdt_status not_regular(const char *path, mode_t m) {
    char shown[4096];
    return MDT_FAIL(MDT_E_IO, "%s: not a regular file (%s); meshdit reads only regular files",
                    mdt_escape(path, shown, sizeof shown), kind_of(m));
}

mdt_status mdt_file_open_read(const char *path, mdt_status missing, int *fd) {
    char shown[4096];
    struct stat sb;
    *fd = -1;
    if (stat(path, &sb) != 0)
        return MDT_FAIL(errno == ENOENT ? missing : MDT_E_IO, "%s: cannot open: %s",
                        mdt_escape(path, shown, sizeof shown), strerror(errno));
    if (!S_ISREG(sb.st_mode))
        return not_regular(path, sb.st_mode);
    int f = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
    if (f < 0)
        return MDT_FAIL(errno == ENOENT ? missing : MDT_E_IO, "%s: cannot open: %s",
                        mdt_escape(path, shown, sizeof shown), strerror(errno));
    if (fstat(f, &sb) != 0) {
        mdt_status st = MDT_FAIL(MDT_E_IO, "%s: cannot stat: %s",
                                 mdt_escape(path, shown, sizeof shown), strerror(errno));
        close(f);
        return st;
    }
    if (!S_ISREG(sb.st_mode)) {
        close(f);
        return not_regular(path, sb.st_mode);
    }
    int fl = fcntl(f, F_GETFL);
    if (fl < 0 || fcntl(f, F_SETFL, fl & ~O_NONBLOCK) != 0) {
        mdt_status st = MDT_FAIL(MDT_E_IO, "%s: cannot clear O_NONBLOCK: %s",
                                 mdt_escape(path, shown, sizeof shown), strerror(errno));
        close(f);
        return st;
    }
    *fd = f;
    return MDT_OK;
}
