/*
 * devices.c — the planner's device presets (published or measured figures, each with its
 * source); `meshdit plan --calibrate` measures a machine instead (calibrate.c).
 */
#include "plan/cost.h"

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

mdt_status mdt_device_spec_preset(const char *name, mdt_device_spec *out) {
    const mdt_device *d = mdt_device_preset(name);
    if (!d)
        return MDT_FAIL(MDT_E_NOTFOUND, "unknown device '%s' (cpu, h100, h200, trn2)", name);
    *out = *d;
    return MDT_OK;
}
