"""Flux.2 golden cases (diffusers' Flux2Transformer2DModel), called by make_goldens.py.

Five cases, < 1 MB together: diffusers' own tiny test config and inputs; guidance with batch 2,
odd token counts, a non-integer mlp_ratio, rope_theta 10000 and 3-D float ids whose second
batch entry differs (diffusers uses batch 0); 3 heads (no TP degree > 1 divides them, uneven
Ulysses head groups) without guidance embeds (the FLUX.2 [klein] form); bf16 weights in
several shards with an index; an MLP width (95) no TP degree divides (the uneven split).
"""
import os

import torch
from diffusers import Flux2Transformer2DModel


def _ids(n_img, n_txt, width):
    """(t, h, w, l) ids as Flux2Pipeline builds them: image (0, row, col, 0), text (0, 0, 0, l)."""
    img = torch.zeros(n_img, 4)
    for s in range(n_img):
        img[s, 1], img[s, 2] = s // width, s % width
    txt = torch.zeros(n_txt, 4)
    txt[:, 3] = torch.arange(n_txt, dtype=torch.float32)
    return img, txt


def flux2_cases(out_dir):
    import make_goldens as mg  # write_case, perturb_norms (make_goldens imports this module)

    cls = Flux2Transformer2DModel

    # 1. diffusers' tiny test config and dummy inputs: heads 2 x 16, axes [4, 4, 4, 4], 1 + 1
    #    blocks, guidance embeds; 16 image (4 x 4) + 48 text tokens, batch 1; 3-D int64 ids.
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    cfg = dict(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
               attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
               timestep_guidance_channels=256, axes_dims_rope=[4, 4, 4, 4])
    m = cls(**cfg).eval()
    mg.perturb_norms(m, gen)
    img = torch.cartesian_prod(torch.arange(1), torch.arange(4), torch.arange(4), torch.arange(1))
    txt = torch.cartesian_prod(torch.arange(1), torch.arange(1), torch.arange(1), torch.arange(48))
    inputs = {
        "hidden_states": torch.randn(1, 16, 4, generator=gen),
        "encoder_hidden_states": torch.randn(1, 48, 32, generator=gen),
        "img_ids": img.unsqueeze(0),
        "txt_ids": txt.unsqueeze(0),
        "timestep": torch.tensor([1.0]),
        "guidance": torch.tensor([1.0]),
    }
    mg.write_case(out_dir, "flux2_tiny", m, inputs,
                  "diffusers tiny Flux.2 test config and dummy inputs (int64 3-D ids); "
                  "timestep 1.0, guidance 1.0", cls=cls)

    # 2. guidance, batch 2, heads 4 x 8, 1 + 2 blocks, mlp_ratio 2.5 (MLP width 80), rope_theta
    #    10000, 29 image + 7 text tokens; 3-D float ids, batch 1 differs from batch 0.
    torch.manual_seed(1)
    gen = torch.Generator().manual_seed(1)
    cfg = dict(patch_size=1, in_channels=8, num_layers=1, num_single_layers=2,
               attention_head_dim=8, num_attention_heads=4, joint_attention_dim=24,
               timestep_guidance_channels=32, mlp_ratio=2.5, axes_dims_rope=[2, 2, 2, 2],
               rope_theta=10000, guidance_embeds=True)
    m = cls(**cfg).eval()
    mg.perturb_norms(m, gen)
    img, txt = _ids(29, 7, 6)
    inputs = {
        "hidden_states": torch.randn(2, 29, 8, generator=gen),
        "encoder_hidden_states": torch.randn(2, 7, 24, generator=gen),
        "img_ids": torch.stack([img, img + 5.0]),
        "txt_ids": torch.stack([txt, txt + 5.0]),
        "timestep": torch.tensor([0.7, 0.3]),
        "guidance": torch.tensor([4.0, 2.5]),
    }
    mg.write_case(out_dir, "flux2_guidance", m, inputs,
                  "guidance, batch 2, heads 4 x 8, 1+2 blocks, mlp_ratio 2.5, rope_theta 1e4, "
                  "29 image + 7 text tokens, 3-D float ids (batch 0 used)", cls=cls)

    # 3. 3 heads x 8 (tp 2 and 4 do not divide them; Ulysses groups uneven), no guidance embeds
    #    (klein), 2 + 1 blocks, mlp_ratio 2, 37 image + 11 text tokens, 2-D ids with a time axis.
    torch.manual_seed(2)
    gen = torch.Generator().manual_seed(2)
    cfg = dict(patch_size=1, in_channels=4, num_layers=2, num_single_layers=1,
               attention_head_dim=8, num_attention_heads=3, joint_attention_dim=20,
               timestep_guidance_channels=16, mlp_ratio=2.0, axes_dims_rope=[2, 2, 2, 2],
               guidance_embeds=False)
    m = cls(**cfg).eval()
    mg.perturb_norms(m, gen)
    img, txt = _ids(37, 11, 7)
    img[20:, 0] = 10.0  # a second image (reference latents at t = 10), as Flux2Pipeline does
    inputs = {
        "hidden_states": torch.randn(1, 37, 4, generator=gen),
        "encoder_hidden_states": torch.randn(1, 11, 20, generator=gen),
        "img_ids": img,
        "txt_ids": txt,
        "timestep": torch.tensor([0.45]),
    }
    mg.write_case(out_dir, "flux2_heads3", m, inputs,
                  "heads 3 x 8, no guidance embeds, 2+1 blocks, 37 image + 11 text tokens, "
                  "2-D ids", cls=cls)

    # 4. bf16 weights in several shards with an index; expected from the bf16 values in f32.
    torch.manual_seed(3)
    gen = torch.Generator().manual_seed(3)
    cfg = dict(patch_size=1, in_channels=4, num_layers=1, num_single_layers=2,
               attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
               timestep_guidance_channels=32, axes_dims_rope=[2, 2, 2, 2])
    m = cls(**cfg).eval()
    mg.perturb_norms(m, gen)
    img, txt = _ids(24, 8, 5)
    inputs = {
        "hidden_states": torch.randn(1, 24, 4, generator=gen),
        "encoder_hidden_states": torch.randn(1, 8, 16, generator=gen),
        "img_ids": img,
        "txt_ids": txt,
        "timestep": torch.tensor([0.5]),
        "guidance": torch.tensor([3.5]),
    }
    d = mg.write_case(out_dir, "flux2_bf16_sharded", m, inputs,
                      "bf16 weights in shards + index; expected from the bf16 values upcast to f32",
                      dtype=torch.bfloat16, max_shard_size="20KB", cls=cls)
    if d:
        shards = [f for f in os.listdir(d)
                  if f.endswith(".safetensors") and f.startswith("diffusion")]
        assert len(shards) >= 2, shards

    # 5. an MLP width no TP degree > 1 divides: heads 4 x 8, mlp_ratio 2.97 (int(32 x 2.97) = 95;
    #    tp 2: 48 | 47 of each SwiGLU half, tp 4: 24 | 24 | 24 | 23), 1 + 1 blocks, guidance.
    torch.manual_seed(4)
    gen = torch.Generator().manual_seed(4)
    cfg = dict(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
               attention_head_dim=8, num_attention_heads=4, joint_attention_dim=16,
               timestep_guidance_channels=32, mlp_ratio=2.97, axes_dims_rope=[2, 2, 2, 2])
    m = cls(**cfg).eval()
    mg.perturb_norms(m, gen)
    img, txt = _ids(15, 6, 5)
    inputs = {
        "hidden_states": torch.randn(1, 15, 4, generator=gen),
        "encoder_hidden_states": torch.randn(1, 6, 16, generator=gen),
        "img_ids": img,
        "txt_ids": txt,
        "timestep": torch.tensor([0.6]),
        "guidance": torch.tensor([3.0]),
    }
    mg.write_case(out_dir, "flux2_mlp95", m, inputs,
                  "heads 4 x 8, mlp_ratio 2.97: MLP width 95 (no tp > 1 divides it: uneven "
                  "SwiGLU split), 1+1 blocks, 15 image + 6 text tokens", cls=cls)
