#!/usr/bin/env python3
"""A whole FluxPipeline's wall time with meshdit as its transformer against diffusers' own
transformer: same pipeline, weights, prompt, seed, machine and thread count. Benchmarks only.

usage: python bench/pipeline_wall.py [--size 256] [--steps 4] [--rounds 2] [--ranks 1]
           [--bin build/meshdit]
The pipeline is tests/python/flux_pipeline.py's (tiny local text encoders and VAE, tokenizers
from a local vocabulary) with a medium-sized transformer (the `medium` preset's blocks and
heads: inner 1024, 8 heads x 128, 2 double + 4 single blocks; joint and pooled dims of the tiny
encoders), so the transformer dominates as it does in a real pipeline. diffusers runs with
torch.set_num_threads(--ranks); meshdit with --ranks ranks (tp) of one thread each, the server
started once (as a resident server is), the pipeline run `--rounds` times alternating with
diffusers'. Prints medians, their ratio, and the max relative difference of the images.
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "python"), os.path.join(HERE, "..", "tests", "python")]
os.environ["OPENBLAS_NUM_THREADS"] = "1"
os.environ.pop("OPENBLAS_CORETYPE", None)

import numpy as np  # noqa: E402
import torch  # noqa: E402

import flux_pipeline  # noqa: E402
import meshdit  # noqa: E402

MEDIUM = dict(num_layers=2, num_single_layers=4, attention_head_dim=128, num_attention_heads=8,
              axes_dims_rope=(16, 56, 56))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--bin", default="build/meshdit")
    a = ap.parse_args()
    torch.set_num_threads(a.ranks)
    kw = dict(seed=0, steps=a.steps, size=a.size)
    with tempfile.TemporaryDirectory() as root:
        flux_pipeline.build(root, seed=0, transformer_config=MEDIUM)
        ref_pipe = flux_pipeline.load(root)
        t_ref, t_mdt = [], []
        with meshdit.Transformer.from_pretrained(os.path.join(root, "transformer"), tp=a.ranks,
                                                 binary=a.bin) as t:
            pipe = flux_pipeline.load(root, transformer=t)
            for _ in range(a.rounds):
                t0 = time.perf_counter()
                ref = flux_pipeline.generate(ref_pipe, **kw)
                t1 = time.perf_counter()
                img = flux_pipeline.generate(pipe, **kw)
                t2 = time.perf_counter()
                t_ref.append(t1 - t0)
                t_mdt.append(t2 - t1)
            srv = statistics.median(t.stats["step_seconds"])
            cli = statistics.median(t.stats["wall_seconds"])
            sent = t.stats["request_bytes"]
    m_ref, m_mdt = statistics.median(t_ref), statistics.median(t_mdt)
    tokens = (a.size // 16) ** 2
    d = float(np.max(np.abs(img - ref)) / np.max(np.abs(ref)))
    print(f"FluxPipeline {a.size}x{a.size} ({tokens} image + {flux_pipeline.TXT_LEN} text tokens), "
          f"{a.steps} steps, {a.rounds} rounds; {a.ranks} thread(s) / rank(s); torch "
          f"{torch.__version__}\n")
    print("| pipeline with | wall per generation (median) | transformer per step |\n|---|---|---|")
    print(f"| diffusers FluxTransformer2DModel | {m_ref:.3f} s | |")
    print(f"| meshdit.Transformer, tp={a.ranks} | {m_mdt:.3f} s | server {srv:.3f} s, client "
          f"{cli:.3f} s |")
    print(f"\ndiffusers / meshdit = {m_ref / m_mdt:.2f}x; images' max relative difference {d:.1e}; "
          f"request bytes per step {sent[0]:,} then {sent[-1]:,}")


if __name__ == "__main__":
    main()
