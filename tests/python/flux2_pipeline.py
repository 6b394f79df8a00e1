#!/usr/bin/env python3
"""A tiny but real diffusers Flux2KleinPipeline (FLUX.2 [klein]), built locally from random components.

Nothing is downloaded: every component is created here with random weights and saved with
``save_pretrained``, so ``Flux2KleinPipeline.from_pretrained(root)`` works offline. The prompt goes
through the real tokenizer, chat template and text encoder (no prompt-embedding shortcut). FLUX.2
[klein] is the Flux.2 variant whose text encoder is Qwen3; FLUX.2 [dev]'s ``Flux2Pipeline`` runs the
same ``Flux2Transformer2DModel`` behind a Mistral-3 encoder and a Pixtral processor, which cannot be
built without downloaded processor files, so the transformer's calls are exercised here.

* tokenizer: ``Qwen2Tokenizer`` over a local byte-level BPE (as qwenimage_pipeline: 256 byte symbols,
  one merge chain per word, Qwen's specials) with a Qwen3-style chat template that honours
  ``enable_thinking=False`` (the empty ``<think>`` block the pipeline asks for).
* text_encoder: ``Qwen3ForCausalLM`` hidden 16, 3 layers, 2 heads x 8 (1 KV head); the pipeline
  stacks the hidden states of layers ``TEXT_LAYERS`` = (1, 2, 3), so prompt_embeds are 48 wide.
* transformer: ``Flux2Transformer2DModel`` 1 double + 2 single blocks, 4 heads x 16 (tp 2 and 4
  divide them), axes_dims_rope (4, 4, 4, 4), in_channels 16 (4 latent channels x 2x2 patchify),
  joint_attention_dim 48, no guidance embedder (klein), float32; constant parameters perturbed.
* vae: ``AutoencoderKLFlux2`` block_out_channels (8, 16, 16, 16) (spatial factor 8), 4 latent
  channels, random batch-norm running statistics (the pipeline normalises latents with them).
  64 x 96 pixels -> 8 x 12 latents -> 4 x 6 = 24 image tokens; a reference image adds 24 more at
  time coordinate 10 (image editing).
* scheduler: ``FlowMatchEulerDiscreteScheduler`` with FLUX.2's dynamic shifting.

``generate`` runs a batch of two prompts with classifier-free guidance (``is_distilled`` False, guidance
4; the negative prompt is the pipeline's ""), so each step calls the transformer twice; with ``image=``
it also conditions on a reference image.

Usage: ``python tests/python/flux2_pipeline.py [--meshdit build/meshdit] [--keep DIR]`` builds into a
temp dir, runs the pipeline twice with diffusers' transformer (must agree exactly), then replays the
first transformer call in ``meshdit run`` and compares with diffusers.
"""

import argparse
import os
import shutil
import sys
import tempfile

import numpy as np
import torch

from pipeline_util import (bpe_vocab, capture_calls, load_pipeline, perturb_constants as _perturb_constants,
                           replay)

HEADS = 4
HEAD_DIM = 16
TEXT_HIDDEN = 16
TEXT_LAYERS = (1, 2, 3)
LATENT_CHANNELS = 4
HEIGHT, WIDTH = 64, 96
TXT_LEN = 32  # max_sequence_length used by generate()
PROMPTS = ["a small red cube on a white table", "a black cat under a blue sky"]
GUIDANCE = 4.0

_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
_WORDS = ["user", "assistant", " a", " an", " on", " in", " with", " under", " red", " green", " blue",
          " white", " black", " cube", " cat", " table", " small", " sky", "a", "an"]
# Qwen3's template reduced to what the pipeline uses: messages, a generation prompt, no thinking.
_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}")


def _make_tokenizer():
    from transformers import Qwen2Tokenizer

    vocab, merges = bpe_vocab(_WORDS, _SPECIALS)
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges, extra_special_tokens=_SPECIALS[1:], model_max_length=40960)
    tok.chat_template = _CHAT_TEMPLATE
    return tok


