#!/usr/bin/env python3
"""A tiny but real diffusers QwenImageEditPlusPipeline (Qwen-Image-Edit-2509/2511), built locally.

Nothing is downloaded: every component is created here from a small config with random weights and
saved with ``save_pretrained``, so ``QwenImageEditPlusPipeline.from_pretrained(root)`` works offline
(with this module imported: see ``processor``). The transformer has Qwen-Image-Edit-2511's
``zero_cond_t=True``: the rows of the condition images (every ``img_shapes`` entry after the first)
are modulated at timestep 0.

Components (qwenimage_pipeline.py's, except where said):

* transformer: qwenimage_pipeline's ``QwenImageTransformer2DModel`` (2 blocks, 4 heads x 32, ...) with
  ``zero_cond_t=True``, its attention sharpened and its value and modulation projections scaled
  (``_couple_rows``) so that the condition rows, and zero_cond_t, visibly change the output image.
* vae, scheduler: qwenimage_pipeline's (spatial factor 8; Qwen-Image's scheduler config).
* tokenizer: qwenimage_pipeline's byte-level BPE, with merges for the words of this pipeline's
  template, so that its system prefix is 64 tokens as in Qwen2's vocabulary:
  ``prompt_template_encode_start_idx`` (checked in ``build``).
* text_encoder: qwenimage_pipeline's ``Qwen2_5_VLForConditionalGeneration``; its vision tower (1 block,
  width 16, patch 4, temporal patch 2, spatial merge 2) now runs on the condition images.
* processor: a ``Qwen2VLProcessor`` over a ``Qwen2VLImageProcessorPil`` whose patch_size / merge_size /
  temporal_patch_size are read from the text encoder's vision config, and the tokenizer. No chat
  template (the pipeline formats its own template). transformers 5.24's ``Qwen2VLProcessor`` takes a
  video processor that needs torchvision (not installed, and PyPI has none for torch 2.15), so the
  processor is ``Qwen2VLImageOnlyProcessor``: ``Qwen2VLProcessor`` without the video processor,
  the same for images (the pipeline passes no video). model_index.json names it from this module;
  diffusers loads it once this module is imported (it never imports a module a repository names).

Sizes. The pipeline sizes the condition images to fixed areas: 384^2 pixels for the vision tower
(``CONDITION_IMAGE_SIZE``) and 1024^2 for the VAE (``VAE_IMAGE_SIZE``), i.e. 4096 condition rows per
image in the transformer. ``generate`` sets both module constants for the call (``CONDITION_AREA``,
``VAE_AREA``) and restores them; everything else is the pipeline's own code. With the default two
reference images (96 x 64 and 64 x 96 pixels) and a 64 x 64 output:

* transformer: ``img_shapes`` [[(1, 4, 4), (1, 4, 6), (1, 6, 4)]]: 16 rows being denoised, then
  24 + 24 condition rows (64 in all); the text is the template's user part with both images'
  32 vision tokens each.
* vision tower: each image at 64 x 32 (or 32 x 64) pixels: 8 x 16 patches -> 32 merged tokens.

``generate`` runs one prompt with true CFG (``true_cfg_scale`` 4, a negative prompt): two transformer
calls per step (text lengths differ; batch 1, so the pipeline passes no text mask).

Usage: ``python tests/python/qwenimage_edit_pipeline.py [--meshdit build/meshdit] [--keep DIR]`` builds
into a temp dir, runs the pipeline twice with diffusers' own transformer (must agree exactly), prints
the transformer calls' inputs, the effect of the seed, of the reference images and of zero_cond_t,
and replays every transformer call in ``meshdit run`` against diffusers' outputs.
"""

import argparse
import contextlib
import importlib
import os
import shutil
import sys
import tempfile
import time

import numpy as np
import torch
from transformers import ProcessorMixin, Qwen2VLProcessor  # noqa: F401 (ProcessorMixin: see below)

import qwenimage_pipeline as _qi
from pipeline_util import capture_calls as _capture_calls, load_pipeline, replay as _replay

HEIGHT, WIDTH = 64, 64
# The areas (pixels) the pipeline gives each condition image: for the vision tower (its
# CONDITION_IMAGE_SIZE, 384^2) and for the VAE (its VAE_IMAGE_SIZE, 1024^2); sides rounded to 32.
CONDITION_AREA = 48 * 32
VAE_AREA = 96 * 64
# The reference images' sizes (width, height): two aspect ratios, so two different img_shapes entries.
REFERENCE_SIZES = ((96, 64), (64, 96))

PROMPT = "a black cat on a white table"
NEGATIVE_PROMPT = "a blurry photo"
TRUE_CFG_SCALE = 4.0

