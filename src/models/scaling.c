/* scaling.c — see scaling.h. */
#define _POSIX_C_SOURCE 200809L
#include "scaling.h"

#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const mdt_device k_devices[] = {
    /* measured on the 2-vCPU development VM (docs/perf.md): fp32 forward 62 GFLOP/s, MPI shared
     * memory ~1 GB/s all-reduce, ~3 GB/s all-to-all */
    {"cpu", 62e9, 1.5e9, 1.5e9, 50e-6, 24e9, 2},
    /* dense bf16 989 TFLOPS x 0.62 (the H3 SGLang calibration of peers.md §8: ~610 TFLOPS);
     * NVLink busbw ~370 GB/s (NCCL, non-all-reduce); 400 Gb/s NIC ~48 GB/s between nodes */
    {"h100", 989e12 * 0.62, 370e9, 48e9, 20e-6, 80e9, 8},
    {"h200", 989e12 * 0.62, 370e9, 48e9, 20e-6, 141e9, 8},
    /* one logical Trainium2 core (LNC=2: two physical NeuronCores, 64 per trn2.48xlarge):
     * 667 TFLOPS bf16 per 8-core chip -> 167 per logical core, x 0.6; 96 GB HBM per chip -> 24
     * GB; link bandwidth per core an assumption (NeuronLink shared by the chip's cores) */
    {"trn2", 667e12 / 4 * 0.6, 100e9, 25e9, 30e-6, 24e9, 64},
};

const mdt_device *mdt_device_preset(const char *name) {
    for (size_t i = 0; i < sizeof k_devices / sizeof k_devices[0]; i++)
        if (strcmp(k_devices[i].name, name) == 0)
            return &k_devices[i];
    return NULL;
}

/* Whether weight `name` is the query projection of a self-attention block: a separate to_q
 * (attn: Flux, H3, Qwen-Image; attn1: Wan), or a fused projection that holds the query (Flux.2's
 * single blocks: attn.to_qkv_mlp_proj). */
static int is_query_proj(const char *name) {
    static const char *const k_suffix[] = {"attn.to_q.weight", "attn1.to_q.weight",
                                           "attn.to_qkv_mlp_proj.weight"};
    const size_t len = strlen(name);
    for (size_t i = 0; i < sizeof k_suffix / sizeof k_suffix[0]; i++) {
        const size_t n = strlen(k_suffix[i]);
        if (len >= n && strcmp(name + len - n, k_suffix[i]) == 0)
            return 1;
    }
    return 0;
}

static int64_t cfg_or(const mdt_model *m, const char *key, int64_t def) {
    int64_t v = def;
    if (mdt_cfg_int(m->config, key, 0, def, &v) != MDT_OK)
        v = def;
    return v;
}

