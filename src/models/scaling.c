/* scaling.c — see scaling.h. */
#define _POSIX_C_SOURCE 200809L
#include "scaling.h"

#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const mdt_device k_devices[] = {
    {.name = "cpu",
     .flops = 62e9,
     .bw_intra = 1.5e9,
     .bw_inter = 1.5e9,
     .latency = 50e-6,
     .mem_bytes = 24e9,
     .node_size = 2,
     .source = "uncalibrated: an older 2-vCPU development VM (fp32 forward 62 GFLOP/s, MPI shared "
               "memory ~1.5 GB/s); measure yours with plan --calibrate"},
    {.name = "h100",
     .flops = 989e12 * 0.62,
     .bw_intra = 370e9,
     .bw_inter = 48e9,
     .latency = 20e-6,
     .mem_bytes = 80e9,
     .node_size = 8,
     .source = "published: dense bf16 989 TFLOPS x 0.62 (SGLang's MiniMax-H3 points, peers.md "
               "section 8), NVLink busbw ~370 GB/s, 400 Gb/s NIC"},
    {.name = "h200",
     .flops = 989e12 * 0.62,
     .bw_intra = 370e9,
     .bw_inter = 48e9,
     .latency = 20e-6,
     .mem_bytes = 141e9,
     .node_size = 8,
     .source = "published: as h100 with 141 GB (SGLang's MiniMax-H3 points, peers.md section 8)"},
    /* one logical Trainium2 core (LNC=2): 667 TFLOPS bf16 per 8-core chip -> 167 per core, x 0.6;
     * 96 GB HBM per chip -> 24 GB; link bandwidth per core an assumption */
    {.name = "trn2",
     .flops = 667e12 / 4 * 0.6,
     .bw_intra = 100e9,
     .bw_inter = 25e9,
     .latency = 30e-6,
     .mem_bytes = 24e9,
     .node_size = 64,
     .source = "uncalibrated: datasheet peak x 0.6 and assumed link rates; the two published "
               "points cannot calibrate it"},
};

const mdt_device *mdt_device_preset(const char *name) {
    for (size_t i = 0; i < sizeof k_devices / sizeof k_devices[0]; i++)
        if (strcmp(k_devices[i].name, name) == 0)
            return &k_devices[i];
    return NULL;
}

/* ---- which rows a weight runs on ---- */

typedef enum { ROWS_ALL = 0, ROWS_TEXT, ROWS_ONE } rows_class;

static int has(const char *name, const char *const *subs) {
    for (; *subs; subs++)
        if (strstr(name, *subs))
            return 1;
    return 0;
}

/* By diffusers' names, shared by the families: the conditioning embedders run on one row per
 * sample, the text stream's projections (MMDiT context stream, text embedders and refiners,
 * cross-attention keys and values) on the text tokens, everything else on all tokens. */
static rows_class rows_of(const mdt_weight_spec *w) {
    static const char *const k_one[] = {"time_text_embed.", "time_guidance_embed.",
                                        "condition_embedder.time_", "time_embedder.", NULL};
    static const char *const k_text[] = {"context_embedder",
                                         "add_q_proj",
                                         "add_k_proj",
                                         "add_v_proj",
                                         "to_add_out",
                                         "ff_context.",
                                         "txt_in",
                                         "txt_mlp.",
                                         "condition_embedder.text_embedder",
                                         "condition_embedder.image_",
                                         "attn2.to_k",
                                         "attn2.to_v",
                                         "token_refiner.",
                                         NULL};
    if (w->style == MDT_TP_REPLICATED_INPUT_ROWWISE || has(w->name, k_one))
        return ROWS_ONE;
    return has(w->name, k_text) ? ROWS_TEXT : ROWS_ALL;
}

/* Length of the block prefix of `name` ("transformer_blocks.3." of
 * "transformer_blocks.3.ff.net.0.proj.weight"): through the first ".<digits>." component; 0 if
 * none. */
static size_t block_prefix(const char *name) {
    for (const char *p = strchr(name, '.'); p; p = strchr(p + 1, '.')) {
        const char *q = p + 1;
        while (*q >= '0' && *q <= '9')
            q++;
        if (q > p + 1 && *q == '.')
            return (size_t)(q - name) + 1;
    }
    return 0;
}

