#!/usr/bin/env python3
"""Step caches over a whole FluxPipeline: meshdit's drop-in with enable_cache against
diffusers' own transformer with the same enable_cache, and each against its uncached run: same
pipeline, weights, prompt, seed, machine and thread count. Benchmarks only.

usage: python bench/cache_pipeline.py [--size 128] [--steps 8] [--rounds 3]
           [--caches fbc,mag,taylorseer] [--thresholds 0.05,0.3,0.5] [--ranks 1]
           [--slow SCALE] [--cache-dit]
The pipeline is tests/python/flux_pipeline.py's with bench/pipeline_wall.py's medium transformer
(inner 1024, 2 double + 4 single blocks). Random weights do not change slowly between steps as a
trained model's do: the default threshold 0.05 skips nothing on them, so larger thresholds are
swept to make the cache skip. Per threshold: the skip pattern of each, wall medians per
generation (alternating, --rounds each), the ratio, the transformer FLOPs saved (meshdit's
report), and each output's distance from the uncached one (max rel, PSNR of the decoded image).

--slow SCALE multiplies the first linear of the timestep and guidance embedders by SCALE (e.g.
0.05) before both sides load the weights: the adaLN modulation then varies weakly and smoothly
with the timestep, as a trained model's does, and the first block's residual changes by a few
per cent between steps (0.03-0.04 at 28 steps with 0.05, against 0.42-0.48 unscaled), so
diffusers' default threshold skips at the rates the papers report.
--cache-dit adds cache-dit's DBCache (PyPI cache-dit, bench/requirements.txt) on diffusers'
transformer for every First-Block Cache threshold: Fn=1, Bn=0, no warm-up steps and no cap on
cached steps, the configuration whose decision is First-Block Cache's (relative L1 of the first
block's residual against the last computed one), on its own copy of the pipeline.
"""
import argparse
import math
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "python"), os.path.join(HERE, "..", "tests", "python"),
                HERE]
os.environ["OPENBLAS_NUM_THREADS"] = "1"
os.environ.pop("OPENBLAS_CORETYPE", None)

import numpy as np  # noqa: E402
import torch  # noqa: E402
from diffusers.hooks import FirstBlockCacheConfig  # noqa: E402
from diffusers.hooks import first_block_cache as fbc  # noqa: E402

import flux_pipeline  # noqa: E402
import meshdit  # noqa: E402
from pipeline_wall import MEDIUM  # noqa: E402


def psnr(a, b):
    mse = float(np.mean((a - b) ** 2))
    return float("inf") if mse == 0 else 10 * math.log10(1.0 / mse)


def rel(a, b):
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def slow_down(transformer_dir, scale):
    """Scale the first linear of the timestep and guidance embedders in the saved checkpoint."""
    from diffusers import FluxTransformer2DModel

    tr = FluxTransformer2DModel.from_pretrained(transformer_dir)
    with torch.no_grad():
        for name, p in tr.named_parameters():
            if name.endswith(("timestep_embedder.linear_1.weight",
                              "guidance_embedder.linear_1.weight")):
                p.mul_(scale)
    tr.save_pretrained(transformer_dir, safe_serialization=True)


