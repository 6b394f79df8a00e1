#!/usr/bin/env python3
"""A tiny MiniMax-H3 text-to-video+audio pipeline, built from the modular pipeline shipped in diffusers.

Every component is made locally from a small config with random weights (no Hub, no download):

  root/modular_model_index.json  MiniMaxH3ModularPipeline / MiniMaxH3Blocks, one entry per component
  root/transformer/              MiniMaxH3Transformer3DModel: 4 heads x 16, hidden 48, 2 blocks + 1 refiner
                                 block, ffn 64, time_embed 32 (tp 1/2/4 divide heads, time_embed_dim, ffn_dim)
  root/vae/                      AutoencoderKLMiniMaxH3: 8 latent channels, spatial /4, temporal /4
                                 (clip_length 17, token_drop 3: 17n+5 frames -> 5n+2 latent frames, as released)
  root/audio_vae/                AutoencoderKLMiniMaxH3Audio: 8 latent channels, hop 4 at 160 Hz (40 latents/s)
  root/scheduler/, root/audio_scheduler/   MiniMaxH3Scheduler, shift 12 (video) and 3 (audio)
  root/text_encoder/             Qwen3VLForConditionalGeneration: 51 text layers (the pipeline reads
                                 hidden_states[50]) of width 16, 1-layer vision tower
  root/tokenizer/                Qwen2Tokenizer: byte-level BPE over a local 256-byte vocabulary + Qwen's specials
  root/processor/                Qwen3VLProcessor files (tokenizer + Qwen2-VL image processor config)

The pipeline is assembled the ordinary way: `ModularPipeline.from_pretrained(root, workflow="t2va")` resolves
MiniMaxH3ModularPipeline and MiniMaxH3Blocks (pruned to t2va) from the index, and `load_components` loads every
component from its subfolder. The prompt goes through the real tokenizer and text encoder (no precomputed prompt
embeddings). Two environment gaps have fallbacks, taken only for what `load_components` could not load (see
`load` and LOAD_FALLBACKS): without accelerate, diffusers' from_pretrained refuses the three MiniMax-H3 models
(they declare `_keep_in_fp32_modules`), so they are built with from_config + a strict load_state_dict; without
torchvision, transformers cannot construct a Qwen3VLProcessor (its video-processor class check looks the base
class up in a registry that is a placeholder then), so it is built from root/processor with that one check
skipped -- the text-only t2va path only calls its `create_mm_token_type_ids`.

MiniMax-H3 generates 5 to 15 s at 24 fps, so the shortest request is 124 frames (17 * 7 + 5): 37 latent frames
and 207 audio latents per stereo channel. The canvas is tiny (16 x 24 pixels -> 4 x 6 latents -> 2 x 3 patches),
so one transformer call sees 42 text + 414 audio + 222 video rows (678).

usage: python tests/python/h3_pipeline.py [--meshdit build/meshdit] [--keep DIR] [--steps N]
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

from pipeline_util import (ForwardProxy as _ForwardProxy, capture_calls as _capture_calls,
                           perturb_constants as _perturb_constants, replay as _replay)


PROMPT = "a red fox trots through fresh snow at dawn"
HEIGHT, WIDTH = 16, 24
NUM_FRAMES = 124  # 17 * 7 + 5: the shortest aligned request MiniMax-H3 accepts (5 s at 24 fps)

# The tokenizer's special tokens, in id order after the 256 byte-level tokens.
_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
             "<|image_pad|>", "<|video_pad|>"]
TEXT_DIM = 16

TRANSFORMER_CONFIG = dict(
    num_attention_heads=4, attention_head_dim=16, hidden_size=48, num_layers=2, num_refiner_layers=1,
    ffn_dim=64, in_channels=8, audio_in_channels=8, patch_size=(1, 2, 2), text_dim=TEXT_DIM, freq_dim=16,
    time_embed_hidden_dim=48, time_embed_dim=32, rope_freq_dim=2, rope_theta=10000.0,
)
VAE_CONFIG = dict(
    in_channels=3, out_channels=3, latent_channels=8, block_out_channels=(8, 8), layers_per_block=1,
    spatial_downsample_factors=(2, 2), temporal_downsample_factors=(2, 2), norm_num_groups=4,
    decoder_num_layers=1, decoder_num_attention_heads=2, decoder_attention_head_dim=8,
    decoder_num_register_tokens=2, decoder_ffn_mult=2, clip_length=17, token_drop=3,
)
AUDIO_VAE_CONFIG = dict(
    encoder_dim=4, encoder_rates=(2, 2), latent_dim=16, latent_channels=8, num_attention_heads=2,
    decoder_dim=16, decoder_rates=(2, 2), decoder_kernel_sizes=(4, 4), resblock_kernel_sizes=(3, 5),
    resblock_dilation_sizes=((1, 2), (1, 2)), sampling_rate=160,
)
_COMPONENTS = {
    # name: (library, class name), in the order MiniMaxH3Blocks declares them
    "text_encoder": ("transformers", "Qwen3VLForConditionalGeneration"),
    "tokenizer": ("transformers", "Qwen2Tokenizer"),
    "processor": ("transformers", "Qwen3VLProcessor"),
    "scheduler": ("diffusers", "MiniMaxH3Scheduler"),
    "audio_scheduler": ("diffusers", "MiniMaxH3Scheduler"),
    "transformer": ("diffusers", "MiniMaxH3Transformer3DModel"),
    "vae": ("diffusers", "AutoencoderKLMiniMaxH3"),
    "audio_vae": ("diffusers", "AutoencoderKLMiniMaxH3Audio"),
}


def _make_tokenizer():
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import Qwen2Tokenizer

    vocab = {ch: i for i, ch in enumerate(sorted(ByteLevel.alphabet()))}
    for token in _SPECIALS:
        vocab[token] = len(vocab)
    return Qwen2Tokenizer(vocab=vocab, merges=[], extra_special_tokens=_SPECIALS[1:])


def _make_text_encoder(tokenizer, seed):
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in _SPECIALS}
    cfg = Qwen3VLConfig(
        text_config=dict(
            vocab_size=272, hidden_size=TEXT_DIM, intermediate_size=32, num_hidden_layers=51,
            num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=2048,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 1, 1],
                                 mrope_interleaved=True),
        ),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=4,
                           out_hidden_size=TEXT_DIM, num_position_embeddings=16, deepstack_visual_indexes=[0]),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
    )
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        # Unit-scale embeddings so the prompt moves hidden_states[50] well away from a constant.
        emb = model.get_input_embeddings().weight
        emb.copy_(torch.randn(emb.shape, generator=gen))
    _perturb_constants(model, gen)
    return model


def _make_image_processor():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=64,
                                    max_pixels=64 * 64)


def _processor_from_dir(path):
    """A Qwen3VLProcessor from `path`, through its own constructor, without a video processor and with only the
    processor's attribute class check skipped (transformers' lookup of the video-processor base class fails when
    torchvision is not installed). The t2va text encoder step only calls `create_mm_token_type_ids`."""
    from transformers import Qwen2Tokenizer, Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    processor = Qwen3VLProcessor.__new__(Qwen3VLProcessor)
    processor.check_argument_for_proper_class = lambda name, arg: type(arg)
    Qwen3VLProcessor.__init__(processor, image_processor=Qwen2VLImageProcessorPil.from_pretrained(path),
                              tokenizer=Qwen2Tokenizer.from_pretrained(path), video_processor=None)
    del processor.check_argument_for_proper_class
    return processor


def build(root: str, seed: int = 0) -> None:
    """Write every component of a tiny MiniMax-H3 t2va pipeline under `root` (float32, random weights,
    deterministic per seed), plus `modular_model_index.json`."""
    import diffusers
    from diffusers import (AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio, MiniMaxH3Scheduler,
                           MiniMaxH3Transformer3DModel)

    os.makedirs(root, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)

    torch.manual_seed(seed + 1)
    transformer = MiniMaxH3Transformer3DModel(**TRANSFORMER_CONFIG).eval()
    _perturb_constants(transformer, gen)
    transformer.save_pretrained(os.path.join(root, "transformer"), safe_serialization=True)

    lat = VAE_CONFIG["latent_channels"]
    torch.manual_seed(seed + 2)
    vae = AutoencoderKLMiniMaxH3(
        **VAE_CONFIG,
        latents_mean=tuple((0.1 * torch.randn(lat, generator=gen)).tolist()),
        latents_std=tuple((0.75 + 0.5 * torch.rand(lat, generator=gen)).tolist()),
    ).eval()
    _perturb_constants(vae, gen)
    vae.save_pretrained(os.path.join(root, "vae"), safe_serialization=True)

    alat = AUDIO_VAE_CONFIG["latent_channels"]
    torch.manual_seed(seed + 3)
    audio_vae = AutoencoderKLMiniMaxH3Audio(
        **AUDIO_VAE_CONFIG,
        latents_mean=(0.1 * torch.randn(alat, generator=gen)).tolist(),
        latents_std=(0.75 + 0.5 * torch.rand(alat, generator=gen)).tolist(),
    ).eval()
    _perturb_constants(audio_vae, gen)
    audio_vae.save_pretrained(os.path.join(root, "audio_vae"), safe_serialization=True)

    MiniMaxH3Scheduler(shift=12.0).save_pretrained(os.path.join(root, "scheduler"))
    MiniMaxH3Scheduler(shift=3.0).save_pretrained(os.path.join(root, "audio_scheduler"))

    tokenizer = _make_tokenizer()
    tokenizer.save_pretrained(os.path.join(root, "tokenizer"))
    text_encoder = _make_text_encoder(tokenizer, seed + 4)
    text_encoder.save_pretrained(os.path.join(root, "text_encoder"))

    # The processor folder of a Qwen3-VL repository: its tokenizer, the image processor config and
    # processor_config.json (written by hand: ProcessorMixin cannot be instantiated here without torchvision).
    pdir = os.path.join(root, "processor")
    tokenizer.save_pretrained(pdir)
    _make_image_processor().save_pretrained(pdir)
    with open(os.path.join(pdir, "processor_config.json"), "w") as fp:
        json.dump({"processor_class": "Qwen3VLProcessor"}, fp, indent=2)

    # The index names a placeholder repository; ModularPipeline rewrites every component whose files are in the
    # local directory to that directory, so the tree can be moved.
    index = {
        "_class_name": "MiniMaxH3ModularPipeline",
        "_diffusers_version": diffusers.__version__,
        "_blocks_class_name": "MiniMaxH3Blocks",
        "canvas_short_edge": HEIGHT,
        "canvas_max_pixels": HEIGHT * WIDTH,
    }
    for name, (library, class_name) in _COMPONENTS.items():
        index[name] = [library, class_name, {
            "pretrained_model_name_or_path": "local/minimax-h3-tiny", "subfolder": name, "variant": None,
            "revision": None, "type_hint": [library, class_name]}]
    with open(os.path.join(root, "modular_model_index.json"), "w") as fp:
        json.dump(index, fp, indent=2)


# Components `load` could not load through `load_components` and built another way, name -> how (see `load`).
LOAD_FALLBACKS = {}


def _diffusers_model_from_dir(cls, path):
    """`cls` from a save_pretrained directory without accelerate: from_config, then the safetensors weights with a
    strict load_state_dict (float32 throughout, so `_keep_in_fp32_modules` changes nothing)."""
    from safetensors.torch import load_file

    model = cls.from_config(cls.load_config(path))
    model.load_state_dict(load_file(os.path.join(path, "diffusion_pytorch_model.safetensors")), strict=True)
    return model.eval()


def load(root: str, transformer=None):
    """The MiniMax-H3 modular pipeline (t2va workflow) over root's components, CPU float32. With `transformer`
    (any object), that object is used instead of root/transformer.

    Components load through `ModularPipeline.from_pretrained(root, workflow="t2va")` + `load_components`. Two
    environment gaps have fallbacks, taken only for what `load_components` left unloaded (recorded in
    LOAD_FALLBACKS): without accelerate, diffusers' `from_pretrained` refuses the MiniMax-H3 models (they declare
    `_keep_in_fp32_modules`, which needs `low_cpu_mem_usage=True`, which needs accelerate), so they are built
    with from_config + a strict load_state_dict; without torchvision a Qwen3VLProcessor cannot be constructed,
    so it is built with its class check skipped (`_processor_from_dir`)."""
    import diffusers
    from diffusers import ModularPipeline
    from diffusers.utils import logging as dlogging

    pipe = ModularPipeline.from_pretrained(root, workflow="t2va")
    names = [n for n in pipe.pretrained_component_names if not (n == "transformer" and transformer is not None)]
    level = dlogging.get_verbosity()
    dlogging.set_verbosity_error()  # a failed component load is a logged warning; the fallbacks below cover it
    try:
        pipe.load_components(names=names, dtype=torch.float32)
    finally:
        dlogging.set_verbosity(level)
    LOAD_FALLBACKS.clear()
    for name in names:
        if getattr(pipe, name, None) is not None:
            continue
        library, class_name = _COMPONENTS[name]
        path = os.path.join(root, name)
        if name == "processor":
            pipe.update_components(processor=_processor_from_dir(path))
            LOAD_FALLBACKS[name] = "Qwen3VLProcessor constructor with its class check skipped (no torchvision)"
        elif library == "diffusers" and issubclass(getattr(diffusers, class_name), diffusers.ModelMixin):
            pipe.update_components(**{name: _diffusers_model_from_dir(getattr(diffusers, class_name), path)})
            LOAD_FALLBACKS[name] = "from_config + load_state_dict (diffusers from_pretrained needs accelerate)"
    if transformer is not None:
        pipe.update_components(transformer=transformer)
    missing = [n for n in pipe.pretrained_component_names if getattr(pipe, n, None) is None]
    if missing:
        raise RuntimeError(f"components not loaded: {missing}")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def generate(pipe, seed: int = 0, steps: int = 2, latent: bool = False, **kwargs) -> dict:
    """One t2va request (124 frames at 16 x 24, 5.17 s of stereo audio at 160 Hz), decoded:
    {"video": [1, 124, 16, 24, 3] in [0, 1], "audio": [1, 2, 828] in [-1, 1]}, float32, deterministic per seed;
    with `latent` the denoised latents instead (the modular pipeline's outputs "latents" and "audio_latents",
    its equivalent of output_type="latent"). Other keyword arguments (attention_kwargs) go to the pipeline.

    `steps` is the number of denoising steps, i.e. transformer forwards. MiniMaxH3Scheduler's
    `num_inference_steps` counts sigma grid points including the terminal 0 (N points -> N - 1 forwards), so the
    pipeline gets `num_inference_steps=steps + 1`. With the default 2: forward 0 at t = 0 for both modalities (one
    distinct timestep), forward 1 at t = 0.0769 (video, shift 12) and 0.25 (audio, shift 3)."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    generator = torch.Generator("cpu").manual_seed(seed)
    if latent:
        out = pipe(prompt=PROMPT, height=HEIGHT, width=WIDTH, num_frames=NUM_FRAMES, num_inference_steps=steps + 1,
                   generator=generator, output=["latents", "audio_latents"], **kwargs)
        return {k: out[n].detach().to(torch.float32).cpu().numpy() for k, n in (("video", "latents"),
                                                                                 ("audio", "audio_latents"))}
    out = pipe(prompt=PROMPT, height=HEIGHT, width=WIDTH, num_frames=NUM_FRAMES, num_inference_steps=steps + 1,
               generator=generator, output_type="np", output=["videos", "audio"], **kwargs)
    video = np.asarray(out["videos"], dtype=np.float32)
    audio = out["audio"].detach().to(torch.float32).cpu().numpy()
    return {"video": video, "audio": audio}


