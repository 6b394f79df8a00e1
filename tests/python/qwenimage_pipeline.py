#!/usr/bin/env python3
"""A tiny but real diffusers QwenImagePipeline, built locally from random components.

Nothing is downloaded: every component is created here from a small config with random weights and
saved with ``save_pretrained``, so ``QwenImagePipeline.from_pretrained(root)`` works offline. The
prompt goes through the real tokenizer and text encoder (no prompt-embedding shortcut):

* ``tokenizer`` -- ``Qwen2Tokenizer`` (a ``tokenizers`` byte-level BPE, saved as tokenizer.json):
  the 256 byte-level symbols, merges that make every word of the pipeline's prompt template (and a
  small word list) one token, and Qwen's special tokens (``<|endoftext|>`` = pad, ``<|im_start|>``,
  ``<|im_end|>``, vision tokens). The merges reproduce the real Qwen2 tokenization of the template's
  system prefix: 34 tokens, which is exactly ``prompt_template_encode_start_idx``, the number of
  hidden states the pipeline drops (checked in ``build``).

Sizes (Qwen/Qwen-Image layout, scaled down):

* transformer: ``QwenImageTransformer2DModel`` 2 blocks, 4 heads x head_dim 32 (inner 128; tp 2 and
  4 divide the heads), axes_dims_rope (8, 12, 12) (sum = head_dim), patch 2, in_channels 16 (4 latent
  channels x 2x2 packing), out_channels 4, joint_attention_dim 32, guidance_embeds False, float32.
  Every parameter that is one constant (RMSNorm weights at 1, ...) is perturbed so that it matters.
* vae: ``AutoencoderKLQwenImage`` base_dim 16, z_dim 4, dim_mult (1, 2, 2, 2), 1 res block,
  temperal_downsample (False, True, True) (spatial factor 8, as Qwen-Image), random latents_mean/std.
  64 x 96 pixels -> 8 x 12 latents -> 4 x 6 = 24 packed image tokens (img_shapes (1, 4, 6)).
* text_encoder: ``Qwen2_5_VLForConditionalGeneration``, text model hidden 32 (= joint_attention_dim),
  2 layers, 2 heads x 16 (1 KV head), mrope_section (2, 3, 3); a 1-block vision tower of width 16
  (not run by this text-only pipeline; qwenimage_edit_pipeline.py runs it). The pipeline reads
  ``hidden_states[-1]``.
* scheduler: ``FlowMatchEulerDiscreteScheduler`` with Qwen/Qwen-Image's config (dynamic exponential
  shift 0.5..0.9 over 256..8192 tokens, shift_terminal 0.02).

``generate`` runs a batch of two prompts of different lengths with true CFG (``true_cfg_scale`` 4
and two negative prompts, the longer one in the other batch element): both transformer calls of a
step then get an ``encoder_hidden_states_mask`` with padding (the pipeline drops the mask, passing
None, only when it is all ones).

Usage: ``python tests/python/qwenimage_pipeline.py [--meshdit build/meshdit] [--keep DIR]`` builds into
a temp dir, runs the pipeline twice with diffusers' own transformer and prints shapes, times and the
max abs difference between the two runs (must be 0); then runs the pipeline with a plain-object
stand-in for the transformer, and replays every transformer call of the first run in
``meshdit run`` (inputs saved as /tmp/qwenimage_step{i}.safetensors) and compares with diffusers.
"""

import argparse
import os
import shutil
import sys
import tempfile
import time

import numpy as np
import torch

from pipeline_util import (load_pipeline, ForwardProxy as _ForwardProxy, bpe_vocab, capture_calls as _capture_calls,
                           perturb_constants as _perturb_constants, replay as _replay)

# Transformer size; also used by callers that want to know the layout.
HEADS = 4
HEAD_DIM = 32
AXES_DIMS_ROPE = (8, 12, 12)
TEXT_DIM = 32  # text encoder hidden size = transformer joint_attention_dim
Z_DIM = 4  # VAE latent channels; transformer in_channels = 4 * Z_DIM
HEIGHT, WIDTH = 64, 96

