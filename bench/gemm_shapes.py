#!/usr/bin/env python3
"""Where a one-rank forward's GEMM time goes, per shape: `meshdit run` under oneDNN's verbose mode
(DNNL_VERBOSE=1 prints every matmul's shape and milliseconds), the first half of the forwards
dropped (primitive creation, first touch), the rest summed per shape: calls per forward,
milliseconds per forward, GFLOP/s and the share of the GEMM time. The verbose lines cost a little
per call, so the total reads slightly above the report's `linear` seconds. Benchmarks only (never
in make test); the standard library only.

usage: python3 bench/gemm_shapes.py (--checkpoint DIR | --cache-bench-model)
           [--img-tokens 64] [--txt-tokens 32] [--repeat 6]
--cache-bench-model writes (with `meshdit gen`) a transformer of bench/cache_pipeline.py's size:
pipeline_wall's MEDIUM (inner 1024, 2 double + 4 single blocks) with tests/python/flux_pipeline's
input widths; its 128-px generations run 64 image + 32 text tokens, the defaults here.
Needs build/meshdit on the onednn GEMM path (MESHDIT_CPU_GEMM=onednn* or `auto`'s choice).
"""
import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sgemm_rate import cpu_model  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE_BENCH_MODEL = {
    "_class_name": "FluxTransformer2DModel", "attention_head_dim": 128,
    "axes_dims_rope": [16, 56, 56], "guidance_embeds": True, "in_channels": 16,
    "joint_attention_dim": 64, "num_attention_heads": 8, "num_layers": 2,
    "num_single_layers": 4, "out_channels": None, "patch_size": 1, "pooled_projection_dim": 32,
}
SHAPE = re.compile(r"^(\d+)x(\d+):(\d+)x(\d+):(\d+)x(\d+)$")


def run(cmd, env):
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"gemm_shapes: {' '.join(cmd[:2])} failed: {p.stderr.strip()[-400:]}")
    return p.stdout


def main():
    ap = argparse.ArgumentParser()
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint")
    src.add_argument("--cache-bench-model", action="store_true")
    ap.add_argument("--img-tokens", type=int, default=64)
    ap.add_argument("--txt-tokens", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=6)
    ap.add_argument("--meshdit", default=os.path.join(ROOT, "build", "meshdit"))
    a = ap.parse_args()
    if a.repeat < 2:
        sys.exit("gemm_shapes: --repeat must be at least 2 (the first half is dropped)")
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    env.pop("OPENBLAS_CORETYPE", None)
    with tempfile.TemporaryDirectory() as tmp:
        ck = a.checkpoint
        if a.cache_bench_model:
            cfg, ck = os.path.join(tmp, "config.json"), os.path.join(tmp, "ckpt")
            with open(cfg, "w") as f:
                json.dump(CACHE_BENCH_MODEL, f)
            run([a.meshdit, "gen", "--model", "flux", "--config", cfg, "--out", ck], env)
        inputs = os.path.join(tmp, "in.safetensors")
        run([a.meshdit, "inputs", "--checkpoint", ck, "--out", inputs, "--img-tokens",
             str(a.img_tokens), "--txt-tokens", str(a.txt_tokens)], env)
        report = os.path.join(tmp, "report.json")
        out = run([a.meshdit, "run", "--checkpoint", ck, "--inputs", inputs, "--out",
                   os.path.join(tmp, "out.safetensors"), "--repeat", str(a.repeat), "--report",
                   report, "--quiet"], dict(env, DNNL_VERBOSE="1"))
        with open(report) as f:
            rep = json.load(f)
    lines = [ln.split(",") for ln in out.splitlines() if ln.startswith("onednn_verbose,exec,")]
    if not lines or len(lines) % a.repeat:
        sys.exit(f"gemm_shapes: {len(lines)} oneDNN calls for {a.repeat} forwards: is the GEMM "
                 "path onednn?")
    per, kept = len(lines) // a.repeat, a.repeat - a.repeat // 2
    tot = collections.defaultdict(lambda: [0, 0.0])
    for f in lines[per * (a.repeat // 2):]:
        tot[f[-2]][0] += 1
        tot[f[-2]][1] += float(f[-1])
    ms_all = sum(t for _, t in tot.values()) / kept
    print(f"cpu: {cpu_model()}; meshdit kernels {rep['cpu_kernels']}, gemm {rep['cpu_gemm']}")
    print(f"{per} GEMM calls per forward, {a.img_tokens} + {a.txt_tokens} tokens, "
          f"{ms_all:.1f} ms per forward in GEMMs (mean of the last {kept} of {a.repeat})")
    print("| M x K . K x N | calls per forward | ms per forward | GFLOP/s | share |")
    print("|---|---|---|---|---|")
    for shape, (c, t) in sorted(tot.items(), key=lambda kv: -kv[1][1]):
        m = SHAPE.match(shape)
        gf = 2 * int(m[1]) * int(m[2]) * int(m[4]) * c / (t * 1e-3) * 1e-9 if m else float("nan")
        print(f"| {shape.split(':')[0]} . {shape.split(':')[1]} | {c / kept:.0f} | "
              f"{t / kept:.2f} | {gf:.1f} | {100 * t / kept / ms_all:.1f}% |")


if __name__ == "__main__":
    main()
