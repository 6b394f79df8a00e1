#!/usr/bin/env python3
"""Tiny but real diffusers ControlNet pipelines, built locally: FluxControlNetPipeline (an
InstantX-style ControlNet) and QwenImageControlNetPipeline.

Each is its family's tiny pipeline (flux_pipeline: 2 + 2 blocks, 64 px; qwenimage_pipeline: 2
blocks, 64 px, two prompts with padded masks) plus a ControlNet made with diffusers' own
``from_transformer`` (the transformer's embedders and first blocks copied; Flux: 1 double and 1
single block, Qwen-Image: 1 block). diffusers zero-initialises a ControlNet's output projections
(``controlnet_blocks``, ``controlnet_single_blocks``) and its ``controlnet_x_embedder``, so a fresh
one adds nothing; ``build`` gives them random weights (``RESIDUAL_SCALE``) so that the residuals
change the image. Each step the pipeline runs the ControlNet on the control image's latents, then
the transformer with the residuals (1 per stack: every block of the stack reads it, diffusers'
ceil(2 / 1) = 2), in both branches of true CFG.

``FAMILIES`` maps each family to (its tiny pipeline module, its pipeline and ControlNet classes).
"""

import os

import numpy as np
import torch

import flux_pipeline as _fp
import qwenimage_pipeline as _qi
from pipeline_util import load_pipeline

RESIDUAL_SCALE = 0.5  # std x sqrt(fan-in) of the ControlNet's output projections (diffusers: zero)
SIZE = 64
FAMILIES = {
    "flux": (_fp, "FluxPipeline", "FluxControlNetPipeline", "FluxControlNetModel",
             "FluxTransformer2DModel", dict(num_layers=1, num_single_layers=1)),
    "qwenimage": (_qi, "QwenImagePipeline", "QwenImageControlNetPipeline", "QwenImageControlNetModel",
                  "QwenImageTransformer2DModel", dict(num_layers=1)),
}


def build(root: str, family: str, seed: int = 0) -> None:
    """The family's tiny pipeline under root, its ControlNet under root/controlnet."""
    import diffusers

    mod, _, _, net_cls, tr_cls, layers = FAMILIES[family]
    mod.build(root, seed=seed)
    transformer = getattr(diffusers, tr_cls).from_pretrained(os.path.join(root, "transformer"))
    torch.manual_seed(seed + 7)
    net = getattr(diffusers, net_cls).from_transformer(
        transformer, attention_head_dim=mod.HEAD_DIM, num_attention_heads=mod.HEADS, **layers)
    gen = torch.Generator().manual_seed(seed + 8)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if name.startswith(("controlnet_blocks", "controlnet_single_blocks", "controlnet_x_embedder")):
                p.copy_(RESIDUAL_SCALE * torch.randn(p.shape, generator=gen) / max(1, p.shape[-1]) ** 0.5)
    net.eval().save_pretrained(os.path.join(root, "controlnet"), safe_serialization=True)


def load(root: str, family: str, transformer=None):
    """The family's ControlNet pipeline from the components under root and root/controlnet, with
    `transformer` (a meshdit drop-in, say) instead of root/transformer if given."""
    import diffusers

    _, base_cls, cls, net_cls, _, _ = FAMILIES[family]
    base = load_pipeline(getattr(diffusers, base_cls), root, transformer)
    net = getattr(diffusers, net_cls).from_pretrained(os.path.join(root, "controlnet")).eval()
    pipe = getattr(diffusers, cls)(**base.components, controlnet=net)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def control_image(seed: int = 0):
    """A deterministic RGB PIL control image (SIZE x SIZE): smooth gradients and a bright square."""
    from PIL import Image

    rng = np.random.RandomState(seed)
    y, x = np.mgrid[0:SIZE, 0:SIZE].astype(np.float32) / SIZE
    c = rng.rand(3, 2)
    img = np.stack([c[i, 0] * x + c[i, 1] * y for i in range(3)], -1)
    x0, y0 = rng.randint(0, SIZE // 2, 2)
    img[y0:y0 + SIZE // 3, x0:x0 + SIZE // 3] = 1.0
    return Image.fromarray((np.clip(img, 0, 1) * 255).astype(np.uint8))


def generate(pipe, family: str, seed: int = 0, steps: int = 2, image=None, scale: float = 1.0,
             **kwargs) -> np.ndarray:
    """The pipeline's images (float32 in [0, 1]) for control image `image` (default
    control_image()) at controlnet_conditioning_scale `scale`, through the family module's
    generate: Flux one image [H, W, 3] (true CFG with a negative prompt at true_cfg_scale 2, so
    both branches read the residuals); Qwen-Image its two prompts with true CFG, [2, H, W, 3]."""
    control = dict(control_image=control_image() if image is None else image,
                   controlnet_conditioning_scale=scale)
    if family == "flux":
        kwargs = {"true_cfg_scale": 2.0, "negative_prompt": "a blue ball", **kwargs}
        return _fp.generate(pipe, seed=seed, steps=steps, size=SIZE, **control, **kwargs)
    return _qi.generate(pipe, seed=seed, steps=steps, height=SIZE, width=SIZE, **control, **kwargs)
