/*
 * cmd_inspect.c — `meshdit inspect`: a model's weight table, each tensor's shard under a layout,
 * the resident weights by TP degree and every rank's coordinates; no compute.
 */
#include "cli/cli.h"

#include <stdlib.h>

/* Shape of a weight, full or local, in words ("[64, 32]"). */
static const char *shape_str(int ndim, const int64_t *shape, char *buf, size_t cap) {
    mdt_tensor t = {.ndim = ndim};
    for (int d = 0; d < ndim; d++)
        t.shape[d] = shape[d];
    return mdt_tensor_shape_str(&t, buf, cap);
}

/* A local shape whose split is uneven, "[a|b, c]": coordinate 0's and the last one's sizes of the
 * dim that differs. */
static void uneven_str(const mdt_weight_info *first, const mdt_weight_info *last, char *buf,
                       size_t cap) {
    if (first->ndim == 1)
        snprintf(buf, cap, "[%lld|%lld]", (long long)first->local_shape[0],
                 (long long)last->local_shape[0]);
    else if (first->local_shape[0] != last->local_shape[0])
        snprintf(buf, cap, "[%lld|%lld, %lld]", (long long)first->local_shape[0],
                 (long long)last->local_shape[0], (long long)first->local_shape[1]);
    else
        snprintf(buf, cap, "[%lld, %lld|%lld]", (long long)first->local_shape[0],
                 (long long)first->local_shape[1], (long long)last->local_shape[1]);
}

/* Parameters on TP coordinate k under degree `tp` (a degree the model takes); *uneven (optional)
 * is set when some tensor splits unevenly there. */
static double params_at(const mdt_model_info *info, int tp, int k, int *uneven) {
    double params = 0;
    if (uneven)
        *uneven = 0;
    for (int i = 0; i < mdt_model_info_weight_count(info); i++) {
        mdt_weight_info w = {0};
        int u = 0;
        (void)mdt_model_info_weight_at(info, i, tp, k, &w, &u);
        if (uneven)
            *uneven |= u;
        params += (double)w.local_shape[0] * (w.ndim > 1 ? (double)w.local_shape[1] : 1.0);
    }
    return params;
}

/* The resident weights by TP degree and every rank's coordinates, shards and heads. */
static void print_ranks(const mdt_model_info *info, long long cfg, long long tp, long long ring,
                        long long uly, const char *order) {
    /* per-rank resident weights for every valid TP degree up to 16 (ring and ulysses do not
     * shard weights: every CP rank holds its TP shard); where a tensor splits unevenly, TP
     * coordinate 0's, the largest */
    printf("resident weights per rank by tp degree (any ring x ulysses):\n");
    for (int T = 1; T <= 16; T++) {
        if (mdt_model_info_check_layout(info, T, 1, 1) != MDT_OK)
            continue;
        int uneven = 0;
        const double params = params_at(info, T, 0, &uneven);
        char f32b[32], bf16b[32];
        cli_fmt_bytes(params * 4, f32b, sizeof f32b);
        cli_fmt_bytes(params * 2, bf16b, sizeof bf16b);
        printf("  tp=%-2d %6.3f B parameters %s (%s f32, %s bf16)%s\n", T, params * 1e-9,
               uneven ? "per rank at most, uneven split" : "per rank", f32b, bf16b,
               T == tp ? "  <- this layout" : "");
    }
    const long long heads = (long long)mdt_model_info_heads(info);
    const mdt_layout lay = {(int)cfg, (int)tp, (int)ring, (int)uly, order};
    for (long long rk = 0; rk < cfg * tp * ring * uly; rk++) {
        mdt_coords co = {0};
        (void)mdt_mesh_coords_of(&lay, (int)rk, &co);
        char branch[48] = "", local_bytes[32];
        if (cfg > 1)
            snprintf(branch, sizeof branch, "cfg %d, ", co.cfg);
        cli_fmt_bytes(params_at(info, (int)tp, co.tp, NULL) * 4, local_bytes, sizeof local_bytes);
        printf("rank %lld: %stp %d, ring %d, ulysses %d, cp chunk %lld of %lld; %lld local heads "
               "(%lld..%lld); weights %s resident\n",
               rk, branch, co.tp, co.ring, co.ulysses, (long long)co.ring * uly + co.ulysses,
               ring * uly, heads / tp, (long long)co.tp * (heads / tp),
               (long long)(co.tp + 1) * (heads / tp) - 1, local_bytes);
    }
}