void mdt_estimate_layout(const mdt_model *m, int T, int R, int U, int64_t S, double b,
                         const mdt_device *dev, mdt_estimate *e) {
    memset(e, 0, sizeof *e);
    e->T = T, e->R = R, e->U = U;
    if (mdt_model_check_layout(m, T, R, U) != MDT_OK) {
        snprintf(e->why, sizeof e->why, "%s", mdt_last_error());
        mdt_error_clear();
        return;
    }
    const int64_t heads = cfg_or(m, "num_attention_heads", 1),
                  hd = cfg_or(m, "attention_head_dim", 1);
    const double A = (double)(heads * hd);
    const double D = (double)cfg_or(m, "hidden_size", heads * hd);
    double p_shard = 0, p_repl = 0, weights = 0;
    int n_attn = 0;
    for (int i = 0; i < m->table.n; i++) {
        const mdt_weight_spec *w = &m->table.specs[i];
        int64_t loc[2];
        mdt_shard_local_shape(w, T, loc);
        weights += (double)loc[0] * (w->ndim > 1 ? (double)loc[1] : 1.0) * b;
        n_attn += is_query_proj(w->name);
        if (w->ndim != 2 || w->style == MDT_TP_REPLICATED_INPUT_ROWWISE)
            continue; /* AdaLN projections run on timestep rows: ~no FLOPs */
        const double p = (double)w->shape[0] * (double)w->shape[1];
        if (w->style == MDT_TP_REPLICATED)
            p_repl += p;
        else
            p_shard += p;
    }
    const double P = (double)R * U, s = (double)S / P; /* local rows */
    e->weight_bytes = weights;
    e->flops_linear = 2.0 * s * (p_shard / T + p_repl);
    e->flops_attn = 4.0 * (double)S * (double)S * A * n_attn / (T * P);
    /* per attention block: 2 TP all-reduces of the local rows (reduce-scatter + all-gather);
     * Ulysses q, k, v in and out; ring K and V of the other blocks; one output gather */
    e->bytes_tp = T > 1 ? n_attn * 2.0 * 2.0 * (T - 1) / T * s * D * b : 0;
    e->bytes_ulysses = U > 1 ? n_attn * 4.0 * (U - 1) / U * s * (A / T) * b : 0;
    e->bytes_ring = R > 1 ? n_attn * 2.0 * (R - 1) * ((double)S / R) * (A / (T * U)) * b : 0;
    e->bytes_cp = P > 1 ? (P - 1) * s * D * b : 0;
    e->act_bytes = mdt_act_bytes(m, T, R, U, 1, S, b);
    /* placement: tp innermost on a node, then ulysses, then ring (only what exceeds a node
     * crosses it) */
    const int node = dev->node_size;
    const double bw_tp = T <= node ? dev->bw_intra : dev->bw_inter;
    const double bw_u = T * U <= node ? dev->bw_intra : dev->bw_inter;
    const double bw_r = T * U * R <= node ? dev->bw_intra : dev->bw_inter;
    const double t_attn = e->flops_attn / dev->flops;
    e->t_compute = (e->flops_linear + e->flops_attn) / dev->flops;
    const double t_ring = e->bytes_ring / bw_r + (R > 1 ? n_attn * (R - 1) * dev->latency : 0);
    e->t_comm = e->bytes_tp / bw_tp + (T > 1 ? n_attn * 2 * dev->latency : 0) +
                e->bytes_ulysses / bw_u + (U > 1 ? n_attn * 2 * dev->latency : 0) +
                fmax(0.0, t_ring - t_attn) + e->bytes_cp / bw_r;
    e->t_step = e->t_compute + e->t_comm;
    if (e->weight_bytes + e->act_bytes > dev->mem_bytes) {
        snprintf(e->why, sizeof e->why,
                 "needs %.1f GiB per device (weights %.1f + activations %.1f), over %.1f GiB",
                 (e->weight_bytes + e->act_bytes) / 1073741824.0, e->weight_bytes / 1073741824.0,
                 e->act_bytes / 1073741824.0, dev->mem_bytes / 1073741824.0);
        return;
    }
    e->valid = 1;
}

/* ---- memory of one rank of `meshdit run` ---- */

double mdt_act_bytes(const mdt_model *m, int T, int R, int U, int64_t batch, int64_t S, double b) {
    const int64_t heads = cfg_or(m, "num_attention_heads", 1),
                  hd = cfg_or(m, "attention_head_dim", 1);
    const double A = (double)(heads * hd);
    const double D = (double)cfg_or(m, "hidden_size", heads * hd);
    const double F = (double)cfg_or(m, "ffn_dim", 4 * heads * hd);
    const int64_t P = (int64_t)R * U, rows = (S + P - 1) / P; /* the largest CP chunk */
    const double per_row = 10.0 * D + (4.0 * A + 1.5 * F) / T + (U > 1 ? 14.0 * A / T : 0.0) +
                           (R > 1 ? 14.0 * A / T : 0.0);
    return (double)batch * (double)rows * per_row * b;
}

mdt_run_memory mdt_run_memory_at(const mdt_model *m, int T, int R, int U,
                                 const mdt_run_inputs *in) {
    mdt_run_memory r = {0, 0};
    double weights = 0, widest = 0;
    for (int i = 0; i < m->table.n; i++) {
        const mdt_weight_spec *w = &m->table.specs[i];
        int64_t loc[2];
        mdt_shard_local_shape(w, T, loc);
        const double n = (double)loc[0] * (w->ndim > 1 ? (double)loc[1] : 1.0);
        const int lin = m->table.lin[i] != NULL;
        weights += n * (in->bf16 && lin ? 2.0 : 4.0);
        if (lin && n > widest)
            widest = n;
    }
    mdt_error_clear(); /* a degree the model cannot take is the caller's to check */
    r.weights = (int64_t)weights;
    if (!in->device_acts) {
        double a = mdt_act_bytes(m, T, R, U, in->batch, in->rows, 4.0) + (double)in->input_bytes +
                   3.0 * (double)in->latent_f32 + 2.0 * 1048576.0;
        if (in->bf16) /* the panel a bf16 weight is widened into, at most 64 MiB */
            a += fmin(4.0 * widest, 64.0 * 1048576.0);
        r.activations = (int64_t)a;
    }
    return r;
}

