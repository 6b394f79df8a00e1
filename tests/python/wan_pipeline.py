#!/usr/bin/env python3
"""A tiny but real diffusers WanPipeline (Wan 2.1 text-to-video), built locally from random components.

Nothing is downloaded: every component is created here with random weights and saved with
``save_pretrained``, so ``WanPipeline.from_pretrained(root)`` works offline (see `load` for the one
environment gap). The tokenizer is built from a local, in-memory vocabulary (no prompt-embedding shortcut):
``T5TokenizerFast`` (= ``T5Tokenizer`` in transformers 5, a ``tokenizers`` Unigram model, the class of
Wan's google/umt5-xxl tokenizer): ``<pad>``=0, ``</s>``=1, ``<unk>``=2, then ``▁``, single characters and
``▁word`` pieces with scores.

Sizes (Wan2.1-T2V layout, scaled down):

* transformer: ``WanTransformer3DModel`` 2 blocks, 4 heads x head_dim 16 (inner 64; RoPE splits the head
  dim 8/4/4 over frames/rows/columns), ffn 128, freq_dim 32, text_dim 32 (= UMT5 d_model), in/out channels 8
  (= VAE z_dim), patch (1, 2, 2), qk_norm rms_norm_across_heads, cross_attn_norm, rope_max_seq_len 32,
  float32. Every constant parameter (norm weights at 1, zero biases) is perturbed so that it matters.
* vae: ``AutoencoderKLWan`` base_dim 8, dim_mult (1, 1, 1, 1), 1 res block, z_dim 8, temporal downsampling
  (False, True, True): spatial /8, temporal /4 (5 frames -> 2 latent frames); random latents_mean/std.
* text_encoder: ``UMT5EncoderModel`` d_model 32, 2 layers, 4 heads x d_kv 8, d_ff 64, gated-gelu (as umt5).
* scheduler: ``UniPCMultistepScheduler`` with Wan2.1-T2V's shipped config (flow_prediction, use_flow_sigmas,
  flow_shift 3.0, solver_order 2): integer timesteps 0..999.
* transformer_2: None, boundary_ratio None, expand_timesteps False (Wan 2.1, not 2.2 A14B / TI2V).

generate() asks for 5 frames at 32 x 48 (latents [1, 8, 2, 4, 6] -> 2 x 2 x 3 = 12 video tokens), 32 text
tokens, guidance_scale 5 with a negative prompt, so each step calls the transformer twice (cond, uncond).

``build_i2v`` / ``load_i2v`` / ``generate_i2v``: the same components as a Wan 2.1 image-to-video pipeline
(``WanImageToVideoPipeline``): a ``CLIPVisionModel`` image encoder (hidden 16, 64 x 64 images in 4 x 4 patches:
257 tokens, as CLIP ViT-H/14's 224 / 14) with a ``CLIPImageProcessor``, a transformer with image_dim 16 and
added_kv_proj_dim 64, in_channels 20 (latent 8 + mask 4 + condition 8). generate_i2v pads the text to
``max_sequence_length`` I2V_TXT_LEN = 226 (the pipeline's encode_prompt default, not 512): diffusers' attention
then cuts [image | text] (483 tokens) at 483 - 512 as a slice bound, the image attention getting the 257 image
and the first 197 text tokens.

Usage: ``python tests/python/wan_pipeline.py [--meshdit build/meshdit] [--keep DIR] [--steps N]`` builds into
a temp dir, runs the pipeline twice with diffusers' own transformer and prints shapes, times and the max abs
difference between the two runs (must be 0); then a non-Module stand-in for the transformer, and meshdit run on
the pipeline's captured first transformer call, compared with diffusers' output of that call.
"""

import argparse
import os
import shutil
import sys
import tempfile
import time
import types

import numpy as np
import torch

from pipeline_util import (load_pipeline, ForwardProxy as _ForwardProxy, capture_calls as _capture_calls,
                           perturb_constants as _perturb_constants, replay as _replay,
                           t5_tokenizer)

