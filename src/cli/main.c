/*
 * main.c — the `meshdit` command: gen | inputs | run | compare | inspect (contract: DESIGN.md §4).
 *
 * The only code that calls MPI_Init/Finalize and exit(). Library failures come back as status
 * codes; this file prints one line per failure ("meshdit: error: ...") from rank 0 and exits
 * non-zero. Exit codes: 0 success, 1 failure or comparison beyond tolerance, 2 usage error.
 */
#define _POSIX_C_SOURCE 200809L
#include "backend/backend.h"
#include "core/outfile.h"
#include "models/model.h"
#include "models/scaling.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

static int g_rank = 0, g_world = 1;

static void usage(FILE *fp) {
    fprintf(
        fp,
        "usage: meshdit <command> [options]\n"
        "  gen     --model flux|minimax-h3 (--preset NAME | --config FILE) --out DIR\n"
        "          [--seed N] [--dtype f32|bf16|f16] [--shards K]\n"
        "  inputs  --checkpoint DIR --out FILE [--seed N] [--img-tokens N] [--txt-tokens N]\n"
        "          [--batch N] [--timestep T] [--guidance G] [--audio-tokens N]\n"
        "  run     --checkpoint DIR --inputs FILE --out FILE [--steps N] [--repeat N]\n"
        "          [--tp T --ring R --ulysses U] [--mesh-order tp,ring,ulysses]\n"
        "          [--report FILE.json] [--max-memory SIZE] [--step-timeout S] [--quiet]\n"
        "          [--device cpu|cuda] [--dtype f32|bf16] [--comm auto|mpi|nccl]\n"
        "  compare A.safetensors B.safetensors [--tol X]   (B is the reference)\n"
        "  inspect (--checkpoint DIR | --config FILE) [--tp T --ring R --ulysses U]\n"
        "          [--mesh-order ORDER]\n"
        "  gather  --checkpoint DIR --out DIR [--tp T]   (under mpiexec -n T)\n"
        "  plan    (--checkpoint DIR | --config FILE) --devices N [--device cpu|h100|h200|trn2]\n"
        "          [--device-mem GiB] [--tokens S] [--bytes 2|4]\n");
}

static int fail_exit(mdt_status st) {
    if (g_rank == 0) {
        if (getenv("MESHDIT_DEBUG"))
            fprintf(stderr, "meshdit: error: %s [%s, %s]\n", mdt_last_error(), mdt_status_str(st),
                    mdt_last_error_where());
        else
            fprintf(stderr, "meshdit: error: %s\n", mdt_last_error());
    }
    return 1;
}

static int usage_exit(const char *fmt, const char *arg) {
    if (g_rank == 0) {
        fprintf(stderr, "meshdit: usage error: ");
        fprintf(stderr, fmt, arg);
        fprintf(stderr, "\n");
        usage(stderr);
    }
    return 2;
}

/* ---- option parsing: --key value pairs after the command ---- */
typedef struct opts {
    int n;
    const char *keys[32], *vals[32];
    int used[32];
    const char *pos[4];
    int npos;
} opts;

static int parse_opts(int argc, char **argv, opts *o, const char *const *flags) {
    memset(o, 0, sizeof *o);
    for (int i = 0; i < argc; i++) {
        if (strncmp(argv[i], "--", 2) == 0) {
            if (o->n == 32)
                return usage_exit("too many options%s", "");
            int is_flag = 0;
            for (int f = 0; flags && flags[f]; f++)
                is_flag |= strcmp(argv[i] + 2, flags[f]) == 0;
            o->keys[o->n] = argv[i] + 2;
            if (is_flag) {
                o->vals[o->n++] = "1";
                continue;
            }
            if (i + 1 >= argc)
                return usage_exit("option %s needs a value", argv[i]);
            o->vals[o->n++] = argv[++i];
        } else {
            if (o->npos == 4)
                return usage_exit("unexpected argument '%s'", argv[i]);
            o->pos[o->npos++] = argv[i];
        }
    }
    return 0;
}

static const char *opt_str(opts *o, const char *key, const char *def) {
    for (int i = 0; i < o->n; i++)
        if (strcmp(o->keys[i], key) == 0) {
            o->used[i] = 1;
            return o->vals[i];
        }
    return def;
}

static int opt_int(opts *o, const char *key, long long def, long long lo, long long hi,
                   long long *out) {
    const char *v = opt_str(o, key, NULL);
    if (!v) {
        *out = def;
        return 0;
    }
    char *end;
    long long x = strtoll(v, &end, 10);
    if (*v == 0 || *end != 0 || x < lo || x > hi) {
        char msg[128];
        snprintf(msg, sizeof msg, "--%s must be an integer in [%lld, %lld], got '%%s'", key, lo,
                 hi);
        return usage_exit(msg, v);
    }
    *out = x;
    return 0;
}

static int opt_double(opts *o, const char *key, double def, double *out) {
    const char *v = opt_str(o, key, NULL);
    if (!v) {
        *out = def;
        return 0;
    }
    char *end;
    *out = strtod(v, &end);
    if (*v == 0 || *end != 0 || !isfinite(*out))
        return usage_exit("bad number '%s'", v);
    return 0;
}

static int opts_check_unused(opts *o) {
    for (int i = 0; i < o->n; i++)
        if (!o->used[i])
            return usage_exit("unknown option --%s", o->keys[i]);
    return 0;
}

static mdt_status read_file_text(const char *path, char **out) {
    cJSON *j;
    MDT_TRY(mdt_config_load(path, &j));
    *out = cJSON_Print(j);
    cJSON_Delete(j);
    return *out ? MDT_OK : MDT_FAIL(MDT_E_NOMEM, "out of memory");
}

/* "512M", "8G", "1.5GiB", "1048576" -> bytes (binary units); -1 if malformed. */
static int64_t parse_size(const char *s) {
    char *end;
    double v = strtod(s, &end);
    if (end == s || !(v > 0))
        return -1;
    double mul = 1;
    switch (*end) {
    case 'k':
    case 'K': mul = 1024.0, end++; break;
    case 'm':
    case 'M': mul = 1048576.0, end++; break;
    case 'g':
    case 'G': mul = 1073741824.0, end++; break;
    case 't':
    case 'T': mul = 1099511627776.0, end++; break;
    default: break;
    }
    if (strcmp(end, "iB") == 0 || strcmp(end, "B") == 0 || strcmp(end, "b") == 0)
        end += strlen(end);
    if (*end || v * mul > 9.0e18)
        return -1;
    return (int64_t)(v * mul);
}

/* ---- outputs ---- */
/* Writes the output and, when `report` is set, the report: both or neither. Each is staged in a
 * temporary of its own directory and renamed over its target only once both are written, so a
 * failure anywhere leaves the old files as they were (mdt_out_commit). */
static mdt_status write_outputs(const char *out, const mdt_tensor_set *res, const char *report,
                                const char *report_txt) {
    mdt_out o[2];
    int n = 0;
    mdt_status st = mdt_tensor_set_stage(&o[0], res, out);
    if (st == MDT_OK)
        n = 1;
    if (st == MDT_OK && report) {
        st = mdt_out_begin(&o[1], report);
        if (st == MDT_OK)
            n = 2, st = mdt_out_write(&o[1], report_txt, strlen(report_txt));
    }
    if (st != MDT_OK) {
        mdt_out_abort(o, n);
        return st;
    }
    return mdt_out_commit(o, n);
}

