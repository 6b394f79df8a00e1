/*
 * cmd_plan.c — `meshdit plan`: the library's scaling-model estimate of every layout of N devices,
 * best first, on a preset device or a device file; with --calibrate FILE, the device file
 * measured on this machine (collective: launch it under mpiexec placed as the job will be).
 */
#include "cli/cli.h"

#include <stdlib.h>

static const char *const k_kinds[MDT_COST_KIND_COUNT] = {"all-reduce", "all-to-all", "send/recv",
                                                         "all-gather"};

static void print_device(const mdt_device_spec *d) {
    printf("device %s (%s): %s\n", d->name, d->calibrated ? "calibrated" : "uncalibrated",
           d->source);
    printf("  rates: linear %.2f GFLOP/s, attention %.2f GFLOP/s, ", d->flops * 1e-9,
           (d->flops_attn > 0 ? d->flops_attn : d->flops) * 1e-9);
    if (d->flops_other > 0)
        printf("element-wise %.2f GFLOP/s\n", d->flops_other * 1e-9);
    else
        printf("element-wise not counted\n");
    for (int l = 0; l < MDT_LINK_COUNT; l++)
        for (int k = 0; k < MDT_COST_KIND_COUNT; k++) {
            const mdt_link_cost *c = &d->coll[l][k];
            if (c->bw > 0) {
                printf("  %s %-10s latency %8.1f us, %9.2f MB/s sent per rank",
                       l == MDT_LINK_INTRA ? "inside a host:" : "across hosts: ", k_kinds[k],
                       c->latency * 1e6, c->bw * 1e-6);
                if (k == MDT_COST_SENDRECV)
                    printf(", %.0f%% hidden behind compute", 100 * c->overlap);
                printf("\n");
            }
        }
}

static int calibrate(mdt_model_info *info, const char *path, const char *ck, const char *cfgp,
                     long long tokens) {
    mdt_device_spec dev;
    /* a file that cannot be written, or that the command reads, is refused before anything is
     * measured */
    mdt_status st = MDT_OK;
    if (cli_rank == 0 && (st = mdt_output_check(path)) == MDT_OK)
        st = mdt_output_not_input("--calibrate", path, ck, (const char *const[]){cfgp}, 1);
    st = mdt_world_agree(st);
    if (st != MDT_OK) {
        mdt_model_info_free(info);
        return cli_fail_exit(st);
    }
    int end_job = 0;
    st = mdt_calibrate(info, tokens, &dev, &end_job);
    if (end_job) { /* this rank failed while its peers wait in a collective: end the job */
        cli_print_error(mdt_last_error());
        mdt_model_info_free(info);
        cli_abort_job(1);
    }
    if (st == MDT_OK && cli_rank == 0)
        st = mdt_device_spec_save(&dev, path);
    st = mdt_world_agree(st); /* rank 0's write decides for every rank */
    mdt_model_info_free(info);
    if (st != MDT_OK)
        return cli_fail_exit(st);
    if (cli_rank == 0) {
        print_device(&dev);
        printf("wrote %s\n", path);
    }
    return 0;
}

