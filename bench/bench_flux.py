#!/usr/bin/env python3
"""Single-rank Flux forward: meshdit next to diffusers on the same checkpoint, inputs and thread
count, in f32 and in bf16, alternating rounds; one table of medians, ratios and the fraction of
this machine's sgemm rate measured in the same run. Benchmarks only (never in make test).

usage: python3 bench/bench_flux.py --checkpoint DIR --inputs FILE [--rounds 3] [--repeat 3]
           [--dtypes f32,bf16] [--torch-bf16-repeat 1]
MESHDIT_CPU_GEMM in the environment picks meshdit's GEMM path (gemm.h; default auto); the table
header says which ran, with the CPU model and flags, and the fp32 FMA and bf16 dot peaks.
Run with OPENBLAS_CORETYPE unset (the image's Haswell preset halves sgemm speed); one thread.
bf16: meshdit keeps linear weights in bf16 (`--dtype bf16`) and, on CPUs with bf16 instructions,
multiplies bf16 GEMM operands with fp32 accumulation (else fp32 arithmetic); diffusers runs the
model and inputs in torch.bfloat16 (on a CPU without bf16 instructions PyTorch emulates them, so
its bf16 forward is slow there: --torch-bf16-repeat keeps the run short).
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import time

import torch
from diffusers import FluxTransformer2DModel
from safetensors.torch import load_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sgemm_rate import sgemm_rate  # noqa: E402

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


def run_meshdit(args, env, dtype):
    out = subprocess.run([args.meshdit, "run", "--checkpoint", args.checkpoint, "--inputs",
                          args.inputs, "--out", f"/tmp/bench_flux_{dtype}.safetensors", "--dtype", dtype,
                          "--repeat", str(args.repeat + 1)], env=env, check=True,
                         capture_output=True, text=True).stdout
    sec = float(re.search(r"median ([0-9.]+) s per forward", out).group(1))
    run_meshdit.gemm = re.search(r"gemm ([^\n]*)", out).group(1)
    gflop = float(re.search(r"per forward:? ([0-9.]+) GFLOP", out).group(1))
    w = re.search(r"weights ([0-9.]+) (KiB|MiB|GiB)", out)
    mib = float(w.group(1)) * {"KiB": 1 / 1024, "MiB": 1, "GiB": 1024}[w.group(2)]
    return sec, gflop, mib


def time_torch(model, inputs, n):
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        model(**inputs)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def rel(a, ref):
    return ((a.float() - ref).abs().max() / ref.abs().max()).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--inputs", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dtypes", default="f32,bf16")
    ap.add_argument("--torch-bf16-repeat", type=int, default=1)
    ap.add_argument("--meshdit", default="build/meshdit")
    ap.add_argument("--sgemm", default="build/bench/bench_sgemm")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    env.pop("OPENBLAS_CORETYPE", None)
    dtypes = args.dtypes.split(",")
    models, inputs = {}, {}
    raw = load_file(args.inputs)
    for dt in dtypes:
        models[dt] = FluxTransformer2DModel.from_pretrained(args.checkpoint,
                                                            torch_dtype=DTYPES[dt]).eval()
        inputs[dt] = {k: (v.to(DTYPES[dt]) if v.is_floating_point() else v) for k, v in raw.items()}
        models[dt](**inputs[dt])  # warm-up
    ours = {dt: [] for dt in dtypes}
    theirs = {dt: [] for dt in dtypes}
    rates, fmas, mib, gflop = [], [], {}, 0.0
    dots, pf32, pbf16, cpu = [], [], [], ""
    for r in range(args.rounds):
        rate, fma, dot, g32, g16, cpu = sgemm_rate(args.sgemm, env)
        rates.append(rate)
        fmas.append(fma)
        dots.append(dot or 0.0)
        pf32.append(g32 or 0.0)
        pbf16.append(g16 or 0.0)
        for dt in dtypes:
            sec, gflop, mib[dt] = run_meshdit(args, env, dt)
            ours[dt].append(sec)
            n = args.torch_bf16_repeat if dt == "bf16" else args.repeat
            theirs[dt].append(time_torch(models[dt], inputs[dt], n))
            print(f"round {r} {dt}: meshdit {ours[dt][-1]:.3f} s  diffusers {theirs[dt][-1]:.3f} s",
                  flush=True)
    peak, fma = statistics.median(rates), statistics.median(fmas)
    dot, g32, g16 = statistics.median(dots), statistics.median(pf32), statistics.median(pbf16)
    print(f"\ncpu: {cpu}")
    print(f"meshdit gemm path: {run_meshdit.gemm}")
    print(f"forward: {gflop:.1f} GFLOP; OpenBLAS sgemm {peak:.1f} GFLOP/s, gemm path f32 {g32:.1f}"
          f" / bf16 {g16:.1f} GFLOP/s; FMA peak {fma:.1f} GFLOP/s, bf16 dot peak "
          f"{dot:.1f} GFLOP/s (0: no AVX512-BF16) (medians of {len(rates)} runs in this run); "
          f"torch {torch.__version__}, {torch.get_num_threads()} thread, "
          f"{torch.backends.cpu.get_cpu_capability()}")
    print("| dtype | meshdit s | diffusers s | diffusers/meshdit | meshdit GFLOP/s | "
          "of OpenBLAS sgemm | of its gemm path | meshdit weights MiB |")
    print("|---|---|---|---|---|---|---|---|")
    med = {dt: (statistics.median(ours[dt]), statistics.median(theirs[dt])) for dt in dtypes}
    for dt in dtypes:
        m, d = med[dt]
        gp = g16 if dt == "bf16" and g16 else g32
        print(f"| {dt} | {m:.3f} | {d:.3f} | {d / m:.2f}x | {gflop / m:.1f} | "
              f"{gflop / m / peak:.0%} | {gflop / m / gp:.0%} | {mib[dt]:.1f} |" if gp else
              f"| {dt} | {m:.3f} | {d:.3f} | {d / m:.2f}x | {gflop / m:.1f} | "
              f"{gflop / m / peak:.0%} | - | {mib[dt]:.1f} |")
    if "f32" in models:  # accuracy against diffusers in f32, the reference
        ref = models["f32"](**inputs["f32"]).sample.float()
        for dt in dtypes:
            ours_out = load_file(f"/tmp/bench_flux_{dt}.safetensors")["sample"]
            theirs_out = models[dt](**inputs[dt]).sample
            print(f"{dt} vs diffusers f32: meshdit {rel(ours_out, ref):.2e}, "
                  f"diffusers {dt} {rel(theirs_out, ref):.2e} (max|a-b| / max|b|)")
    if "f32" in med and "bf16" in med:
        print(f"meshdit f32/bf16 time = {med['f32'][0] / med['bf16'][0]:.2f}x; bf16 weights = "
              f"{mib['bf16'] / mib['f32']:.2f} of f32")


if __name__ == "__main__":
    sys.exit(main())