/* Both paths name one file: the same directory (device and inode) and the same last name. */
static int same_file(const char *a, const char *b) {
    struct stat da, db;
    const char *sa = strrchr(a, '/'), *sb = strrchr(b, '/');
    const char *ba = sa ? sa + 1 : a, *bb = sb ? sb + 1 : b;
    char dira[4096], dirb[4096];
    snprintf(dira, sizeof dira, "%.*s", sa ? (int)(sa - a) + 1 : 1, sa ? a : ".");
    snprintf(dirb, sizeof dirb, "%.*s", sb ? (int)(sb - b) + 1 : 1, sb ? b : ".");
    return strcmp(ba, bb) == 0 && stat(dira, &da) == 0 && stat(dirb, &db) == 0 &&
           da.st_dev == db.st_dev && da.st_ino == db.st_ino;
}

/* Before any weight is read: --out (and --report) can be written (mdt_out_check) and differ. */
static mdt_status check_outputs(const char *out, const char *report) {
    mdt_status st = mdt_out_check(out);
    if (st != MDT_OK)
        return mdt_fail_prefix(st, "--out");
    if (!report)
        return MDT_OK;
    if ((st = mdt_out_check(report)) != MDT_OK)
        return mdt_fail_prefix(st, "--report");
    if (same_file(out, report))
        return MDT_FAIL(MDT_E_INVALID, "--out %s and --report %s name the same file", out, report);
    return MDT_OK;
}

/* ---- gen ---- */
static int cmd_gen(int argc, char **argv) {
    opts o;
    long long seed, shards;
    int rc = parse_opts(argc, argv, &o, NULL);
    if (rc)
        return rc;
    const char *model = opt_str(&o, "model", "flux"), *preset = opt_str(&o, "preset", NULL);
    const char *cfg = opt_str(&o, "config", NULL), *out = opt_str(&o, "out", NULL);
    const char *dts = opt_str(&o, "dtype", "f32");
    if ((rc = opt_int(&o, "seed", 0, 0, INT64_MAX, &seed)) ||
        (rc = opt_int(&o, "shards", 1, 1, 99999, &shards)) || (rc = opts_check_unused(&o)))
        return rc;
    if (!out)
        return usage_exit("gen needs --out DIR%s", "");
    if (!!preset == !!cfg)
        return usage_exit("gen needs exactly one of --preset NAME or --config FILE%s", "");
    mdt_dtype dt = strcmp(dts, "f32") == 0    ? MDT_F32
                   : strcmp(dts, "bf16") == 0 ? MDT_BF16
                   : strcmp(dts, "f16") == 0  ? MDT_F16
                                              : MDT_DTYPE_COUNT;
    if (dt == MDT_DTYPE_COUNT)
        return usage_exit("--dtype must be f32, bf16 or f16, got '%s'", dts);
    char *text = NULL;
    mdt_status st;
    if (preset) {
        const mdt_family *fam = mdt_family_by_name(model);
        if (!fam)
            return usage_exit("unknown --model '%s' (supported: flux, minimax-h3)", model);
        const char *p = mdt_family_preset(fam, preset);
        if (!p)
            return usage_exit(
                "unknown --preset '%s' (flux: tiny, medium, narrow; minimax-h3: tiny)", preset);
        st = mdt_model_gen(p, (uint64_t)seed, dt, (int)shards, out);
    } else {
        st = read_file_text(cfg, &text);
        if (st == MDT_OK)
            st = mdt_model_gen(text, (uint64_t)seed, dt, (int)shards, out);
        cJSON_free(text);
    }
    if (st != MDT_OK)
        return fail_exit(st);
    printf("wrote %s (seed %lld, %s, %lld shard%s)\n", out, seed, dts, shards,
           shards > 1 ? "s" : "");
    return 0;
}

/* ---- inputs ---- */
static int cmd_inputs(int argc, char **argv) {
    opts o;
    long long seed, img, txt, batch, audio;
    double t, g;
    int rc = parse_opts(argc, argv, &o, NULL);
    if (rc)
        return rc;
    const char *ck = opt_str(&o, "checkpoint", NULL), *out = opt_str(&o, "out", NULL);
    if ((rc = opt_int(&o, "seed", 0, 0, INT64_MAX, &seed)) ||
        (rc = opt_int(&o, "img-tokens", 16, 1, 1 << 24, &img)) ||
        (rc = opt_int(&o, "txt-tokens", 8, 1, 1 << 24, &txt)) ||
        (rc = opt_int(&o, "batch", 1, 1, 4096, &batch)) ||
        (rc = opt_int(&o, "audio-tokens", 6, 0, 1 << 24, &audio)) ||
        (rc = opt_double(&o, "timestep", 1.0, &t)) || (rc = opt_double(&o, "guidance", 3.5, &g)) ||
        (rc = opts_check_unused(&o)))
        return rc;
    if (!ck || !out)
        return usage_exit("inputs needs --checkpoint DIR and --out FILE%s", "");
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", ck);
    cJSON *cfg = NULL;
    mdt_model *m = NULL;
    mdt_tensor_set *set = NULL;
    mdt_status st = mdt_config_load(path, &cfg);
    if (st == MDT_OK)
        st = mdt_model_describe(cfg, &m);
    if (st == MDT_OK)
        st = mdt_tensor_set_create(&set);
    if (st == MDT_OK)
        st = mdt_out_check(out);
    if (st == MDT_OK) {
        mdt_inputs_params p = {.seed = (uint64_t)seed,
                               .batch = batch,
                               .img_tokens = img,
                               .txt_tokens = txt,
                               .timestep = t,
                               .guidance = g,
                               .audio_tokens = audio};
        st = mdt_model_make_inputs(m, &p, set);
    }
    if (st == MDT_OK)
        st = write_outputs(out, set, NULL, NULL);
    mdt_tensor_set_free(set);
    mdt_model_free(m);
    cJSON_Delete(cfg);
    if (st != MDT_OK)
        return fail_exit(st);
    printf("wrote %s (seed %lld, batch %lld, %lld image + %lld text tokens)\n", out, seed, batch,
           img, txt);
    return 0;
}