/* For each weight of the table: 1 if it belongs to a block that also holds text-stream weights
 * (an MMDiT dual-stream block, whose other weights then run on the image rows only). The weights
 * of a block are contiguous in the table. */
static void dual_stream_blocks(const mdt_wtable *t, unsigned char *dual) {
    for (int i = 0; i < t->n;) {
        const size_t len = block_prefix(t->specs[i].name);
        int j = i + 1, text = 0;
        while (j < t->n && len && block_prefix(t->specs[j].name) == len &&
               strncmp(t->specs[j].name, t->specs[i].name, len) == 0)
            j++;
        for (int k = i; k < j; k++)
            text |= len && t->specs[k].ndim == 2 && rows_of(&t->specs[k]) == ROWS_TEXT;
        for (int k = i; k < j; k++)
            dual[k] = (unsigned char)text;
        i = j;
    }
}

static int ends_with(const char *name, const char *suffix) {
    const size_t len = strlen(name), n = strlen(suffix);
    return len >= n && strcmp(name + len - n, suffix) == 0;
}

/* Whether weight `name` is the query projection of a self-attention block: a separate to_q
 * (attn: Flux, H3, Qwen-Image; attn1: Wan), or a fused projection that holds the query (Flux.2's
 * single blocks: attn.to_qkv_mlp_proj). */
static int is_query_proj(const char *name) {
    return ends_with(name, "attn.to_q.weight") || ends_with(name, "attn1.to_q.weight") ||
           ends_with(name, "attn.to_qkv_mlp_proj.weight");
}

int mdt_model_cross_attention(const mdt_model *m) { return mdt_model_dims_of(m).text_cross; }

mdt_model_dims mdt_model_dims_of(const mdt_model *m) {
    mdt_model_dims d = {1, 1, 1, 1, 0};
    m->fam->dims(m->impl, &d);
    return d;
}

/* Seconds of `calls` collectives of `kind` sending `bytes` per rank over the inter-node link or
 * not: the measured cost where the spec has it, else the flat bandwidth and latency. */
static double coll_s(const mdt_device *dev, mdt_coll_cost_kind kind, int inter, double calls,
                     double bytes) {
    if (calls <= 0)
        return 0;
    const mdt_link_cost *c = &dev->coll[inter ? MDT_LINK_INTER : MDT_LINK_INTRA][kind];
    if (c->bw > 0)
        return calls * c->latency + bytes / c->bw;
    return calls * dev->latency + bytes / (inter ? dev->bw_inter : dev->bw_intra);
}

