/*
 * opts.c — the command's option parsing (--key value pairs and flags) and its exit helpers:
 * one line per failure from rank 0; exit codes 0 success, 1 failure, 2 usage error.
 */
#define _POSIX_C_SOURCE 200809L
#include "cli/cli.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* An error line as printed: control bytes, malformed UTF-8 and the code points terminals act on
 * (from an argument echoed in it) as \xNN, so it stays one line and inert. */
static void put_line(const char *what, const char *msg) {
    static char shown[4 * 4096 + 64];
    fprintf(stderr, "meshdit: %s: %s\n", what, mdt_escape_line(msg, shown, sizeof shown));
}

void cli_print_error(const char *msg) {
    put_line("error", msg);
    fflush(stderr);
}

int cli_fail_exit(mdt_status st) {
    if (cli_rank == 0) {
        char line[4096];
        if (getenv("MESHDIT_DEBUG")) {
            snprintf(line, sizeof line, "%s [%s, %s]", mdt_last_error(), mdt_status_str(st),
                     mdt_last_error_where());
            put_line("error", line);
        } else {
            put_line("error", mdt_last_error());
        }
    }
    return 1;
}

int cli_usage_exit(const char *fmt, ...) {
    if (cli_rank == 0) {
        char line[8192];
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(line, sizeof line, fmt, ap);
        va_end(ap);
        put_line("usage error", line);
        cli_usage(stderr);
    }
    return 2;
}

int cli_parse_opts(int argc, char **argv, cli_opts *o, const char *const *flags) {
    memset(o, 0, sizeof *o);
    for (int i = 0; i < argc; i++) { /* help asked anywhere: the usage on stdout, nothing run */
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            if (cli_rank == 0)
                cli_usage(stdout);
            return CLI_HELP_SHOWN;
        }
    }
    for (int i = 0; i < argc; i++) {
        if (argv[i][0] == '-' && argv[i][1] != '-' && argv[i][1] != '\0')
            return cli_usage_exit("unknown option %s (options start with --)", argv[i]);
        if (strncmp(argv[i], "--", 2) == 0) {
            if (o->n == 32)
                return cli_usage_exit("too many options");
            int is_flag = 0;
            for (int f = 0; flags && flags[f]; f++)
                is_flag |= strcmp(argv[i] + 2, flags[f]) == 0;
            o->keys[o->n] = argv[i] + 2;
            const char *eq = strchr(argv[i], '=');
            for (int f = 0; eq && flags && flags[f]; f++) /* --quiet=1: a flag takes no value */
                if (strlen(flags[f]) == (size_t)(eq - argv[i] - 2) &&
                    strncmp(argv[i] + 2, flags[f], (size_t)(eq - argv[i] - 2)) == 0)
                    return cli_usage_exit("option %s: --%s takes no value", argv[i], flags[f]);
            if (eq)
                return cli_usage_exit("option %s: write the value after a space (%.*s %s)", argv[i],
                                      (int)(eq - argv[i]), argv[i], eq + 1);
            if (is_flag) {
                o->vals[o->n++] = "1";
                continue;
            }
            if (i + 1 >= argc)
                return cli_usage_exit("option %s needs a value", argv[i]);
            o->vals[o->n++] = argv[++i];
        } else {
            if (o->npos == 4)
                return cli_usage_exit("unexpected argument '%s'", argv[i]);
            o->pos[o->npos++] = argv[i];
        }
    }
    return 0;
}

const char *cli_opt_str(cli_opts *o, const char *key, const char *def) {
    for (int i = 0; i < o->n; i++)
        if (strcmp(o->keys[i], key) == 0) {
            o->used[i] = 1;
            return o->vals[i];
        }
    return def;
}

int cli_opt_int(cli_opts *o, const char *key, long long def, long long lo, long long hi,
                long long *out) {
    const char *v = cli_opt_str(o, key, NULL);
    if (!v) {
        *out = def;
        return 0;
    }
    char *end;
    errno = 0;
    long long x = strtoll(v, &end, 10);
    const char *d = v + (*v == '-'); /* digits only: no blanks, no '+' (' 2' was taken, '2 ' not) */
    if (*d < '0' || *d > '9' || *end != 0 || errno == ERANGE || x < lo || x > hi) {
        char msg[128];
        snprintf(msg, sizeof msg, "--%s must be an integer in [%lld, %lld], got '%%s'", key, lo,
                 hi);
        return cli_usage_exit(msg, v);
    }
    *out = x;
    return 0;
}

/* 1 when text v, a number whose mantissa has a digit other than 0, was read as 0 (1e-400: below
 * the smallest double): not a number to use. */
static int underflows(const char *v, double x) {
    int nonzero = 0;
    for (const char *q = v; *q && *q != 'e' && *q != 'E'; q++)
        nonzero |= *q >= '1' && *q <= '9';
    return nonzero && x == 0;
}

