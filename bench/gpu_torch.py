#!/usr/bin/env python3
"""diffusers' FluxTransformer2DModel on the GPU (PyTorch eager: torch.nn.Linear and
scaled_dot_product_attention) on a meshdit checkpoint and inputs file: the peer that
scripts/gpu-check times meshdit --device cuda against. Writes the output and prints the median
forward time (CUDA events, after warm-up). Benchmarks only; needs torch, diffusers and a GPU.

usage: python3 bench/gpu_torch.py --checkpoint DIR --inputs FILE --out FILE [--dtype bf16|f32]
                                  [--reps 20]
"""
import argparse
import statistics

import torch
from diffusers import FluxTransformer2DModel
from safetensors.torch import load_file, save_file


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--inputs", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "f32"])
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False  # f32 means f32, as in meshdit
    torch.backends.cudnn.allow_tf32 = False
    dt = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    model = FluxTransformer2DModel.from_pretrained(args.checkpoint, torch_dtype=dt)
    model = model.to("cuda").eval()
    kw = {}
    for k, v in load_file(args.inputs).items():  # positions stay f32, like a pipeline's
        kw[k] = v.to("cuda") if k in ("img_ids", "txt_ids") else v.to("cuda", dt)
    times = []
    with torch.no_grad():
        for _ in range(3):
            out = model(**kw, return_dict=False)[0]
        torch.cuda.synchronize()
        for _ in range(args.reps):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            out = model(**kw, return_dict=False)[0]
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e))
    save_file({"sample": out.float().cpu().contiguous()}, args.out)
    print(f"torch {args.dtype} median {statistics.median(times):.3f} ms over {args.reps}"
          f" (min {min(times):.3f}); peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
