#!/usr/bin/env python3
"""Single-rank Flux forward: meshdit next to diffusers on the same checkpoint, inputs and thread
count, alternating rounds, medians and ratio side by side. Benchmarks only (never in make test).

usage: python3 bench/bench_flux.py --checkpoint DIR --inputs FILE [--rounds 3] [--repeat 3]
Run with OPENBLAS_CORETYPE unset (the image's Haswell preset halves sgemm speed); one thread.
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--inputs", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--meshdit", default="build/meshdit")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    env.pop("OPENBLAS_CORETYPE", None)
    model = FluxTransformer2DModel.from_pretrained(args.checkpoint, torch_dtype=torch.float32).eval()
    inputs = load_file(args.inputs)
    model(**inputs)  # warm-up
    ours, theirs = [], []
    for r in range(args.rounds):
        out = subprocess.run([args.meshdit, "run", "--checkpoint", args.checkpoint, "--inputs",
                              args.inputs, "--out", "/tmp/bench_flux_out.safetensors",
                              "--repeat", str(args.repeat + 1)], env=env, check=True,
                             capture_output=True, text=True).stdout
        ours.append(float(re.search(r"median ([0-9.]+) s per forward", out).group(1)))
        gflop = float(re.search(r"per forward:? ([0-9.]+) GFLOP", out).group(1))
        ts = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            model(**inputs)
            ts.append(time.perf_counter() - t0)
        theirs.append(statistics.median(ts))
        print(f"round {r}: meshdit {ours[-1]:.3f} s  diffusers {theirs[-1]:.3f} s", flush=True)
    m, d = statistics.median(ours), statistics.median(theirs)
    print(f"forward ({gflop:.1f} GFLOP): meshdit median {m:.3f} s ({gflop / m:.1f} GFLOP/s), "
          f"diffusers median {d:.3f} s ({gflop / d:.1f} GFLOP/s); diffusers/meshdit = {d / m:.2f}x")
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")


if __name__ == "__main__":
    sys.exit(main())
