#!/usr/bin/env python3
"""Per-rank FLOPs and bytes per forward for parallel layouts of a Flux checkpoint, measured
(from `meshdit run --report`) next to the analytic values of reference/peers.md §8.

usage: python3 bench/cp_layouts.py --checkpoint DIR --inputs FILE [--layouts "T,R,U ..."]
Prints a markdown table (rank 0's row; the maximum over ranks where they differ). Benchmarks
only; multi-rank wall times on a 2-vCPU box are not meaningful, bytes and FLOPs are.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from safetensors_shape import shapes  # noqa: E402


def analytic(cfg, B, Si, St, T, R, U):
    """Per-rank bytes (fp32) and FLOPs per forward of meshdit's schedule for Flux."""
    C = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    A, P = C, R * U
    S = Si + St
    s = S / P                      # local rows (even split)
    nd, ns = cfg["num_layers"], cfg["num_single_layers"]
    blocks = nd + ns
    ar = 2 * (T - 1) / T * 4      # reduce-scatter + all-gather, bytes per all-reduced float
    tp = ar * B * (nd * 2 * s * C + ns * s * C + (nd * 12 * C + ns * 3 * C + 2 * C))
    uly = blocks * B * 4 * (U - 1) / U * s * (A / T) * 4
    ring = blocks * B * 2 * (R - 1) * (S / R) * (A / (T * U)) * 4
    out_ch = cfg.get("out_channels") or cfg["in_channels"]
    cp = (P - 1) * B * (Si / P) * out_ch * 4
    attn = blocks * B * 4 * S * S * A / (T * P)
    return dict(tp=tp if T > 1 else 0, ulysses=uly, ring=ring, cp=cp if P > 1 else 0,
                attention=attn)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--inputs", required=True)
    ap.add_argument("--meshdit", default="build/meshdit")
    ap.add_argument("--layouts", default="1,1,1 2,1,1 1,1,2 1,2,1 1,2,2 1,1,4 2,1,2 2,2,1 2,2,2")
    args = ap.parse_args()
    mpiexec = shutil.which("mpiexec.mpich") or shutil.which("mpiexec")
    cfg = json.load(open(os.path.join(args.checkpoint, "config.json")))
    tmp = tempfile.mkdtemp()
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    env.pop("OPENBLAS_CORETYPE", None)
    print("| tp×ring×ulysses | linear GFLOP/rank | attention GFLOP/rank (analytic) | tp bytes (analytic) "
          "| ulysses bytes (analytic) | ring bytes (analytic) | cp gather bytes (analytic) "
          "| ring compute / wait s |")
    print("|---|---|---|---|---|---|---|---|")
    for lay in args.layouts.split():
        T, R, U = (int(x) for x in lay.split(","))
        n = T * R * U
        rep = os.path.join(tmp, f"r{lay}.json")
        cmd = [mpiexec, "-n", str(n), args.meshdit, "run", "--checkpoint", args.checkpoint,
               "--inputs", args.inputs, "--out", os.path.join(tmp, "o.safetensors"),
               "--tp", str(T), "--ring", str(R), "--ulysses", str(U), "--report", rep, "--quiet"]
        subprocess.run(cmd, check=True, env=env)
        r = json.load(open(rep))
        ranks = r["ranks"]
        mx = lambda f: max(f(k) for k in ranks)
        B, Si, St = shapes(args.inputs)
        a = analytic(cfg, B, Si, St, T, R, U)
        ax = lambda g: mx(lambda k: k["bytes_sent_per_step_by_axis"][g])
        print(f"| {T}×{R}×{U} | {mx(lambda k: k['flops_per_step']['linear']) / 1e9:.2f} "
              f"| {mx(lambda k: k['flops_per_step']['attention']) / 1e9:.2f} ({a['attention'] / 1e9:.2f}) "
              f"| {ax('tp') / 1e6:.1f} MB ({a['tp'] / 1e6:.1f}) "
              f"| {ax('ulysses') / 1e6:.1f} MB ({a['ulysses'] / 1e6:.1f}) "
              f"| {ax('ring') / 1e6:.1f} MB ({a['ring'] / 1e6:.1f}) "
              f"| {ax('cp') / 1e6:.2f} MB ({a['cp'] / 1e6:.2f}) "
              f"| {mx(lambda k: k['ring_per_step']['ring_compute_seconds']):.2f} / "
              f"{mx(lambda k: k['ring_per_step']['ring_wait_seconds']):.2f} |", flush=True)
    shutil.rmtree(tmp)


if __name__ == "__main__":
    main()