/* ---- run ---- */
static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static void fmt_bytes(double b, char *buf, size_t cap) {
    const char *u[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    int i = 0;
    while (b >= 1024.0 && i < 4)
        b /= 1024.0, i++;
    snprintf(buf, cap, "%.2f %s", b, u[i]);
}

static long max_rss_kib(void) {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return ru.ru_maxrss;
}

/* What one rank did, gathered to rank 0 for the plan report. */
typedef struct rank_facts {
    int rank, t, r, u, cp_index;
    int64_t heads_local, weight_bytes, peak_bytes, max_rss_kib, bytes_read;
    double flops[MDT_FLOP_KIND_COUNT];
    int64_t attn_calls, attn_q, attn_kv;
    int64_t coll[MDT_COLL_KIND_COUNT];
    int64_t group[MDT_GROUP_COUNT];
    double ring_wait_s, ring_compute_s, prep_s;
} rank_facts;

/* The report's JSON text (cJSON_free it), or NULL with the message set. */
static char *report_text(const mdt_model *m, const char *order, double load_s, double step_s,
                         int steps, const rank_facts *rf) {
    cJSON *r = cJSON_CreateObject();
    cJSON_AddStringToObject(r, "model", m->fam->name);
    cJSON_AddNumberToObject(r, "world", g_world);
    cJSON *lay = cJSON_AddObjectToObject(r, "layout");
    cJSON_AddNumberToObject(lay, "tp", m->mesh ? m->mesh->T : 1);
    cJSON_AddNumberToObject(lay, "ring", m->mesh ? m->mesh->R : 1);
    cJSON_AddNumberToObject(lay, "ulysses", m->mesh ? m->mesh->U : 1);
    cJSON_AddStringToObject(lay, "mesh_order", order);
    cJSON_AddStringToObject(r, "device", mdt_backend_name());
    cJSON_AddStringToObject(r, "weights_dtype", mdt_backend_bf16() ? "bf16" : "f32");
    cJSON_AddStringToObject(r, "cpu_kernels", mdt_cpu_isa());
    char gemm[96];
    mdt_cpu_gemm_describe(gemm, sizeof gemm);
    cJSON_AddStringToObject(r, "cpu_gemm", gemm);
    cJSON_AddStringToObject(r, "gemm_operands",
                            mdt_backend_bf16() && mdt_cpu_gemm_bf16_operands() ? "bf16" : "f32");
    cJSON_AddNumberToObject(r, "load_seconds", load_s);
    cJSON_AddNumberToObject(r, "step_seconds_median", step_s);
    cJSON_AddNumberToObject(r, "steps", steps);
    cJSON *ranks = cJSON_AddArrayToObject(r, "ranks");
    for (int i = 0; i < g_world; i++) {
        const rank_facts *f = &rf[i];
        cJSON *rk = cJSON_CreateObject();
        cJSON_AddItemToArray(ranks, rk);
        cJSON_AddNumberToObject(rk, "rank", f->rank);
        cJSON *co = cJSON_AddObjectToObject(rk, "coords");
        cJSON_AddNumberToObject(co, "tp", f->t);
        cJSON_AddNumberToObject(co, "ring", f->r);
        cJSON_AddNumberToObject(co, "ulysses", f->u);
        cJSON_AddNumberToObject(co, "cp_index", f->cp_index);
        cJSON_AddNumberToObject(rk, "heads_local", (double)f->heads_local);
        cJSON_AddNumberToObject(rk, "weight_bytes", (double)f->weight_bytes);
        cJSON_AddNumberToObject(rk, "peak_bytes", (double)f->peak_bytes);
        cJSON_AddNumberToObject(rk, "max_rss_kib", (double)f->max_rss_kib);
        cJSON_AddNumberToObject(rk, "bytes_read", (double)f->bytes_read);
        cJSON *fl = cJSON_AddObjectToObject(rk, "flops_per_step");
        cJSON_AddNumberToObject(fl, "linear", f->flops[MDT_FLOP_LINEAR]);
        cJSON_AddNumberToObject(fl, "attention", f->flops[MDT_FLOP_ATTN]);
        cJSON_AddNumberToObject(fl, "other", f->flops[MDT_FLOP_OTHER]);
        cJSON *at = cJSON_AddObjectToObject(rk, "attention_per_step");
        cJSON_AddNumberToObject(at, "calls", (double)f->attn_calls);
        cJSON_AddNumberToObject(at, "query_rows_x_heads", (double)f->attn_q);
        cJSON_AddNumberToObject(at, "kv_rows_x_heads", (double)f->attn_kv);
        cJSON *cb = cJSON_AddObjectToObject(rk, "bytes_sent_per_step");
        for (int k = 0; k < MDT_COLL_KIND_COUNT; k++)
            cJSON_AddNumberToObject(cb, mdt_coll_kind_name((mdt_coll_kind)k), (double)f->coll[k]);
        cJSON *ga = cJSON_AddObjectToObject(rk, "bytes_sent_per_step_by_axis");
        for (int g = 0; g < MDT_GROUP_COUNT; g++)
            cJSON_AddNumberToObject(ga, mdt_group_name((mdt_group)g), (double)f->group[g]);
        cJSON *rg = cJSON_AddObjectToObject(rk, "ring_per_step");
        cJSON_AddNumberToObject(rg, "ring_compute_seconds", f->ring_compute_s);
        cJSON_AddNumberToObject(rg, "ring_wait_seconds", f->ring_wait_s);
    }
    if (g_rank == 0) { /* per tensor: style, local shape, bytes read (rank 0's view) */
        cJSON *tens = cJSON_AddArrayToObject(r, "tensors_rank0");
        for (int i = 0; i < m->table.n; i++) {
            const mdt_weight_spec *w = &m->table.specs[i];
            cJSON *t = cJSON_CreateObject();
            cJSON_AddItemToArray(tens, t);
            cJSON_AddStringToObject(t, "name", w->name);
            cJSON_AddStringToObject(t, "style", mdt_tp_style_name(w->style));
            cJSON *ls = cJSON_AddArrayToObject(t, "local_shape");
            for (int d = 0; d < w->ndim; d++)
                cJSON_AddItemToArray(ls, cJSON_CreateNumber((double)m->ws[i].local[d]));
            cJSON_AddNumberToObject(t, "bytes_read", (double)m->ws[i].bytes_read);
        }
    }
    char *txt = cJSON_Print(r);
    cJSON_Delete(r);
    if (!txt)
        (void)MDT_FAIL(MDT_E_NOMEM, "out of memory");
    return txt;
}

static void print_plan(const mdt_model *m, const char *order, const rank_facts *rf, double load_s,
                       double med, int nsteps, int sampling, const char *out) {
    char wb[32], pb[32], gemm[96];
    mdt_cpu_gemm_describe(gemm, sizeof gemm);
    printf("plan: model %s, world %d = tp %d x ring %d x ulysses %d (mesh order %s), cpu kernels "
           "%s, gemm %s\n",
           m->fam->name, g_world, m->mesh ? m->mesh->T : 1, m->mesh ? m->mesh->R : 1,
           m->mesh ? m->mesh->U : 1, order, mdt_cpu_isa(), gemm);
    double tot0 = 0;
    for (int i = 0; i < g_world; i++) {
        const rank_facts *f = &rf[i];
        double tot = f->flops[MDT_FLOP_LINEAR] + f->flops[MDT_FLOP_ATTN] + f->flops[MDT_FLOP_OTHER];
        if (i == 0)
            tot0 = tot;
        fmt_bytes((double)f->weight_bytes, wb, sizeof wb);
        fmt_bytes((double)f->peak_bytes, pb, sizeof pb);
        printf("rank %d (tp %d, ring %d, ulysses %d): %lld tp-local heads, weights %s, peak %s, "
               "read %lld B; per forward %.3f GFLOP (linear %.3f, attn %.3f), attn %lld/%lld "
               "q/kv rows x heads; bytes sent tp %lld, ring %lld, ulysses %lld, cp %lld",
               f->rank, f->t, f->r, f->u, (long long)f->heads_local, wb, pb,
               (long long)f->bytes_read, tot * 1e-9, f->flops[MDT_FLOP_LINEAR] * 1e-9,
               f->flops[MDT_FLOP_ATTN] * 1e-9, (long long)f->attn_q, (long long)f->attn_kv,
               (long long)f->group[MDT_GROUP_TP], (long long)f->group[MDT_GROUP_RING],
               (long long)f->group[MDT_GROUP_ULYSSES], (long long)f->group[MDT_GROUP_CP]);
        if (f->ring_compute_s > 0)
            printf("; ring compute %.4f s, wait %.4f s", f->ring_compute_s, f->ring_wait_s);
        if (f->prep_s > 0)
            printf("; input prep %.6f s", f->prep_s);
        printf("\n");
    }
    printf("load %.3f s; %s %d: median %.6f s per %s (rank 0: %.2f GFLOP/s); wrote %s\n", load_s,
           sampling ? "steps" : "forwards", nsteps, med, sampling ? "step" : "forward",
           med > 0 ? tot0 / med * 1e-9 : 0.0, out);
}

/* --device/--dtype/--comm: the backend on this rank's GPU (node-local rank modulo the GPUs) and,
 * for --comm nccl (or auto with a GPU per rank), NCCL communicators per mesh group. */
static mdt_status select_device(mdt_mesh *mesh, const char *device, int bf16, const char *comm) {
    MPI_Comm node;
    int local = 0, nlocal = 1;
    if (MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node) ==
        MPI_SUCCESS) {
        MPI_Comm_rank(node, &local);
        MPI_Comm_size(node, &nlocal);
        MPI_Comm_free(&node);
    }
    const int cuda = strcmp(device, "cuda") == 0;
    mdt_status st = mdt_mesh_agree(
        mesh, mdt_backend_select(cuda ? MDT_BACKEND_CUDA : MDT_BACKEND_CPU, local, bf16));
    if (st != MDT_OK || !cuda || mesh->world_size == 1)
        return st;
    const mdt_backend_ops *ops = mdt_backend_device_ops();
    const int gpus = ops->device_count();
    if (strcmp(comm, "mpi") == 0 || (strcmp(comm, "auto") == 0 && nlocal > gpus))
        return MDT_OK; /* host-staged MPI (several ranks share a GPU: NCCL would refuse) */
    return mdt_mesh_use_device_comm(mesh, ops);
}

