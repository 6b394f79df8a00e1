#!/usr/bin/env python3
"""Wan golden cases (WanTransformer3DModel) for make_goldens.py; runnable alone for these only.

Randomly initialised diffusers models saved with save_pretrained, inputs drawn here, expected
outputs from diffusers' forward in float32: text-to-video on diffusers' own tiny test config,
per-token timesteps (Wan 2.2 TI2V), an odd case (3 heads, batch 2, odd token grid, a frame
count the temporal patch does not divide, no cross-attention norm), Wan 2.1 image-to-video
(257 image tokens), first-last-frame with pos_embed in bf16 weights over several shards, an FFN
width no TP degree divides (12 heads, ffn_dim 41: the uneven split), and I2V with text lengths
other than 512. diffusers' I2V attention cuts [image | text] (L tokens) at L - 512 as a Python
slice bound, whatever the lengths: the image attention gets the tokens before the cut, the text
attention the rest. wan_i2v and wan_flf2v_bf16 use 512 text tokens (the cut falls between image
and text, as in Wan's pipelines); wan_i2v_txt20 20 (cut at -235: the text attention also sees
the last 215 image tokens), wan_i2v_txt600 600 (the image attention also sees the first 88 text
tokens), wan_flf2v_txt8 8 with 10 image tokens (cut at -494, before the start: no image tokens;
diffusers attends over zero keys, which gives zeros).

usage: python3 scripts/goldens_wan.py [--out tests/data] [--only CASE ...]
"""
import argparse
import os
import sys

import torch


def perturb(model, gen):
    # norm weights start at 1 and LayerNorm biases at 0: make them non-trivial
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and "norm" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=gen))


def seeded(seed):
    return torch.Generator().manual_seed(seed)


