"""Qwen-Image golden cases (diffusers' QwenImageTransformer2DModel), called by make_goldens.py.

diffusers' forward takes `img_shapes` as a Python list; meshdit's inputs file holds it as an
int64 tensor [B, n, 3] (element b's images, each (frames, height, width) in patches), which
`to_diffusers` turns back into the list of lists of tuples the pipelines pass. The text mask is
saved as given (int64 or bool); diffusers and meshdit both read any nonzero as "attended".
"""
import os
import shutil
import sys

import torch
import diffusers
import safetensors
from diffusers import QwenImageTransformer2DModel
from safetensors.torch import save_file


def _perturb_norms(model, gen):
    # RMSNorm weights start at 1; make them non-trivial so a wrong weight use shows.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and "norm" in name and name.endswith("weight"):
                p.add_(0.1 * torch.randn(p.shape, generator=gen))


def to_diffusers(inputs):
    kw = dict(inputs)
    kw["img_shapes"] = [[tuple(int(v) for v in img) for img in el] for el in kw["img_shapes"]]
    if "controlnet_block_samples" in kw:  # meshdit's [B, N, S_img, C]: diffusers' list of N
        kw["controlnet_block_samples"] = list(kw["controlnet_block_samples"].unbind(1))
    return kw


def _euler(model, inputs, steps):
    """Flow-matching Euler over sigmas 1 -> 0, as `meshdit run --steps N` does: the rows of the
    first image of img_shapes only; the rows after it (an edit's condition images, which
    Qwen-Image-Edit's pipelines append to the latents) stay as given, as the pipelines keep them.
    Under use_layer3d_rope every image but the last (QwenImageLayeredPipeline's input image)."""
    x = inputs["hidden_states"].clone()
    shapes = inputs["img_shapes"][0]
    if model.config.use_layer3d_rope:
        n0 = x.shape[1] - int(torch.prod(shapes[-1]))
    else:
        n0 = int(torch.prod(shapes[0]))
    for i in range(steps):
        sig, nxt = 1.0 - i / steps, 1.0 - (i + 1) / steps
        kw = to_diffusers(inputs)
        kw["hidden_states"] = x
        kw["timestep"] = torch.full((x.shape[0],), sig, dtype=torch.float32)
        v = model(**kw, return_dict=False)[0]
        x[:, :n0] = x[:, :n0] + (nxt - sig) * v[:, :n0]
    return x


