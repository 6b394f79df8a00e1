#!/usr/bin/env python3
"""Golden cases from diffusers itself, for meshdit's numerical tests.

Builds randomly initialised diffusers FluxTransformer2DModel instances, saves them with
save_pretrained (the real diffusers checkpoint layout), draws inputs, runs diffusers' forward in
float32, and writes tests/data/<case>/{config.json, weights, inputs.safetensors,
expected.safetensors, versions.txt}. Needs a venv with torch, diffusers and safetensors
(CI never runs this; the outputs are committed, < 2 MB in all).

usage: python3 scripts/make_goldens.py [--out tests/data] [--only CASE ...]
"""
import argparse
import json
import os
import shutil
import sys

import torch
import diffusers
import safetensors
from diffusers import FluxTransformer2DModel, MiniMaxH3Transformer3DModel
from safetensors.torch import save_file
# the case modules `import make_goldens`: let that be this module when run as a script, so they
# share its --only filter (ONLY)
sys.modules.setdefault("make_goldens", sys.modules[__name__])

from goldens_qwenimage import qwenimage_cases  # noqa: E402

from goldens_flux2 import flux2_cases  # noqa: E402

from goldens_wan import wan_cases  # noqa: E402


def perturb_norms(model, gen):
    # RMSNorm weights start at 1; make them non-trivial so a wrong weight use shows.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and "norm" in name and name.endswith("weight"):
                p.add_(0.1 * torch.randn(p.shape, generator=gen))