int cli_opt_double(cli_opts *o, const char *key, double def, double *out) {
    const char *v = cli_opt_str(o, key, NULL);
    if (!v) {
        *out = def;
        return 0;
    }
    char *end;
    *out = strtod(v, &end);
    /* a plain decimal number, as the integer options and --lora's scale take: no hex floats
     * (0x1p3), no leading blanks, no inf or nan */
    if (*v == 0 || isspace((unsigned char)*v) || *end != 0 || !isfinite(*out) ||
        strpbrk(v, "xXpP") || underflows(v, *out))
        return cli_usage_exit("--%s must be a finite decimal number, got '%s'", key, v);
    return 0;
}

int cli_opt_all(cli_opts *o, const char *key, const char **vals, int cap) {
    int n = 0;
    for (int i = 0; i < o->n; i++)
        if (strcmp(o->keys[i], key) == 0) {
            o->used[i] = 1;
            if (n < cap)
                vals[n] = o->vals[i];
            n++;
        }
    return n;
}

int cli_opts_check_unused(cli_opts *o) {
    /* an unknown option first: it took the next word as its value, so a stray word after it
     * (run --bogus --checkpoint DIR: DIR) is its doing */
    for (int i = 0; i < o->n; i++) {
        if (o->used[i])
            continue;
        for (int j = 0; j < i; j++) /* the command read the first one: a second is not taken */
            if (strcmp(o->keys[j], o->keys[i]) == 0)
                return cli_usage_exit("option --%s is given more than once", o->keys[i]);
        return cli_usage_exit("unknown option --%s", o->keys[i]);
    }
    if (o->npos > o->pos_taken) /* a word no option takes is never dropped silently */
        return cli_usage_exit("unexpected argument '%s'", o->pos[o->pos_taken]);
    return 0;
}

