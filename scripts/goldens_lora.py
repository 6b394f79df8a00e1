#!/usr/bin/env python3
"""LoRA golden cases: random adapters in diffusers/peft form on the tiny test checkpoints, and
what diffusers + peft compute with them, for meshdit's LoRA tests (tests/mpi/test_lora.c).

For each case (flux_tiny, flux2_tiny, qwenimage_tiny, wan_tiny, h3_tiny) it writes tests/data/lora/CASE/:
  a.safetensors   every linear (and Wan's Conv3d patch embedding), rank 4, keys
                  `transformer.MODULE.lora_A.weight` / `lora_B.weight`, diffusers'
                  `lora_adapter_metadata` (prefixed "transformer.") with lora_alpha 8, an
                  alpha_pattern and a rank_pattern (a module of rank 2)
  b.safetensors   the attention projections, rank 2, `MODULE.alpha` keys (most 2, some 5), and
                  for Flux a `lora_B.bias` on each
  expected_a.safetensors    the checkpoint's inputs.safetensors through diffusers with adapter a
                            at weight 1 (load_lora_adapter; peft's unfused forward)
  expected_ab.safetensors   set_adapters(["a", "b"], [0.7, -1.3])
  versions.txt
Each expected output is checked against diffusers' own fuse_lora (fused weights) here (1e-5).
Needs the venv of tests/python (torch, diffusers, peft, safetensors); CI never runs it.

usage: python3 scripts/goldens_lora.py [--data tests/data]
"""
import argparse
import json
import os
import sys
import zlib

import diffusers
import peft
import safetensors
import torch
from safetensors.torch import load_file, save_file

WA, WB = 0.7, -1.3


def linears(model, convs=False):
    kinds = (torch.nn.Linear, torch.nn.Conv3d) if convs else (torch.nn.Linear,)
    return [n for n, mod in model.named_modules() if isinstance(mod, kinds)]


def factors(model, names, rank_of, gen, bias=False):
    """Random A [r, in...] and B [out, r, 1...] for each module, peft's shapes, N(0, 0.15^2)."""
    sd = {}
    mods = dict(model.named_modules())
    for n in names:
        w = mods[n].weight
        r = rank_of(n)
        a_shape = (r, *w.shape[1:])
        b_shape = (w.shape[0], r, *([1] * (w.ndim - 2)))
        sd[f"transformer.{n}.lora_A.weight"] = 0.15 * torch.randn(a_shape, generator=gen)
        sd[f"transformer.{n}.lora_B.weight"] = 0.15 * torch.randn(b_shape, generator=gen)
        if bias:
            sd[f"transformer.{n}.lora_B.bias"] = 0.1 * torch.randn(w.shape[0], generator=gen)
    return sd


def strip(d, prefix="transformer."):
    return {k[len(prefix):]: v for k, v in d.items() if k.startswith(prefix)}


