/*
 * cmd_compare.c — `meshdit compare` (per-tensor differences of a result from a reference; exit 1
 * beyond the tolerance) and `meshdit gather` (TP shards back into one ordinary checkpoint).
 */
#include "cli/cli.h"

/* A name from a file (a tensor's) or the command line, as a report line may print it: escaped
 * (a newline or ESC in it cannot split the line or forge another). */
static char e1[1024], e2[1024];
static const char *shown(const char *s, char *buf) { return mdt_escape_line(s, buf, 1024); }

static int is_float(mdt_dtype dt) {
    return dt == MDT_F32 || dt == MDT_F16 || dt == MDT_BF16 || dt == MDT_F64;
}

int cmd_compare(int argc, char **argv) {
    cli_opts o;
    double tol;
    int rc = cli_parse_opts(argc, argv, &o, NULL);
    if (rc)
        return rc;
    o.pos_taken = 2;
    if ((rc = cli_opt_double(&o, "tol", 1e-4, &tol)) || (rc = cli_opts_check_unused(&o)))
        return rc;
    if (!(tol >= 0))
        return cli_usage_exit("--tol must be a number >= 0, got %g", tol);
    if (o.npos != 2)
        return cli_usage_exit("compare needs two files: A.safetensors B.safetensors");
    mdt_tensor_set *a = NULL, *b = NULL;
    mdt_status st = mdt_tensor_set_load(o.pos[0], &a);
    if (st == MDT_OK)
        st = mdt_tensor_set_load(o.pos[1], &b);
    if (st != MDT_OK) {
        mdt_tensor_set_free(a);
        return cli_fail_exit(st);
    }
    int bad = 0;
    char s1[96], s2[96];
    if (mdt_tensor_set_count(b) == 0) { /* nothing compared is not a pass */
        printf("%s holds no tensors: nothing to compare against\n", shown(o.pos[1], e1));
        bad = 1;
    }
    for (int i = 0; i < mdt_tensor_set_count(a); i++) { /* said, never silently dropped */
        const char *name;
        mdt_tensor_set_at(a, i, &name);
        if (!mdt_tensor_set_get(b, name))
            printf("%-24s EXTRA in %s (not in the reference; not compared)\n", shown(name, e1),
                   shown(o.pos[0], e2));
    }
    for (int i = 0; i < mdt_tensor_set_count(b); i++) {
        const char *name;
        mdt_tensor *tb = mdt_tensor_set_at(b, i, &name), *ta = mdt_tensor_set_get(a, name);
        if (!ta) {
            printf("%-24s MISSING in %s\n", shown(name, e1), shown(o.pos[0], e2));
            bad = 1;
            continue;
        }
        mdt_tensor_diff d;
        if ((st = mdt_tensor_compare(ta, tb, &d)) != MDT_OK) {
            mdt_tensor_set_free(a), mdt_tensor_set_free(b);
            return cli_fail_exit(st);
        }
        if (!d.comparable) {
            printf("%-24s SHAPE/DTYPE MISMATCH %s %s vs %s %s\n", shown(name, e1),
                   mdt_tensor_shape_str(ta, s1, 96), mdt_dtype_str(ta->dtype),
                   mdt_tensor_shape_str(tb, s2, 96), mdt_dtype_str(tb->dtype));
            bad = 1;
            continue;
        }
        double rel = d.max_abs_b > 0 ? d.max_abs_diff / d.max_abs_b : d.max_abs_diff;
        /* integer and bool tensors (ids, indices, masks) must be equal: off by one is not close */
        const int exact = !is_float(ta->dtype);
        int ok = !d.nonfinite && (exact ? d.max_abs_diff == 0 : rel <= tol);
        printf("%-24s %s max|a-b| %.3e  max|b| %.3e  rel %.3e  %s (tol %.1e)\n", shown(name, e1),
               mdt_tensor_shape_str(tb, s1, 96), d.max_abs_diff, d.max_abs_b, rel,
               ok ? "OK" : (d.nonfinite ? "NONFINITE" : "FAIL"), exact ? 0.0 : tol);
        bad |= !ok;
    }
    mdt_tensor_set_free(a);
    mdt_tensor_set_free(b);
    return bad;
}

int cmd_gather(int argc, char **argv) {
    cli_opts o;
    long long tp;
    int rc = cli_parse_opts(argc, argv, &o, NULL);
    if (rc)
        return rc;
    const char *ck = cli_opt_str(&o, "checkpoint", NULL), *out = cli_opt_str(&o, "out", NULL);
    if ((rc = cli_opt_int(&o, "tp", cli_world, 1, 4096, &tp)) || (rc = cli_opts_check_unused(&o)))
        return rc;
    if (!ck || !out)
        return cli_usage_exit("gather needs --checkpoint DIR --out DIR");
    mdt_mesh *mesh = NULL;
    mdt_model *m = NULL;
    mdt_status st = mdt_mesh_create_world(&(mdt_layout){1, (int)tp, 1, 1, NULL}, &mesh);
    mdt_load_params lp = mdt_load_params_default();
    lp.checkpoint_dir = ck, lp.mesh = mesh;
    if (st == MDT_OK)
        st = mdt_model_load(&lp, &m);
    if (st == MDT_OK)
        st = mdt_model_gather(m, out);
    if (st == MDT_OK && cli_rank == 0)
        printf("gathered %d tensors from tp=%lld shards into %s\n", mdt_model_weight_count(m), tp,
               out);
    mdt_model_free(m);
    mdt_mesh_free(mesh);
    return st == MDT_OK ? 0 : cli_fail_exit(st);
}
