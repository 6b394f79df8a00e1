"""A tiny but real diffusers FluxPipeline, built locally from random components.

Nothing is downloaded: every component is created here with random weights and
saved with ``save_pretrained``, so ``FluxPipeline.from_pretrained(root)`` works
offline. Both tokenizers are built from a local, in-memory vocabulary (no
prompt-embedding shortcut):

* ``tokenizer``   -- ``CLIPTokenizer`` (byte-level BPE): the 512 byte-level base
  symbols (each byte, and each byte + ``</w>``), a few dozen merges for a small
  word list, and ``<|startoftext|>`` / ``<|endoftext|>``.
* ``tokenizer_2`` -- ``T5TokenizerFast`` (= ``T5Tokenizer`` in transformers 5,
  a ``tokenizers`` Unigram model): ``<pad>``=0, ``</s>``=1, ``<unk>``=2, then
  ``▁``, single characters and ``▁word`` pieces with scores.

Sizes (FLUX.1-dev layout, scaled down):

* transformer: ``FluxTransformer2DModel`` 2 double + 2 single blocks, 4 heads x
  head_dim 32 (inner 128), axes_dims_rope (8, 12, 12) (sum = head_dim),
  in_channels 16 (4 latent channels x 2x2 packing), joint_attention_dim 64,
  pooled_projection_dim 32, guidance_embeds True, float32. The QK RMSNorm
  weights are perturbed away from 1 so that they matter.
* vae: ``AutoencoderKL`` 4 levels (scale factor 8, as FLUX), block_out_channels
  (16, 16, 32, 32), latent_channels 4, no quant convs, FLUX scaling/shift.
  64x64 pixels -> 8x8 latents -> 4x4 = 16 packed image tokens.
* text_encoder: ``CLIPTextModel`` hidden 32 (= pooled_projection_dim; FluxPipeline
  uses ``pooler_output``), 2 layers, 2 heads, 77 positions.
* text_encoder_2: ``T5EncoderModel`` d_model 64 (= joint_attention_dim), 2 layers,
  4 heads x d_kv 16, gated-gelu (T5 v1.1, like FLUX).
* scheduler: ``FlowMatchEulerDiscreteScheduler`` with FLUX.1-dev's config.

Usage: ``python tests/python/flux_pipeline.py`` builds into a temp dir, runs the
pipeline twice with diffusers' own transformer and prints shapes, times and the
max abs difference between the two runs (must be 0).
"""

import os
import sys
import tempfile
import time

import numpy as np
import torch

from pipeline_util import load_pipeline, bytes_to_unicode as _bytes_to_unicode, t5_tokenizer

# Transformer size; also used by callers that want to know the layout.
HEADS = 4
HEAD_DIM = 32
AXES_DIMS_ROPE = (8, 12, 12)
JOINT_DIM = 64  # T5 d_model
POOLED_DIM = 32  # CLIP hidden size
LATENT_CHANNELS = 4
TXT_LEN = 32  # max_sequence_length used by generate()

_WORDS = [
    "a", "an", "the", "of", "on", "in", "with", "and", "photo", "red", "green",
    "blue", "white", "black", "cube", "sphere", "cat", "dog", "table", "small",
    "big", "car", "tree", "house", "sky",
]


def _clip_tokenizer():
    from transformers import CLIPTokenizer

    base = list(_bytes_to_unicode().values())
    vocab = {}
    for s in base + [c + "</w>" for c in base]:
        vocab.setdefault(s, len(vocab))
    merges = []
    for w in _WORDS:
        syms = list(w[:-1]) + [w[-1] + "</w>"]
        while len(syms) > 1:
            pair = (syms[0], syms[1])
            new = syms[0] + syms[1]
            if pair not in merges:
                merges.append(pair)
            vocab.setdefault(new, len(vocab))
            syms = [new] + syms[2:]
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=77)


