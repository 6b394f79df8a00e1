/*
 * test_outfile.c — output files: the checks made before any work (name, what is there, a
 * writable directory), a group committed both-or-neither, the umask's mode, NAME_MAX-long names,
 * and no temporary left behind.
 */
#define _POSIX_C_SOURCE 200809L
#include "core/outfile.h"
#include "harness.h"

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

static char g_dir[256];

static const char *tpath(const char *name) {
    static char buf[8][1024];
    static int k;
    k = (k + 1) % 8;
    snprintf(buf[k], sizeof buf[k], "%s/%s", g_dir, name);
    return buf[k];
}

static void put(const char *path, const char *text) {
    FILE *fp = fopen(path, "w");
    if (fp) {
        fputs(text, fp);
        fclose(fp);
    }
}

/* The file's whole text (up to 255 bytes), "" if unreadable. */
static const char *get(const char *path) {
    static char buf[256];
    buf[0] = 0;
    FILE *fp = fopen(path, "r");
    if (fp) {
        size_t n = fread(buf, 1, sizeof buf - 1, fp);
        buf[n] = 0;
        fclose(fp);
    }
    return buf;
}

static int temporaries_left(void) {
    int n = 0;
    DIR *d = opendir(g_dir);
    const struct dirent *e;
    while (d && (e = readdir(d)))
        n += strncmp(e->d_name, ".mdt-", 5) == 0;
    if (d)
        closedir(d);
    return n;
}

static mdt_status stage_text(mdt_out *o, const char *path, const char *text) {
    MDT_TRY(mdt_out_begin(o, path));
    mdt_status st = mdt_out_write(o, text, strlen(text));
    if (st != MDT_OK)
        mdt_out_abort(o, 1);
    return st;
}

int main(void) {
    snprintf(g_dir, sizeof g_dir, "/tmp/mdt_outfile_XXXXXX");
    if (!mkdtemp(g_dir))
        return 1;
    char name255[300], name256[300];
    memset(name255, 'a', 255), name255[255] = 0;
    memset(name256, 'b', 256), name256[256] = 0;

    /* checks before any work */
    EXPECT_OK(mdt_out_check(tpath("new.safetensors")));
    EXPECT_OK(mdt_out_check(tpath(name255)));
    EXPECT_ERR(mdt_out_check(tpath(name256)), MDT_E_INVALID, "256 bytes", "NAME_MAX");
    EXPECT_ERR(mdt_out_check(""), MDT_E_INVALID, "empty");
    EXPECT_ERR(mdt_out_check(tpath("sub/")), MDT_E_INVALID, "names a directory");
    EXPECT_ERR(mdt_out_check(tpath("nowhere/x.json")), MDT_E_IO, "nowhere/x.json",
               "cannot create a file in its directory");
    mkdir(tpath("adir"), 0777);
    EXPECT_ERR(mdt_out_check(tpath("adir")), MDT_E_INVALID, "adir", "a directory",
               "not a regular file");
    mkfifo(tpath("fifo"), 0666);
    EXPECT_ERR(mdt_out_check(tpath("fifo")), MDT_E_INVALID, "a FIFO");
    EXPECT_ERR(mdt_out_check("/dev/null"), MDT_E_INVALID, "a character device");
    put(tpath("target"), "old");
    EXPECT(symlink(tpath("target"), tpath("link")) == 0, "symlink");
    EXPECT_ERR(mdt_out_check(tpath("link")), MDT_E_INVALID, "symbolic link");
    put(tpath("old"), "old");
    EXPECT_OK(mdt_out_check(tpath("old")));
    EXPECT(temporaries_left() == 0, "the checks left a temporary");

    /* one output: written whole, mode 0666 & ~umask (0640 under 027), NAME_MAX-long name */
    mode_t prev = umask(027);
    mdt_out o[2];
    EXPECT_OK(stage_text(&o[0], tpath(name255), "hello"));
    EXPECT(access(tpath(name255), F_OK) != 0, "target exists before the commit");
    EXPECT_OK(mdt_out_commit(o, 1));
    struct stat sb;
    EXPECT(stat(tpath(name255), &sb) == 0 && (sb.st_mode & 0777) == 0640, "mode %o",
           (unsigned)(sb.st_mode & 0777));
    EXPECT(strcmp(get(tpath(name255)), "hello") == 0, "content '%s'", get(tpath(name255)));
    umask(022);
    /* a temporary replaced by a file written whole at its name (the safetensors writer's way) */
    EXPECT_OK(mdt_out_begin(&o[0], tpath("old")));
    put(tpath("replacement"), "new");
    EXPECT(rename(tpath("replacement"), o[0].tmp) == 0, "rename over the temporary");
    EXPECT_OK(mdt_out_commit(o, 1));
    EXPECT(strcmp(get(tpath("old")), "new") == 0 && stat(tpath("old"), &sb) == 0 &&
               (sb.st_mode & 0777) == 0644,
           "replaced temporary: '%s' mode %o", get(tpath("old")), (unsigned)(sb.st_mode & 0777));

    /* both or neither: the second target turns into a directory after staging */
    put(tpath("a"), "old a");
    EXPECT_OK(stage_text(&o[0], tpath("a"), "new a"));
    EXPECT_OK(stage_text(&o[1], tpath("b"), "new b"));
    mkdir(tpath("b"), 0777);
    EXPECT_ERR(mdt_out_commit(o, 2), MDT_E_INVALID, "b: exists and is a directory");
    EXPECT(strcmp(get(tpath("a")), "old a") == 0, "a was replaced: '%s'", get(tpath("a")));
    EXPECT(temporaries_left() == 0, "a failed commit left a temporary");
    rmdir(tpath("b"));
    /* ... and both when nothing fails */
    EXPECT_OK(stage_text(&o[0], tpath("a"), "new a"));
    EXPECT_OK(stage_text(&o[1], tpath("b"), "new b"));
    EXPECT_OK(mdt_out_commit(o, 2));
    EXPECT(strcmp(get(tpath("a")), "new a") == 0 && strcmp(get(tpath("b")), "new b") == 0,
           "both written");
    /* abort: nothing written, nothing left */
    EXPECT_OK(stage_text(&o[0], tpath("a"), "newer a"));
    mdt_out_abort(o, 1);
    EXPECT(strcmp(get(tpath("a")), "new a") == 0, "abort touched the target");
    EXPECT(temporaries_left() == 0, "abort left a temporary");
    /* begin refuses what check refuses, and leaves nothing */
    EXPECT_ERR(mdt_out_begin(&o[0], tpath("fifo")), MDT_E_INVALID, "a FIFO");
    EXPECT_ERR(mdt_out_begin(&o[0], tpath("link")), MDT_E_INVALID, "symbolic link");
    EXPECT(strcmp(get(tpath("target")), "old") == 0, "the link's target changed");
    EXPECT(temporaries_left() == 0, "a refused begin left a temporary");
    umask(prev);

    char cmd[512];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
    if (system(cmd) != 0)
        fprintf(stderr, "could not remove %s\n", g_dir);
    TEST_END();
}
