#!/usr/bin/env python3
"""A tiny but real diffusers QwenImageLayeredPipeline (Qwen-Image-Layered), built locally.

Nothing is downloaded: every component is created from a small config with random weights and saved
with ``save_pretrained``, so ``QwenImageLayeredPipeline.from_pretrained(root)`` works offline (with
qwenimage_edit_pipeline imported: its processor class). The pipeline decomposes an RGBA image into
``layers`` RGBA layers: the transformer denoises ``layers + 1`` latent frames (the composite first)
beside the input image's latents, which it never steps.

Components:

* transformer: qwenimage_pipeline's ``QwenImageTransformer2DModel`` with Qwen-Image-Layered's
  ``use_additional_t_cond`` (an nn.Embedding(2, C) row, the pipeline's ``is_rgb`` = 0, added to the
  timestep embedding) and ``use_layer3d_rope`` (the input image, img_shapes' last entry, at frame
  position -1; the text from max(H/2, W/2, entries - 1) on); rows coupled as in
  qwenimage_edit_pipeline (``_couple_rows``), so that the input image visibly changes the output.
* vae: qwenimage_pipeline's ``AutoencoderKLQwenImage`` with 4 image channels (RGBA in and out) and
  8 latent channels (the transformer's in_channels 32, out_channels 8).
* tokenizer, text_encoder, scheduler: qwenimage_pipeline's (the layered pipeline uses
  QwenImagePipeline's prompt template: a 34-token system prefix, checked in ``build``).
* processor: qwenimage_edit_pipeline's ``Qwen2VLImageOnlyProcessor`` (the pipeline only uses it to
  caption an image when no prompt is given; ``generate`` always gives one).

Sizes. The pipeline asserts ``resolution`` 640 or 1024 and sizes everything to it: at 640 and a
square input, every entry of ``img_shapes`` is a 40 x 40 grid, so with ``layers`` = 1 the transformer
sees ``[[(1, 40, 40), (1, 40, 40), (1, 40, 40)]]``: 3200 rows being denoised, then 1600 input-image
rows. ``generate`` runs one prompt with true CFG (a negative prompt, ``true_cfg_scale`` 4): two
transformer calls per step.
"""

import numpy as np
import torch

import qwenimage_edit_pipeline as _qe
import qwenimage_pipeline as _qi
from pipeline_util import load_pipeline

RESOLUTION = 640
LAYERS = 1
INPUT_SIZE = (64, 64)  # (width, height) of the input image; the pipeline resizes it to RESOLUTION^2
PROMPT = "a black cat on a white table"
NEGATIVE_PROMPT = "a blurry photo"
TRUE_CFG_SCALE = 4.0
Z_DIM = 8  # VAE latent channels; transformer in_channels = 4 * Z_DIM
LAYERED = {"use_additional_t_cond": True, "use_layer3d_rope": True, "in_channels": 4 * Z_DIM,
           "out_channels": Z_DIM}


def _make_vae(seed, gen):
    """qwenimage_pipeline's tiny AutoencoderKLQwenImage with 4 image channels (RGBA) and Z_DIM latent
    channels: not 4, which the pipeline would take for an image already encoded (it compares the
    image's channels with z_dim)."""
    from diffusers import AutoencoderKLQwenImage

    config = {**_qi._make_vae(seed, gen).config, "input_channels": 4, "z_dim": Z_DIM,
              "latents_mean": [round(float(v), 4) for v in 0.3 * torch.randn(Z_DIM, generator=gen)],
              "latents_std": [round(float(v), 4) for v in 1.0 + torch.rand(Z_DIM, generator=gen)]}
    torch.manual_seed(seed)
    vae = AutoencoderKLQwenImage(**{k: v for k, v in config.items() if not k.startswith("_")}).eval()
    _qi._perturb_constants(vae, gen)
    return vae


def build(root: str, seed: int = 0) -> None:
    """Write a complete, deterministic (for a seed) tiny QwenImageLayeredPipeline under root."""
    from diffusers import QwenImageLayeredPipeline

    gen = torch.Generator("cpu").manual_seed(seed + 4321)
    tokenizer = _qi._make_tokenizer()
    transformer = _qi._make_transformer(seed, gen, LAYERED)
    _qe._couple_rows(transformer)
    text_encoder = _qi._make_text_encoder(tokenizer, seed + 2)
    pipe = QwenImageLayeredPipeline(
        scheduler=_qi._make_scheduler(),
        vae=_make_vae(seed + 1, gen),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        processor=_qe._make_processor(tokenizer, text_encoder.config.vision_config),
        transformer=transformer,
    )
    _qi._check_prefix_and_save(pipe, tokenizer, root)


def load(root: str, transformer=None):
    """The pipeline from root on CPU (float32), with `transformer` instead of root/transformer if given
    (pipeline_util.load_pipeline)."""
    from diffusers import QwenImageLayeredPipeline

    return load_pipeline(QwenImageLayeredPipeline, root, transformer)


def load_transformer(root: str, **config):
    """diffusers' transformer from root/transformer with config arguments overridden."""
    return _qe.load_transformer(root, **config)


def input_image(seed: int = 0, size=INPUT_SIZE):
    """A deterministic RGBA PIL image: qwenimage_edit_pipeline's reference image with a gradient alpha."""
    from PIL import Image

    rgb = np.asarray(_qe.reference_images([size], seed=seed)[0])
    h, w = rgb.shape[:2]
    alpha = (255 * np.linspace(0.2, 1.0, w))[None, :].repeat(h, 0).astype(np.uint8)
    return Image.fromarray(np.concatenate([rgb, alpha[..., None]], -1), "RGBA")


def generate(pipe, image=None, seed: int = 0, steps: int = 2, layers: int = LAYERS,
             prompt: str = PROMPT, negative_prompt: str | None = NEGATIVE_PROMPT,
             true_cfg_scale: float = TRUE_CFG_SCALE, **kwargs) -> np.ndarray:
    """Decompose `image` (default input_image()) into `layers` layers; return them as float32 numpy
    [layers, H, W, 4] in [0, 1]. steps must be >= 2 (Qwen-Image's scheduler: see qwenimage_pipeline)."""
    if steps < 2:
        raise ValueError(f"steps must be >= 2 with Qwen-Image's scheduler (shift_terminal), got {steps}")
    generator = torch.Generator("cpu").manual_seed(seed)
    with torch.inference_mode():
        out = pipe(image=input_image() if image is None else image, prompt=prompt,
                   negative_prompt=negative_prompt if true_cfg_scale > 1 else None,
                   true_cfg_scale=true_cfg_scale, layers=layers, resolution=RESOLUTION,
                   num_inference_steps=steps, generator=generator, output_type="np", **kwargs)
    return np.asarray(out.images[0], dtype=np.float32)