/* Ranks of this job on this node: they share its memory. Collective over the world. */
static int ranks_on_node(void) {
    MPI_Comm node;
    int n = 1;
    if (MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node) ==
        MPI_SUCCESS) {
        MPI_Comm_size(node, &n);
        MPI_Comm_free(&node);
    }
    return n;
}

/* The inputs as the memory estimate sees them: batch = dim 0 of the latent input; token rows =
 * what the model's context-parallel plan splits (the sum of the sequence-dim-1 tensors, e.g.
 * Flux's image + text rows, else the longest dim-0 one, e.g. MiniMax-H3's packed rows). */
static mdt_run_inputs run_inputs_of(const mdt_model *m, const mdt_tensor_set *in) {
    mdt_run_inputs r = {0};
    const mdt_tensor *lat = mdt_tensor_set_get(in, m->fam->latent_input);
    r.batch = lat && lat->ndim >= 1 ? lat->shape[0] : 1;
    r.latent_f32 = lat ? mdt_tensor_numel(lat) * 4 : 0;
    for (int i = 0; i < mdt_tensor_set_count(in); i++)
        r.input_bytes += mdt_tensor_nbytes(mdt_tensor_set_at(in, i, &(const char *){NULL}));
    int64_t rows1 = 0, rows0 = 0;
    const mdt_cp_plan *cp = m->fam->cp_plan;
    for (int i = 0; cp && i < cp->nsplit; i++) {
        const mdt_tensor *t = mdt_tensor_set_get(in, cp->split[i].input);
        if (t && cp->split[i].dim == 1 && t->ndim >= 2)
            rows1 += t->shape[1];
        else if (t && cp->split[i].dim == 0 && t->ndim >= 1 && t->shape[0] > rows0)
            rows0 = t->shape[0];
    }
    r.rows = rows1 > 0 ? rows1 : rows0;
    return r;
}

/* Before any weight is read: this rank's weights plus activations (mdt_run_memory_at) must fit
 * `max_bytes` (--max-memory) or, without it, the memory this process may use (the smaller of
 * MemAvailable and its cgroup's limit, or MESHDIT_MEM_AVAILABLE in their place) divided among
 * the `nlocal` ranks of this node. A checkpoint, inputs or layout the model cannot take are left
 * to the loader, which names the problem. */
static mdt_status check_run_memory(const char *ck, const mdt_mesh *mesh, const mdt_tensor_set *in,
                                   int64_t max_bytes, int device_acts, int nlocal) {
    char what[256], src[64], b1[32], b2[32];
    int64_t limit = max_bytes;
    if (limit > 0) {
        snprintf(what, sizeof what, "the --max-memory limit of %s",
                 mdt_fmt_size(limit, b1, sizeof b1));
    } else {
        const char *env = getenv("MESHDIT_MEM_AVAILABLE");
        int64_t avail;
        if (env && *env) {
            if ((avail = parse_size(env)) <= 0)
                return MDT_FAIL(MDT_E_INVALID,
                                "MESHDIT_MEM_AVAILABLE='%s' is not a size like 512M, 8G or "
                                "1048576",
                                env);
            snprintf(src, sizeof src, "MESHDIT_MEM_AVAILABLE");
        } else if ((avail = mdt_mem_available("", src, sizeof src)) < 0) {
            return MDT_OK; /* nothing to go by: no check */
        }
        limit = avail / nlocal;
        snprintf(what, sizeof what,
                 "the %s this rank may use (%s: %s for the %d rank%s on this node; "
                 "--max-memory SIZE overrides this check)",
                 mdt_fmt_size(limit, b1, sizeof b1), src, mdt_fmt_size(avail, b2, sizeof b2),
                 nlocal, nlocal > 1 ? "s" : "");
    }
    char path[4096];
    cJSON *cfg = NULL;
    mdt_model *m = NULL;
    snprintf(path, sizeof path, "%s/config.json", ck);
    mdt_status st = mdt_config_load(path, &cfg);
    if (st == MDT_OK)
        st = mdt_model_describe(cfg, &m);
    if (st == MDT_OK)
        st = mdt_model_check_layout(m, mesh->T, mesh->R, mesh->U);
    if (st == MDT_OK) {
        mdt_run_inputs ri = run_inputs_of(m, in);
        ri.bf16 = mdt_backend_bf16(), ri.device_acts = device_acts;
        st = mdt_check_run_memory(m, mesh->T, mesh->R, mesh->U, &ri, limit, what);
    } else {
        mdt_error_clear();
        st = MDT_OK;
    }
    mdt_model_free(m);
    cJSON_Delete(cfg);
    return st;
}