# Sizes; also used by callers that want to know the layout.
HEADS = 4
HEAD_DIM = 16
TEXT_DIM = 32  # UMT5 d_model = transformer text_dim
LATENT_CHANNELS = 8  # VAE z_dim = transformer in_channels
TXT_LEN = 32  # max_sequence_length used by generate()
NUM_FRAMES = 5
HEIGHT, WIDTH = 32, 48
PROMPT = "a red cat on a table"
NEGATIVE_PROMPT = "blurry static gray low quality"

TRANSFORMER_CONFIG = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=HEADS,
    attention_head_dim=HEAD_DIM,
    in_channels=LATENT_CHANNELS,
    out_channels=LATENT_CHANNELS,
    text_dim=TEXT_DIM,
    freq_dim=32,
    ffn_dim=128,
    num_layers=2,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
    image_dim=None,
    added_kv_proj_dim=None,
    rope_max_seq_len=32,
    pos_embed_seq_len=None,
)

# Wan-AI/Wan2.1-T2V-1.3B-Diffusers scheduler/scheduler_config.json.
SCHEDULER_CONFIG = dict(
    beta_end=0.02, beta_schedule="linear", beta_start=0.0001, disable_corrector=[],
    dynamic_thresholding_ratio=0.995, final_sigmas_type="zero", flow_shift=3.0, lower_order_final=True,
    num_train_timesteps=1000, predict_x0=True, prediction_type="flow_prediction", rescale_betas_zero_snr=False,
    sample_max_value=1.0, solver_order=2, solver_p=None, solver_type="bh2", steps_offset=0, thresholding=False,
    timestep_spacing="linspace", trained_betas=None, use_beta_sigmas=False, use_exponential_sigmas=False,
    use_flow_sigmas=True, use_karras_sigmas=False,
)

_WORDS = [
    "a", "an", "the", "of", "on", "in", "with", "and", "video", "red", "green", "blue", "white", "black",
    "gray", "cube", "sphere", "cat", "dog", "table", "small", "big", "car", "tree", "house", "sky", "blurry",
    "static", "low", "quality", "walks", "runs",
]


def build(root: str, seed: int = 0, transformer_config: dict | None = None) -> None:
    """Write a complete, deterministic (for a seed) tiny WanPipeline under root (float32, random weights).
    transformer_config overrides WanTransformer3DModel arguments (keep text_dim, in/out_channels, patch_size)."""
    from diffusers import WanPipeline, WanTransformer3DModel

    gen = torch.Generator("cpu").manual_seed(seed + 12345)

    tokenizer = t5_tokenizer(_WORDS)

    torch.manual_seed(seed)
    transformer = WanTransformer3DModel(**{**TRANSFORMER_CONFIG, **(transformer_config or {})}).eval()
    _perturb_constants(transformer, gen)

    vae, text_encoder, scheduler = _components(seed, gen, tokenizer)
    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=scheduler,
                       transformer=transformer, transformer_2=None, boundary_ratio=None, expand_timesteps=False)
    os.makedirs(root, exist_ok=True)
    pipe.save_pretrained(root, safe_serialization=True)


def build_a14b(root: str, seed: int = 0, boundary_ratio: float = 0.875) -> None:
    """Like build, with Wan 2.2 A14B's second expert: transformer_2 (other weights) runs the
    steps below boundary_ratio x 1000 (the low-noise ones), transformer the others."""
    from diffusers import WanPipeline, WanTransformer3DModel

    gen = torch.Generator("cpu").manual_seed(seed + 12345)
    tokenizer = t5_tokenizer(_WORDS)
    experts = []
    for k in range(2):
        torch.manual_seed(seed + 100 * k)
        t = WanTransformer3DModel(**TRANSFORMER_CONFIG).eval()
        _perturb_constants(t, gen)
        experts.append(t)
    vae, text_encoder, scheduler = _components(seed, gen, tokenizer)
    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=scheduler,
                       transformer=experts[0], transformer_2=experts[1],
                       boundary_ratio=boundary_ratio, expand_timesteps=False)
    os.makedirs(root, exist_ok=True)
    pipe.save_pretrained(root, safe_serialization=True)