void cli_fmt_bytes(double b, char *buf, size_t cap) {
    const char *u[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    int i = 0;
    while (b >= 1024.0 && i < 4)
        b /= 1024.0, i++;
    snprintf(buf, cap, "%.2f %s", b, u[i]);
}

int cli_parse_layout(cli_opts *o, cli_layout *l) {
    l->order = cli_opt_str(o, "mesh-order", "cfg,tp,ring,ulysses");
    const char *maxmem = cli_opt_str(o, "max-memory", NULL);
    l->device = cli_opt_str(o, "device", "cpu"), l->dtype = cli_opt_str(o, "dtype", "f32");
    l->comm = cli_opt_str(o, "comm", "auto");
    if (strcmp(l->device, "cpu") != 0 && strcmp(l->device, "cuda") != 0)
        return cli_usage_exit("--device must be cpu or cuda, got '%s'", l->device);
    if (strcmp(l->dtype, "f32") != 0 && strcmp(l->dtype, "bf16") != 0)
        return cli_usage_exit("--dtype must be f32 or bf16, got '%s'", l->dtype);
    if (strcmp(l->comm, "auto") != 0 && strcmp(l->comm, "mpi") != 0 && strcmp(l->comm, "nccl") != 0)
        return cli_usage_exit("--comm must be auto, mpi or nccl, got '%s'", l->comm);
    if (strcmp(l->comm, "nccl") == 0 && strcmp(l->device, "cuda") != 0)
        return cli_usage_exit("--comm nccl runs the collectives on GPUs: it needs --device cuda");
    l->max_bytes = 0;
    if (maxmem && (l->max_bytes = mdt_size_parse(maxmem)) <= 0)
        return cli_usage_exit("--max-memory takes a size like 512M, 8G or 1048576, got '%s'",
                              maxmem);
    return cli_parse_degrees(o, &l->cfg, &l->tp, &l->ring, &l->uly);
}

int cli_parse_degrees(cli_opts *o, long long *cfg, long long *tp, long long *ring, long long *uly) {
    int rc;
    if ((rc = cli_opt_int(o, "cfg", 1, 1, 2, cfg)) || (rc = cli_opt_int(o, "tp", 1, 1, 4096, tp)) ||
        (rc = cli_opt_int(o, "ring", 1, 1, 4096, ring)) ||
        (rc = cli_opt_int(o, "ulysses", 1, 1, 4096, uly)))
        return rc;
    const long long world = *cfg * *tp * *ring * *uly; /* each axis <= 4096: no overflow */
    if (world > 65536) /* inspect lists every rank: 67 M of them wrote a gigabyte a minute */
        return cli_usage_exit("the layout cfg %lld x tp %lld x ring %lld x ulysses %lld is %lld "
                              "ranks; at most 65536",
                              *cfg, *tp, *ring, *uly, world);
    return 0;
}

mdt_layout cli_mesh_layout(const cli_layout *l) {
    return (mdt_layout){(int)l->cfg, (int)l->tp, (int)l->ring, (int)l->uly, l->order};
}

double cli_now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

mdt_status cli_load_model(const cli_layout *l, const char *checkpoint, mdt_mesh *mesh,
                          const mdt_tensor_set *inputs, mdt_model **m, double *load_s) {
    const mdt_memory_limit lim = {.max_bytes = l->max_bytes,
                                  .mem_available = getenv("MESHDIT_MEM_AVAILABLE"),
                                  .device_activations = strcmp(l->device, "cuda") == 0};
    *load_s = 0;
    mdt_status st = mdt_check_memory(checkpoint, mesh, inputs, &lim);
    if (st != MDT_OK)
        return st;
    mdt_load_params lp = mdt_load_params_default(); /* (the weights-only limit is checked above) */
    lp.checkpoint_dir = checkpoint, lp.mesh = mesh;
    const double t0 = cli_now_s();
    st = mdt_model_load(&lp, m);
    *load_s = cli_now_s() - t0;
    return st;
}

enum { MDT_LORA_NAME = 64 };

/* FILE[:SCALE]: the part after the last ':' is the scale unless it holds a '/' or ends with
 * ".safetensors" (then the whole spec is the file: its name may hold a ':'); a scale is a plain
 * finite decimal number (no space, hex, inf or nan: "f.safetensors:nan" is a bad scale, not a
 * missing file). The same on every rank: it reads the text only. */
static mdt_status lora_spec(const char *spec, char *path, size_t cap, double *scale) {
    const char *colon = strrchr(spec, ':');
    *scale = 1.0;
    if (!*spec || spec[0] == ':')
        return mdt_error_set(MDT_E_INVALID, "--lora '%s': no file name before the scale", spec);
    snprintf(path, cap, "%s", spec);
    const size_t tail = colon ? strlen(colon + 1) : 0;
    if (!colon || strchr(colon, '/') ||
        (tail >= 12 && strcmp(colon + 1 + tail - 12, ".safetensors") == 0))
        return MDT_OK;
    const char *num = colon + 1;
    char *end = NULL;
    const double v = *num ? strtod(num, &end) : NAN;
    if (!*num || isspace((unsigned char)*num) || *end || !isfinite(v) || strpbrk(num, "xXpP") ||
        underflows(num, v))
        return mdt_error_set(MDT_E_INVALID,
                             "--lora %s: the scale '%s' after the last ':' is not a finite "
                             "decimal number",
                             spec, num);
    *scale = v;
    snprintf(path, cap, "%.*s", (int)(colon - spec), spec);
    return MDT_OK;
}

mdt_status cli_lora_spec(const char *spec, char *path, size_t cap, double *scale) {
    return lora_spec(spec, path, cap, scale);
}

mdt_status cli_load_loras(mdt_model *m, const char *const *specs, int n, double *lora_s) {
    char names[16][MDT_LORA_NAME], bases[16][52];
    const char *np[16];
    double scales[16];
    const double t0 = cli_now_s();
    mdt_status st = MDT_OK;
    *lora_s = 0;
    if (n > 16)
        return mdt_error_set(MDT_E_INVALID, "at most 16 --lora adapters, got %d", n);
    for (int i = 0; i < n && st == MDT_OK; i++) {
        char path[4096];
        if ((st = lora_spec(specs[i], path, sizeof path, &scales[i])) != MDT_OK)
            break;
        const char *base = strrchr(path, '/');
        base = base ? base + 1 : path;
        size_t len = strlen(base);
        if (len > 12 && strcmp(base + len - 12, ".safetensors") == 0)
            len -= 12;
        snprintf(bases[i], sizeof bases[i], "%.*s", (int)(len < 50 ? len : 50), base);
        /* a name the server's protocol carries as it is (docs/serve.md, "lora"): ASCII
         * letters, digits and . _ - only, anything else made '_' */
        for (char *c = bases[i]; *c; c++)
            if (!((*c >= 'a' && *c <= 'z') || (*c >= 'A' && *c <= 'Z') ||
                  (*c >= '0' && *c <= '9') || *c == '.' || *c == '_' || *c == '-'))
                *c = '_';
        /* a name taken by an earlier adapter: NAME-2, NAME-3, ..., the first one free (a file
         * may itself be called NAME-2) */
        snprintf(names[i], sizeof names[i], "%.51s", bases[i]);
        for (int rep = 2, j = 0; j < i; j++)
            if (strcmp(names[j], names[i]) == 0) {
                snprintf(names[i], sizeof names[i], "%.51s-%d", bases[i], rep++);
                j = -1; /* check the new name against every earlier one again */
            }
        np[i] = names[i];
        st = mdt_model_lora_load(m, names[i], path);
    }
    if (st == MDT_OK)
        st = mdt_model_set_adapters(m, n, np, scales);
    *lora_s = cli_now_s() - t0;
    return st;
}