def build(root: str, seed: int = 0, transformer_config: dict | None = None) -> None:
    """Write a complete, deterministic (for a seed) tiny Flux2KleinPipeline under root (float32).
    transformer_config overrides Flux2Transformer2DModel arguments (keep in_channels, patch_size and
    joint_attention_dim)."""
    from diffusers import (AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline,
                           Flux2Transformer2DModel)
    from transformers import Qwen3Config, Qwen3ForCausalLM

    gen = torch.Generator("cpu").manual_seed(seed + 12345)
    tokenizer = _make_tokenizer()

    torch.manual_seed(seed)
    transformer = Flux2Transformer2DModel(**{**dict(
        patch_size=1, in_channels=4 * LATENT_CHANNELS, num_layers=1, num_single_layers=2,
        attention_head_dim=HEAD_DIM, num_attention_heads=HEADS,
        joint_attention_dim=TEXT_HIDDEN * len(TEXT_LAYERS), timestep_guidance_channels=32,
        axes_dims_rope=[4, 4, 4, 4], guidance_embeds=False), **(transformer_config or {})}).eval()
    _perturb_constants(transformer, gen)

    torch.manual_seed(seed + 1)
    vae = AutoencoderKLFlux2(block_out_channels=(8, 16, 16, 16), layers_per_block=1,
                             latent_channels=LATENT_CHANNELS, norm_num_groups=4).eval()
    _perturb_constants(vae, gen)
    with torch.no_grad():
        vae.bn.running_mean.copy_(0.3 * torch.randn(vae.bn.running_mean.shape, generator=gen))
        vae.bn.running_var.copy_(0.5 + torch.rand(vae.bn.running_var.shape, generator=gen))

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in _SPECIALS}
    torch.manual_seed(seed + 2)
    text_encoder = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=TEXT_HIDDEN, intermediate_size=32,
        num_hidden_layers=max(TEXT_LAYERS), num_attention_heads=2, num_key_value_heads=1, head_dim=8,
        max_position_embeddings=1024, bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"], tie_word_embeddings=False)).to(torch.float32).eval()
    with torch.no_grad():
        emb = text_encoder.get_input_embeddings().weight
        emb.copy_(torch.randn(emb.shape, generator=gen))  # unit scale: the prompt moves the states
    _perturb_constants(text_encoder, gen)

    # FLUX.2's scheduler: dynamic shifting (the pipeline computes mu from the token count).
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096, time_shift_type="exponential")

    pipe = Flux2KleinPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                              transformer=transformer, is_distilled=False)
    os.makedirs(root, exist_ok=True)
    pipe.save_pretrained(root, safe_serialization=True)


def load(root: str, transformer=None):
    """Load the pipeline from root on CPU (float32); use `transformer` instead of root/transformer if
    given: a diffusers ModelMixin through from_pretrained(transformer=...), any other object (a meshdit
    drop-in) attached with register_modules (diffusers refuses a non-ModelMixin there)."""
    from diffusers import Flux2KleinPipeline

    return load_pipeline(Flux2KleinPipeline, root, transformer)


def build_dev(root: str, seed: int = 0) -> None:
    """Add root/transformer_dev to a built root: a Flux2Transformer2DModel like root/transformer but with
    FLUX.2 [dev]'s guidance embedder (guidance_embeds True), for `Flux2Pipeline` (see `load_dev`)."""
    from diffusers import Flux2Transformer2DModel

    cfg = dict(Flux2Transformer2DModel.load_config(os.path.join(root, "transformer")))
    cfg = {k: v for k, v in cfg.items() if not k.startswith("_")}
    torch.manual_seed(seed + 3)
    model = Flux2Transformer2DModel(**{**cfg, "guidance_embeds": True}).eval()
    _perturb_constants(model, torch.Generator("cpu").manual_seed(seed + 54321))
    model.save_pretrained(os.path.join(root, "transformer_dev"), safe_serialization=True)