/* What an adapter adapts on each rank: per weight its style, rank, scale and the factor slices
 * every TP coordinate holds (the same shapes on every coordinate, other rows or columns). */
static mdt_status print_lora(const mdt_model_info *info, const char *spec, long long tp) {
    mdt_lora_target_info *t = NULL;
    int n = 0;
    char path[4096];
    double user = 1.0; /* FILE[:SCALE] as run reads it: the scale multiplies the adapter's own */
    mdt_status st = cli_lora_spec(spec, path, sizeof path, &user);
    if (st == MDT_OK)
        st = mdt_model_info_lora(info, path, (int)tp, &t, &n);
    if (st != MDT_OK)
        return st;
    for (int i = 0; i < n; i++)
        t[i].scale *= user;
    double bytes = 0, full = 0;
    printf("adapter %s: %d linear weights\n", path, n);
    printf("  %-60s %-26s %5s %8s %-14s %-14s\n", "weight", "tp style", "rank", "scale", "A local",
           "B local");
    for (int i = 0; i < n; i++) {
        char s1[64], s2[64];
        printf("  %-60s %-26s %5lld %8.4g %-14s %-14s%s\n", t[i].weight, t[i].tp_style,
               (long long)t[i].rank, t[i].scale, shape_str(2, t[i].a_local, s1, 64),
               shape_str(2, t[i].b_local, s2, 64), t[i].has_bias ? " +bias" : "");
        bytes += (double)t[i].bytes_local;
    }
    mdt_lora_target_info *t1 = NULL;
    int n1 = 0;
    if (mdt_model_info_lora(info, path, 1, &t1, &n1) == MDT_OK)
        for (int i = 0; i < n1; i++)
            full += (double)t1[i].bytes_local;
    mdt_lora_targets_free(t1);
    mdt_lora_targets_free(t);
    char b1[32], b2[32];
    cli_fmt_bytes(bytes, b1, sizeof b1);
    cli_fmt_bytes(full, b2, sizeof b2);
    printf("  factors per rank %s in f32 (whole adapter %s); every rank fuses its own slices, no "
           "communication\n",
           b1, b2);
    return MDT_OK;
}