def case(data, name, cls, call, alpha_mod, rank_mod, b_filter, bias, convs=False):
    ckpt = os.path.join(data, name)
    out = os.path.join(data, "lora", name)
    os.makedirs(out, exist_ok=True)
    inputs = load_file(os.path.join(ckpt, "inputs.safetensors"))
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))  # the same on every run
    model = cls.from_pretrained(ckpt, torch_dtype=torch.float32).eval()
    names = linears(model, convs)
    # a: metadata as diffusers' save_lora_weights writes it (the LoraConfig, prefixed)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=names,
                          alpha_pattern={alpha_mod: 2.0}, rank_pattern={rank_mod: 2})
    meta = {f"transformer.{k}": (list(v) if isinstance(v, set) else v)
            for k, v in cfg.to_dict().items()}
    sd_a = factors(model, names, lambda n: 2 if n == rank_mod else 4, gen)
    save_file(sd_a, os.path.join(out, "a.safetensors"),
              metadata={"format": "pt", "lora_adapter_metadata": json.dumps(meta, sort_keys=True)})
    # b: `.alpha` keys (network alphas, as kohya-trained diffusers files carry them)
    bnames = [n for n in names if b_filter(n)]
    sd_b = factors(model, bnames, lambda n: 2, gen, bias=bias)
    alphas = {f"transformer.{n}.alpha": torch.tensor(5.0 if i % 3 == 0 else 2.0)
              for i, n in enumerate(bnames)}
    save_file({**sd_b, **alphas}, os.path.join(out, "b.safetensors"))

    def run(m):
        with torch.no_grad():
            out = call(m, inputs)
            if isinstance(out, tuple):  # MiniMax-H3: video and audio
                return {"sample": out[0].contiguous(), "audio_sample": out[1].contiguous()}
            return {"sample": out.contiguous()}

    model.load_lora_adapter(strip(sd_a), prefix=None, adapter_name="a",
                            metadata=strip(meta))
    exp_a = run(model)
    model.load_lora_adapter(sd_b, prefix="transformer", adapter_name="b",
                            network_alphas={k: float(v) for k, v in alphas.items()})
    model.set_adapters(["a", "b"], [WA, WB])
    exp_ab = run(model)
    # the same through diffusers' fused weights
    model.fuse_lora(adapter_names=["a", "b"])
    fused = run(model)["sample"]
    err = (fused - exp_ab["sample"]).abs().max() / exp_ab["sample"].abs().max()
    assert err < 1e-5, f"{name}: fused vs unfused {err:.2e}"
    base = run(cls.from_pretrained(ckpt, torch_dtype=torch.float32).eval())["sample"]
    assert (base - exp_a["sample"]).abs().max() > 1e-2 * base.abs().max(), "a changes nothing"
    save_file(exp_a, os.path.join(out, "expected_a.safetensors"))
    save_file(exp_ab, os.path.join(out, "expected_ab.safetensors"))
    with open(os.path.join(out, "versions.txt"), "w") as fp:
        fp.write(f"diffusers {diffusers.__version__}\npeft {peft.__version__}\n"
                 f"torch {torch.__version__}\nsafetensors {safetensors.__version__}\n"
                 f"python {sys.version.split()[0]}\nbase checkpoint: tests/data/{name}\n"
                 f"a: {len(names)} modules, alpha_pattern {{{alpha_mod}: 2}}, rank_pattern "
                 f"{{{rank_mod}: 2}}; b: {len(bnames)} modules{' with lora_B.bias' if bias else ''}"
                 f"; expected_ab: set_adapters([a, b], [{WA}, {WB}]); fused - unfused {err:.1e}\n")
    print(f"{name}: a {len(names)} modules, b {len(bnames)}, fused vs unfused {err:.1e}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=os.path.join(os.path.dirname(__file__), "..", "tests", "data"))
    args = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from diffusers import (Flux2Transformer2DModel, FluxTransformer2DModel,
                           MiniMaxH3Transformer3DModel, QwenImageTransformer2DModel,
                           WanTransformer3DModel)
    from goldens_qwenimage import to_diffusers

    def plain(m, x):
        return m(**x, return_dict=False)[0]

    attn = lambda n: ".attn." in n and n.rsplit(".", 1)[-1] in ("to_q", "to_k", "to_v")  # noqa: E731
    case(args.data, "flux_tiny", FluxTransformer2DModel, plain, "proj_out",
         "transformer_blocks.0.attn.to_k", attn, bias=True)
    case(args.data, "flux2_tiny", Flux2Transformer2DModel, plain, "proj_out",
         "transformer_blocks.0.attn.to_k", lambda n: attn(n) or "to_qkv_mlp_proj" in n, bias=False)
    case(args.data, "qwenimage_tiny", QwenImageTransformer2DModel,
         lambda m, x: m(**to_diffusers(x), return_dict=False)[0], "img_mlp.net.2",
         "transformer_blocks.1.attn.add_k_proj", attn, bias=False)
    case(args.data, "wan_tiny", WanTransformer3DModel, plain, "ffn.net.2",
         "blocks.0.attn1.to_k", lambda n: ".attn1." in n or ".attn2." in n, bias=False,
         convs=True)
    case(args.data, "h3_tiny", MiniMaxH3Transformer3DModel,
         lambda m, x: m(**x, return_dict=False)[:2], "ff.net.2", "transformer_blocks.0.attn.to_k",
         lambda n: ".attn." in n, bias=False)


if __name__ == "__main__":
    main()