# Every word of QwenImageEditPlusPipeline.prompt_template_encode's system prefix longer than one
# byte, as Qwen2's pre-tokenizer splits it (each one token in Qwen2's vocabulary).
# (" consistency" before "color": a word's merge chain must not meet an earlier word's first merge.)
_TEMPLATE_WORDS = ["system", "Describe", " the", " key", " features", " of", " input", " image", " (",
                   " consistency", "color", " shape", " size", " texture", " objects", " background", "),",
                   " then", " explain", " how", " user", "'s", " text", " instruction", " should", " alter",
                   " or", " modify", " Generate", " a", " new", " that", " meets", " requirements",
                   " while", " maintaining", " with", " original", " where", " appropriate", "user",
                   "assistant"]
# The per-image prefix of the user part ("Picture {i}: <|vision_start|>...").
_IMAGE_WORDS = ["Picture"]


class Qwen2VLImageOnlyProcessor(Qwen2VLProcessor):
    """``Qwen2VLProcessor`` without its video processor (transformers 5.24's needs torchvision): the
    same text and image processing, the image processor's and tokenizer's files saved and loaded as
    Qwen2VLProcessor's. ProcessorMixin takes its sub-processors from ``__init__``'s parameters."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        self.image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
        self.video_token = getattr(tokenizer, "video_token", None) or "<|video_pad|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template, **kwargs)


def _make_processor(tokenizer, vision_config):
    """The processor matching the text encoder's vision tower: patch, temporal patch and spatial merge
    from its config; pixel limits that keep the pipeline's small condition images as they are."""
    from transformers import Qwen2VLImageProcessorPil

    factor = vision_config.patch_size * vision_config.spatial_merge_size
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=vision_config.patch_size,
        temporal_patch_size=vision_config.temporal_patch_size,
        merge_size=vision_config.spatial_merge_size,
        min_pixels=factor * factor,
        max_pixels=128 * 128,
    )
    return Qwen2VLImageOnlyProcessor(image_processor=image_processor, tokenizer=tokenizer)


# How much build() strengthens the random transformer's coupling between rows (_couple_rows).
QK_SCALE, V_SCALE, MOD_SCALE = 2.0, 3.0, 3.0


def _couple_rows(transformer):
    """Make the rows being denoised depend on the condition rows, and on how those are modulated. With
    its random weights the tiny transformer attends almost uniformly over ~150 keys and its modulation
    is small: zero_cond_t, or other reference images, changed the image by ~1e-3 (relative), below what
    a 1e-4 comparison can tell from a 100x margin. The QK-norm weights x QK_SCALE sharpen the attention
    (logits x QK_SCALE^2), the value projections x V_SCALE weigh the attention against the residual
    stream, the modulation projections x MOD_SCALE (img_mod, txt_mod) widen the shift/scale/gate tables
    and so the difference between the t and the 0 table."""
    with torch.no_grad():
        for name, p in transformer.named_parameters():
            if any(k in name for k in (".norm_q.", ".norm_k.", ".norm_added_q.", ".norm_added_k.")):
                p.mul_(QK_SCALE)
            elif any(k in name for k in (".attn.to_v.", ".attn.add_v_proj.")):
                p.mul_(V_SCALE)
            elif any(k in name for k in (".img_mod.1.", ".txt_mod.1.")):
                p.mul_(MOD_SCALE)


def build(root: str, seed: int = 0, transformer_config: dict | None = None) -> None:
    """Write a complete, deterministic (for a seed) tiny QwenImageEditPlusPipeline under root.
    transformer_config overrides QwenImageTransformer2DModel arguments (zero_cond_t is True unless it
    says otherwise; keep in_channels, out_channels, patch_size and joint_attention_dim)."""
    from diffusers import QwenImageEditPlusPipeline

    gen = torch.Generator("cpu").manual_seed(seed + 12345)

    tokenizer = _qi._make_tokenizer(_TEMPLATE_WORDS + _IMAGE_WORDS + _qi._WORDS)
    transformer = _qi._make_transformer(seed, gen, {"zero_cond_t": True, **(transformer_config or {})})
    _couple_rows(transformer)
    vae = _qi._make_vae(seed + 1, gen)
    text_encoder = _qi._make_text_encoder(tokenizer, seed + 2)
    scheduler = _qi._make_scheduler()
    processor = _make_processor(tokenizer, text_encoder.config.vision_config)

    pipe = QwenImageEditPlusPipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        processor=processor,
        transformer=transformer,
    )
    # The pipeline drops the first prompt_template_encode_start_idx (64) hidden states: its template's
    # system prefix, 64 tokens in Qwen2's vocabulary.
    _qi._check_prefix_and_save(pipe, tokenizer, root)