def _components(seed, gen, tokenizer):
    """The VAE, the UMT5 text encoder and the scheduler of both pipelines, drawn from seed and gen."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed + 1)
    vae = AutoencoderKLWan(
        base_dim=8,
        z_dim=LATENT_CHANNELS,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        attn_scales=[],
        temperal_downsample=[False, True, True],
        latents_mean=[round(v, 4) for v in (0.5 * torch.randn(LATENT_CHANNELS, generator=gen)).tolist()],
        latents_std=[round(v, 4) for v in (1.0 + torch.rand(LATENT_CHANNELS, generator=gen)).tolist()],
    ).eval()
    _perturb_constants(vae, gen)

    torch.manual_seed(seed + 2)
    t5_cfg = UMT5Config(
        vocab_size=len(tokenizer),
        d_model=TEXT_DIM,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=32,
        feed_forward_proj="gated-gelu",
        dropout_rate=0.0,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
        is_encoder_decoder=False,
        use_cache=False,
        tie_word_embeddings=False,
    )
    text_encoder = UMT5EncoderModel(t5_cfg).to(torch.float32).eval()
    with torch.no_grad():
        # Unit-scale embeddings (the default init is tiny) so that the prompt moves the encoder output.
        emb = text_encoder.get_input_embeddings().weight
        emb.copy_(torch.randn(emb.shape, generator=gen))
    _perturb_constants(text_encoder, gen)

    return vae, text_encoder, UniPCMultistepScheduler(**SCHEDULER_CONFIG)


# Wan 2.1 I2V, scaled down: the image encoder's hidden size is the transformer's image_dim.
I2V_TXT_LEN = 226
I2V_IMAGE_DIM = 16
I2V_TRANSFORMER_CONFIG = dict(TRANSFORMER_CONFIG, in_channels=2 * LATENT_CHANNELS + 4, image_dim=I2V_IMAGE_DIM,
                              added_kv_proj_dim=HEADS * HEAD_DIM)


def build_i2v(root: str, seed: int = 0) -> None:
    """Write a tiny WanImageToVideoPipeline (Wan 2.1 I2V) under root: build()'s components, a CLIP vision
    encoder and image processor (257 image tokens of width I2V_IMAGE_DIM), an I2V transformer."""
    from diffusers import WanImageToVideoPipeline, WanTransformer3DModel
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    gen = torch.Generator("cpu").manual_seed(seed + 23456)
    tokenizer = t5_tokenizer(_WORDS)
    torch.manual_seed(seed)
    transformer = WanTransformer3DModel(**I2V_TRANSFORMER_CONFIG).eval()
    _perturb_constants(transformer, gen)
    vae, text_encoder, scheduler = _components(seed, gen, tokenizer)
    torch.manual_seed(seed + 3)
    image_encoder = CLIPVisionModel(CLIPVisionConfig(
        hidden_size=I2V_IMAGE_DIM, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        image_size=64, patch_size=4, projection_dim=16)).eval()
    _perturb_constants(image_encoder, gen)
    image_processor = CLIPImageProcessor(size={"shortest_edge": 64}, crop_size={"height": 64, "width": 64})
    pipe = WanImageToVideoPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=scheduler,
                                   image_processor=image_processor, image_encoder=image_encoder,
                                   transformer=transformer, transformer_2=None, boundary_ratio=None,
                                   expand_timesteps=False)
    os.makedirs(root, exist_ok=True)
    pipe.save_pretrained(root, safe_serialization=True)


def load_i2v(root: str, transformer=None):
    """The I2V pipeline from root on CPU (float32), with `transformer` instead of root/transformer if given
    (as load())."""
    from diffusers import WanImageToVideoPipeline
    from diffusers.pipelines.wan import pipeline_wan_i2v
    from diffusers.utils import is_accelerate_available, is_ftfy_available

    if not is_ftfy_available() and not hasattr(pipeline_wan_i2v, "ftfy"):
        # diffusers 0.42.1's I2V prompt cleaning calls ftfy.fix_text without checking that ftfy is installed (the
        # T2V pipeline checks); ftfy only repairs mojibake, which these ASCII prompts do not have
        pipeline_wan_i2v.ftfy = types.SimpleNamespace(fix_text=lambda text: text)
    default = None if is_accelerate_available() else (
        lambda: _transformer_from_dir(os.path.join(root, "transformer")))
    return load_pipeline(WanImageToVideoPipeline, root, transformer, default_transformer=default)


def generate_i2v(pipe, seed: int = 0, steps: int = 2, max_sequence_length: int = I2V_TXT_LEN,
                 output_type: str = "np", **kwargs) -> np.ndarray:
    """Run the I2V pipeline on a fixed 32 x 48 image (a colour gradient; the pipeline resizes it for CLIP)
    with CFG: the decoded video [F, H, W, 3], or the latents with output_type="latent"."""
    from PIL import Image

    yy, xx = np.mgrid[0:HEIGHT, 0:WIDTH]
    rgb = np.stack([xx * 255 // WIDTH, yy * 255 // HEIGHT, (xx + yy) * 127 // (HEIGHT + WIDTH)], -1)
    image = Image.fromarray(rgb.astype(np.uint8))
    generator = torch.Generator("cpu").manual_seed(seed)
    with torch.inference_mode():
        out = pipe(image=image, prompt=PROMPT, negative_prompt=NEGATIVE_PROMPT, height=HEIGHT, width=WIDTH,
                   num_frames=NUM_FRAMES, num_inference_steps=steps, guidance_scale=5.0,
                   max_sequence_length=max_sequence_length, generator=generator, output_type=output_type, **kwargs)
    if output_type == "latent":
        return out.frames.float().cpu().numpy()
    return np.asarray(out.frames, dtype=np.float32)[0]


def _transformer_from_dir(path):
    """WanTransformer3DModel from a save_pretrained directory without accelerate: from_config, then the
    safetensors weights with a strict load_state_dict (all float32, so `_keep_in_fp32_modules` changes nothing)."""
    from diffusers import WanTransformer3DModel
    from safetensors.torch import load_file

    model = WanTransformer3DModel.from_config(WanTransformer3DModel.load_config(path))
    model.load_state_dict(load_file(os.path.join(path, "diffusion_pytorch_model.safetensors")), strict=True)
    return model.eval()


def load(root: str, transformer=None):
    """Load the pipeline from root on CPU (float32); use `transformer` instead of root/transformer if given.

    Without accelerate, diffusers' from_pretrained refuses WanTransformer3DModel: it declares
    `_keep_in_fp32_modules`, which forces low_cpu_mem_usage=True, which needs accelerate. So when no transformer
    is given, root/transformer is built with from_config + a strict load_state_dict (`_transformer_from_dir`) and
    passed in as transformer=; with accelerate installed plain from_pretrained is used. A drop-in that is a
    diffusers ModelMixin is passed as WanPipeline.from_pretrained(root, transformer=obj); anything else would be
    refused by pipeline_loading_utils.maybe_raise_or_warn ("... should be ModelMixin"), so the pipeline is then
    loaded with transformer=None (root/transformer is not read) and the object attached with
    register_modules(transformer=obj). transformer_2 stays None (model_index.json has [null, null])."""
    from diffusers import WanPipeline
    from diffusers.utils import is_accelerate_available

    default = None if is_accelerate_available() else (
        lambda: _transformer_from_dir(os.path.join(root, "transformer")))
    return load_pipeline(WanPipeline, root, transformer, default_transformer=default)


def generate(pipe, seed: int = 0, steps: int = 2, prompt: str = PROMPT, negative_prompt: str = NEGATIVE_PROMPT,
             guidance_scale: float = 5.0, num_frames: int = NUM_FRAMES, height: int = HEIGHT, width: int = WIDTH,
             output_type: str = "np", **kwargs) -> np.ndarray:
    """Run the pipeline; return the decoded video as float32 numpy [F, H, W, 3] in [0, 1] (default
    [5, 32, 48, 3]), or, for several videos (num_videos_per_prompt) or output_type="latent", all of them
    stacked ([N, F, H, W, 3], or the latents [N, C, f, h, w]). With guidance_scale > 1 (default 5) every step
    calls the transformer twice: the prompt, then the negative prompt. Other keyword arguments go to the
    pipeline."""
    generator = torch.Generator("cpu").manual_seed(seed)
    with torch.inference_mode():
        out = pipe(
            prompt=prompt,
            negative_prompt=negative_prompt,
            height=height,
            width=width,
            num_frames=num_frames,
            num_inference_steps=steps,
            guidance_scale=guidance_scale,
            max_sequence_length=TXT_LEN,
            generator=generator,
            output_type=output_type,
            **kwargs,
        )
    if output_type == "latent":
        return out.frames.float().cpu().numpy()
    video = np.asarray(out.frames, dtype=np.float32)
    return video[0] if len(video) == 1 else video


# ---- __main__: determinism, a non-Module stand-in, and meshdit on the pipeline's real transformer inputs ----


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--meshdit", default=os.path.join(here, "..", "..", "build", "meshdit"))
    ap.add_argument("--keep", help="build into this directory (kept) instead of a temporary one")
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args()
    meshdit = os.path.abspath(args.meshdit)
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

    root = os.path.abspath(args.keep) if args.keep else tempfile.mkdtemp(prefix="wan_pipe_")
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
            assert cfg.num_attention_heads % tp == 0 and cfg.ffn_dim % tp == 0, tp
        print(f"root: {root}")
        for name in ("transformer", "vae", "text_encoder"):
            m = getattr(pipe, name)
            print(f"{name}: {type(m).__name__} params={sum(p.numel() for p in m.parameters())} dtype={m.dtype}")
        print(f"tokenizer: {type(pipe.tokenizer).__name__} vocab={len(pipe.tokenizer)}; "
              f"scheduler: {type(pipe.scheduler).__name__}; transformer_2: {pipe.transformer_2}")
        print(f"video shape: {a.shape} dtype: {a.dtype} range: [{a.min():.4f}, {a.max():.4f}] "
              f"clamped {float(np.mean((a <= 0) | (a >= 1))):.1%}")
        print(f"build: {t1 - t0:.2f}s  load: {t2 - t1:.2f}s  generate ({args.steps} steps, "
              f"{len(calls)} transformer calls): {t3 - t2:.2f}s, {t4 - t3:.2f}s")
        diff = float(np.max(np.abs(a - b)))
        print(f"max abs diff between two runs (same seed): {diff}")
        print(f"max abs diff vs seed 1: {float(np.max(np.abs(a - c))):.4f}")
        ok &= diff == 0.0

        # The same pipeline with a plain-object stand-in for the transformer must give the same video.
        proxy_pipe = load(root, transformer=_ForwardProxy(pipe.transformer))
        d = float(np.max(np.abs(a - generate(proxy_pipe, seed=0, steps=args.steps))))
        print(f"non-Module stand-in ({type(proxy_pipe.transformer).__name__}): max|diff| = {d:.3e}")
        ok &= d == 0.0

        if not os.path.exists(meshdit):
            print(f"meshdit not found at {meshdit}; skipping the meshdit check")
        else:
            # The first transformer call (step 0, cond) and the first uncond call, replayed in meshdit.
            tdir = os.path.join(root, "transformer")
            for i, call in enumerate(calls[:2]):
                tag = "step0" if i == 0 else "step0_uncond"
                print(f"call {i} timestep {call['kwargs']['timestep'].tolist()}")
                ok &= _replay(meshdit, tdir, call, f"/tmp/wan_{tag}.safetensors", f"/tmp/wan_{tag}_out.safetensors",
                              f"call {i} ({tag})")
        print("OK" if ok else "FAILED")
        return 0 if ok else 1
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