def write_qwen_case(out_dir, name, model, inputs, note, dtype=None, max_shard_size=None, steps=0):
    """Writes case `name` (returns its directory), or nothing when make_goldens' --only leaves it
    out (None): the other cases' files stay as they are (torch's kernels may round otherwise)."""
    import make_goldens
    if make_goldens.ONLY is not None and name not in make_goldens.ONLY:
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
    ref = QwenImageTransformer2DModel.from_pretrained(d, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        save_file({"sample": ref(**to_diffusers(inputs), return_dict=False)[0].contiguous()},
                  os.path.join(d, "expected.safetensors"))
        if steps:
            save_file({"sample": _euler(ref, inputs, steps).contiguous()},
                      os.path.join(d, f"expected_steps{steps}.safetensors"))
    save_file({k: v.contiguous() for k, v in inputs.items()}, os.path.join(d, "inputs.safetensors"))
    with open(os.path.join(d, "versions.txt"), "w") as fp:
        fp.write(f"diffusers {diffusers.__version__}\ntorch {torch.__version__}\n"
                 f"safetensors {safetensors.__version__}\npython {sys.version.split()[0]}\n{note}\n")
    print(f"{name}: {sorted(os.listdir(d))}")
    return d


def _shapes(batch, images):
    return torch.tensor([images] * batch, dtype=torch.long)


def qwenimage_cases(out_dir):
    # 1. diffusers' tiny test config (patch 2, 16 -> 4 channels, 2 blocks, head_dim 16, axes
    #    (8, 4, 4), joint 16) with 2 heads instead of 4 (weights < 400 KB), and its dummy inputs:
    #    a 4 x 4 latent grid, 8 text tokens with an all-ones int64 mask, timestep 1.0.
    torch.manual_seed(10)
    gen = torch.Generator().manual_seed(10)
    cfg = dict(patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
               num_attention_heads=2, joint_attention_dim=16, guidance_embeds=False,
               axes_dims_rope=(8, 4, 4))
    m = QwenImageTransformer2DModel(**cfg).eval()
    _perturb_norms(m, gen)
    inputs = {
        "hidden_states": torch.randn(1, 16, 16, generator=gen),
        "encoder_hidden_states": torch.randn(1, 8, 16, generator=gen),
        "encoder_hidden_states_mask": torch.ones(1, 8, dtype=torch.long),
        "timestep": torch.tensor([1.0]),
        "img_shapes": _shapes(1, [[1, 4, 4]]),
    }
    write_qwen_case(out_dir, "qwenimage_tiny", m, inputs,
                    "diffusers tiny Qwen-Image test config with 2 heads; its dummy inputs "
                    "(4 x 4 grid, 8 text tokens, all-ones mask); expected_steps2 = 2-step Euler",
                    steps=2)

    # 2. text padding: batch 3 with three different bool masks (non-contiguous; all padding;
    #    a padded tail), 3 heads (no TP or Ulysses degree 2 or 4 divides them), odd token counts
    #    (a 3 x 5 grid, 7 text tokens), three timesteps.
    torch.manual_seed(11)
    gen = torch.Generator().manual_seed(11)
    cfg = dict(patch_size=2, in_channels=8, out_channels=2, num_layers=2, attention_head_dim=8,
               num_attention_heads=3, joint_attention_dim=12, axes_dims_rope=(2, 2, 4))
    m = QwenImageTransformer2DModel(**cfg).eval()
    _perturb_norms(m, gen)
    mask = torch.tensor([[1, 1, 0, 1, 1, 1, 0], [0] * 7, [1, 1, 1, 0, 0, 0, 0]], dtype=torch.bool)
    inputs = {
        "hidden_states": torch.randn(3, 15, 8, generator=gen),
        "encoder_hidden_states": torch.randn(3, 7, 12, generator=gen),
        "encoder_hidden_states_mask": mask,
        "timestep": torch.tensor([0.9, 0.5, 0.2]),
        "img_shapes": _shapes(3, [[1, 3, 5]]),
    }
    write_qwen_case(out_dir, "qwenimage_mask", m, inputs,
                    "batch 3, bool text masks per element (non-contiguous, all padding, tail), "
                    "3 heads x 8, 2 blocks, 15 image + 7 text tokens")

    # 3. bf16 weights in 2 shards + index; batch 2 sharing one padded int64 mask; two images per
    #    element (Qwen-Image-Edit style img_shapes: 3 x 4 then 2 x 3), 4 heads x 8, 1 block.
    torch.manual_seed(12)
    gen = torch.Generator().manual_seed(12)
    cfg = dict(patch_size=2, in_channels=8, out_channels=2, num_layers=1, attention_head_dim=8,
               num_attention_heads=4, joint_attention_dim=12, axes_dims_rope=(2, 2, 4))
    m = QwenImageTransformer2DModel(**cfg).eval()
    _perturb_norms(m, gen)
    inputs = {
        "hidden_states": torch.randn(2, 18, 8, generator=gen),
        "encoder_hidden_states": torch.randn(2, 5, 12, generator=gen),
        "encoder_hidden_states_mask": torch.tensor([[1, 1, 1, 1, 0]] * 2, dtype=torch.long),
        "timestep": torch.tensor([0.6, 0.3]),
        "img_shapes": _shapes(2, [[1, 3, 4], [1, 2, 3]]),
    }
    d = write_qwen_case(out_dir, "qwenimage_bf16_sharded", m, inputs,
                        "bf16 weights in 2 shards + index; expected from the bf16 values upcast "
                        "to f32; batch 2, one shared padded mask, two images per element",
                        dtype=torch.bfloat16, max_shard_size="60KB")
    shards = [f for f in os.listdir(d) if f.endswith(".safetensors") and f.startswith("diffusion")] \
        if d else ["skipped", "skipped"]
    assert len(shards) >= 2, shards

    # 4. no mask; frames: a 2 x 2 x 3 clip then a 1 x 3 x 3 image (21 image rows), 6 text
    #    tokens, 2 heads x 8, 1 block.
    torch.manual_seed(13)
    gen = torch.Generator().manual_seed(13)
    cfg = dict(patch_size=1, in_channels=4, out_channels=None, num_layers=1, attention_head_dim=8,
               num_attention_heads=2, joint_attention_dim=8, axes_dims_rope=(2, 2, 4))
    m = QwenImageTransformer2DModel(**cfg).eval()
    _perturb_norms(m, gen)
    inputs = {
        "hidden_states": torch.randn(1, 21, 4, generator=gen),
        "encoder_hidden_states": torch.randn(1, 6, 8, generator=gen),
        "timestep": torch.tensor([0.4]),
        "img_shapes": _shapes(1, [[2, 2, 3], [1, 3, 3]]),
    }
    write_qwen_case(out_dir, "qwenimage_frames", m, inputs,
                    "no mask; img_shapes (2, 2, 3) then (1, 3, 3): frame positions and a second "
                    "image; out_channels null; 2 heads x 8, 1 block")

    # 5. Qwen-Image-Edit-2511's zero_cond_t: the condition images' rows modulated at timestep 0.
    #    Batch 2 (two timesteps), the output grid 3 x 4 then two condition images 2 x 3 and 1 x 2
    #    (12 + 6 + 2 rows: under CP the boundary falls inside a rank's chunk), padded masks that
    #    differ per element (a pass each), 4 heads x 8, 2 blocks.
    torch.manual_seed(14)
    gen = torch.Generator().manual_seed(14)
    cfg = dict(patch_size=2, in_channels=8, out_channels=2, num_layers=2, attention_head_dim=8,
               num_attention_heads=4, joint_attention_dim=12, axes_dims_rope=(2, 2, 4),
               zero_cond_t=True)
    m = QwenImageTransformer2DModel(**cfg).eval()
    _perturb_norms(m, gen)
    inputs = {
        "hidden_states": torch.randn(2, 20, 8, generator=gen),
        "encoder_hidden_states": torch.randn(2, 6, 12, generator=gen),
        # masks differing per element: one pass each (the second starts at batch row 1)
        "encoder_hidden_states_mask": torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 0, 1, 1, 1]],
                                                   dtype=torch.long),
        "timestep": torch.tensor([0.8, 0.35]),
        "img_shapes": _shapes(2, [[1, 3, 4], [1, 2, 3], [1, 1, 2]]),
    }
    write_qwen_case(out_dir, "qwenimage_edit2511", m, inputs,
                    "zero_cond_t (Qwen-Image-Edit-2511): condition images modulated at timestep "
                    "0; batch 2, output 3 x 4 then condition images 2 x 3 and 1 x 2, masks per element, "
                    "4 heads x 8, 2 blocks; expected_steps2 = 2-step Euler of the first image's "
                    "rows, the condition rows kept", steps=2)

    # 6. Qwen-Image-Layered: use_additional_t_cond (nn.Embedding(2, C) rows added to temb, both
    #    rows used: batch 2 with additional_t_cond [1, 0]) and use_layer3d_rope (three 2 x 3
    #    latent layers at frames 0, 1, 2, then the 3 x 4 input image at frame -1; the text from
    #    position max(2, n - 1) = 3 on: the layer count decides it). A shared padded mask,
    #    4 heads x 8, 2 blocks; expected_steps2 steps every layer, the input image kept.
    torch.manual_seed(15)
    gen = torch.Generator().manual_seed(15)
    cfg = dict(patch_size=2, in_channels=8, out_channels=2, num_layers=2, attention_head_dim=8,
               num_attention_heads=4, joint_attention_dim=12, axes_dims_rope=(2, 2, 4),
               use_additional_t_cond=True, use_layer3d_rope=True)
    m = QwenImageTransformer2DModel(**cfg).eval()
    _perturb_norms(m, gen)
    inputs = {
        "hidden_states": torch.randn(2, 30, 8, generator=gen),
        "encoder_hidden_states": torch.randn(2, 5, 12, generator=gen),
        "encoder_hidden_states_mask": torch.tensor([[1, 1, 1, 1, 0]] * 2, dtype=torch.long),
        "timestep": torch.tensor([0.7, 0.25]),
        "img_shapes": _shapes(2, [[1, 2, 3], [1, 2, 3], [1, 2, 3], [1, 3, 4]]),
        "additional_t_cond": torch.tensor([1, 0], dtype=torch.long),
    }
    write_qwen_case(out_dir, "qwenimage_layered", m, inputs,
                    "Qwen-Image-Layered: use_additional_t_cond (batch 2, additional_t_cond "
                    "[1, 0]) and use_layer3d_rope (three 2 x 3 layers, then the 3 x 4 input image "
                    "at frame -1); shared padded mask, 4 heads x 8, 2 blocks; expected_steps2 = "
                    "2-step Euler of the layers, the input image kept", steps=2)

    # 7. ControlNet residuals (QwenImageControlNetPipeline's controlnet_block_samples, stacked as
    #    [B, N, S_img, C]): 3 blocks with 2 residuals (blocks 0, 1 read residual 0, block 2
    #    residual 1); batch 2 with masks that differ (one pass each: each takes its own
    #    element's residuals), a 3 x 5 grid, 4 heads x 8.
    torch.manual_seed(16)
    gen = torch.Generator().manual_seed(16)
    cfg = dict(patch_size=2, in_channels=8, out_channels=2, num_layers=3, attention_head_dim=8,
               num_attention_heads=4, joint_attention_dim=12, axes_dims_rope=(2, 2, 4))
    m = QwenImageTransformer2DModel(**cfg).eval()
    _perturb_norms(m, gen)
    inputs = {
        "hidden_states": torch.randn(2, 15, 8, generator=gen),
        "encoder_hidden_states": torch.randn(2, 6, 12, generator=gen),
        "encoder_hidden_states_mask": torch.tensor([[1, 1, 1, 1, 0, 0], [1, 0, 1, 1, 1, 1]],
                                                   dtype=torch.long),
        "timestep": torch.tensor([0.9, 0.45]),
        "img_shapes": _shapes(2, [[1, 3, 5]]),
        "controlnet_block_samples": 0.5 * torch.randn(2, 2, 15, 32, generator=gen),
    }
    write_qwen_case(out_dir, "qwenimage_controlnet", m, inputs,
                    "ControlNet residuals: 3 blocks with 2 ([B, N, S_img, C]); batch 2 with masks "
                    "per element (a pass each), a 3 x 5 grid, 4 heads x 8")