# generate()'s defaults: two prompts of different lengths, two negative prompts with the longer one in
# the other element, so the text mask of the cond and of the uncond call both have padding.
PROMPTS = ["a small red cube on a white table under a blue sky", "a black cat"]
NEGATIVE_PROMPTS = ["blurry", "a dark and blurry photo of a green tree"]
TRUE_CFG_SCALE = 4.0

# Qwen2's special tokens, in id order after the byte-level symbols and the merged words.
_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
             "<|image_pad|>", "<|video_pad|>"]

# The words of QwenImagePipeline.prompt_template_encode, each merged into one token as in Qwen2's
# vocabulary (so the system prefix is 34 tokens = prompt_template_encode_start_idx).
_TEMPLATE_WORDS = ["system", "Describe", " the", " image", " by", " detailing", " color", " shape",
                   " size", " texture", " quantity", " text", " spatial", " relationships", " of",
                   " objects", " and", " background", "user", "assistant"]
_WORDS = [" a", " an", " on", " in", " with", " under", " photo", " red", " green", " blue", " white",
          " black", " dark", " cube", " sphere", " cat", " dog", " table", " small", " big", " tree",
          " sky", " blurry", " low", " quality", "a", "blurry"]


def _make_tokenizer(words=None):
    """Qwen2Tokenizer over a local byte-level BPE: byte symbols, one left-to-right merge chain per word
    (default: this template's words and _WORDS), Qwen's specials (pad = eos = unk = <|endoftext|>)."""
    from transformers import Qwen2Tokenizer

    vocab, merges = bpe_vocab(_TEMPLATE_WORDS + _WORDS if words is None else words, _SPECIALS)
    return Qwen2Tokenizer(vocab=vocab, merges=merges, extra_special_tokens=_SPECIALS[1:],
                          model_max_length=32768)


def _make_text_encoder(tokenizer, seed):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in _SPECIALS}
    cfg = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer), hidden_size=TEXT_DIM, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048, rms_norm_eps=1e-6,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0, mrope_section=[2, 3, 3]),
            bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
        ),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=4,
                           spatial_merge_size=2, temporal_patch_size=2, window_size=16, out_hidden_size=TEXT_DIM,
                           fullatt_block_indexes=[0]),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
    )
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(cfg).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        # Unit-scale embeddings so that the prompt moves the last hidden state well away from a constant.
        emb = model.get_input_embeddings().weight
        emb.copy_(torch.randn(emb.shape, generator=gen))
    _perturb_constants(model, gen)
    return model


def _make_transformer(seed, gen, overrides=None):
    """The tiny QwenImageTransformer2DModel (module docstring), `overrides` on top of its arguments;
    constant parameters perturbed from `gen`."""
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(seed)
    transformer = QwenImageTransformer2DModel(**{**dict(
        patch_size=2,
        in_channels=4 * Z_DIM,
        out_channels=Z_DIM,
        num_layers=2,
        attention_head_dim=HEAD_DIM,
        num_attention_heads=HEADS,
        joint_attention_dim=TEXT_DIM,
        guidance_embeds=False,
        axes_dims_rope=AXES_DIMS_ROPE,
    ), **(overrides or {})}).eval()
    _perturb_constants(transformer, gen)
    return transformer


def _make_vae(seed, gen):
    """The tiny AutoencoderKLQwenImage (spatial factor 8); latents_mean/std and perturbations from `gen`."""
    from diffusers import AutoencoderKLQwenImage

    torch.manual_seed(seed)
    vae = AutoencoderKLQwenImage(
        base_dim=16,
        z_dim=Z_DIM,
        dim_mult=[1, 2, 2, 2],
        num_res_blocks=1,
        attn_scales=[],
        temperal_downsample=[False, True, True],
        dropout=0.0,
        latents_mean=[round(float(v), 4) for v in 0.3 * torch.randn(Z_DIM, generator=gen)],
        latents_std=[round(float(v), 4) for v in 1.0 + torch.rand(Z_DIM, generator=gen)],
    ).eval()
    _perturb_constants(vae, gen)
    return vae