static int cmd_run(int argc, char **argv) {
    static const char *const flags[] = {"quiet", NULL};
    opts o;
    long long tp, ring, uly, steps, repeat, step_timeout;
    int rc = parse_opts(argc, argv, &o, flags);
    if (rc)
        return rc;
    const char *ck = opt_str(&o, "checkpoint", NULL), *inp = opt_str(&o, "inputs", NULL);
    const char *out = opt_str(&o, "out", NULL), *report = opt_str(&o, "report", NULL);
    const char *order = opt_str(&o, "mesh-order", "tp,ring,ulysses");
    const char *maxmem = opt_str(&o, "max-memory", NULL);
    const char *device = opt_str(&o, "device", "cpu"), *dtype = opt_str(&o, "dtype", "f32");
    const char *comm = opt_str(&o, "comm", "auto");
    int quiet = opt_str(&o, "quiet", NULL) != NULL;
    if (strcmp(device, "cpu") != 0 && strcmp(device, "cuda") != 0)
        return usage_exit("--device must be cpu or cuda, got '%s'", device);
    if (strcmp(dtype, "f32") != 0 && strcmp(dtype, "bf16") != 0)
        return usage_exit("--dtype must be f32 or bf16, got '%s'", dtype);
    if (strcmp(comm, "auto") != 0 && strcmp(comm, "mpi") != 0 && strcmp(comm, "nccl") != 0)
        return usage_exit("--comm must be auto, mpi or nccl, got '%s'", comm);
    int64_t max_bytes = 0;
    if (maxmem && (max_bytes = parse_size(maxmem)) <= 0)
        return usage_exit("--max-memory takes a size like 512M, 8G or 1048576, got '%s'", maxmem);
    if ((rc = opt_int(&o, "tp", 1, 1, 4096, &tp)) ||
        (rc = opt_int(&o, "ring", 1, 1, 4096, &ring)) ||
        (rc = opt_int(&o, "ulysses", 1, 1, 4096, &uly)) ||
        (rc = opt_int(&o, "steps", 0, 0, 100000, &steps)) ||
        (rc = opt_int(&o, "repeat", 1, 1, 100000, &repeat)) ||
        (rc = opt_int(&o, "step-timeout", 0, 0, 86400 * 7, &step_timeout)) ||
        (rc = opts_check_unused(&o)))
        return rc;
    if (!ck || !inp || !out)
        return usage_exit("run needs --checkpoint DIR --inputs FILE --out FILE%s", "");
    mdt_mesh *mesh = NULL;
    mdt_model *m = NULL;
    mdt_tensor_set *in = NULL, *res = NULL;
    rank_facts *all = NULL;
    double *times = NULL;
    mdt_status st = mdt_mesh_create_world((int)tp, (int)ring, (int)uly, order, &mesh);
    if (st != MDT_OK)
        return fail_exit(st); /* same verdict on every rank: nothing to agree on */
    /* rank 0 writes the outputs: it finds out now, not after the compute, that it cannot */
    st = mdt_mesh_agree(mesh, g_rank == 0 ? check_outputs(out, report) : MDT_OK);
    if (st == MDT_OK)
        st = select_device(mesh, device, strcmp(dtype, "bf16") == 0, comm);
    if (st != MDT_OK)
        goto done;
    /* the inputs first: the memory check counts their activations before the weights load */
    st = mdt_mesh_agree(mesh, mdt_tensor_set_load(inp, &in));
    if (st != MDT_OK)
        goto done;
    const int nlocal = ranks_on_node();
    st = mdt_mesh_agree(
        mesh, check_run_memory(ck, mesh, in, max_bytes, strcmp(device, "cuda") == 0, nlocal));
    if (st != MDT_OK)
        goto done;
    mdt_load_params lp = mdt_load_params_default(); /* (the weights-only limit is checked above) */
    lp.checkpoint_dir = ck, lp.mesh = mesh;
    double t0 = mdt_now();
    st = mdt_model_load(&lp, &m);
    double load_s = mdt_now() - t0;
    if (st != MDT_OK)
        goto done;
    const mdt_family *fam = m->fam;
    const int nsteps = steps > 0 ? (int)steps : (int)repeat;
    const int progress = !quiet && g_rank == 0 && steps > 0 && isatty(STDERR_FILENO);
    times = calloc((size_t)nsteps, sizeof(double));
    mdt_counters per = {0};
    int64_t coll[MDT_COLL_KIND_COUNT] = {0}, group[MDT_GROUP_COUNT] = {0};
    mdt_tensor *lat = NULL, *tst = NULL;
    if (!times) {
        st = MDT_FAIL(MDT_E_NOMEM, "out of memory");
        goto done;
    }
    if (steps > 0) {
        lat = mdt_tensor_set_get(in, fam->latent_input);
        tst = mdt_tensor_set_get(in, fam->timestep_input);
        if (!lat || lat->dtype != MDT_F32 || !tst || tst->dtype != MDT_F32) {
            st = MDT_FAIL(MDT_E_INVALID, "inputs: --steps needs F32 '%s' and '%s'",
                          fam->latent_input, fam->timestep_input);
            goto done;
        }
    }
    /* the step watchdog: a rank that does not reach a collective of a step within the bound ends
     * the job with one line naming it; default: 10 x the longest step so far, at least 60 s */
    double longest = 0.0;
    for (int i = 0; i < nsteps && st == MDT_OK; i++) {
        mdt_mesh_set_deadline(mesh, step_timeout > 0
                                        ? (double)step_timeout
                                        : (10.0 * longest > 60.0 ? 10.0 * longest : 60.0));
        /* flow-matching Euler: sigma_i = 1 - i/N, x <- x + (sigma_{i+1} - sigma_i) v */
        double sig = 1.0 - (double)i / (double)nsteps, sig_next = 1.0 - (double)(i + 1) / nsteps;
        if (tst)
            for (int64_t b = 0; b < mdt_tensor_numel(tst); b++)
                ((float *)tst->data)[b] = (float)sig;
        mdt_tensor_set_free(res);
        res = NULL;
        st = mdt_tensor_set_create(&res);
        if (st != MDT_OK)
            break;
        int64_t c0[MDT_COLL_KIND_COUNT], gb0[MDT_GROUP_COUNT];
        memcpy(c0, mesh->bytes_sent, sizeof c0);
        memcpy(gb0, mesh->group_bytes, sizeof gb0);
        mdt_counters_reset();
        st = mdt_mesh_barrier(mesh, "step start");
        if (st != MDT_OK)
            break;
        double ts = mdt_now();
        st = mdt_model_forward(m, in, res);
        times[i] = mdt_now() - ts;
        longest = times[i] > longest ? times[i] : longest;
        per = *mdt_counters_get();
        for (int k = 0; k < MDT_COLL_KIND_COUNT; k++)
            coll[k] = mesh->bytes_sent[k] - c0[k];
        for (int g = 0; g < MDT_GROUP_COUNT; g++)
            group[g] = mesh->group_bytes[g] - gb0[g];
        if (st != MDT_OK && steps > 0) { /* say which step: its input is ours, not the user's */
            st = mdt_fail_prefix(st, "step %d of %d", i + 1, nsteps);
        }
        if (st != MDT_OK)
            break;
        if (lat) {
            mdt_tensor *v = mdt_tensor_set_get(res, fam->output);
            if (!v || mdt_tensor_numel(v) != mdt_tensor_numel(lat)) {
                st = MDT_FAIL(MDT_E_INVALID,
                              "the model output '%s' does not match the shape of "
                              "'%s'; cannot sample",
                              fam->output, fam->latent_input);
                break;
            }
            float *x = lat->data;
            const float *vv = v->data;
            for (int64_t j = 0; j < mdt_tensor_numel(lat); j++)
                x[j] += (float)(sig_next - sig) * vv[j];
            const int64_t bad = mdt_first_nonfinite(x, mdt_tensor_numel(lat));
            if (bad >= 0) {
                st = MDT_FAIL(MDT_E_NUMERIC,
                              "step %d of %d: the sampler's latent went non-finite at element "
                              "%lld (the model output times the step size overflowed f32)",
                              i + 1, nsteps, (long long)bad);
                break;
            }
        }
        if (progress)
            fprintf(stderr, "\rstep %d/%d  %.3f s", i + 1, nsteps, times[i]);
    }
    if (progress)
        fprintf(stderr, "\n");
    st = mdt_mesh_agree(mesh, st);
    mdt_mesh_set_deadline(mesh, 0); /* phases after the steps wait as long as they take */
    if (st == MDT_OK && lat) {
        /* the sampler's result is the final latent, under the model's output name */
        mdt_tensor_set_free(res);
        res = NULL;
        st = mdt_tensor_set_create(&res);
        if (st == MDT_OK)
            st = mdt_tensor_set_add_copy(res, fam->output, lat);
    }
    for (int k = 0; st == MDT_OK && k < mdt_tensor_set_count(res); k++) {
        const char *oname; /* never written with NaN or Inf, whatever the backend */
        const mdt_tensor *t = mdt_tensor_set_at(res, k, &oname);
        const int64_t bad =
            t->dtype == MDT_F32 ? mdt_first_nonfinite(t->data, mdt_tensor_numel(t)) : -1;
        if (bad >= 0)
            st = MDT_FAIL(MDT_E_NUMERIC,
                          "output '%s' holds a NaN or Inf at element %lld; not written", oname,
                          (long long)bad);
    }
    st = mdt_mesh_agree(mesh, st);
    if (st != MDT_OK)
        goto done;
    /* per-rank facts to rank 0 */
    double med = median(times, nsteps);
    rank_facts mine = {0};
    int64_t heads = 0;
    mdt_cfg_int(m->config, "num_attention_heads", 0, 0, &heads);
    mine.rank = g_rank, mine.t = mesh->t, mine.r = mesh->r, mine.u = mesh->u;
    mine.cp_index = mesh->cp_index;
    mine.heads_local = heads / mesh->T;
    mine.weight_bytes = m->weight_bytes, mine.peak_bytes = mdt_mem_peak();
    mine.max_rss_kib = max_rss_kib(), mine.bytes_read = m->bytes_read;
    memcpy(mine.flops, per.flops, sizeof mine.flops);
    mine.attn_calls = per.attn_calls, mine.attn_q = per.attn_query_rows;
    mine.attn_kv = per.attn_kv_rows;
    memcpy(mine.coll, coll, sizeof coll);
    memcpy(mine.group, group, sizeof group);
    mine.ring_wait_s = per.ring_wait_s, mine.ring_compute_s = per.ring_compute_s;
    mine.prep_s = per.prep_s;
    all = calloc((size_t)g_world, sizeof *all);
    if (!all) {
        st = MDT_FAIL(MDT_E_NOMEM, "out of memory");
        goto done;
    }
    MPI_Gather(&mine, (int)sizeof mine, MPI_BYTE, all, (int)sizeof mine, MPI_BYTE, 0,
               MPI_COMM_WORLD);
    if (g_rank == 0) { /* the output and the report: both or neither */
        char *txt = report ? report_text(m, order, load_s, med, nsteps, all) : NULL;
        st = report && !txt ? MDT_E_NOMEM : write_outputs(out, res, report, txt);
        cJSON_free(txt);
    }
    st = mdt_mesh_agree(mesh, st);
    if (st != MDT_OK)
        goto done;
    if (g_rank == 0 && !quiet && mdt_backend_device_ops()) {
        char desc[256];
        mdt_backend_describe(desc, sizeof desc);
        printf("device: %s, compute %s, weights %.1f MiB per rank, device memory peak %.2f GiB "
               "(rank 0)\n",
               desc, mdt_backend_bf16() ? "bf16 (fp32 accumulation)" : "f32",
               (double)m->weight_bytes / 1048576.0,
               (double)mdt_backend_device_ops()->mem_peak() / 1073741824.0);
    } else if (g_rank == 0 && !quiet && mdt_backend_bf16() && mdt_cpu_gemm_bf16_operands()) {
        printf("device: cpu, compute bf16 x bf16 GEMM operands with fp32 accumulation (linears, "
               "QK^T, PV; norms, softmax and residuals fp32), weights %.1f MiB per rank, operand "
               "scratch %.1f MiB (rank 0)\n",
               (double)m->weight_bytes / 1048576.0,
               (double)mdt_backend_scratch_bytes() / 1048576.0);
    } else if (g_rank == 0 && !quiet && mdt_backend_bf16()) {
        printf("device: cpu, compute bf16 weights widened to f32 panels for sgemm (fp32 "
               "arithmetic), weights %.1f MiB per rank, widening scratch %.1f MiB (rank 0)\n",
               (double)m->weight_bytes / 1048576.0,
               (double)mdt_backend_scratch_bytes() / 1048576.0);
    }
    st = mdt_mesh_agree(mesh, st);
    if (st == MDT_OK && !quiet && g_rank == 0)
        print_plan(m, order, all, load_s, med, nsteps, steps > 0, out);
done:
    if (st != MDT_OK && mesh && mesh->peers_stuck) {
        /* this rank failed inside a step while its peers wait in a collective: no agreement is
         * possible, so report from here and end the whole job */
        fprintf(stderr, "meshdit: error: %s\n", mdt_last_error());
        fflush(stderr);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    free(all);
    free(times);
    mdt_tensor_set_free(res);
    mdt_tensor_set_free(in);
    mdt_model_free(m);
    mdt_mesh_free(mesh);
    return st == MDT_OK ? 0 : fail_exit(st);
}

/* ---- compare ---- */
static int cmd_compare(int argc, char **argv) {
    opts o;
    double tol;
    int rc = parse_opts(argc, argv, &o, NULL);
    if (rc)
        return rc;
    if ((rc = opt_double(&o, "tol", 1e-4, &tol)) || (rc = opts_check_unused(&o)))
        return rc;
    if (o.npos != 2)
        return usage_exit("compare needs two files: A.safetensors B.safetensors%s", "");
    mdt_tensor_set *a = NULL, *b = NULL;
    mdt_status st = mdt_tensor_set_load(o.pos[0], &a);
    if (st == MDT_OK)
        st = mdt_tensor_set_load(o.pos[1], &b);
    if (st != MDT_OK) {
        mdt_tensor_set_free(a);
        return fail_exit(st);
    }
    int bad = 0;
    char s1[96], s2[96];
    for (int i = 0; i < mdt_tensor_set_count(b); i++) {
        const char *name;
        mdt_tensor *tb = mdt_tensor_set_at(b, i, &name), *ta = mdt_tensor_set_get(a, name);
        if (!ta) {
            printf("%-24s MISSING in %s\n", name, o.pos[0]);
            bad = 1;
            continue;
        }
        int same = ta->ndim == tb->ndim;
        for (int d = 0; same && d < ta->ndim; d++)
            same = ta->shape[d] == tb->shape[d];
        if (!same || !mdt_dtype_is_float(ta->dtype) || !mdt_dtype_is_float(tb->dtype)) {
            printf("%-24s SHAPE/DTYPE MISMATCH %s %s vs %s %s\n", name,
                   mdt_shape_str(ta->ndim, ta->shape, s1, 96), mdt_dtype_name(ta->dtype),
                   mdt_shape_str(tb->ndim, tb->shape, s2, 96), mdt_dtype_name(tb->dtype));
            bad = 1;
            continue;
        }
        int64_t n = mdt_tensor_numel(ta);
        float *fa = malloc(sizeof(float) * (size_t)(n ? n : 1)),
              *fb = malloc(sizeof(float) * (size_t)(n ? n : 1));
        if (!fa || !fb) {
            free(fa), free(fb);
            mdt_tensor_set_free(a), mdt_tensor_set_free(b);
            return fail_exit(MDT_FAIL(MDT_E_NOMEM, "out of memory"));
        }
        mdt_convert_to_f32(ta->dtype, ta->data, fa, n);
        mdt_convert_to_f32(tb->dtype, tb->data, fb, n);
        double maxd = 0, maxb = 0;
        int nonfinite = 0;
        for (int64_t j = 0; j < n; j++) {
            double d = fabs((double)fa[j] - fb[j]);
            nonfinite |= !isfinite(fa[j]) || !isfinite(fb[j]);
            maxd = d > maxd ? d : maxd;
            maxb = fabs(fb[j]) > maxb ? fabs(fb[j]) : maxb;
        }
        free(fa), free(fb);
        double rel = maxb > 0 ? maxd / maxb : maxd;
        int ok = !nonfinite && rel <= tol;
        printf("%-24s %s max|a-b| %.3e  max|b| %.3e  rel %.3e  %s (tol %.1e)\n", name,
               mdt_shape_str(tb->ndim, tb->shape, s1, 96), maxd, maxb, rel,
               ok ? "OK" : (nonfinite ? "NONFINITE" : "FAIL"), tol);
        bad |= !ok;
    }
    mdt_tensor_set_free(a);
    mdt_tensor_set_free(b);
    return bad;
}

/* ---- inspect ---- */
static int cmd_inspect(int argc, char **argv) {
    opts o;
    long long tp, ring, uly;
    int rc = parse_opts(argc, argv, &o, NULL);
    if (rc)
        return rc;
    const char *ck = opt_str(&o, "checkpoint", NULL), *cfgp = opt_str(&o, "config", NULL);
    const char *order_s = opt_str(&o, "mesh-order", "tp,ring,ulysses");
    if ((rc = opt_int(&o, "tp", 1, 1, 4096, &tp)) ||
        (rc = opt_int(&o, "ring", 1, 1, 4096, &ring)) ||
        (rc = opt_int(&o, "ulysses", 1, 1, 4096, &uly)) || (rc = opts_check_unused(&o)))
        return rc;
    if (!!ck == !!cfgp)
        return usage_exit("inspect needs exactly one of --checkpoint DIR or --config FILE%s", "");
    mdt_ckpt *c = NULL;
    cJSON *cfg = NULL;
    mdt_model *m = NULL;
    mdt_axis order[3];
    mdt_status st = mdt_mesh_parse_order(order_s, order);
    if (st == MDT_OK)
        st = ck ? mdt_ckpt_open(ck, &c) : mdt_config_load(cfgp, &cfg);
    if (st == MDT_OK)
        st = mdt_model_describe(ck ? c->config : cfg, &m);
    if (st == MDT_OK)
        st = mdt_model_check_layout(m, (int)tp, (int)ring, (int)uly);
    if (st != MDT_OK)
        goto done;
    printf("model %s (%s), %d tensors; layout tp %lld x ring %lld x ulysses %lld = %lld ranks "
           "(mesh order %s)\n",
           m->fam->name, m->fam->class_name, m->table.n, tp, ring, uly, tp * ring * uly, order_s);
    const mdt_cp_plan *cp = m->fam->cp_plan;
    printf("cp plan: split");
    for (int i = 0; cp && i < cp->nsplit; i++)
        printf(" %s[dim %d]", cp->split[i].input, cp->split[i].dim);
    printf("; gather");
    for (int i = 0; cp && i < cp->ngather; i++)
        printf(" %s[dim %d]", cp->gather[i].input, cp->gather[i].dim);
    printf("\n");
    printf("%-64s %-14s %-26s %-14s %s\n", "tensor", "shape", "tp style", "local", "stored");
    double total = 0, local_total = 0;
    for (int i = 0; i < m->table.n && st == MDT_OK; i++) {
        const mdt_weight_spec *w = &m->table.specs[i];
        int64_t loc[2];
        char s1[64], s2[64];
        st = mdt_shard_local_shape(w, (int)tp, loc);
        if (st != MDT_OK)
            break;
        const char *stored = "-";
        const mdt_ckpt_ref *ref;
        if (c)
            stored = mdt_ckpt_find(c, w->name, &ref) == MDT_OK ? mdt_dtype_name(ref->entry->dtype)
                                                               : "MISSING";
        total += (double)w->shape[0] * (w->ndim > 1 ? (double)w->shape[1] : 1.0);
        local_total += (double)loc[0] * (w->ndim > 1 ? (double)loc[1] : 1.0);
        printf("%-64s %-14s %-26s %-14s %s\n", w->name, mdt_shape_str(w->ndim, w->shape, s1, 64),
               mdt_tp_style_name(w->style), mdt_shape_str(w->ndim, loc, s2, 64), stored);
    }
    if (st == MDT_OK) {
        char b1[32], b2[32];
        int64_t heads = 0;
        mdt_cfg_int(m->config, "num_attention_heads", 0, 0, &heads);
        fmt_bytes(total * 4, b1, sizeof b1);
        fmt_bytes(local_total * 4, b2, sizeof b2);
        printf("parameters %.0f (%s in f32); per rank %.0f (%s in f32)\n", total, b1, local_total,
               b2);
        /* per-rank resident weights for every valid TP degree up to 16 (ring and ulysses do not
         * shard weights: every CP rank holds its TP shard) */
        printf("resident weights per rank by tp degree (any ring x ulysses):\n");
        for (int T = 1; T <= 16; T++) {
            if (mdt_model_check_layout(m, T, 1, 1) != MDT_OK)
                continue;
            double params = 0;
            for (int i = 0; i < m->table.n; i++) {
                int64_t loc[2];
                mdt_shard_local_shape(&m->table.specs[i], T, loc);
                params += (double)loc[0] * (m->table.specs[i].ndim > 1 ? (double)loc[1] : 1.0);
            }
            char f32b[32], bf16b[32];
            fmt_bytes(params * 4, f32b, sizeof f32b);
            fmt_bytes(params * 2, bf16b, sizeof bf16b);
            printf("  tp=%-2d %6.3f B parameters per rank (%s f32, %s bf16)%s\n", T, params * 1e-9,
                   f32b, bf16b, T == tp ? "  <- this layout" : "");
        }
        mdt_error_clear();
        for (long long rk = 0; rk < tp * ring * uly; rk++) {
            int t, r, u;
            mdt_mesh_coords((int)rk, (int)tp, (int)ring, (int)uly, order, &t, &r, &u);
            printf("rank %lld: tp %d, ring %d, ulysses %d, cp chunk %lld of %lld; %lld local heads "
                   "(%lld..%lld); weights %s resident\n",
                   rk, t, r, u, (long long)r * uly + u, ring * uly, (long long)(heads / tp),
                   (long long)t * (heads / tp), (long long)(t + 1) * (heads / tp) - 1, b2);
        }
    }
done:
    mdt_model_free(m);
    cJSON_Delete(cfg);
    mdt_ckpt_close(c);
    return st == MDT_OK ? 0 : fail_exit(st);
}

/* ---- plan ---- */
static int cmp_est(const void *a, const void *b) {
    const mdt_estimate *x = a, *y = b;
    if (x->valid != y->valid)
        return y->valid - x->valid;
    return (x->t_step > y->t_step) - (x->t_step < y->t_step);
}

static int cmd_plan(int argc, char **argv) {
    opts o;
    long long devices, tokens;
    double mem_gib, elem;
    int rc = parse_opts(argc, argv, &o, NULL);
    if (rc)
        return rc;
    const char *ck = opt_str(&o, "checkpoint", NULL), *cfgp = opt_str(&o, "config", NULL);
    const char *devname = opt_str(&o, "device", "h200");
    if ((rc = opt_int(&o, "devices", 1, 1, 4096, &devices)) ||
        (rc = opt_int(&o, "tokens", 4096, 1, 1 << 26, &tokens)) ||
        (rc = opt_double(&o, "device-mem", 0, &mem_gib)) ||
        (rc = opt_double(&o, "bytes", 2, &elem)) || (rc = opts_check_unused(&o)))
        return rc;
    if (!!ck == !!cfgp)
        return usage_exit("plan needs exactly one of --checkpoint DIR or --config FILE%s", "");
    const mdt_device *preset = mdt_device_preset(devname);
    if (!preset)
        return usage_exit("unknown --device '%s' (cpu, h100, h200, trn2)", devname);
    mdt_device dev = *preset;
    if (mem_gib > 0)
        dev.mem_bytes = mem_gib * 1073741824.0;
    char path[4096];
    cJSON *cfg = NULL;
    mdt_model *m = NULL;
    snprintf(path, sizeof path, "%s/config.json", ck ? ck : "");
    mdt_status st = mdt_config_load(ck ? path : cfgp, &cfg);
    if (st == MDT_OK)
        st = mdt_model_describe(cfg, &m);
    if (st != MDT_OK) {
        cJSON_Delete(cfg);
        return fail_exit(st);
    }
    mdt_estimate *est = calloc(4096, sizeof *est); /* at most one per (T, R) pair */
    int n = 0;
    if (!est) {
        mdt_model_free(m);
        cJSON_Delete(cfg);
        return fail_exit(MDT_FAIL(MDT_E_NOMEM, "out of memory"));
    }
    for (long long T = 1; T <= devices; T++)
        for (long long R = 1; T * R <= devices; R++)
            if (devices % (T * R) == 0 && n < 4096)
                mdt_estimate_layout(m, (int)T, (int)R, (int)(devices / (T * R)), tokens, elem, &dev,
                                    &est[n++]);
    qsort(est, (size_t)n, sizeof *est, cmp_est);
    printf("plan: %s, %lld tokens, %lld x %s (%.0f GiB, %.0f TFLOP/s sustained, %.0f GB/s in a "
           "node of %d, %.0f GB/s across), %.0f-byte elements; one forward per step\n",
           m->fam->name, tokens, devices, dev.name, dev.mem_bytes / 1073741824.0, dev.flops * 1e-12,
           dev.bw_intra * 1e-9, dev.node_size, dev.bw_inter * 1e-9, elem);
    printf("%-16s %9s %9s %10s %10s %10s %10s %10s %9s %9s %9s\n", "tp x ring x uly", "weights",
           "activ.", "lin TFLOP", "attn TFLOP", "tp GB", "ulysses GB", "ring GB", "compute s",
           "comm s", "step s");
    for (int i = 0; i < n; i++) {
        const mdt_estimate *e = &est[i];
        char lay[32];
        snprintf(lay, sizeof lay, "%d x %d x %d", e->T, e->R, e->U);
        if (!e->valid) {
            printf("%-16s rejected: %s\n", lay, e->why);
            continue;
        }
        printf("%-16s %8.2fG %8.2fG %10.2f %10.2f %10.2f %10.2f %10.2f %9.4f %9.4f %9.4f%s\n", lay,
               e->weight_bytes / 1073741824.0, e->act_bytes / 1073741824.0, e->flops_linear * 1e-12,
               e->flops_attn * 1e-12, e->bytes_tp * 1e-9, e->bytes_ulysses * 1e-9,
               e->bytes_ring * 1e-9, e->t_compute, e->t_comm, e->t_step, i == 0 ? "  <- best" : "");
    }
    free(est);
    mdt_model_free(m);
    cJSON_Delete(cfg);
    return 0;
}

/* ---- gather ---- */
static int cmd_gather(int argc, char **argv) {
    opts o;
    long long tp;
    int rc = parse_opts(argc, argv, &o, NULL);
    if (rc)
        return rc;
    const char *ck = opt_str(&o, "checkpoint", NULL), *out = opt_str(&o, "out", NULL);
    if ((rc = opt_int(&o, "tp", g_world, 1, 4096, &tp)) || (rc = opts_check_unused(&o)))
        return rc;
    if (!ck || !out)
        return usage_exit("gather needs --checkpoint DIR --out DIR%s", "");
    mdt_mesh *mesh = NULL;
    mdt_model *m = NULL;
    mdt_status st = mdt_mesh_create_world((int)tp, 1, 1, NULL, &mesh);
    mdt_load_params lp = mdt_load_params_default();
    lp.checkpoint_dir = ck, lp.mesh = mesh;
    if (st == MDT_OK)
        st = mdt_model_load(&lp, &m);
    if (st == MDT_OK)
        st = mdt_model_gather(m, out);
    if (st == MDT_OK && g_rank == 0)
        printf("gathered %d tensors from tp=%lld shards into %s\n", m->table.n, tp, out);
    mdt_model_free(m);
    mdt_mesh_free(mesh);
    return st == MDT_OK ? 0 : fail_exit(st);
}

int main(int argc, char **argv) {
    if (MPI_Init(&argc, &argv) != MPI_SUCCESS) {
        fprintf(stderr, "meshdit: error: MPI_Init failed\n");
        return 1;
    }
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &g_world);
    if (g_world > 1)
        mdt_log_set_rank(g_rank);
    int rc;
    /* MESHDIT_CPU_ISA or MESHDIT_CPU_GEMM that a rank's CPU cannot run is an error on every
     * rank, never ignored;
     * the lowest failing rank says why */
    const char *isa = getenv("MESHDIT_CPU_ISA"), *gemm = getenv("MESHDIT_CPU_GEMM");
    int first_bad = (isa && *isa && mdt_cpu_isa_select(isa) != MDT_OK) ||
                            (gemm && *gemm && mdt_cpu_gemm_select(gemm) != MDT_OK)
                        ? g_rank
                        : g_world;
    MPI_Allreduce(MPI_IN_PLACE, &first_bad, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    if (first_bad < g_world) {
        if (first_bad == g_rank)
            fprintf(stderr, "meshdit: error: %s\n", mdt_last_error());
        rc = 1;
    } else if (argc < 2 || strcmp(argv[1], "-h") == 0 || strcmp(argv[1], "--help") == 0) {
        usage(argc < 2 ? stderr : stdout);
        rc = argc < 2 ? 2 : 0;
    } else if (strcmp(argv[1], "gen") == 0) {
        rc = cmd_gen(argc - 2, argv + 2);
    } else if (strcmp(argv[1], "inputs") == 0) {
        rc = cmd_inputs(argc - 2, argv + 2);
    } else if (strcmp(argv[1], "run") == 0) {
        rc = cmd_run(argc - 2, argv + 2);
    } else if (strcmp(argv[1], "compare") == 0) {
        rc = cmd_compare(argc - 2, argv + 2);
    } else if (strcmp(argv[1], "inspect") == 0) {
        rc = cmd_inspect(argc - 2, argv + 2);
    } else if (strcmp(argv[1], "gather") == 0) {
        rc = cmd_gather(argc - 2, argv + 2);
    } else if (strcmp(argv[1], "plan") == 0) {
        rc = cmd_plan(argc - 2, argv + 2);
    } else if (strcmp(argv[1], "--version") == 0) {
        printf("meshdit %d.%d.%d\n", MDT_VERSION_MAJOR, MDT_VERSION_MINOR, MDT_VERSION_PATCH);
        rc = 0;
    } else {
        rc = usage_exit("unknown command '%s'", argv[1]);
    }
    MPI_Finalize();
    return rc;
}