def _perturb_norms(model, gen, scale=0.1):
    """Move every all-ones norm weight slightly away from 1 (deterministically)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight") and p.dim() == 1 and torch.all(p == 1):
                p.add_(scale * torch.randn(p.shape, generator=gen, dtype=p.dtype))


def build(root: str, seed: int = 0, transformer_config: dict | None = None) -> None:
    """Write a complete, deterministic (for a seed) tiny FluxPipeline under root.
    transformer_config overrides FluxTransformer2DModel arguments (a bigger transformer for
    benchmarks: keep joint_attention_dim, pooled_projection_dim and in_channels)."""
    from diffusers import (AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline,
                           FluxTransformer2DModel)
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    gen = torch.Generator("cpu").manual_seed(seed + 12345)

    tokenizer = _clip_tokenizer()
    tokenizer_2 = t5_tokenizer(_WORDS)

    torch.manual_seed(seed)
    transformer = FluxTransformer2DModel(**{**dict(
        patch_size=1,
        in_channels=4 * LATENT_CHANNELS,
        out_channels=None,
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=HEAD_DIM,
        num_attention_heads=HEADS,
        joint_attention_dim=JOINT_DIM,
        pooled_projection_dim=POOLED_DIM,
        guidance_embeds=True,
        axes_dims_rope=AXES_DIMS_ROPE,
    ), **(transformer_config or {})})
    _perturb_norms(transformer, gen)

    torch.manual_seed(seed + 1)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(16, 16, 32, 32),
        layers_per_block=1,
        act_fn="silu",
        latent_channels=LATENT_CHANNELS,
        norm_num_groups=8,
        sample_size=64,
        scaling_factor=0.3611,
        shift_factor=0.1159,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )
    _perturb_norms(vae, gen)

    torch.manual_seed(seed + 2)
    clip_cfg = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=POOLED_DIM,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=77,
        projection_dim=POOLED_DIM,
        hidden_act="quick_gelu",
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    text_encoder = CLIPTextModel(clip_cfg).to(torch.float32).eval()
    _perturb_norms(text_encoder, gen)

    torch.manual_seed(seed + 3)
    t5_cfg = T5Config(
        vocab_size=len(tokenizer_2),
        d_model=JOINT_DIM,
        d_kv=16,
        d_ff=128,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=32,
        feed_forward_proj="gated-gelu",
        dropout_rate=0.0,
        pad_token_id=tokenizer_2.pad_token_id,
        eos_token_id=tokenizer_2.eos_token_id,
        decoder_start_token_id=tokenizer_2.pad_token_id,
        is_encoder_decoder=False,
        use_cache=False,
    )
    text_encoder_2 = T5EncoderModel(t5_cfg).to(torch.float32).eval()
    _perturb_norms(text_encoder_2, gen)

    # FLUX.1-dev's scheduler config.
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )

    pipe = FluxPipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        transformer=transformer,
    )
    os.makedirs(root, exist_ok=True)
    pipe.save_pretrained(root, safe_serialization=True)


def load(root: str, transformer=None):
    """Load the pipeline from root on CPU (float32); use `transformer` instead of root/transformer if given.

    The drop-in is passed as FluxPipeline.from_pretrained(root, transformer=obj). diffusers only accepts
    that for an instance of diffusers' ModelMixin: model_index.json names diffusers.FluxTransformer2DModel,
    and pipeline_loading_utils.maybe_raise_or_warn raises ValueError("... is of type X, but should be
    ModelMixin") for anything else, a plain object or a torch.nn.Module alike. For such an object the
    pipeline is loaded with transformer=None (root/transformer is then not read at all) and the object is
    attached with register_modules(transformer=obj), which accepts any object. Either way nothing is read
    from root/transformer and the pipeline calls the object exactly as it calls FluxTransformer2DModel.
    """
    from diffusers import FluxPipeline

    return load_pipeline(FluxPipeline, root, transformer)


def generate(pipe, seed: int = 0, steps: int = 2, size: int = 64,
             prompt: str = "a red cube", output_type: str = "np", **kwargs) -> np.ndarray:
    """Run the pipeline; return the decoded image as float32 numpy [H, W, 3], or, for several
    images (num_images_per_prompt) or output_type="latent", all of them stacked ([N, H, W, 3], or
    the packed latents [N, S, C]). Other keyword arguments go to the pipeline (e.g. true_cfg_scale
    and negative_prompt)."""
    generator = torch.Generator("cpu").manual_seed(seed)
    with torch.inference_mode():
        out = pipe(
            prompt=prompt,
            height=size,
            width=size,
            num_inference_steps=steps,
            guidance_scale=3.5,
            max_sequence_length=TXT_LEN,
            generator=generator,
            output_type=output_type,
            **kwargs,
        )
    if output_type == "latent":
        return out.images.float().cpu().numpy()
    img = np.asarray(out.images, dtype=np.float32)
    return img[0] if len(img) == 1 else img


def _main():
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    with tempfile.TemporaryDirectory(prefix="flux_pipe_") as root:
        t0 = time.perf_counter()
        build(root, seed=0)
        t1 = time.perf_counter()
        pipe = load(root)
        t2 = time.perf_counter()
        a = generate(pipe, seed=0)
        t3 = time.perf_counter()
        b = generate(pipe, seed=0)
        t4 = time.perf_counter()
        c = generate(pipe, seed=1)
        n_params = sum(p.numel() for p in pipe.transformer.parameters())
        print(f"root: {root}")
        print(f"transformer: {type(pipe.transformer).__name__} params={n_params} "
              f"dtype={pipe.transformer.dtype}")
        print(f"image shape: {a.shape} dtype: {a.dtype} range: [{a.min():.4f}, {a.max():.4f}]")
        print(f"build: {t1 - t0:.2f}s  load: {t2 - t1:.2f}s  generate: {t3 - t2:.2f}s, {t4 - t3:.2f}s")
        diff = float(np.max(np.abs(a - b)))
        print(f"max abs diff between two runs (same seed): {diff}")
        print(f"max abs diff vs seed 1: {float(np.max(np.abs(a - c))):.4f}")
        if diff != 0.0:
            print("FAIL: generation is not deterministic", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(_main())
