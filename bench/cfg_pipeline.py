#!/usr/bin/env python3
"""A whole guided WanPipeline generation on two ranks: cfg=2 (the two branches at once, the
pipeline unchanged) against one rank and the other two-rank layouts (tp2, ulysses2, ring2), and
diffusers' own transformer on one thread, alternating, medians. Benchmarks only.

usage: python bench/cfg_pipeline.py [--rounds 3] [--steps 4] [--layers 8]
The pipeline is tests/python/wan_pipeline.py's with a bigger transformer (8 heads x 128, ffn
4096, --layers blocks) at 9 frames of 128 x 128 (192 image tokens), guidance 5: two transformer
forwards per step. One thread per rank (OPENBLAS_NUM_THREADS=1, torch 1 thread);
OPENBLAS_CORETYPE unset. Prints per layout the median wall seconds per generation, the ratio to
one rank, cfg hits, and the largest difference from diffusers' images.
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
os.environ.setdefault("MESHDIT_BIN", os.path.join(HERE, "..", "build", "meshdit"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import meshdit  # noqa: E402
import wan_pipeline as wp  # noqa: E402

LAYOUTS = {"1 rank": {}, "cfg2": dict(cfg=2), "tp2": dict(tp=2), "ulysses2": dict(ulysses=2),
           "ring2": dict(ring=2)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--layers", type=int, default=8)
    a = ap.parse_args()
    torch.set_num_threads(1)
    root = tempfile.mkdtemp(prefix="mdt_cfg_bench_")
    wp.build(root, seed=0, transformer_config=dict(num_attention_heads=8, attention_head_dim=128,
                                                   ffn_dim=4096, num_layers=a.layers,
                                                   rope_max_seq_len=64))
    gen = dict(steps=a.steps, num_frames=9, height=128, width=128)
    ts = {k: meshdit.Transformer.from_pretrained(f"{root}/transformer", **v)
          for k, v in LAYOUTS.items()}
    pipes = {k: wp.load(root, transformer=t) for k, t in ts.items()}
    pipes["diffusers"] = wp.load(root)
    wall = {k: [] for k in pipes}
    out = {}
    for k in pipes:  # warm each once
        out[k] = wp.generate(pipes[k], **gen)
    for _ in range(a.rounds):
        for k, p in pipes.items():
            t0 = time.perf_counter()
            out[k] = wp.generate(p, **gen)
            wall[k].append(time.perf_counter() - t0)
    one = statistics.median(wall["1 rank"])
    print(f"WanPipeline, {a.layers} blocks of 1024 (ffn 4096), 9 x 128 x 128, {a.steps} steps, "
          f"guidance 5; median of {a.rounds} alternating rounds")
    print("| layout | s per generation | vs 1 rank | cfg hits / forwards | max rel vs diffusers |")
    print("|---|---|---|---|---|")
    for k in pipes:
        m = statistics.median(wall[k])
        t = ts.get(k)
        hits = f"{t.stats['cfg_hits']} / {t.stats['forwards']}" if t else "-"
        d = float(np.max(np.abs(out[k] - out["diffusers"])) / np.max(np.abs(out["diffusers"])))
        print(f"| {k} | {m:.3f} | {one / m:.2f}x | {hits} | {d:.1e} |")
    for t in ts.values():
        t.close()


if __name__ == "__main__":
    main()