void mdt_estimate_layout(const mdt_model *m, int T, int R, int U, int64_t S, int64_t L, double b,
                         const mdt_device *dev, mdt_estimate *e) {
    memset(e, 0, sizeof *e);
    e->T = T, e->R = R, e->U = U;
    if (mdt_model_check_layout(m, T, R, U) != MDT_OK) {
        snprintf(e->why, sizeof e->why, "%s", mdt_last_error());
        mdt_error_clear();
        return;
    }
    const mdt_model_dims md = mdt_model_dims_of(m);
    const double A = (double)(md.heads * md.head_dim), D = (double)md.hidden;
    const double P = (double)R * U, s = (double)S / P; /* local rows */
    /* a model with cross-attention keeps its text (encoder) rows whole on every rank; a joint
     * model's text rows are part of the S it splits */
    const int cross = mdt_model_cross_attention(m);
    const double Lt = L < 0 ? 0 : (double)(L > S && !cross ? S : L);
    const double txt = cross ? Lt : Lt / P;
    double weights = 0, n_rowwise = 0, rows_ar = 0, elementwise = 0;
    int n_attn = 0, n_cross = 0, n_text_attn = 0;
    unsigned char *dual = calloc((size_t)(m->table.n > 0 ? m->table.n : 1), 1);
    if (!dual) {
        snprintf(e->why, sizeof e->why, "out of memory");
        return;
    }
    dual_stream_blocks(&m->table, dual);
    for (int i = 0; i < m->table.n; i++) {
        const mdt_weight_spec *w = &m->table.specs[i];
        int64_t loc[2];
        mdt_shard_local_shape(w, T, loc);
        weights += (double)loc[0] * (w->ndim > 1 ? (double)loc[1] : 1.0) * b;
        if (w->ndim != 2)
            continue;
        const rows_class rc = rows_of(w);
        const int q = is_query_proj(w->name);
        n_attn += q && rc == ROWS_ALL;
        n_text_attn += q && rc == ROWS_TEXT;
        n_cross += ends_with(w->name, "attn2.to_q.weight");
        if (rc == ROWS_ONE)
            continue; /* AdaLN and the conditioning embedders: one row per sample, ~no FLOPs */
        /* in a joint model's dual-stream block the other linears run on the image rows */
        const double rows = rc == ROWS_TEXT ? txt : dual[i] && !cross ? s - txt : s;
        const double p = (double)w->shape[0] * (double)w->shape[1];
        const int sharded = w->style != MDT_TP_REPLICATED;
        e->flops_linear += 2.0 * rows * (sharded ? p / T : p);
        elementwise += rows * (double)loc[0];
        if (T > 1 && (w->style == MDT_TP_ROWWISE || w->style == MDT_TP_PACKED_ROWWISE)) {
            n_rowwise += 1; /* one all-reduce of its output rows (reduce-scatter + all-gather) */
            rows_ar += rows * (double)w->shape[0];
        }
    }
    free(dual);
    /* self-attention: local queries x all keys over the local heads; cross-attention: local
     * queries x the text keys; a text refiner: text x text */
    e->weight_bytes = weights;
    e->flops_attn = 4.0 * (double)S * (double)S * A * n_attn / (T * P) +
                    4.0 * s * Lt * A * n_cross / T + 4.0 * Lt * Lt * A * n_text_attn / T;
    e->flops_other = 8.0 * elementwise; /* norms, gates, activations: ~8 per output element */
    /* per attention block: the TP all-reduces of rowwise outputs; Ulysses q, k, v in and out; ring
     * K and V of the other blocks; one output gather */
    e->bytes_tp = T > 1 ? 2.0 * (T - 1) / T * rows_ar * b : 0;
    e->bytes_ulysses = U > 1 ? n_attn * 4.0 * (U - 1) / U * s * (A / T) * b : 0;
    e->bytes_ring = R > 1 ? n_attn * 2.0 * (R - 1) * ((double)S / R) * (A / (T * U)) * b : 0;
    e->bytes_cp = P > 1 ? (P - 1) * s * D * b : 0;
    e->act_bytes = mdt_act_bytes(m, T, R, U, 1, S, b);
    /* placement: tp innermost on a node, then ulysses, then ring (only what exceeds a node
     * crosses it) */
    const int node = dev->node_size;
    const int x_tp = T > node, x_u = T * U > node, x_r = T * U * R > node;
    const double f_attn = dev->flops_attn > 0 ? dev->flops_attn : dev->flops;
    const double t_attn = e->flops_attn / f_attn;
    e->t_compute = e->flops_linear / dev->flops + t_attn +
                   (dev->flops_other > 0 ? e->flops_other / dev->flops_other : 0);
    const double t_ring =
        coll_s(dev, MDT_COST_SENDRECV, x_r, R > 1 ? n_attn * (R - 1.0) : 0, e->bytes_ring);
    /* the ring's next block travels while this one is attended, as far as the transport moves
     * data while no MPI call runs (measured: overlap; a preset assumes all of it) */
    const mdt_link_cost *rc = &dev->coll[x_r ? MDT_LINK_INTER : MDT_LINK_INTRA][MDT_COST_SENDRECV];
    const double hide = rc->bw > 0 ? rc->overlap : 1.0;
    e->t_comm = coll_s(dev, MDT_COST_ALLREDUCE, x_tp, n_rowwise, e->bytes_tp) +
                coll_s(dev, MDT_COST_ALLTOALL, x_u, U > 1 ? n_attn * 4.0 : 0, e->bytes_ulysses) +
                t_ring - hide * fmin(t_ring, t_attn) +
                coll_s(dev, MDT_COST_ALLGATHER, x_r || x_u, P > 1 ? 1 : 0, e->bytes_cp);
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
    const mdt_model_dims md = mdt_model_dims_of(m);
    const double A = (double)(md.heads * md.head_dim), D = (double)md.hidden, F = (double)md.ffn;
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