def _make_scheduler():
    """Qwen/Qwen-Image's scheduler config."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=1.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=0.9,
        base_image_seq_len=256,
        max_image_seq_len=8192,
        shift_terminal=0.02,
        time_shift_type="exponential",
    )


def build(root: str, seed: int = 0, transformer_config: dict | None = None) -> None:
    """Write a complete, deterministic (for a seed) tiny QwenImagePipeline under root.
    transformer_config overrides QwenImageTransformer2DModel arguments (keep in_channels,
    out_channels, patch_size and joint_attention_dim)."""
    from diffusers import QwenImagePipeline

    gen = torch.Generator("cpu").manual_seed(seed + 12345)

    tokenizer = _make_tokenizer()
    transformer = _make_transformer(seed, gen, transformer_config)
    vae = _make_vae(seed + 1, gen)
    text_encoder = _make_text_encoder(tokenizer, seed + 2)
    scheduler = _make_scheduler()

    pipe = QwenImagePipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
    )
    # The pipeline drops the first prompt_template_encode_start_idx (34) hidden states: the system prefix of
    # its template, 34 tokens in Qwen2's vocabulary.
    _check_prefix_and_save(pipe, tokenizer, root)


def _check_prefix_and_save(pipe, tokenizer, root):
    """Check that the tokenizer's merges give the template's system prefix exactly the
    prompt_template_encode_start_idx tokens the pipeline drops; save the pipeline under root."""
    prefix = pipe.prompt_template_encode.split("{}")[0]
    n_prefix = len(tokenizer(prefix).input_ids)
    if n_prefix != pipe.prompt_template_encode_start_idx:
        raise RuntimeError(f"the template's system prefix is {n_prefix} tokens, the pipeline drops "
                           f"{pipe.prompt_template_encode_start_idx}")
    os.makedirs(root, exist_ok=True)
    pipe.save_pretrained(root, safe_serialization=True)


def load(root: str, transformer=None):
    """Load the pipeline from root on CPU (float32); use `transformer` instead of root/transformer if given.

    As in flux_pipeline.load: diffusers accepts `from_pretrained(root, transformer=obj)` only for a ModelMixin
    (model_index.json names diffusers.QwenImageTransformer2DModel; anything else raises ValueError in
    pipeline_loading_utils.maybe_raise_or_warn). Any other object is attached with register_modules after
    loading with transformer=None (root/transformer is then not read). Every component loads through
    diffusers'/transformers' from_pretrained (QwenImage declares no `_keep_in_fp32_modules`, so no accelerate
    fallback is needed)."""
    from diffusers import QwenImagePipeline

    return load_pipeline(QwenImagePipeline, root, transformer)


def generate(pipe, seed: int = 0, steps: int = 2, height: int = HEIGHT, width: int = WIDTH,
             prompt=None, negative_prompt=None, true_cfg_scale: float = TRUE_CFG_SCALE, output_type: str = "np",
             **kwargs) -> np.ndarray:
    """Run the pipeline; return the decoded images as float32 numpy [B, H, W, 3] in [0, 1] (B = number of
    prompts x num_images_per_prompt, 2 by default), or with output_type="latent" the packed latents [B, S, C].

    Defaults: PROMPTS with NEGATIVE_PROMPTS at true_cfg_scale 4, i.e. two transformer calls per step (cond,
    uncond), both with a padded text mask. With another prompt and no negative_prompt, the negative prompt is
    " " per prompt (Qwen-Image's usual empty negative). true_cfg_scale <= 1 turns CFG off (no negative prompt
    is passed). A single prompt gives encoder_hidden_states_mask=None (the pipeline drops an all-ones mask).
    Other keyword arguments go to the pipeline.

    steps must be >= 2: with Qwen-Image's scheduler config (shift_terminal 0.02) one step gives a NaN timestep
    (FlowMatchEulerDiscreteScheduler.stretch_shift_to_terminal divides 0 by 0 for sigmas = [1.0])."""
    if steps < 2 and kwargs.get("sigmas") is None:
        raise ValueError(f"steps must be >= 2 with Qwen-Image's scheduler (shift_terminal), got {steps}")
    prompt = PROMPTS if prompt is None else prompt
    if true_cfg_scale <= 1:
        negative_prompt = None
    elif negative_prompt is None:
        negative_prompt = NEGATIVE_PROMPTS if prompt == PROMPTS else (
            [" "] * len(prompt) if isinstance(prompt, list) else " ")
    generator = torch.Generator("cpu").manual_seed(seed)
    with torch.inference_mode():
        out = pipe(
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


# ---- __main__: determinism, a non-Module stand-in, and meshdit on the pipeline's real transformer inputs ----


def _main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--meshdit", default=os.path.join(here, "..", "..", "build", "meshdit"))
    ap.add_argument("--keep", help="build into this directory (kept) instead of a temporary one")
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args()
    meshdit = os.path.abspath(args.meshdit)
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

    root = os.path.abspath(args.keep) if args.keep else tempfile.mkdtemp(prefix="qwenimage_pipe_")
    ok = True
    try:
        t0 = time.perf_counter()
        build(root, seed=0)
        t1 = time.perf_counter()
        pipe = load(root)
        t2 = time.perf_counter()
        calls, handle = _capture_calls(pipe.transformer)
        a = generate(pipe, seed=0, steps=args.steps)
        t3 = time.perf_counter()
        handle.remove()
        b = generate(pipe, seed=0, steps=args.steps)
        t4 = time.perf_counter()
        c = generate(pipe, seed=1, steps=args.steps)
        cfg = pipe.transformer.config
        for tp in (2, 4):
            assert cfg.num_attention_heads % tp == 0, (cfg.num_attention_heads, tp)
        print(f"root: {root}")
        for name in ("transformer", "vae", "text_encoder"):
            m = getattr(pipe, name)
            print(f"{name}: {type(m).__name__} params={sum(p.numel() for p in m.parameters())} dtype={m.dtype}")
        print(f"tokenizer: {type(pipe.tokenizer).__name__} vocab={len(pipe.tokenizer)}")
        print(f"images: {a.shape} {a.dtype} range [{a.min():.4f}, {a.max():.4f}]")
        print(f"build: {t1 - t0:.2f}s  load: {t2 - t1:.2f}s  generate: {t3 - t2:.2f}s, {t4 - t3:.2f}s")
        diff = float(np.max(np.abs(a - b)))
        print(f"max abs diff between two runs (same seed): {diff}")
        print(f"max abs diff vs seed 1: {float(np.max(np.abs(a - c))):.4f}")
        if diff != 0.0:
            print("FAIL: generation is not deterministic", file=sys.stderr)
            ok = False

        # The same pipeline with a plain-object stand-in for the transformer must give the same images.
        proxy = _ForwardProxy(pipe.transformer)
        proxy_pipe = load(root, transformer=proxy)
        d = float(np.max(np.abs(generate(proxy_pipe, seed=0, steps=args.steps) - a)))
        print(f"non-Module stand-in: max abs diff {d}; other attributes probed: {sorted(set(proxy.probes))}")
        ok &= d == 0.0

        if not os.path.exists(meshdit):
            print(f"meshdit not found at {meshdit}; skipping the meshdit checks")
            return 0 if ok else 1
        tdir = os.path.join(root, "transformer")
        for i, call in enumerate(calls):
            mask = call["kwargs"].get("encoder_hidden_states_mask")
            if mask is not None:
                print(f"call {i}: text mask per element {mask.sum(1).tolist()} of {mask.shape[1]} attended")
            ok &= _replay(meshdit, tdir, call, f"/tmp/qwenimage_step{i}.safetensors",
                          f"/tmp/qwenimage_step{i}_out.safetensors",
                          f"call {i} ({'cond' if i % 2 == 0 else 'uncond'}, step {i // 2})")
        print("OK" if ok else "FAILED")
        return 0 if ok else 1
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(_main())