def grid_ids(n, naxes=3):
    w = int(-(-n ** 0.5 // 1))
    ids = torch.zeros(n, naxes)
    for s in range(n):
        ids[s, 1] = s // w
        ids[s, 2] = s % w
    return ids


def euler(model, inputs, steps):
    """Flow-matching Euler over sigmas 1 -> 0, as `meshdit run --steps N` does."""
    x = inputs["hidden_states"].clone()
    b = x.shape[0]
    for i in range(steps):
        sig, nxt = 1.0 - i / steps, 1.0 - (i + 1) / steps
        kw = dict(inputs)
        kw["hidden_states"] = x
        kw["timestep"] = torch.full((b,), sig, dtype=torch.float32)
        v = model(**kw, return_dict=False)[0]
        x = x + (nxt - sig) * v
    return x


# --only: the case names to write (None: every case); the others are skipped, their files kept.
ONLY = None


def write_case(out_dir, name, model, inputs, note, dtype=None, max_shard_size=None, steps=0,
               cls=FluxTransformer2DModel, to_ref=dict):
    """Writes case `name` (returns its directory), or nothing when --only leaves it out (None).
    to_ref maps the saved inputs to diffusers' forward arguments (its lists, its flags)."""
    if ONLY is not None and name not in ONLY:
        return None
    d = os.path.join(out_dir, name)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    if dtype is not None:
        model = model.to(dtype)
    kw = {"safe_serialization": True}
    if max_shard_size:
        kw["max_shard_size"] = max_shard_size
    model.save_pretrained(d, **kw)
    # Reload exactly what was saved and run it in float32 (bf16 values upcast, not re-rounded).
    ref = cls.from_pretrained(d, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        outs = ref(**to_ref(inputs), return_dict=False)
        expected = {"sample": outs[0].contiguous()}
        if cls is MiniMaxH3Transformer3DModel:
            expected["audio_sample"] = outs[1].contiguous()
        if steps:
            expected_steps = {"sample": euler(ref, inputs, steps).contiguous()}
    save_file({k: v.contiguous() for k, v in inputs.items()}, os.path.join(d, "inputs.safetensors"))
    save_file(expected, os.path.join(d, "expected.safetensors"))
    if steps:
        save_file(expected_steps, os.path.join(d, f"expected_steps{steps}.safetensors"))
    with open(os.path.join(d, "versions.txt"), "w") as fp:
        fp.write(f"diffusers {diffusers.__version__}\ntorch {torch.__version__}\n"
                 f"safetensors {safetensors.__version__}\npython {sys.version.split()[0]}\n{note}\n")
    files = sorted(os.listdir(d))
    print(f"{name}: {files}")
    return d


def controlnet_to_diffusers(inputs):
    """meshdit's ControlNet residuals [B, N, S_img, C] as diffusers' lists of N [B, S_img, C], and
    controlnet_blocks_repeat as the bool the pipelines pass."""
    kw = dict(inputs)
    for k in ("controlnet_block_samples", "controlnet_single_block_samples"):
        if k in kw:
            kw[k] = list(kw[k].unbind(1))
    if "controlnet_blocks_repeat" in kw:
        kw["controlnet_blocks_repeat"] = bool(kw["controlnet_blocks_repeat"].item())
    return kw


def flux_controlnet_cases(out_dir):
    # ControlNet residuals: N per stack as one tensor [B, N, S_img, C] (docs/models.md). 3 double
    # blocks with 2 residuals (ceil(3/2) = 2: blocks 0, 1 read residual 0, block 2 residual 1)
    # and 5 single blocks with 3 (0, 0, 1, 1, 2); guidance, batch 2, heads 4 x 8, 23 image and
    # 7 text tokens (odd, so CP chunks differ); residuals at half the stream's scale.
    torch.manual_seed(5)
    gen = torch.Generator().manual_seed(5)
    cfg = dict(patch_size=1, in_channels=8, num_layers=3, num_single_layers=5,
               attention_head_dim=8, num_attention_heads=4, joint_attention_dim=24,
               pooled_projection_dim=16, guidance_embeds=True, axes_dims_rope=[2, 2, 4])
    m = FluxTransformer2DModel(**cfg).eval()
    perturb_norms(m, gen)
    txt_ids = torch.zeros(7, 3)
    txt_ids[:, 0] = torch.arange(7, dtype=torch.float32)
    inputs = {
        "hidden_states": torch.randn(2, 23, 8, generator=gen),
        "encoder_hidden_states": torch.randn(2, 7, 24, generator=gen),
        "pooled_projections": torch.randn(2, 16, generator=gen),
        "img_ids": grid_ids(23),
        "txt_ids": txt_ids,
        "timestep": torch.tensor([0.8, 0.4]),
        "guidance": torch.tensor([3.5, 2.0]),
        "controlnet_block_samples": 0.5 * torch.randn(2, 2, 23, 32, generator=gen),
        "controlnet_single_block_samples": 0.5 * torch.randn(2, 3, 23, 32, generator=gen),
    }
    write_case(out_dir, "flux_controlnet", m, inputs,
               "ControlNet residuals: 3 double blocks with 2, 5 single with 3 ([B, N, S_img, C]); "
               "guidance, batch 2, heads 4 x 8, 23 image + 7 text tokens",
               to_ref=controlnet_to_diffusers)
    # XLabs' repeated residuals (controlnet_blocks_repeat): 3 double blocks read 0, 1, 0 of 2; no
    # single-block residuals; batch 1, 2 heads x 16, 13 image + 5 text tokens.
    torch.manual_seed(6)
    gen = torch.Generator().manual_seed(6)
    cfg = dict(patch_size=1, in_channels=4, num_layers=3, num_single_layers=1,
               attention_head_dim=16, num_attention_heads=2, joint_attention_dim=16,
               pooled_projection_dim=16, axes_dims_rope=[4, 4, 8])
    m = FluxTransformer2DModel(**cfg).eval()
    perturb_norms(m, gen)
    inputs = {
        "hidden_states": torch.randn(1, 13, 4, generator=gen),
        "encoder_hidden_states": torch.randn(1, 5, 16, generator=gen),
        "pooled_projections": torch.randn(1, 16, generator=gen),
        "img_ids": grid_ids(13),
        "txt_ids": torch.zeros(5, 3),
        "timestep": torch.tensor([0.6]),
        "controlnet_block_samples": 0.5 * torch.randn(1, 2, 13, 32, generator=gen),
        "controlnet_blocks_repeat": torch.tensor([True]),
    }
    write_case(out_dir, "flux_controlnet_repeat", m, inputs,
               "XLabs ControlNet residuals repeated (controlnet_blocks_repeat): 3 double blocks "
               "read residuals 0, 1, 0 of 2; batch 1, heads 2 x 16, 13 image + 5 text tokens",
               to_ref=controlnet_to_diffusers)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "data"))
    ap.add_argument("--only", nargs="*", help="write only these cases (the others stay as they are)")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    global ONLY
    ONLY = set(args.only) if args.only else None

    # 1. diffusers' own tiny test config: heads 2 x 16, axes [4,4,8], 1+1 layers, 16 image + 48
    #    text tokens, batch 1, random-normal ids (like diffusers' tester), timestep 1.0.
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    cfg = dict(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
               attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
               pooled_projection_dim=32, axes_dims_rope=[4, 4, 8])
    m = FluxTransformer2DModel(**cfg).eval()
    perturb_norms(m, gen)
    inputs = {
        "hidden_states": torch.randn(1, 16, 4, generator=gen),
        "encoder_hidden_states": torch.randn(1, 48, 32, generator=gen),
        "pooled_projections": torch.randn(1, 32, generator=gen),
        "img_ids": torch.randn(16, 3, generator=gen),
        "txt_ids": torch.randn(48, 3, generator=gen),
        "timestep": torch.tensor([1.0]),
    }
    write_case(args.out, "flux_tiny", m, inputs,
               "diffusers tiny Flux test config; ids random normal; timestep 1.0; "
               "expected_steps2 = 2-step flow-matching Euler", steps=2)

    # 2. guidance embeds, batch 2, heads 4 x 8, 2+2 layers, odd token counts (37 image, 11 text).
    torch.manual_seed(1)
    gen = torch.Generator().manual_seed(1)
    cfg = dict(patch_size=1, in_channels=8, num_layers=2, num_single_layers=2,
               attention_head_dim=8, num_attention_heads=4, joint_attention_dim=24,
               pooled_projection_dim=16, guidance_embeds=True, axes_dims_rope=[2, 2, 4])
    m = FluxTransformer2DModel(**cfg).eval()
    perturb_norms(m, gen)
    txt_ids = torch.zeros(11, 3)
    txt_ids[:, 0] = torch.arange(11, dtype=torch.float32)
    inputs = {
        "hidden_states": torch.randn(2, 37, 8, generator=gen),
        "encoder_hidden_states": torch.randn(2, 11, 24, generator=gen),
        "pooled_projections": torch.randn(2, 16, generator=gen),
        "img_ids": grid_ids(37),
        "txt_ids": txt_ids,
        "timestep": torch.tensor([0.7, 0.3]),
        "guidance": torch.tensor([3.5, 2.0]),
    }
    write_case(args.out, "flux_guidance", m, inputs,
               "guidance_embeds, batch 2, heads 4 x 8, 2+2 layers, 37 image + 11 text tokens")

    # 3. bf16 weights saved as 2 shards with an index; expected = diffusers on the same bf16
    #    values upcast to float32.
    torch.manual_seed(2)
    gen = torch.Generator().manual_seed(2)
    cfg = dict(patch_size=1, in_channels=4, num_layers=1, num_single_layers=2,
               attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
               pooled_projection_dim=32, axes_dims_rope=[4, 4, 8])
    m = FluxTransformer2DModel(**cfg).eval()
    perturb_norms(m, gen)
    inputs = {
        "hidden_states": torch.randn(1, 24, 4, generator=gen),
        "encoder_hidden_states": torch.randn(1, 8, 32, generator=gen),
        "pooled_projections": torch.randn(1, 32, generator=gen),
        "img_ids": grid_ids(24),
        "txt_ids": torch.zeros(8, 3),
        "timestep": torch.tensor([0.5]),
    }
    d = write_case(args.out, "flux_bf16_sharded", m, inputs,
                   "bf16 weights in 2 shards + index; expected from the bf16 values upcast to f32",
                   dtype=torch.bfloat16, max_shard_size="100KB")
    if d:
        shards = [f for f in os.listdir(d)
                  if f.endswith(".safetensors") and f.startswith("diffusion")]
        assert len(shards) == 2, shards
        with open(os.path.join(d, "diffusion_pytorch_model.safetensors.index.json")) as fp:
            assert len(set(json.load(fp)["weight_map"].values())) == 2

    flux_controlnet_cases(args.out)
    h3_cases(args.out)
    flux2_cases(args.out)
    if ONLY is None or any(c.startswith("qwenimage") for c in ONLY):
        qwenimage_cases(args.out)
    wan_cases(args.out, ONLY)


def h3_layout(segments, timesteps):
    """Packed MiniMax-H3 layout from (modality, timestep index, rows) segments in sequence order:
    modality 0 video, 1 text, 2 audio. Video rows get (t, h, w) = (row, i mod 4, i mod 2) with i
    their index among video rows; other rows (row, 0, 0)."""
    tags, tidx, vid, aud, txt = [], [], [], [], []
    for mod, ti, n in segments:
        for _ in range(n):
            row = len(tags)
            tags.append(mod)
            tidx.append(ti)
            (vid if mod == 0 else txt if mod == 1 else aud).append(row)
    S = len(tags)
    pos = torch.zeros(S, 3, dtype=torch.long)
    pos[:, 0] = torch.arange(S)
    for i, row in enumerate(vid):
        pos[row, 1] = i % 4
        pos[row, 2] = i % 2
    L = lambda v: torch.tensor(v, dtype=torch.long)
    return dict(timestep=torch.tensor(timesteps, dtype=torch.float32), timestep_indices=L(tidx),
                token_tags=L(tags), position_ids=pos, video_indices=L(vid), audio_indices=L(aud),
                text_indices=L(txt))


def h3_cases(out_dir):
    # 4. MiniMax-H3, diffusers' tiny test config: 4 text + 6 audio + 8 video = 18 rows, batch 2,
    #    timesteps [0.7, 0.3] (audio rows at index 1), latents drawn from one generator (video,
    #    audio, text).
    torch.manual_seed(3)
    gen = torch.Generator().manual_seed(0)
    cfg = dict(num_attention_heads=2, attention_head_dim=16, hidden_size=24, num_layers=2,
               num_refiner_layers=2, ffn_dim=32, in_channels=4, audio_in_channels=6,
               patch_size=(1, 2, 2), text_dim=8, freq_dim=8, time_embed_hidden_dim=24,
               time_embed_dim=16, rope_freq_dim=2)
    m = MiniMaxH3Transformer3DModel(**cfg).eval()
    perturb_norms(m, torch.Generator().manual_seed(3))
    inputs = {
        "hidden_states": torch.randn(2, 8, 16, generator=gen),
        "audio_hidden_states": torch.randn(2, 6, 6, generator=gen),
        "encoder_hidden_states": torch.randn(2, 4, 8, generator=gen),
    }
    inputs.update(h3_layout([(1, 0, 4), (2, 1, 6), (0, 0, 8)], [0.7, 0.3]))
    write_case(out_dir, "h3_tiny", m, inputs,
               "diffusers tiny MiniMax-H3 test config; S = 18 packed rows; batch 2",
               cls=MiniMaxH3Transformer3DModel)

    # 5. heads 8 (TP=2 x U=4 valid), adaln_proj ~42% of the weights, packed length 23 (not
    #    divisible by 4 or 8), modalities interleaved: text, conditioning video, audio, target
    #    video; three timesteps.
    torch.manual_seed(4)
    gen = torch.Generator().manual_seed(4)
    cfg = dict(num_attention_heads=8, attention_head_dim=8, hidden_size=32, num_layers=2,
               num_refiner_layers=1, ffn_dim=48, in_channels=4, audio_in_channels=6,
               patch_size=(1, 2, 2), text_dim=8, freq_dim=8, time_embed_hidden_dim=24,
               time_embed_dim=16, rope_freq_dim=1)
    m = MiniMaxH3Transformer3DModel(**cfg).eval()
    perturb_norms(m, torch.Generator().manual_seed(4))
    inputs = {
        "hidden_states": torch.randn(1, 11, 16, generator=gen),
        "audio_hidden_states": torch.randn(1, 7, 6, generator=gen),
        "encoder_hidden_states": torch.randn(1, 5, 8, generator=gen),
    }
    inputs.update(h3_layout([(1, 0, 5), (0, 0, 5), (2, 1, 7), (0, 2, 6)], [0.9, 0.5, 0.2]))
    write_case(out_dir, "h3_heads8", m, inputs,
               "MiniMax-H3 heads 8 x 8, 2 blocks + 1 refiner, S = 23 rows interleaved, "
               "three timesteps", cls=MiniMaxH3Transformer3DModel)

    # 6. an FFN width no TP degree > 1 divides: heads 4 x 8, ffn_dim 45 (tp 2: 23 | 22 of each
    #    SwiGLU half, tp 4: 12 | 11 x 3), 1 block + 1 refiner, S = 14 rows, batch 2.
    torch.manual_seed(5)
    gen = torch.Generator().manual_seed(5)
    cfg = dict(num_attention_heads=4, attention_head_dim=8, hidden_size=24, num_layers=1,
               num_refiner_layers=1, ffn_dim=45, in_channels=4, audio_in_channels=6,
               patch_size=(1, 2, 2), text_dim=8, freq_dim=8, time_embed_hidden_dim=24,
               time_embed_dim=16, rope_freq_dim=1)
    m = MiniMaxH3Transformer3DModel(**cfg).eval()
    perturb_norms(m, torch.Generator().manual_seed(5))
    inputs = {
        "hidden_states": torch.randn(2, 6, 16, generator=gen),
        "audio_hidden_states": torch.randn(2, 5, 6, generator=gen),
        "encoder_hidden_states": torch.randn(2, 3, 8, generator=gen),
    }
    inputs.update(h3_layout([(1, 0, 3), (2, 1, 5), (0, 0, 6)], [0.8, 0.4]))
    write_case(out_dir, "h3_ffn45", m, inputs,
               "MiniMax-H3 heads 4 x 8, ffn_dim 45 (no tp > 1 divides it: uneven SwiGLU split), "
               "1 block + 1 refiner, S = 14 rows, batch 2", cls=MiniMaxH3Transformer3DModel)


if __name__ == "__main__":
    main()
