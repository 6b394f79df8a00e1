/*
 * cli.h — what the files of the `meshdit` command share: the world rank and size (set by main.c,
 * which owns MPI), option parsing, the exit helpers and one entry per command. The command uses
 * the library only through meshdit.h.
 */
#ifndef MDT_CLI_H
#define MDT_CLI_H

#include "meshdit.h"

#include <stddef.h>
#include <stdio.h>

extern int cli_rank, cli_world; /* MPI_COMM_WORLD rank and size */

/* ---- main.c ---- */
void cli_usage(FILE *fp);
/* Ends every process of the job (MPI_Abort): for a rank whose peers wait in a collective. */
void cli_abort_job(int code);

/* ---- test_env.c ---- */
/* Reads MESHDIT_TEST_SHARD_INDEX, MESHDIT_TEST_SKIP_CP_SPLIT and MESHDIT_TEST_FAIL once and
 * installs the library's test hooks. */
void cli_test_env_install(void);

/* ---- opts.c: --key value pairs after the command ---- */
typedef struct cli_opts {
    int n;
    const char *keys[32], *vals[32];
    int used[32];
    const char *pos[4];
    int npos;
    int pos_taken; /* positional words the command takes (the rest are refused as unexpected) */
} cli_opts;
/* What cli_parse_opts returns after printing the usage for --help or -h: the command ends with
 * status 0 (main maps it), having run nothing. */
#define CLI_HELP_SHOWN (-1)

/* Parses argv; `flags` (NULL-terminated, optional) names the options that take no value.
 * Returns 0, CLI_HELP_SHOWN, or the usage exit code after printing why (a single-dash word is
 * refused; positional words are kept for cli_opts_check_unused, which refuses those beyond
 * pos_taken). */
int cli_parse_opts(int argc, char **argv, cli_opts *o, const char *const *flags);
const char *cli_opt_str(cli_opts *o, const char *key, const char *def);
int cli_opt_int(cli_opts *o, const char *key, long long def, long long lo, long long hi,
                long long *out);
int cli_opt_double(cli_opts *o, const char *key, double def, double *out);
/* Every value of the repeatable option `key`, in order, into vals[cap]; returns the count. */
int cli_opt_all(cli_opts *o, const char *key, const char **vals, int cap);
/* The usage exit code naming the first option no command read, or 0. */
int cli_opts_check_unused(cli_opts *o);

/* The layout, device and memory options `run` and `serve` share: --tp --ring --ulysses
 * --mesh-order --device --dtype --comm --max-memory. */
typedef struct cli_layout {
    long long cfg, tp, ring, uly;
    const char *order, *device, *dtype, *comm;
    int64_t max_bytes; /* --max-memory, 0 if absent */
} cli_layout;
/* Reads those options from `o`; returns 0 or the usage exit code after printing why. */
int cli_parse_layout(cli_opts *o, cli_layout *l);
/* --cfg (1 or 2), --tp, --ring, --ulysses (1..4096 each, 1 when absent), their product at most
 * 65536 ranks; 0, or the usage error's exit code. */
int cli_parse_degrees(cli_opts *o, long long *cfg, long long *tp, long long *ring, long long *uly);
/* The mesh layout of those options. */
mdt_layout cli_mesh_layout(const cli_layout *l);
/* The checks before any weight is read, then the load: this rank's weights plus the activations
 * of `inputs` against --max-memory (or what the node has), then mdt_model_load shard-on-read
 * over `mesh` (after mdt_device_select). Collective; *load_s gets the load's seconds. */
mdt_status cli_load_model(const cli_layout *l, const char *checkpoint, mdt_mesh *mesh,
                          const mdt_tensor_set *inputs, mdt_model **m, double *load_s);
/* `--lora FILE[:SCALE]` (repeatable, scale 1 by default) on a loaded model: each file loaded
 * under its base name (without .safetensors; #2, #3 ... for repeats), then all fused at their
 * scales (mdt_model_set_adapters). Collective; *lora_s gets the seconds. */
/* A --lora FILE[:SCALE] spec: the file into path [cap], the scale (1 when none), as
 * cli_load_loras reads it. */
mdt_status cli_lora_spec(const char *spec, char *path, size_t cap, double *scale);
mdt_status cli_load_loras(mdt_model *m, const char *const *specs, int n, double *lora_s);
/* Monotonic seconds. */
double cli_now_s(void);

/* Prints "meshdit: error: MESSAGE" from rank 0 (with the code and place under MESHDIT_DEBUG);
 * returns the exit code 1. */
int cli_fail_exit(mdt_status st);
/* Prints "meshdit: usage error: " fmt (with `arg`) and the usage from rank 0; returns 2. */
/* "meshdit: error: MSG" on stderr, escaped as every error line is (mdt_escape_line), flushed:
 * for a rank that reports on its own before it ends the job. */
void cli_print_error(const char *msg);
int cli_usage_exit(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* `b` bytes in binary units with two decimals ("1.50 MiB"). */
void cli_fmt_bytes(double b, char *buf, size_t cap);

/* ---- the commands: argc/argv after the command's name; the return value is the exit code ---- */
int cmd_gen(int argc, char **argv);     /* cmd_gen.c */
int cmd_inputs(int argc, char **argv);  /* cmd_gen.c */
int cmd_run(int argc, char **argv);     /* cmd_run.c */
int cmd_compare(int argc, char **argv); /* cmd_compare.c */
int cmd_gather(int argc, char **argv);  /* cmd_compare.c */
int cmd_inspect(int argc, char **argv); /* cmd_inspect.c */
int cmd_plan(int argc, char **argv);    /* cmd_plan.c */
int cmd_serve(int argc, char **argv);   /* cmd_serve.c */

#endif /* MDT_CLI_H */