def load(root: str, transformer=None):
    """Load the pipeline from root on CPU (float32); use `transformer` instead of root/transformer if given
    (a ModelMixin through from_pretrained, anything else, e.g. a meshdit drop-in, attached after loading:
    pipeline_util.load_pipeline)."""
    from diffusers import QwenImageEditPlusPipeline

    return load_pipeline(QwenImageEditPlusPipeline, root, transformer)


def load_transformer(root: str, **config):
    """diffusers' transformer from root/transformer with config arguments overridden (e.g. zero_cond_t=False:
    the same weights without Qwen-Image-Edit-2511's timestep-0 modulation of the condition rows)."""
    from diffusers import QwenImageTransformer2DModel

    model = QwenImageTransformer2DModel.from_pretrained(os.path.join(root, "transformer"), **config).eval()
    for k, v in config.items():
        if getattr(model.config, k) != v:
            raise RuntimeError(f"from_pretrained ignored {k}={v!r}")
    return model


def reference_images(sizes=REFERENCE_SIZES, seed: int = 0):
    """Deterministic RGB PIL images of the given (width, height) sizes: smooth colour gradients with a
    bright rectangle and some noise, different for each image."""
    from PIL import Image

    rng = np.random.RandomState(seed)
    images = []
    for w, h in sizes:
        y, x = np.mgrid[0:h, 0:w].astype(np.float32)
        c = rng.rand(3, 3).astype(np.float32)
        img = np.stack([c[i, 0] * x / w + c[i, 1] * y / h + 0.3 * c[i, 2] for i in range(3)], -1)
        x0, y0 = rng.randint(0, w // 2), rng.randint(0, h // 2)
        img[y0:y0 + h // 3, x0:x0 + w // 3] = rng.rand(3)
        img = np.clip(img + 0.05 * rng.randn(h, w, 3), 0, 1)
        images.append(Image.fromarray((img * 255).astype(np.uint8)))
    return images


@contextlib.contextmanager
def condition_areas(condition_area: int = CONDITION_AREA, vae_area: int = VAE_AREA):
    """Set the pipeline module's CONDITION_IMAGE_SIZE / VAE_IMAGE_SIZE (pixel areas of the condition
    images for the vision tower and for the VAE) for the duration."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as m

    saved = m.CONDITION_IMAGE_SIZE, m.VAE_IMAGE_SIZE
    m.CONDITION_IMAGE_SIZE, m.VAE_IMAGE_SIZE = condition_area, vae_area
    try:
        yield
    finally:
        m.CONDITION_IMAGE_SIZE, m.VAE_IMAGE_SIZE = saved


def generate(pipe, image=None, seed: int = 0, steps: int = 2, height: int = HEIGHT, width: int = WIDTH,
             prompt: str = PROMPT, negative_prompt: str | None = NEGATIVE_PROMPT,
             true_cfg_scale: float = TRUE_CFG_SCALE, output_type: str = "np",
             condition_area: int = CONDITION_AREA, vae_area: int = VAE_AREA, **kwargs) -> np.ndarray:
    """Edit `image` (a PIL image or a list; default reference_images()) with the pipeline; return the decoded
    images as float32 numpy [1, H, W, 3] in [0, 1], or with output_type="latent" the packed latents [1, S, C].

    Defaults: PROMPT with NEGATIVE_PROMPT at true_cfg_scale 4 (two transformer calls per step);
    true_cfg_scale <= 1 turns CFG off (no negative prompt is passed). The condition images are sized to
    condition_area / vae_area pixels (condition_areas). Other keyword arguments go to the pipeline.
    steps must be >= 2 (Qwen-Image's scheduler: one step gives a NaN timestep, see qwenimage_pipeline)."""
    if steps < 2 and kwargs.get("sigmas") is None:
        raise ValueError(f"steps must be >= 2 with Qwen-Image's scheduler (shift_terminal), got {steps}")
    image = reference_images() if image is None else image
    if true_cfg_scale <= 1:
        negative_prompt = None
    generator = torch.Generator("cpu").manual_seed(seed)
    with torch.inference_mode(), condition_areas(condition_area, vae_area):
        out = pipe(
            image=image,
            prompt=prompt,
            negative_prompt=negative_prompt,
            true_cfg_scale=true_cfg_scale,
            height=height,
            width=width,
            num_inference_steps=steps,
            generator=generator,
            output_type=output_type,
            **kwargs,
        )
    if output_type == "latent":
        return out.images.float().cpu().numpy()
    return np.asarray(out.images, dtype=np.float32)


def img_shapes_hook(model):
    """A forward pre-hook recording each call's `img_shapes` and hidden_states / encoder_hidden_states
    shapes (and whether a text mask came): (records, hook handle)."""
    records = []

    def hook(module, args, kwargs):
        mask = kwargs.get("encoder_hidden_states_mask")
        records.append({"img_shapes": kwargs.get("img_shapes"),
                        "hidden_states": tuple(kwargs["hidden_states"].shape),
                        "encoder_hidden_states": tuple(kwargs["encoder_hidden_states"].shape),
                        "mask": None if mask is None else tuple(mask.shape)})

    return records, model.register_forward_pre_hook(hook, with_kwargs=True)


def expected_img_shapes(images=None, height: int = HEIGHT, width: int = WIDTH, vae_area: int = VAE_AREA):
    """The img_shapes the pipeline builds for images (default reference_images()) with a height x width output
    (vae scale 8, 2x2 packing): the output's entry, then one per condition image."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import calculate_dimensions

    images = reference_images() if images is None else images
    shapes = [(1, height // 16, width // 16)]
    for img in images:
        w, h = calculate_dimensions(vae_area, img.size[0] / img.size[1])
        shapes.append((1, h // 16, w // 16))
    return [shapes]


# ---- __main__: determinism, the transformer's inputs, the controls, meshdit on each transformer call ----


def _rel(a, b):
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))


def _main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--meshdit", default=os.path.join(here, "..", "..", "build", "meshdit"))
    ap.add_argument("--keep", help="build into this directory (kept) instead of a temporary one")
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args()
    meshdit = os.path.abspath(args.meshdit)
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

    root = os.path.abspath(args.keep) if args.keep else tempfile.mkdtemp(prefix="qwenimage_edit_pipe_")
    ok = True
    try:
        t0 = time.perf_counter()
        build(root, seed=0)
        t1 = time.perf_counter()
        pipe = load(root)
        t2 = time.perf_counter()
        records, pre = img_shapes_hook(pipe.transformer)
        calls, handle = _capture_calls(pipe.transformer)
        a = generate(pipe, seed=0, steps=args.steps)
        t3 = time.perf_counter()
        handle.remove()
        pre.remove()
        b = generate(pipe, seed=0, steps=args.steps)
        t4 = time.perf_counter()
        print(f"root: {root}")
        for name in ("transformer", "vae", "text_encoder"):
            m = getattr(pipe, name)
            print(f"{name}: {type(m).__name__} params={sum(p.numel() for p in m.parameters())} dtype={m.dtype}")
        print(f"tokenizer: {type(pipe.tokenizer).__name__} vocab={len(pipe.tokenizer)}; processor: "
              f"{type(pipe.processor).__name__} ({type(pipe.processor.image_processor).__name__})")
        print(f"transformer zero_cond_t={pipe.transformer.config.zero_cond_t}")
        for i, r in enumerate(records):
            print(f"call {i}: {r}")
        want = expected_img_shapes()
        if any(r["img_shapes"] != want for r in records):
            print(f"FAIL: img_shapes are not {want}", file=sys.stderr)
            ok = False
        print(f"images: {a.shape} {a.dtype} range [{a.min():.4f}, {a.max():.4f}]")
        print(f"build: {t1 - t0:.2f}s  load: {t2 - t1:.2f}s  generate: {t3 - t2:.2f}s, {t4 - t3:.2f}s")
        diff = float(np.max(np.abs(a - b)))
        print(f"max abs diff between two runs (same seed): {diff}")
        ok &= diff == 0.0
        print(f"rel diff vs seed 1: {_rel(generate(pipe, seed=1, steps=args.steps), a):.3e}")
        print(f"rel diff vs other reference images: "
              f"{_rel(generate(pipe, image=reference_images(seed=1), seed=0, steps=args.steps), a):.3e}")
        plain = load(root, transformer=load_transformer(root, zero_cond_t=False))
        print(f"rel diff vs zero_cond_t=False: {_rel(generate(plain, seed=0, steps=args.steps), a):.3e}")

        if not os.path.exists(meshdit):
            print(f"meshdit not found at {meshdit}; skipping the meshdit checks")
            return 0 if ok else 1
        tdir = os.path.join(root, "transformer")
        for i, call in enumerate(calls):
            ok &= _replay(meshdit, tdir, call, f"/tmp/qwenimage_edit_step{i}.safetensors",
                          f"/tmp/qwenimage_edit_step{i}_out.safetensors",
                          f"call {i} ({'cond' if i % 2 == 0 else 'uncond'}, step {i // 2})")
        print("OK" if ok else "FAILED")
        return 0 if ok else 1
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    # Run as the module `qwenimage_edit_pipeline` (not __main__), so that model_index.json names the
    # processor's module by the name under which load() finds it.
    sys.exit(importlib.import_module("qwenimage_edit_pipeline")._main())