const char *mdt_fmt_size(int64_t b, char *buf, size_t cap) {
    static const char *const unit[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    double v = (double)b;
    int u = 0;
    while (v >= 1024.0 && u < 4)
        v /= 1024.0, u++;
    snprintf(buf, cap, "%.1f %s", v, unit[u]);
    return buf;
}

mdt_status mdt_check_run_memory(const mdt_model *m, int T, int R, int U, const mdt_run_inputs *in,
                                int64_t limit, const char *limit_what) {
    const mdt_run_memory need = mdt_run_memory_at(m, T, R, U, in);
    if (need.weights + need.activations <= limit)
        return MDT_OK;
    int fit = 0;
    mdt_run_memory at = need;
    for (int t = T + 1; t <= 256 && !fit; t++) {
        if (mdt_model_check_layout(m, t, R, U) != MDT_OK)
            continue;
        at = mdt_run_memory_at(m, t, R, U, in);
        fit = at.weights + at.activations <= limit ? t : 0;
    }
    mdt_error_clear();
    char acts[160] = "", tail[160], b1[32], b2[32], b3[32];
    if (!in->device_acts)
        snprintf(acts, sizeof acts, " + %s of activations (batch %lld x %lld tokens)",
                 mdt_fmt_size(need.activations, b1, sizeof b1), (long long)in->batch,
                 (long long)in->rows);
    if (fit)
        snprintf(tail, sizeof tail, "tp=%d would need %s", fit,
                 mdt_fmt_size(at.weights + at.activations, b1, sizeof b1));
    else
        snprintf(tail, sizeof tail, "no valid tp up to 256 fits");
    return MDT_FAIL(MDT_E_NOMEM, "tp=%d needs %s per rank (%s of %s%s), over %s; %s%s", T,
                    mdt_fmt_size(need.weights + need.activations, b2, sizeof b2),
                    mdt_fmt_size(need.weights, b3, sizeof b3),
                    in->bf16 ? "weights (linears in bf16)" : "f32 weights", acts, limit_what, tail,
                    need.activations > need.weights
                        ? "; more --ring/--ulysses ranks split the activations"
                        : "");
}

/* ---- memory this process may use ---- */

/* The first number in `path` ("max" = no limit: INT64_MAX), or -1 when unreadable. */
static int64_t read_num(const char *path) {
    FILE *fp = fopen(path, "r");
    char buf[64] = "";
    if (!fp)
        return -1;
    const int got = fgets(buf, sizeof buf, fp) != NULL;
    fclose(fp);
    if (!got)
        return -1;
    if (strncmp(buf, "max", 3) == 0)
        return INT64_MAX;
    char *end;
    const long long v = strtoll(buf, &end, 10);
    return end == buf || v < 0 ? -1 : (int64_t)v;
}

/* The value of line "key value" in a memory.stat-like file, or -1. */
static int64_t stat_field(const char *path, const char *key) {
    FILE *fp = fopen(path, "r");
    char line[256];
    int64_t v = -1;
    const size_t kl = strlen(key);
    while (fp && v < 0 && fgets(line, sizeof line, fp))
        if (strncmp(line, key, kl) == 0 && line[kl] == ' ')
            v = (int64_t)strtoll(line + kl + 1, NULL, 10);
    if (fp)
        fclose(fp);
    return v;
}

/* limit - usage + reclaimable file cache, within [0, limit]; -1 when unknown or unlimited. */
static int64_t headroom(int64_t limit, int64_t usage, int64_t active, int64_t inactive) {
    if (limit < 0 || limit >= ((int64_t)1 << 60) || usage < 0)
        return -1;
    const int64_t v = limit - usage + (active > 0 ? active : 0) + (inactive > 0 ? inactive : 0);
    return v < 0 ? 0 : v > limit ? limit : v;
}

static void take_min(int64_t v, const char *src, int64_t *best, char *what, size_t cap) {
    if (v >= 0 && (*best < 0 || v < *best)) {
        *best = v;
        snprintf(what, cap, "%s", src);
    }
}

/* cgroup v2: the cgroup at `dir` and each parent down to `base` (a prefix of dir). */
static void cgroup_v2(char *dir, size_t base_len, int64_t *best, char *what, size_t cap) {
    char p[PATH_MAX + 32];
    for (;;) {
        snprintf(p, sizeof p, "%s/memory.max", dir);
        const int64_t max = read_num(p);
        if (max >= 0 && max != INT64_MAX) {
            snprintf(p, sizeof p, "%s/memory.current", dir);
            const int64_t cur = read_num(p);
            snprintf(p, sizeof p, "%s/memory.stat", dir);
            take_min(
                headroom(max, cur, stat_field(p, "active_file"), stat_field(p, "inactive_file")),
                "cgroup memory.max", best, what, cap);
        }
        char *slash = strrchr(dir, '/');
        if (!slash || (size_t)(slash - dir) < base_len)
            break;
        *slash = 0;
    }
}

/* cgroup v1: memory.limit_in_bytes and the hierarchy's limit of the cgroup at `dir`. */
static void cgroup_v1(const char *dir, int64_t *best, char *what, size_t cap) {
    char p[PATH_MAX + 32];
    snprintf(p, sizeof p, "%s/memory.limit_in_bytes", dir);
    int64_t limit = read_num(p);
    snprintf(p, sizeof p, "%s/memory.stat", dir);
    const int64_t hier = stat_field(p, "hierarchical_memory_limit");
    const int64_t act = stat_field(p, "total_active_file"),
                  inact = stat_field(p, "total_inactive_file");
    if (hier >= 0 && (limit < 0 || hier < limit))
        limit = hier;
    snprintf(p, sizeof p, "%s/memory.usage_in_bytes", dir);
    take_min(headroom(limit, read_num(p), act, inact), "cgroup memory.limit_in_bytes", best, what,
             cap);
}

int64_t mdt_mem_available(const char *root, char *what, size_t cap) {
    int64_t best = -1;
    char path[PATH_MAX], line[PATH_MAX];
    snprintf(what, cap, "%s", "unknown");
    snprintf(path, sizeof path, "%s/proc/meminfo", root);
    FILE *fp = fopen(path, "r");
    while (fp && fgets(line, sizeof line, fp)) {
        long long kb;
        if (sscanf(line, "MemAvailable: %lld kB", &kb) == 1 && kb >= 0)
            take_min((int64_t)kb * 1024, "MemAvailable", &best, what, cap);
    }
    if (fp)
        fclose(fp);
    /* "0::/path" (v2) and "N:ctrl,ctrl:/path" (v1) lines, mounted where systemd mounts them */
    snprintf(path, sizeof path, "%s/proc/self/cgroup", root);
    fp = fopen(path, "r");
    while (fp && fgets(line, sizeof line, fp)) {
        line[strcspn(line, "\n")] = 0;
        char *c1 = strchr(line, ':'), *c2 = c1 ? strchr(c1 + 1, ':') : NULL;
        if (!c2 || c2[1] != '/')
            continue;
        *c1 = 0, *c2 = 0;
        const char *ctrls = c1 + 1, *cg = c2 + 1;
        char dir[PATH_MAX];
        if (strcmp(line, "0") == 0 && *ctrls == 0) {
            static const char *const bases[] = {"/sys/fs/cgroup", "/sys/fs/cgroup/unified"};
            for (int b = 0; b < 2; b++) {
                const int base_len = snprintf(dir, sizeof dir, "%s%s", root, bases[b]);
                snprintf(dir, sizeof dir, "%s%s%s", root, bases[b], strcmp(cg, "/") ? cg : "");
                cgroup_v2(dir, (size_t)base_len, &best, what, cap);
            }
            continue;
        }
        int is_memory = 0;
        for (const char *t = ctrls; *t; t += strcspn(t, ",") + (t[strcspn(t, ",")] ? 1 : 0))
            is_memory |= strncmp(t, "memory", 6) == 0 && (t[6] == ',' || t[6] == 0);
        if (!is_memory)
            continue;
        char probe[PATH_MAX + 32];
        snprintf(dir, sizeof dir, "%s/sys/fs/cgroup/memory%s", root, strcmp(cg, "/") ? cg : "");
        snprintf(probe, sizeof probe, "%s/memory.limit_in_bytes", dir);
        if (read_num(probe) < 0) /* a container that sees its own cgroup as the mount's root */
            snprintf(dir, sizeof dir, "%s/sys/fs/cgroup/memory", root);
        cgroup_v1(dir, &best, what, cap);
    }
    if (fp)
        fclose(fp);
    return best;
}