int cmd_plan(int argc, char **argv) {
    cli_opts o;
    static const char *const flags[] = {"guided", NULL};
    long long devices, tokens, txt, elem;
    double mem_gib;
    int rc = cli_parse_opts(argc, argv, &o, flags);
    if (rc)
        return rc;
    const char *ck = cli_opt_str(&o, "checkpoint", NULL), *cfgp = cli_opt_str(&o, "config", NULL);
    const char *devname = cli_opt_str(&o, "device", NULL);
    const char *devfile = cli_opt_str(&o, "device-file", NULL);
    const char *cal = cli_opt_str(&o, "calibrate", NULL);
    const int guided = cli_opt_str(&o, "guided", NULL) != NULL;
    if ((rc = cli_opt_int(&o, "devices", 1, 1, 4096, &devices)) ||
        (rc = cli_opt_int(&o, "tokens", 4096, 1, 1 << 24, &tokens)) ||
        (rc = cli_opt_int(&o, "txt-tokens", 0, 0, 1 << 24, &txt)) ||
        (rc = cli_opt_double(&o, "device-mem", 0, &mem_gib)) ||
        (rc = cli_opt_int(&o, "bytes", 2, 1, 8, &elem)))
        return rc;
    if (elem != 2 && elem != 4)
        return cli_usage_exit("--bytes is the weights' element size: 2 (bf16) or 4 (f32), got %lld",
                              elem);
    const char *const planning[] = {"devices", "txt-tokens", "device-mem", "bytes", "guided"};
    for (size_t i = 0; cal && i < sizeof planning / sizeof *planning; i++)
        if (cli_opt_str(&o, planning[i], NULL))
            return cli_usage_exit("--%s plans; --calibrate only measures (plan with "
                                  "--device-file FILE after it)",
                                  planning[i]);
    if ((rc = cli_opts_check_unused(&o)))
        return rc;
    if (cli_opt_str(&o, "device-mem", NULL) && !(mem_gib >= 0.001 && mem_gib <= 1e6))
        return cli_usage_exit("--device-mem must be a size in GiB in [0.001, 1e6], not '%s'",
                              cli_opt_str(&o, "device-mem", NULL));
    if (!!ck == !!cfgp)
        return cli_usage_exit("plan needs exactly one of --checkpoint DIR or --config FILE");
    if (!!devname + !!devfile + !!cal > 1)
        return cli_usage_exit("plan takes one of --device, --device-file and --calibrate");
    mdt_device_spec dev;
    mdt_status st = MDT_OK;
    if (devfile)
        st = mdt_device_spec_load(devfile, &dev);
    else if (!cal && mdt_device_spec_preset(devname ? devname : "h200", &dev) != MDT_OK)
        return cli_usage_exit("unknown --device '%s' (cpu, h100, h200, trn2)", devname);
    if (st != MDT_OK)
        return cli_fail_exit(st);
    if (mem_gib > 0)
        dev.mem_bytes = mem_gib * 1073741824.0;
    mdt_model_info *info = NULL;
    st = mdt_model_info_open(ck, ck ? NULL : cfgp, 0, &info);
    if (cal) { /* every rank opened the model itself: the lowest failing rank says why */
        if ((st = mdt_world_agree(st)) != MDT_OK) {
            mdt_model_info_free(info);
            return cli_fail_exit(st);
        }
        return calibrate(info, cal, ck, cfgp, tokens);
    }
    if (st != MDT_OK)
        return cli_fail_exit(st);
    mdt_layout_estimate *est = NULL;
    int n = 0;
    const mdt_plan_request rq = {(int)devices, tokens, txt, (double)elem, guided};
    st = mdt_plan_layouts(info, &dev, &rq, &est, &n);
    if (st != MDT_OK) {
        mdt_model_info_free(info);
        return cli_fail_exit(st);
    }
    if (cli_rank != 0) { /* under mpiexec: one table, not one per rank */
        free(est);
        mdt_model_info_free(info);
        return 0;
    }
    printf("plan: %s, %lld tokens (%lld text), %lld x %s (%.0f GiB, node of %d), %lld-byte "
           "elements; %s per step\n",
           mdt_model_info_family(info), tokens, txt, devices, dev.name,
           dev.mem_bytes / 1073741824.0, dev.node_size, elem,
           guided ? "two forwards (guidance: cfg 1 runs them in turn, cfg 2 at once)"
                  : "one forward");
    print_device(&dev);
    int inter = 0;
    for (int k = 0; k < MDT_COST_KIND_COUNT; k++)
        inter |= dev.coll[MDT_LINK_INTER][k].bw > 0;
    if (dev.calibrated && !inter && devices > dev.node_size)
        printf("note: no link across hosts was measured (the calibration ran on one host): "
               "layouts whose axes span more than %d devices are costed with the figures inside "
               "a host; calibrate across hosts for them\n",
               dev.node_size);
    printf("%-*s %9s %9s %10s %10s %10s %10s %10s %9s %9s %9s\n", guided ? 22 : 16,
           guided ? "cfg x tp x ring x uly" : "tp x ring x uly", "weights", "activ.", "lin GFLOP",
           "attn GFLOP", "tp MB", "ulysses MB", "ring MB", "compute s", "comm s", "step s");
    for (int i = 0; i < n; i++) {
        const mdt_layout_estimate *e = &est[i];
        char lay[48];
        if (guided)
            snprintf(lay, sizeof lay, "%d x %d x %d x %d", e->cfg, e->tp, e->ring, e->ulysses);
        else
            snprintf(lay, sizeof lay, "%d x %d x %d", e->tp, e->ring, e->ulysses);
        const int w = guided ? 22 : 16;
        if (!e->valid) {
            printf("%-*s rejected: %s\n", w, lay, e->why);
            continue;
        }
        printf("%-*s %8.2fG %8.2fG %10.1f %10.1f %10.1f %10.1f %10.1f %9.4f %9.4f %9.4f%s\n", w,
               lay, e->weight_bytes / 1073741824.0, e->act_bytes / 1073741824.0,
               e->flops_linear * 1e-9, e->flops_attn * 1e-9, e->bytes_tp * 1e-6,
               e->bytes_ulysses * 1e-6, e->bytes_ring * 1e-6, e->t_compute, e->t_comm, e->t_step,
               i == 0 ? "  <- best" : "");
    }
    free(est);
    mdt_model_info_free(info);
    return 0;
}