def wan_cases(out_dir, only=None):
    """Writes every case, or those named in `only`."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from make_goldens import write_case
    from diffusers import WanTransformer3DModel

    class Reload(WanTransformer3DModel):
        # keeping modules in fp32 needs accelerate to reload; the goldens run in fp32 anyway
        _keep_in_fp32_modules = None

    Wan = WanTransformer3DModel

    def write(name, *args, **kw):
        if only is None or name in only:
            return write_case(out_dir, name, *args, **kw)
        return None  # left out by --only

    # 1. diffusers' tiny test config and inputs: heads 2 x 12, 2 blocks, latent [1, 4, 2, 16, 16]
    #    (128 tokens), 12 text tokens, an integer timestep; each input from a fresh seed-0
    #    generator, as diffusers' tester draws them.
    torch.manual_seed(0)
    cfg = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4,
               out_channels=4, text_dim=16, freq_dim=256, ffn_dim=32, num_layers=2,
               cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32)
    m = Wan(**cfg).eval()
    perturb(m, seeded(10))
    inputs = {
        "hidden_states": torch.randn(1, 4, 2, 16, 16, generator=seeded(0)),
        "encoder_hidden_states": torch.randn(1, 12, 16, generator=seeded(0)),
        "timestep": torch.randint(0, 1000, size=(1,), generator=seeded(0)),
    }
    write("wan_tiny", m, inputs,
          "diffusers tiny Wan test config (T2V); 128 video + 12 text tokens; int64 timestep",
          cls=Reload)

    # 2. Wan 2.2 TI2V: timestep [B, S], the first latent frame's tokens at 0 (the conditioning
    #    image), the rest at each batch element's t; heads 4 x 8, batch 2, 3 x 2 x 3 tokens.
    torch.manual_seed(1)
    gen = seeded(1)
    cfg = dict(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=8, in_channels=6,
               out_channels=6, text_dim=12, freq_dim=32, ffn_dim=48, num_layers=2,
               rope_max_seq_len=16)
    m = Wan(**cfg).eval()
    perturb(m, gen)
    ts = torch.tensor([[0.0] * 6 + [812.0] * 12, [0.0] * 6 + [233.5] * 12])
    inputs = {
        "hidden_states": torch.randn(2, 6, 3, 4, 6, generator=gen),
        "encoder_hidden_states": torch.randn(2, 5, 12, generator=gen),
        "timestep": ts,
    }
    write("wan_ti2v", m, inputs,
          "Wan 2.2 TI2V per-token timestep [2, 18] (first frame 0); heads 4 x 8; batch 2",
          cls=Reload)

    # 3. odd: 3 heads (no TP degree divides them; uneven Ulysses head groups), batch 2 with two
    #    timesteps, patch (2, 1, 2) over 7 frames (the last dropped, as Conv3d does), 3 x 3 x 5 =
    #    45 tokens, 7 text tokens, out_channels 3, no cross-attention norm, eps 1e-5.
    torch.manual_seed(2)
    gen = seeded(2)
    cfg = dict(patch_size=(2, 1, 2), num_attention_heads=3, attention_head_dim=8, in_channels=4,
               out_channels=3, text_dim=10, freq_dim=16, ffn_dim=40, num_layers=2,
               cross_attn_norm=False, eps=1e-5, rope_max_seq_len=8)
    m = Wan(**cfg).eval()
    perturb(m, gen)
    inputs = {
        "hidden_states": torch.randn(2, 4, 7, 3, 10, generator=gen),
        "encoder_hidden_states": torch.randn(2, 7, 10, generator=gen),
        "timestep": torch.tensor([700.5, 31.0]),
    }
    write("wan_odd", m, inputs,
          "3 heads x 8, batch 2, patch (2, 1, 2) over 7 x 3 x 10 (45 tokens), 7 text tokens, "
          "out_channels 3, cross_attn_norm false, eps 1e-5", cls=Reload)

    # 4. Wan 2.1 I2V: image_dim + added_kv_proj_dim, 257 image tokens, 512 text tokens.
    torch.manual_seed(3)
    gen = seeded(3)
    cfg = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=6,
               out_channels=4, text_dim=8, freq_dim=16, ffn_dim=24, num_layers=2,
               image_dim=12, added_kv_proj_dim=16, rope_max_seq_len=16)
    m = Wan(**cfg).eval()
    perturb(m, gen)
    inputs = {
        "hidden_states": torch.randn(1, 6, 3, 4, 6, generator=gen),
        "encoder_hidden_states": torch.randn(1, 512, 8, generator=gen),
        "encoder_hidden_states_image": torch.randn(1, 257, 12, generator=gen),
        "timestep": torch.tensor([640.0]),
    }
    write("wan_i2v", m, inputs,
          "Wan 2.1 I2V: 257 image tokens (image_dim 12, added_kv_proj_dim 16), 512 text "
          "tokens, 18 video tokens", cls=Reload)

    # 5. first-last-frame (pos_embed over two images' tokens) in bf16 weights, 3 shards; heads
    #    4 x 8, batch 2, image input [2B, 5, 12] viewed as [B, 10, 12], 512 text tokens.
    torch.manual_seed(4)
    gen = seeded(4)
    cfg = dict(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=8, in_channels=6,
               out_channels=4, text_dim=8, freq_dim=16, ffn_dim=24, num_layers=2,
               image_dim=12, added_kv_proj_dim=32, pos_embed_seq_len=10, rope_max_seq_len=16)
    m = Wan(**cfg).eval()
    perturb(m, gen)
    with torch.no_grad():
        m.condition_embedder.image_embedder.pos_embed.normal_(generator=gen)
    inputs = {
        "hidden_states": torch.randn(2, 6, 2, 6, 4, generator=gen),
        "encoder_hidden_states": torch.randn(2, 512, 8, generator=gen),
        "encoder_hidden_states_image": torch.randn(4, 5, 12, generator=gen),
        "timestep": torch.tensor([999.0, 450.0]),
    }
    d = write("wan_flf2v_bf16", m, inputs,
              "first-last-frame (pos_embed_seq_len 10), bf16 weights in shards + index; "
              "expected from the bf16 values upcast to f32", dtype=torch.bfloat16,
              max_shard_size="40KB", cls=Reload)
    if d:
        shards = [f for f in os.listdir(d)
                  if f.endswith(".safetensors") and f.startswith("diffusion")]
        assert len(shards) >= 2, shards

    # 6. an FFN width no TP degree > 1 divides: 12 heads x 4 (tp 2, 3, 4, 6, 12 divide the
    #    heads), ffn_dim 41 (prime: tp 2 splits it 21 | 20, tp 3 14 | 14 | 13, tp 4 11 | 10 x 3),
    #    batch 2, 2 x 3 x 4 tokens, 6 text tokens.
    torch.manual_seed(5)
    gen = seeded(5)
    cfg = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=4, in_channels=4,
               out_channels=4, text_dim=8, freq_dim=16, ffn_dim=41, num_layers=2,
               rope_max_seq_len=8)
    m = Wan(**cfg).eval()
    perturb(m, gen)
    inputs = {
        "hidden_states": torch.randn(2, 4, 2, 6, 8, generator=gen),
        "encoder_hidden_states": torch.randn(2, 6, 8, generator=gen),
        "timestep": torch.tensor([420.0, 77.0]),
    }
    write("wan_ffn41", m, inputs,
          "12 heads x 4, ffn_dim 41 (no tp > 1 divides it: uneven FFN split), batch 2, "
          "24 video + 6 text tokens", cls=Reload)

    # 7-9. I2V with a text length other than 512 (one block each, heads 2 x 8 as wan_i2v).
    def i2v(name, seed, n_txt, n_img, batch, note, pos=0):
        torch.manual_seed(seed)
        gen = seeded(seed)
        cfg = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8,
                   in_channels=6, out_channels=4, text_dim=8, freq_dim=16, ffn_dim=24,
                   num_layers=1, image_dim=12, added_kv_proj_dim=16, rope_max_seq_len=16)
        if pos:
            cfg["pos_embed_seq_len"] = pos
        m = Wan(**cfg).eval()
        perturb(m, gen)
        if pos:
            with torch.no_grad():
                m.condition_embedder.image_embedder.pos_embed.normal_(generator=gen)
        inputs = {
            "hidden_states": torch.randn(batch, 6, 2, 4, 6, generator=gen),
            "encoder_hidden_states": torch.randn(batch, n_txt, 8, generator=gen),
            "encoder_hidden_states_image": torch.randn(batch * (2 if pos else 1), n_img, 12,
                                                       generator=gen),
            "timestep": torch.tensor([640.0, 130.0][:batch]),
        }
        write(name, m, inputs, note, cls=Reload)

    i2v("wan_i2v_txt20", 6, 20, 257, 1,
        "I2V, 20 text + 257 image tokens: of the 277 context tokens diffusers' image attention "
        "takes the first 42 (277 - 512 = -235 as a slice end), its text attention the last 235 "
        "(215 image + 20 text)")
    i2v("wan_i2v_txt600", 7, 600, 257, 2,
        "I2V, 600 text + 257 image tokens, batch 2: diffusers' image attention takes the first "
        "345 context tokens (257 image + 88 text), its text attention the last 512")
    i2v("wan_flf2v_txt8", 8, 8, 5, 1,
        "first-last-frame, 8 text + 10 image tokens: diffusers' split leaves its image "
        "attention no tokens (zeros); all 18 context tokens go to the text attention", pos=10)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "data"))
    ap.add_argument("--only", nargs="*", help="write only these cases")
    torch.set_grad_enabled(False)
    args = ap.parse_args()
    wan_cases(args.out, set(args.only) if args.only else None)