# ---- __main__: determinism, a non-Module stand-in, and meshdit on the pipeline's real transformer inputs ----


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--meshdit", default=os.path.join(here, "..", "..", "build", "meshdit"))
    ap.add_argument("--keep", help="build into this directory (kept) instead of a temporary one")
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args()
    meshdit = os.path.abspath(args.meshdit)

    root = os.path.abspath(args.keep) if args.keep else tempfile.mkdtemp(prefix="h3_pipeline_")
    ok = True
    try:
        t0 = time.perf_counter()
        build(root, seed=0)
        print(f"build: {time.perf_counter() - t0:.2f} s -> {root}")
        with open(os.path.join(root, "transformer", "config.json")) as fp:
            cfg = json.load(fp)
        for tp in (2, 4):
            for key in ("num_attention_heads", "time_embed_dim", "ffn_dim"):
                assert cfg[key] % tp == 0, (key, cfg[key], tp)

        t0 = time.perf_counter()
        pipe = load(root)
        print(f"load: {time.perf_counter() - t0:.2f} s; transformer {type(pipe.transformer).__name__}")
        for name, how in LOAD_FALLBACKS.items():
            print(f"  {name}: {how}")
        calls, handle = _capture_calls(pipe.transformer)
        t0 = time.perf_counter()
        a = generate(pipe, seed=0, steps=args.steps)
        t1 = time.perf_counter()
        handle.remove()
        b = generate(pipe, seed=0, steps=args.steps)
        t2 = time.perf_counter()
        for k in a:
            d = float(np.abs(a[k] - b[k]).max())
            sat = float(np.mean((a[k] <= (0.0 if k == "video" else -1.0)) | (a[k] >= 1.0)))
            print(f"{k:6s} {tuple(a[k].shape)} {a[k].dtype} range [{a[k].min():.4f}, {a[k].max():.4f}] "
                  f"clamped {sat:.1%}; max|run1 - run2| = {d:.3e}")
            ok &= d == 0.0
        print(f"generate ({args.steps} steps): {t1 - t0:.2f} s, {t2 - t1:.2f} s")

        # The same pipeline with a plain-object stand-in for the transformer must give the same outputs.
        proxy_pipe = load(root, transformer=_ForwardProxy(pipe.transformer))
        c = generate(proxy_pipe, seed=0, steps=args.steps)
        d = max(float(np.abs(a[k] - c[k]).max()) for k in a)
        print(f"non-Module stand-in ({type(proxy_pipe.transformer).__name__}): max|diff| = {d:.3e}")
        ok &= d == 0.0

        if not os.path.exists(meshdit):
            print(f"meshdit not found at {meshdit}; skipping the meshdit checks")
            return 0 if ok else 1
        tdir = os.path.join(root, "transformer")
        for cmd in ([meshdit, "inputs", "--checkpoint", tdir, "--out", "/tmp/h3_in.safetensors"],
                    [meshdit, "run", "--checkpoint", tdir, "--inputs", "/tmp/h3_in.safetensors",
                     "--out", "/tmp/h3_out.safetensors", "--quiet"]):
            r = subprocess.run(cmd, capture_output=True, text=True)
            print(f"$ {' '.join(cmd[1:])}: rc {r.returncode}")
            if r.returncode:
                print(r.stdout + r.stderr)
                ok = False

        # Every denoising step's transformer call, replayed in meshdit: step 0 (one distinct timestep, t = 0 for
        # both modalities) and the later ones (video and audio on their own schedules: two timesteps).
        for step, call in enumerate(calls):
            print(f"step {step} timestep {[round(float(t), 6) for t in call['kwargs']['timestep']]}")
            ok &= _replay(meshdit, tdir, call, f"/tmp/h3_step{step}.safetensors", f"/tmp/h3_step{step}_out.safetensors",
                          f"step {step}", outputs=("sample", "audio_sample"))
        print("OK" if ok else "FAILED")
        return 0 if ok else 1
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
