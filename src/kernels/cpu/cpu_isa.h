/*
 * cpu_isa.h — private to kernels/cpu: the kernel sets the builds of cpu.c export (cpu.h's
 * mdt_cpu_kernel_set); cpu_dispatch.c picks one.
 */
#ifndef MDT_KERNELS_CPU_ISA_H
#define MDT_KERNELS_CPU_ISA_H

#include "cpu.h"

/* x86-64 builds carry the first three; other architectures the generic one. */
extern const mdt_cpu_kernel_set mdt_cpu_kernels_x86_64, mdt_cpu_kernels_avx2,
    mdt_cpu_kernels_avx512, mdt_cpu_kernels_generic;

#endif /* MDT_KERNELS_CPU_ISA_H */
