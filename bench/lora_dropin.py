"""The drop-in's LoRA calls on the medium Flux config: what load_lora_adapter and the first
fuse cost against the checkpoint's own start, and the fused step against the base step.

    .venv/bin/python bench/lora_dropin.py [--rank 64] [--rounds 5] [--tp 1]

A random rank-R adapter in peft form on every linear weight of the medium Flux preset (bf16
factors), loaded through `t.load_lora_adapter` (diffusers' state dict handling, the blob sent,
each rank's slices read) on a drop-in started here; the first forward after set_adapters fuses
it (`t.stats["lora_fuse_seconds"]`, outside `step_seconds`). Step times are the server's
`step_seconds`, base and fused alternating (disable_lora / enable_lora between them: each turn
pays a fuse, which is not in the step). Also the probe's cost per forward (the coefficients
peft gives, in this process). One thread per rank; OPENBLAS_CORETYPE unset.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ["OPENBLAS_NUM_THREADS"] = "1"
os.environ.pop("OPENBLAS_CORETYPE", None)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))
BIN = os.environ.setdefault("MESHDIT_BIN", os.path.join(ROOT, "build", "meshdit"))

import torch  # noqa: E402

import meshdit  # noqa: E402
from meshdit import _lora  # noqa: E402


def linears(ckpt):
    """(module, out, in) of every 2-D weight of the checkpoint (Flux: all linears)."""
    names = [f for f in os.listdir(ckpt) if f.endswith(".safetensors")]
    out = []
    for f in names:
        with open(os.path.join(ckpt, f), "rb") as fh:
            head = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        out += [(k[:-len(".weight")], *v["shape"]) for k, v in head.items()
                if k.endswith(".weight") and len(v.get("shape", [])) == 2]
    return sorted(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--img", type=int, default=1024)
    ap.add_argument("--txt", type=int, default=256)
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="mdt_lora_bench_")
    ckpt = os.path.join(tmp, "medium")
    subprocess.run([BIN, "gen", "--model", "flux", "--preset", "medium", "--dtype", "bf16",
                    "--out", ckpt], check=True, capture_output=True)
    inputs = os.path.join(tmp, "in.safetensors")
    subprocess.run([BIN, "inputs", "--checkpoint", ckpt, "--out", inputs, "--img-tokens",
                    str(a.img), "--txt-tokens", str(a.txt)], check=True, capture_output=True)
    from safetensors.torch import load_file
    x = load_file(inputs)
    g = torch.Generator().manual_seed(0)
    sd = {}
    for mod, o, i in linears(ckpt):
        sd[f"transformer.{mod}.lora_A.weight"] = (0.01 * torch.randn(a.rank, i, generator=g)).bfloat16()
        sd[f"transformer.{mod}.lora_B.weight"] = (0.01 * torch.randn(o, a.rank, generator=g)).bfloat16()
    factor_bytes = sum(v.numel() * 2 for v in sd.values())
    t0 = time.perf_counter()
    t = meshdit.Transformer.from_pretrained(ckpt, tp=a.tp)
    start_s = time.perf_counter() - t0
    with t, torch.no_grad():
        t(**x)  # warm
        t0 = time.perf_counter()
        t.load_lora_adapter(dict(sd), adapter_name="bench")
        load_s = time.perf_counter() - t0
        t(**x)
        first_fuse = t.stats["lora_fuse_seconds"][-1]
        base, fused = [], []
        for _ in range(a.rounds):
            t.disable_lora()
            t(**x)
            base.append(t.stats["step_seconds"][-1])
            t.enable_lora()
            t(**x)
            fused.append(t.stats["step_seconds"][-1])
        probe = []
        for _ in range(200):
            t0 = time.perf_counter()
            _lora.lora_value(t)
            probe.append(time.perf_counter() - t0)
        mb, mf = statistics.median(base), statistics.median(fused)
        print(f"medium Flux, tp={a.tp}, rank-{a.rank} adapter on {len(sd) // 2} linears "
              f"({factor_bytes / 1e6:.1f} MB bf16), {a.img}+{a.txt} tokens")
        print(f"from_pretrained (server start + checkpoint load): {start_s:.3f} s")
        print(f"load_lora_adapter (blob built, sent, slices read): {load_s:.3f} s")
        print(f"first fuse (in the first forward after the load): {first_fuse:.3f} s")
        print(f"fuse per disable/enable turn, median: "
              f"{statistics.median(t.stats['lora_fuse_seconds'][1:]):.3f} s")
        print(f"step, median of {a.rounds} alternating: base {mb:.4f} s, fused {mf:.4f} s "
              f"({100 * (mf / mb - 1):+.2f}%)")
        print(f"probe (the lora value of a forward), median: {1e6 * statistics.median(probe):.0f} us")


if __name__ == "__main__":
    main()