int cmd_inspect(int argc, char **argv) {
    cli_opts o;
    long long cfg, tp, ring, uly;
    const char *lora[16];
    int rc = cli_parse_opts(argc, argv, &o, NULL);
    if (rc)
        return rc;
    const char *ck = cli_opt_str(&o, "checkpoint", NULL), *cfgp = cli_opt_str(&o, "config", NULL);
    const char *order = cli_opt_str(&o, "mesh-order", "cfg,tp,ring,ulysses");
    const int nlora = cli_opt_all(&o, "lora", lora, 16);
    if (nlora > 16)
        return cli_usage_exit("at most 16 --lora adapters, got %d", nlora);
    if ((rc = cli_parse_degrees(&o, &cfg, &tp, &ring, &uly)) || (rc = cli_opts_check_unused(&o)))
        return rc;
    if (!!ck == !!cfgp)
        return cli_usage_exit("inspect needs exactly one of --checkpoint DIR or --config FILE%s",
                              "");
    mdt_model_info *info = NULL;
    mdt_coords co0;
    mdt_status st = mdt_mesh_coords_of(&(mdt_layout){1, 1, 1, 1, order}, 0, &co0); /* valid? */
    if (st == MDT_OK)
        st = mdt_model_info_open(ck, ck ? NULL : cfgp, 1, &info);
    if (st == MDT_OK)
        st = mdt_model_info_check_layout(info, (int)tp, (int)ring, (int)uly);
    for (int i = 0; i < nlora && st == MDT_OK; i++) { /* read before anything is printed */
        char path[4096];
        double user;
        mdt_lora_target_info *t = NULL;
        int n = 0;
        st = cli_lora_spec(lora[i], path, sizeof path, &user);
        if (st == MDT_OK)
            st = mdt_model_info_lora(info, path, (int)tp, &t, &n);
        mdt_lora_targets_free(t);
    }
    if (st != MDT_OK)
        goto done;
    printf("model %s (%s), %d tensors; layout %stp %lld x ring %lld x ulysses %lld = %lld ranks "
           "(mesh order %s)\n",
           mdt_model_info_family(info), mdt_model_info_class_name(info),
           mdt_model_info_weight_count(info), cfg > 1 ? "cfg 2 x " : "", tp, ring, uly,
           cfg * tp * ring * uly, order);
    for (int gather = 0; gather < 2; gather++) {
        printf(gather ? "; gather" : "cp plan: split");
        for (int i = 0; i < mdt_model_info_cp_count(info, gather); i++) {
            int dim = 0;
            const char *by = NULL, *name = mdt_model_info_cp_entry(info, gather, i, &dim, &by);
            printf(" %s[dim %d%s%s]", name, dim, by ? " by " : "", by ? by : "");
        }
    }
    printf("\n");
    printf("%-64s %-14s %-26s %-14s %s\n", "tensor", "shape", "tp style", "local", "stored");
    double total = 0, local_total = 0;
    int any_uneven = 0;
    for (int i = 0; i < mdt_model_info_weight_count(info) && st == MDT_OK; i++) {
        mdt_weight_info w, last;
        char s1[64], s2[64];
        int uneven = 0;
        if ((st = mdt_model_info_weight_at(info, i, (int)tp, 0, &w, &uneven)) != MDT_OK ||
            (st = mdt_model_info_weight_at(info, i, (int)tp, (int)tp - 1, &last, NULL)) != MDT_OK)
            break;
        total += (double)w.shape[0] * (w.ndim > 1 ? (double)w.shape[1] : 1.0);
        local_total += (double)w.local_shape[0] * (w.ndim > 1 ? (double)w.local_shape[1] : 1.0);
        shape_str(w.ndim, w.local_shape, s2, 64);
        if (uneven) /* "[a|b, c]": rank 0's rows or columns | the last rank's */
            uneven_str(&w, &last, s2, sizeof s2);
        any_uneven |= uneven;
        printf("%-64s %-14s %-26s %-14s %s\n", w.name, shape_str(w.ndim, w.shape, s1, 64),
               w.tp_style, s2, w.stored);
    }
    if (st == MDT_OK) {
        char b1[32], b2[32];
        cli_fmt_bytes(total * 4, b1, sizeof b1);
        cli_fmt_bytes(local_total * 4, b2, sizeof b2);
        if (any_uneven)
            printf("[a|b, ...]: split unevenly at tp=%lld, the first n mod %lld tp ranks hold a "
                   "rows or columns, the others b (as Ulysses splits uneven head groups)\n",
                   tp, tp);
        printf("parameters %.0f (%s in f32); per rank %.0f (%s in f32)%s\n", total, b1, local_total,
               b2, any_uneven ? " at most (tp rank 0)" : "");
        print_ranks(info, cfg, tp, ring, uly, order);
    }
    for (int i = 0; i < nlora && st == MDT_OK; i++)
        st = print_lora(info, lora[i], tp);
done:
    mdt_model_info_free(info);
    return st == MDT_OK ? 0 : cli_fail_exit(st);
}