def load_dev(root: str, transformer=None):
    """FLUX.2 [dev]'s `Flux2Pipeline` over root's scheduler and VAE with root/transformer_dev (or the
    given transformer object) and no text encoder: its Mistral-3 encoder and Pixtral processor cannot be
    built offline, so prompts come in as prompt_embeds (`dev_prompt_embeds`)."""
    from diffusers import (AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Pipeline,
                           Flux2Transformer2DModel)

    if transformer is None:
        transformer = Flux2Transformer2DModel.from_pretrained(os.path.join(root, "transformer_dev")).eval()
    pipe = Flux2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(root, subfolder="scheduler"),
                         vae=AutoencoderKLFlux2.from_pretrained(root, subfolder="vae").eval(),
                         text_encoder=None, tokenizer=None, transformer=None)
    pipe.register_modules(transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def dev_prompt_embeds(klein_pipe, prompts=None):
    """prompt_embeds for `Flux2Pipeline` from the klein pipeline's text encoder (same width)."""
    with torch.inference_mode():
        embeds, _ = klein_pipe.encode_prompt(prompt=PROMPTS if prompts is None else prompts,
                                             max_sequence_length=TXT_LEN, text_encoder_out_layers=TEXT_LAYERS)
    return embeds


def generate_dev(pipe, prompt_embeds, seed: int = 0, steps: int = 2, guidance_scale: float = GUIDANCE,
                 **kwargs) -> np.ndarray:
    """Run `Flux2Pipeline` (guidance-distilled: one forward per step with a guidance tensor); return the
    images as float32 numpy [B, H, W, 3]."""
    kwargs.setdefault("height", HEIGHT)
    kwargs.setdefault("width", WIDTH)
    with torch.inference_mode():
        out = pipe(prompt_embeds=prompt_embeds, num_inference_steps=steps, guidance_scale=guidance_scale,
                   generator=torch.Generator("cpu").manual_seed(seed), output_type="np", **kwargs)
    return np.asarray(out.images, dtype=np.float32)


def reference_image(seed: int = 0):
    """A deterministic random RGB PIL image of HEIGHT x WIDTH, for image-conditioned generation."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (HEIGHT, WIDTH, 3), dtype=np.uint8))


def generate(pipe, seed: int = 0, steps: int = 2, prompt=None, guidance_scale: float = GUIDANCE,
             output_type: str = "np", **kwargs) -> np.ndarray:
    """Run the pipeline; return the decoded images as float32 numpy [B, H, W, 3] in [0, 1] (B = number
    of prompts x num_images_per_prompt, 2 by default), or with output_type="latent" the latents
    [B, C, h, w]. Other keyword arguments (image=, height=, ...) go to the pipeline."""
    kwargs.setdefault("height", HEIGHT)
    kwargs.setdefault("width", WIDTH)
    with torch.inference_mode():
        out = pipe(prompt=PROMPTS if prompt is None else prompt, num_inference_steps=steps,
                   guidance_scale=guidance_scale, max_sequence_length=TXT_LEN,
                   text_encoder_out_layers=TEXT_LAYERS, generator=torch.Generator("cpu").manual_seed(seed),
                   output_type=output_type, **kwargs)
    if output_type == "latent":
        return out.images.float().cpu().numpy()
    return np.asarray(out.images, dtype=np.float32)


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--meshdit", default=os.path.join(here, "..", "..", "build", "meshdit"))
    ap.add_argument("--keep", help="build into this directory (kept) instead of a temporary one")
    args = ap.parse_args()
    root = os.path.abspath(args.keep) if args.keep else tempfile.mkdtemp(prefix="flux2_pipe_")
    try:
        build(root)
        pipe = load(root)
        calls, hook = capture_calls(pipe.transformer)
        a = generate(pipe, seed=0, image=reference_image())
        hook.remove()
        b = generate(pipe, seed=0, image=reference_image())
        print(f"images {a.shape}, {len(calls)} transformer calls, max|a-b| between runs {np.abs(a - b).max()}")
        ok = bool(np.abs(a - b).max() == 0)
        if os.path.exists(args.meshdit):
            ok &= replay(args.meshdit, os.path.join(root, "transformer"), calls[0],
                         os.path.join(root, "call0.safetensors"), os.path.join(root, "call0_out.safetensors"),
                         "first call")
        print("OK" if ok else "FAILED")
        return 0 if ok else 1
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