def cache_dit_runner(root, steps):
    """A third copy of the pipeline and a function that runs it under cache-dit's DBCache at a
    threshold: returns (output, pattern, seconds of the generation alone)."""
    os.environ.setdefault("CACHE_DIT_LOG_LEVEL", "warning")
    try:
        import cache_dit
    except ImportError:
        sys.exit("bench/cache_pipeline.py: --cache-dit needs cache-dit: "
                 ".venv/bin/pip install --no-deps -r bench/requirements.txt")
    pipe = flux_pipeline.load(root)

    def run(threshold, gen):
        cache_dit.enable_cache(pipe, cache_config=cache_dit.DBCacheConfig(
            Fn_compute_blocks=1, Bn_compute_blocks=0, residual_diff_threshold=threshold,
            max_warmup_steps=0, max_cached_steps=-1, max_continuous_cached_steps=-1,
            num_inference_steps=steps))
        t0 = time.perf_counter()
        out = flux_pipeline.generate(pipe, **gen)
        seconds = time.perf_counter() - t0
        cached = set(cache_dit.summary(pipe, logging=False)[0].cached_steps or [])
        cache_dit.disable_cache(pipe)
        return out, "".join("-" if i in cached else "C" for i in range(steps)), seconds
    return run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=128)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--thresholds", default="0.05,0.3,0.5")
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--caches", default="fbc",
                    help="comma-separated: fbc (the --thresholds sweep), mag (FLUX_MAG_RATIOS at "
                         "diffusers' defaults), taylorseer (diffusers' defaults)")
    ap.add_argument("--slow", type=float, default=0.0,
                    help="scale the timestep/guidance embedders' first linear (0: unscaled)")
    ap.add_argument("--cache-dit", action="store_true",
                    help="add cache-dit's DBCache (F1B0, no warm-up) at each fbc threshold")
    a = ap.parse_args()
    torch.set_num_threads(a.ranks)
    root = tempfile.mkdtemp(prefix="mdt_cache_bench_")
    flux_pipeline.build(root, seed=0, transformer_config=MEDIUM)
    if a.slow:
        slow_down(os.path.join(root, "transformer"), a.slow)
    ref_pipe = flux_pipeline.load(root)
    cd_run = cache_dit_runner(root, a.steps) if a.cache_dit else None
    decisions = []
    orig = fbc.FBCHeadBlockHook._should_compute_remaining_blocks

    def spy(hook, r):
        out = orig(hook, r)
        decisions.append(bool(out))
        return out
    fbc.FBCHeadBlockHook._should_compute_remaining_blocks = spy
    gen = dict(seed=3, steps=a.steps, size=a.size)
    with meshdit.Transformer.from_pretrained(f"{root}/transformer", tp=a.ranks) as t:
        md_pipe = flux_pipeline.load(root, transformer=t)
        base_d = flux_pipeline.generate(ref_pipe, **gen)
        base_m = flux_pipeline.generate(md_pipe, **gen)
        print(f"# {a.size}px, {a.steps} steps, {a.ranks} rank(s)/thread(s), embedder scale "
              f"{a.slow or 1}; uncached meshdit vs diffusers rel {rel(base_m, base_d):.1e}")
        cd_head = (" cache-dit s | cache-dit pattern | cache-dit PSNR dB | meshdit vs cache-dit |"
                   if cd_run else "")
        print("| cache | skip pattern (C computed, - skipped) | diffusers + hook s | meshdit + "
              "hook s | ratio | uncached diffusers s | uncached meshdit s | FLOPs saved | "
              "rel vs uncached | PSNR vs uncached dB | meshdit vs diffusers rel |" + cd_head)
        print("|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" * 4 if cd_run else ""))
        from diffusers.hooks import MagCacheConfig, TaylorSeerCacheConfig
        from diffusers.hooks.mag_cache import FLUX_MAG_RATIOS
        configs = []
        for kind in a.caches.split(","):
            if kind == "fbc":
                configs += [(f"first_block {th}", lambda th=th: FirstBlockCacheConfig(threshold=th),
                             th)
                            for th in (float(x) for x in a.thresholds.split(","))]
            elif kind == "mag":
                configs.append(("mag (defaults)", lambda: MagCacheConfig(
                    num_inference_steps=a.steps, mag_ratios=FLUX_MAG_RATIOS), None))
            elif kind == "taylorseer":
                configs.append(("taylorseer (defaults)", lambda: TaylorSeerCacheConfig(), None))
            else:
                sys.exit(f"cache_pipeline.py: unknown cache {kind!r} (fbc, mag or taylorseer)")
        for label, make, th in configs:  # th: the First-Block threshold cache-dit runs at too
            kinds = ("dc", "mc", "du", "mu") + (("cc",) if cd_run and th is not None else ())
            times = {k: [] for k in kinds}
            for _ in range(a.rounds):  # alternating: each kind once per round
                for k in kinds:
                    if k == "cc":
                        c_out, c_pat, sec = cd_run(th, gen)
                        times[k].append(sec)
                        continue
                    pipe = ref_pipe if k[0] == "d" else md_pipe
                    tr = pipe.transformer
                    if k[1] == "c":
                        tr.enable_cache(make())
                    decisions.clear()
                    n0 = len(t.stats["cache"])
                    t0 = time.perf_counter()
                    out = flux_pipeline.generate(pipe, **gen)
                    times[k].append(time.perf_counter() - t0)
                    if k[1] == "c":
                        tr.disable_cache()
                    if k == "dc":
                        d_out, d_pat = out, "".join("C" if c else "-" for c in decisions)
                    if k == "mc":
                        log = t.stats["cache"][n0:]
                        m_out = out
                        m_pat = "".join("-" if e["skipped"] else "C" for e in log)
                        saved = sum(e["flops_saved"] for e in log)
            med = {k: statistics.median(v) for k, v in times.items()}
            pat = m_pat if not d_pat or m_pat == d_pat else f"{m_pat} (diffusers {d_pat})"
            print(f"| {label} | {pat} | {med['dc']:.3f} | {med['mc']:.3f} | "
                  f"{med['dc'] / med['mc']:.2f}x | {med['du']:.3f} | {med['mu']:.3f} | "
                  f"{saved / 1e9:.2f} GFLOP | {rel(m_out, base_m):.1e} | "
                  f"{psnr(m_out, base_m):.1f} | {rel(m_out, d_out):.1e} |" + (
                      f" {med['cc']:.3f} | {c_pat} | {psnr(c_out, base_d):.1f} | "
                      f"{med['cc'] / med['mc']:.2f}x |" if "cc" in med else ""))


if __name__ == "__main__":
    main()
