#!/usr/bin/env python3
"""A whole guided WanPipeline generation on two ranks: cfg=2 (the two branches at once, the
pipeline unchanged) against one rank and the other two-rank layouts (tp2, ulysses2, ring2), and
diffusers' own transformer on one thread, alternating, medians. Benchmarks only.

usage: python bench/cfg_pipeline.py [--rounds 3] [--steps 4] [--layers 8]
           [--layouts "1 rank,cfg2,tp2,ulysses2,ring2,diffusers"] [--one-at-a-time]
           [--threshold T]
The pipeline is tests/python/wan_pipeline.py's with a bigger transformer (8 heads x 128, ffn
4096, --layers blocks) at 9 frames of 128 x 128 (192 image tokens), guidance 5: two transformer
forwards per step. One thread per rank (OPENBLAS_NUM_THREADS=1, torch 1 thread);
OPENBLAS_CORETYPE unset. Prints per layout the median wall seconds per generation, the ratio to
one rank, cfg hits, and the largest difference from diffusers' images, and the transformer's
GFLOP per forward (counted from the shapes: the blocks' linears and attention).
Every layout's server is started once and stays resident; --one-at-a-time instead starts each
layout's server in its turn of every round, warms it with a two-step generation (two steps: the
drop-in tells a step's inputs from the constant ones by their change between steps, and only
then pairs the branches' sessions, so the timed generation's first step can hit too), times one
generation and closes it, so only one layout's weights are in
memory at a time (for transformers too large for all of them at once; 40 blocks are ~2.6 GB per
copy). --layouts picks the rows; "1 rank" is always run (the ratios' base).
A row named "NAME+fbc" ("cfg2+fbc", "1 rank+fbc", "diffusers+fbc") is NAME with diffusers'
First-Block Cache on its transformer (`enable_cache(FirstBlockCacheConfig(threshold=T))`, the
same call on both sides); it prints the forwards skipped and compares its images with
"diffusers+fbc" when that row runs. Random weights change a lot between steps, so T must be
far above diffusers' default 0.05 for anything to skip (docs/perf.md).
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
from diffusers.hooks import FirstBlockCacheConfig  # noqa: E402

LAYOUTS = {"1 rank": {}, "cfg2": dict(cfg=2), "tp2": dict(tp=2), "ulysses2": dict(ulysses=2),
           "ring2": dict(ring=2)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--layouts", default=",".join(list(LAYOUTS) + ["diffusers"]))
    ap.add_argument("--one-at-a-time", action="store_true")
    ap.add_argument("--threshold", type=float, default=0.2,
                    help="First-Block Cache threshold of the rows named NAME+fbc")
    a = ap.parse_args()
    names = ["1 rank"] + [k for k in a.layouts.split(",") if k != "1 rank"]
    for k in names:
        base = k.removesuffix("+fbc")
        if base not in LAYOUTS and base != "diffusers":
            sys.exit(f"cfg_pipeline.py: unknown layout {k!r} (one of {', '.join(LAYOUTS)}, "
                     "diffusers, each also as NAME+fbc)")
    torch.set_num_threads(1)
    root = tempfile.mkdtemp(prefix="mdt_cfg_bench_")
    wp.build(root, seed=0, transformer_config=dict(num_attention_heads=8, attention_head_dim=128,
                                                   ffn_dim=4096, num_layers=a.layers,
                                                   rope_max_seq_len=64))
    gen = dict(steps=a.steps, num_frames=9, height=128, width=128)
    ts, pipes, wall, out, hits, skips = {}, {}, {k: [] for k in names}, {}, {}, {}
    # 192 image tokens (3 latent frames of 8 x 8 patches), wp.TXT_LEN text tokens, per block:
    # self-attention q/k/v/o and cross-attention q/o on the image rows, cross k/v on the text,
    # the ffn; attention's QK^T and PV (the embeddings and the head are a few MFLOP)
    S, L, D, F = 192, wp.TXT_LEN, 1024, 4096
    gflop = a.layers * 2 * (6 * D * D * S + 2 * D * D * L + 2 * D * F * S + 2 * S * S * D
                            + 2 * S * L * D) / 1e9

    def open_layout(k):
        base = k.removesuffix("+fbc")
        if base == "diffusers":
            pipe = wp.load(root)
        else:
            ts[k] = meshdit.Transformer.from_pretrained(f"{root}/transformer", **LAYOUTS[base])
            pipe = wp.load(root, transformer=ts[k])
        if k.endswith("+fbc"):
            pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=a.threshold))
        return pipe

    def close_layout(k):
        t = ts.pop(k, None)
        if t:
            hits[k] = f"{t.stats['cfg_hits']} / {t.stats['forwards']}"
            log = t.stats["cache"]
            if log:
                skips[k] = f"{sum(e['skipped'] for e in log)} / {len(log)}"
            t.close()
        pipes.pop(k, None)

    if not a.one_at_a_time:
        for k in names:  # every server resident; warm each once
            pipes[k] = open_layout(k)
            out[k] = wp.generate(pipes[k], **gen)
    for _ in range(a.rounds):
        for k in names:
            if a.one_at_a_time:
                pipes[k] = open_layout(k)
                wp.generate(pipes[k], **dict(gen, steps=2))
            t0 = time.perf_counter()
            out[k] = wp.generate(pipes[k], **gen)
            wall[k].append(time.perf_counter() - t0)
            if a.one_at_a_time:
                close_layout(k)
    for k in list(pipes):
        close_layout(k)
    one = statistics.median(wall["1 rank"])
    print(f"WanPipeline, {a.layers} blocks of 1024 (ffn 4096), 9 x 128 x 128, {a.steps} steps, "
          f"guidance 5; median of {a.rounds} alternating rounds"
          + (", one layout resident at a time" if a.one_at_a_time else "")
          + f"; {gflop:.1f} GFLOP per forward"
          + (f"; +fbc: First-Block Cache, threshold {a.threshold}"
             if any(k.endswith("+fbc") for k in names) else ""))
    print("| layout | s per generation | vs 1 rank | cfg hits / forwards | skipped / cached "
          "forwards | max rel vs diffusers (+fbc: diffusers+fbc) |")
    print("|---|---|---|---|---|---|")
    for k in names:
        m = statistics.median(wall[k])
        ref = out.get("diffusers+fbc" if k.endswith("+fbc") else "diffusers")
        d = (f"{float(np.max(np.abs(out[k] - ref)) / np.max(np.abs(ref))):.1e}"
             if ref is not None else "-")
        print(f"| {k} | {m:.3f} | {one / m:.2f}x | {hits.get(k, '-')} | {skips.get(k, '-')} "
              f"| {d} |")


if __name__ == "__main__":
    main()
