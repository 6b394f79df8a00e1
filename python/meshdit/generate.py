"""`meshdit generate`: a prompt in, a PNG or MP4 out, with the transformer on a meshdit mesh.

The `Engine` here is what both `meshdit generate` and `meshdit api` run: one diffusers pipeline
(its class from the folder's ``model_index.json``) whose transformer is a `meshdit.Transformer`
on the mesh, and a `run(Request)` that maps the request's family-neutral fields (prompt,
negative prompt, steps, guidance, size, frames, seed, n) onto the pipeline's own arguments,
reports every step (`on_event`), can stop between two steps (`cancel`), and can decode a preview
of the predicted final image every K steps (x0 = x_t - sigma * v, flow matching).

Needs torch and diffusers (``pip install 'meshdit[serve]'``).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import inspect
import json
import math
import os
import re
import secrets
import sys
import tempfile
import threading
import time
from typing import Any, Callable

from .client import MeshditError

# ---- the pipelines meshdit generates with -------------------------------------------------------
# kind: what it makes; guidance: how `--guidance` (and `--true-cfg`, `--negative-prompt`) map onto
# the pipeline's arguments (see _guidance_kwargs and docs/service.md).
PIPELINES = {
    "FluxPipeline": "image",
    "FluxKontextPipeline": "image",  # edits: an input image (FLUX.1 Kontext)
    "FluxImg2ImgPipeline": "image",  # edits: an input image and a strength
    "FluxInpaintPipeline": "image",  # edits: an input image, a mask and a strength
    "Flux2Pipeline": "image",
    "Flux2KleinPipeline": "image",
    "QwenImagePipeline": "image",
    "QwenImageEditPipeline": "image",  # edits: an input image (Qwen-Image-Edit)
    "QwenImageEditPlusPipeline": "image",  # edits: 1 to 4 input images (Qwen-Image-Edit-2509/2511)
    "WanPipeline": "video",
}


# the largest |guidance| or |true_cfg| taken: far above any useful scale, and the bound the mesh
# puts on a LoRA weight (a non-finite one is refused as well)
MAX_SCALE = 1e6
# text tokens a pipeline accepts: diffusers' FluxPipeline refuses more than 512 and
# QwenImagePipeline more than 1024; the others (Flux.2, Wan, MiniMax-H3) enforce none, so only a
# bound against a prompt padded to an absurd length (memory), far above their 512 default
# FLUX.1's pipelines: one transformer, one latent packing, FluxPipeline's guidance arguments
FLUX1 = ("FluxPipeline", "FluxKontextPipeline", "FluxImg2ImgPipeline", "FluxInpaintPipeline")
# Qwen-Image's pipelines: one transformer, one latent packing, true CFG (true_cfg_scale)
QWEN = ("QwenImagePipeline", "QwenImageEditPipeline", "QwenImageEditPlusPipeline")
MAX_SEQUENCE_LENGTH = {**{n: 512 for n in FLUX1}, **{n: 1024 for n in QWEN}}
MAX_INPUT_IMAGES = 4  # input images of one request (Flux.2 [klein]'s, Qwen-Image-Edit-2509's)
MULTI_IMAGE = ("Flux2KleinPipeline", "QwenImageEditPlusPipeline")  # take a list of images
NEEDS_IMAGE = ("QwenImageEditPipeline", "QwenImageEditPlusPipeline")  # edit models: an image
FROM_IMAGE = ("FluxImg2ImgPipeline", "FluxInpaintPipeline")  # start from the image's latents
MAX_SEQUENCE_LENGTH_OTHERS = 8192
# the largest width or height taken: 4x a 4096-pixel side; far beyond, the schedulers' shift of
# the token count overflows (math range error) before any memory check
MAX_SIDE = 16384
SIZE_RE = re.compile(r"([0-9]+)x([0-9]+)")  # WIDTHxHEIGHT, ASCII digits only


def max_sequence_length(class_name: str) -> int:
    return MAX_SEQUENCE_LENGTH.get(class_name, MAX_SEQUENCE_LENGTH_OTHERS)


class RequestError(ValueError):
    """A request the engine refuses: `param` names the field, the message the constraint."""

    def __init__(self, param: str | None, message: str):
        super().__init__(message)
        self.param = param


def check_values(r: "Request", class_name: str) -> None:
    """The checks that need no pipeline (run before one is loaded): text that is valid Unicode,
    finite scales of at most MAX_SCALE, max_sequence_length within what `class_name` accepts.
    RequestError naming the field."""
    for name in ("prompt", "negative_prompt"):
        v = getattr(r, name)
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as e:
                raise RequestError(name, f"{name} must be valid Unicode text (a lone surrogate "
                                         f"at character {e.start})") from None
    for name in ("guidance", "true_cfg"):
        v = getattr(r, name)
        if v is not None and not (isinstance(v, (int, float)) and math.isfinite(v)
                                  and abs(v) <= MAX_SCALE):
            raise RequestError(name, f"{name} {v!r}: must be a finite number of magnitude at "
                                     f"most {MAX_SCALE:g}")
    limit = max_sequence_length(class_name)
    if r.max_sequence_length is not None and not 1 <= r.max_sequence_length <= limit:
        raise RequestError("max_sequence_length", f"max_sequence_length {r.max_sequence_length}: "
                                                  f"{class_name} takes 1 to {limit}")


class Cancelled(Exception):
    """Raised between two steps when a job's cancel flag is set."""


@dataclasses.dataclass
class Request:
    """What to generate. None means the pipeline's default (reported in the Result)."""

    prompt: str
    negative_prompt: str | None = None
    steps: int | None = None
    guidance: float | None = None
    true_cfg: float | None = None  # FluxPipeline with guidance embeddings only (true CFG on top)
    width: int | None = None
    height: int | None = None
    frames: int | None = None  # video pipelines only
    fps: int = 16  # video pipelines only: the MP4's frame rate
    seed: int | None = None  # None: a random seed, reported
    n: int = 1  # images: one batch of n, image k from seed + k
    max_sequence_length: int | None = None
    preview_every: int = 0  # 0: no previews
    loras: dict | None = None  # {adapter name: weight} of those loaded (--lora); None: theirs
    images: list | None = None  # input images (PIL) of an edit pipeline; None: none
    mask: Any = None  # FluxInpaintPipeline's mask (PIL, white: repaint)
    strength: float | None = None  # img2img / inpaint: how far from the input image


@dataclasses.dataclass
class Result:
    kind: str  # "image" or "video"
    images: list  # PIL images (image pipelines)
    frames: Any  # numpy [F, H, W, 3] float in [0, 1] (video pipelines), else None
    fps: int
    seeds: list
    width: int
    height: int
    steps: int
    pipeline_kwargs: dict  # what the pipeline was called with (no tensors)
    seconds: float  # the pipeline call
    step_seconds: list  # per denoising step
    resumes: list  # lost ranks recovered during this run (meshdit/_resume.py)
    loras: dict = dataclasses.field(default_factory=dict)  # the adapters' weights it ran with


# ---- finding the model ---------------------------------------------------------------------------
def resolve_model(model: str) -> str:
    """A diffusers pipeline folder: `model` itself, or a hub id found in the local Hugging Face
    cache. Never downloads."""
    if os.path.isdir(model):
        if not os.path.isfile(os.path.join(model, "model_index.json")):
            raise MeshditError(f"meshdit: '{model}' has no model_index.json: --model takes a "
                               f"diffusers pipeline folder (with transformer/, vae/, ...)")
        return os.path.abspath(model)
    parts = model.split("/")
    if len(parts) != 2 or not all(parts) or os.sep in model.replace("/", "") or model.startswith("."):
        raise MeshditError(f"meshdit: --model '{model}' is neither a folder nor a hub id "
                           f"(ORG/NAME)")
    try:
        from huggingface_hub import snapshot_download
        path = snapshot_download(model, local_files_only=True)
    except Exception:  # not cached (LocalEntryNotFoundError), or no huggingface_hub
        raise MeshditError(f"meshdit: '{model}' is not in the local Hugging Face cache: download "
                           f"it first (hf download {model}) or pass its folder") from None
    if not os.path.isfile(os.path.join(path, "model_index.json")):
        raise MeshditError(f"meshdit: the cached '{model}' ({path}) has no model_index.json: it "
                           f"is not a diffusers pipeline")
    return path


def read_model_index(root: str) -> dict:
    path = os.path.join(root, "model_index.json")
    try:
        with open(path, encoding="utf-8") as f:
            index = json.load(f)
    except (OSError, ValueError) as e:  # missing, unreadable, not UTF-8, not JSON
        raise MeshditError(f"meshdit: {path}: {' '.join(str(e).split())}") from None
    if not isinstance(index, dict):
        raise MeshditError(f"meshdit: {path}: not a JSON object")
    name = index.get("_class_name")
    if not isinstance(name, str) or name not in PIPELINES:
        raise MeshditError(f"meshdit: {root}: pipeline class '{name}' is not one meshdit "
                           f"generates with ({', '.join(PIPELINES)})")
    for key, val in index.items():
        if key.startswith("transformer") and key != "transformer" and val and val[0] is not None \
                and not (key == "transformer_2" and name == "WanPipeline"):
            raise MeshditError(f"meshdit: {root}: the pipeline has a second transformer "
                               f"('{key}'), which meshdit runs for WanPipeline only (Wan 2.2 "
                               f"A14B's transformer_2)")
    if not os.path.isdir(os.path.join(root, "transformer")):
        raise MeshditError(f"meshdit: {root} has no transformer/ folder")
    return index


def _quiet_loading_bars() -> None:
    """diffusers' and transformers' own loading bars off: the engine prints its load lines."""
    from diffusers.utils import logging as dlog
    dlog.disable_progress_bar()
    try:
        from transformers.utils import logging as tlog
        tlog.disable_progress_bar()
    except ImportError:
        pass


def _torch_dtype(name: str):
    import torch
    table = {"float32": torch.float32, "f32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "f16": torch.float16}
    if name not in table:
        raise MeshditError(f"meshdit: --pipeline-dtype '{name}': one of float32, bfloat16, float16")
    return table[name]


# ---- the engine ----------------------------------------------------------------------------------
class Engine:
    """One pipeline resident, its transformer on the mesh. `log(line)` gets the load's lines.

    Mesh options are `meshdit.Transformer.from_pretrained`'s (cfg, tp, ring, ulysses,
    mesh_order, device, dtype, binary, launcher, step_timeout, max_memory, resume, env);
    pipeline_device and pipeline_dtype place the rest of the pipeline (text encoders, VAE) in
    this process. `loras`: (file, weight) pairs loaded as the pipeline's own
    `load_lora_weights` + `set_adapters` would (text encoder parts included); `cache`: a
    diffusers cache config (`cache_config`) enabled on the transformer.
    """

    def __init__(self, model: str, *, pipeline_device: str = "cpu",
                 pipeline_dtype: str = "float32", log: Callable[[str], None] = print,
                 resume: bool | dict = True, loras: list[tuple[str, float]] = (),
                 loras_2: list[tuple[str, float]] = (),
                 cache=None, **mesh):
        import diffusers
        import torch
        from diffusers.utils import logging as dlog

        import meshdit
        self.model = model
        self.root = resolve_model(model)
        self.index = read_model_index(self.root)
        self.class_name = self.index["_class_name"]
        self.kind = PIPELINES[self.class_name]
        self.log = log
        self._lock = threading.Lock()  # one generation at a time
        layout = {k: int(mesh.get(k) or 1) for k in ("cfg", "tp", "ring", "ulysses")}
        world = layout["cfg"] * layout["tp"] * layout["ring"] * layout["ulysses"]
        log(f"meshdit: {self.class_name} from {self.root}")
        t0 = time.perf_counter()
        log(f"loading the transformer on {world} rank{'s' if world > 1 else ''} "
            + (f"(cfg {layout['cfg']} x " if layout["cfg"] > 1 else "(")
            + f"tp {layout['tp']} x ring {layout['ring']} x ulysses {layout['ulysses']}) ...")
        opts = {k: v for k, v in mesh.items() if v is not None}
        self.transformer = meshdit.Transformer.from_pretrained(
            os.path.join(self.root, "transformer"), resume=resume, **opts)
        self.transformer_2 = None  # Wan 2.2 A14B's low-noise expert: a mesh of its own
        try:
            self.load_seconds = {"transformer": time.perf_counter() - t0}
            log(plan_line(self.transformer.info) +
                f"; loaded in {self.load_seconds['transformer']:.2f} s")
            if (self.index.get("transformer_2") or [None])[0] is not None:
                t2 = time.perf_counter()
                log(f"loading transformer_2 (the low-noise expert) on {world} more "
                    f"rank{'s' if world > 1 else ''} ...")
                self.transformer_2 = meshdit.Transformer.from_pretrained(
                    os.path.join(self.root, "transformer_2"), resume=resume, **opts)
                self.load_seconds["transformer_2"] = time.perf_counter() - t2
                log(plan_line(self.transformer_2.info) +
                    f"; loaded in {self.load_seconds['transformer_2']:.2f} s")
            t1 = time.perf_counter()
            others = [k for k, v in self.index.items() if not k.startswith("_")  # components
                      and k not in ("transformer", "transformer_2") and isinstance(v, list)
                      and v and v[0] is not None]  # (boundary_ratio: 0.875 is a setting)
            log(f"loading {', '.join(others)} in this process ({pipeline_device}, {pipeline_dtype}) ...")
            cls = getattr(diffusers, self.class_name)
            level = dlog.get_verbosity()
            dlog.set_verbosity_error()  # "Expected types for transformer", accelerate's advice
            _quiet_loading_bars()
            extra = {"transformer_2": self.transformer_2} if self.transformer_2 else {}
            try:
                self.pipe = cls.from_pretrained(self.root, transformer=self.transformer,
                                                dtype=_torch_dtype(pipeline_dtype), **extra)
            finally:
                dlog.set_verbosity(level)
            self.pipe.set_progress_bar_config(disable=True)
            self.pipe.to(pipeline_device)
            self.device = torch.device(pipeline_device)
            self.load_seconds["pipeline"] = time.perf_counter() - t1
            log(f"pipeline ready in {self.load_seconds['pipeline']:.2f} s")
            self.loras = self._load_loras(loras, loras_2)
            self.cache = None
            if cache is not None:
                for t in self.transformers:  # each expert its own hook, as a diffusers user does
                    try:
                        t.enable_cache(copy.deepcopy(cache))
                    except (ValueError, NotImplementedError) as e:  # this family does not run it
                        why = str(e).removeprefix("meshdit: ")
                        raise MeshditError(f"meshdit: --cache: {why}") from None
                self.cache = self.transformer._cache_spec
                log(f"step cache: {self.cache}")
        except BaseException:
            self.close()
            raise
        self._sig = inspect.signature(type(self.pipe).__call__).parameters
        self.defaults = self._defaults()

    def _check_aspects(self, images: list) -> None:
        """Qwen-Image-Edit's pipelines resize each input image to fixed pixel areas at its aspect
        (their module's calculate_dimensions, sides rounded to 32): an image so elongated that a
        side rounds to 0 fails inside diffusers ("height and width must be > 0"), after the mesh
        started; refused here naming it, with the pipeline's own function and areas."""
        mod = sys.modules.get(type(self.pipe).__module__)
        dims = getattr(mod, "calculate_dimensions", None)
        if dims is None or self.class_name not in QWEN:
            return
        areas = [a for a in (getattr(mod, n, None) for n in ("CONDITION_IMAGE_SIZE", "VAE_IMAGE_SIZE"))
                 if isinstance(a, int)] or [1024 * 1024]
        for k, im in enumerate(images):  # (one for QwenImageEditPipeline: checked before)
            w, h = im.size
            for area in areas:
                cw, ch = dims(area, w / h)[:2]
                if cw < 1 or ch < 1:
                    raise RequestError("image", f"input image {k + 1} is {w}x{h}: "
                                                f"{self.class_name} resizes it to {area:,} pixels at "
                                                f"its aspect, which leaves a side of 0 (too "
                                                f"elongated)")

    def _check_inputs(self, r: Request, max_pixels: int | None) -> None:
        """An edit's input images, mask and strength, for the pipelines that take them; each
        refused naming it where the pipeline would fail or ignore it. strength gets the
        pipeline's default (explicit in the call)."""
        sig, name = self._sig, self.class_name
        if r.images is not None:
            if "image" not in sig:
                raise RequestError("image", f"{name} takes no input image (an edit pipeline "
                                            f"does: {', '.join(FLUX1[1:] + QWEN[1:])}, "
                                            f"Flux2KleinPipeline)")
            if not r.images or len(r.images) > (MAX_INPUT_IMAGES if name in MULTI_IMAGE else 1):
                raise RequestError("image", f"{len(r.images)} input images: {name} takes "
                                            + ("1 to " + str(MAX_INPUT_IMAGES)
                                               if name in MULTI_IMAGE else "one"))
            for im in r.images + ([r.mask] if r.mask is not None else []):
                if max_pixels and im.size[0] * im.size[1] > 4 * max_pixels:
                    raise RequestError("image", f"an input image of {im.size[0]}x{im.size[1]} is "
                                                f"over 4 x the pixel limit ({4 * max_pixels:,})")
            # an image given as a PIL object in any mode is read as a file is (load_image: RGB)
            r.images = [im if im.mode == "RGB" else im.convert("RGB") for im in r.images]
            self._check_aspects(r.images)
        elif name in FROM_IMAGE + NEEDS_IMAGE:
            raise RequestError("image", f"{name} needs an input image")
        if r.n > 1 and name in FROM_IMAGE:
            # diffusers encodes the image once and samples its latent with the first generator
            # only: image k of a batch is not the image of seed + k, as a report would say
            raise RequestError("n", f"n {r.n}: {name} makes one image a request here (its "
                                    f"batch draws every image's start from the first seed)")
        if r.mask is not None and "mask_image" not in sig:
            raise RequestError("mask", f"{name} takes no mask (FluxInpaintPipeline does)")
        if r.mask is None and "mask_image" in sig:
            raise RequestError("mask", f"{name} needs a mask (white: the area to repaint)")
        if r.mask is not None and r.mask.size != r.images[0].size:
            raise RequestError("mask", f"the mask is {r.mask.size[0]}x{r.mask.size[1]}, the image "
                                       f"{r.images[0].size[0]}x{r.images[0].size[1]}")
        if "strength" in sig:
            r.strength = sig["strength"].default if r.strength is None else r.strength
            if isinstance(r.strength, bool) or not isinstance(r.strength, (int, float)) \
                    or not 0 < r.strength <= 1:
                raise RequestError("strength", f"strength {r.strength!r}: must be in (0, 1]")
        elif r.strength is not None:
            raise RequestError("strength", f"{name} takes no strength (an img2img or inpaint "
                                           f"pipeline does)")

    def _check_loras(self, want) -> None:
        """A request's adapter weights: names of the loaded adapters, finite numbers."""
        if not isinstance(want, dict):
            raise RequestError("lora", "lora must be an object of adapter name: weight")
        names = [a["name"] for a in self.loras]
        for name, w in want.items():
            if name not in names:
                raise RequestError("lora", f"lora: no adapter '{str(name)[:60]}' "
                                           f"(loaded: {', '.join(names) or 'none, see --lora'})")
            # (abs() first: math.isfinite of a 400-digit int raises OverflowError)
            if isinstance(w, bool) or not isinstance(w, (int, float)) or abs(w) > MAX_SCALE \
                    or not math.isfinite(w):
                raise RequestError("lora", f"lora: the weight of '{name}' must be a finite "
                                           f"number of magnitude at most {MAX_SCALE:g}")

    def _set_loras(self, want: dict | None) -> dict:
        """The adapters' weights for one generation: the request's (an adapter it does not name
        is off), or the --lora weights. peft's state only: the mesh fuses when it changes."""
        if not self.loras:
            return {}
        names = [a["name"] for a in self.loras]
        weights = ([a["weight"] for a in self.loras] if want is None
                   else [float(want.get(n, 0.0)) for n in names])
        self.pipe.set_adapters(names, weights)
        return dict(zip(names, weights))

    def _load_loras(self, loras, loras_2=()) -> list[dict]:
        """Each (file, weight) through the pipeline's own LoRA loader, under a name of its own
        (the file's stem), then set_adapters with the weights: what a diffusers user's
        `pipe.load_lora_weights(f, adapter_name=n); pipe.set_adapters(names, weights)` does.
        `loras_2` go into Wan 2.2 A14B's transformer_2 (`load_into_transformer_2=True`: the
        low-noise expert's file of a pair), `loras` into the transformer."""
        if not loras and not loras_2:
            return []
        if loras_2 and self.transformer_2 is None:
            raise MeshditError(f"meshdit: --lora-2: {self.class_name} here has no transformer_2 "
                               f"(Wan 2.2 A14B's low-noise expert)")
        if not hasattr(self.pipe, "load_lora_weights"):
            raise MeshditError(f"meshdit: --lora: {self.class_name} has no LoRA loader")
        names, out = [], []
        for path, weight, into_2 in [(p, w, False) for p, w in loras] + \
                [(p, w, True) for p, w in loras_2]:
            stem = re.sub(r"[^A-Za-z0-9_-]", "_", os.path.splitext(os.path.basename(
                path.rstrip("/")))[0]) or "lora"
            name, k = stem, 2
            while name in names:
                name, k = f"{stem}-{k}", k + 1
            t0 = time.perf_counter()
            opt = "--lora-2" if into_2 else "--lora"
            try:
                self.pipe.load_lora_weights(path, adapter_name=name,
                                            **({"load_into_transformer_2": True} if into_2 else {}))
            except (OSError, ValueError, KeyError, TypeError, NotImplementedError) as e:
                raise MeshditError(f"meshdit: {opt} {path}: {' '.join(str(e).split())}") from None
            names.append(name)
            out.append({"name": name, "file": path, "weight": weight,
                        "transformer": "transformer_2" if into_2 else "transformer"})
            self.log(f"LoRA '{name}' from {path} (weight {weight:g}"
                     + (", into transformer_2" if into_2 else "") +
                     f") loaded in {time.perf_counter() - t0:.2f} s")
        self.pipe.set_adapters(names, [a["weight"] for a in out])
        return out

    # -- what the pipeline takes ------------------------------------------------------------------
    def _defaults(self) -> dict:
        p, pipe = self._sig, self.pipe

        def default(name, fallback=None):
            v = p[name].default if name in p else inspect.Parameter.empty
            return fallback if v in (inspect.Parameter.empty, None) else v
        if self.kind == "video":
            mult = pipe.vae_scale_factor_spatial * int(pipe.transformer.config.patch_size[1])
            size = (default("width", 832), default("height", 480))
            tmult = pipe.vae_scale_factor_temporal
        else:
            mult = pipe.vae_scale_factor * 2
            side = getattr(pipe, "default_sample_size", 128) * pipe.vae_scale_factor
            size = (default("width", side), default("height", side))
            tmult = None
        return {"steps": default("num_inference_steps", 50), "width": size[0], "height": size[1],
                "multiple": mult, "frames": default("num_frames", 81) if self.kind == "video" else None,
                "frame_multiple": tmult,
                "max_sequence_length": default("max_sequence_length", 512)}

    def check(self, req: Request, *, max_pixels: int | None = None, max_frames: int | None = None,
              max_steps: int | None = None, max_n: int | None = None) -> Request:
        """The request with the pipeline's defaults filled in, or RequestError naming the field."""
        d = self.defaults
        r = dataclasses.replace(req)
        if not isinstance(r.prompt, str) or not r.prompt.strip():
            raise RequestError("prompt", "prompt must be a non-empty string")
        if r.negative_prompt is not None and not isinstance(r.negative_prompt, str):
            raise RequestError("negative_prompt", "negative_prompt must be a string")
        check_values(r, self.class_name)
        self._check_inputs(r, max_pixels)
        r.steps = d["steps"] if r.steps is None else r.steps
        if r.images and r.width is None and r.height is None:  # the input image's size
            # (rounded down to the pipeline's multiple, as diffusers does; Qwen-Image-Edit-2509
            # takes the aspect of the last image, which is the one whose size is kept here)
            w, h = r.images[-1 if self.class_name == "QwenImageEditPlusPipeline" else 0].size
            if max_pixels and w * h > max_pixels:  # a photo over the limit: scaled down to it
                f = math.sqrt(max_pixels / (w * h))
                w, h = int(w * f), int(h * f)
            r.width, r.height = (max(d["multiple"], v - v % d["multiple"]) for v in (w, h))
        r.width = d["width"] if r.width is None else r.width
        r.height = d["height"] if r.height is None else r.height
        r.max_sequence_length = (d["max_sequence_length"] if r.max_sequence_length is None
                                 else r.max_sequence_length)
        if r.steps < 1 or (max_steps and r.steps > max_steps):
            raise RequestError("steps", f"steps {r.steps}: must be "
                                        + (f"1 to {max_steps}" if max_steps else "at least 1"))
        if r.steps < 2 and getattr(self.pipe.scheduler.config, "shift_terminal", None):
            # stretch_shift_to_terminal divides by 1 - the last sigma: one step is 0 / 0
            raise RequestError("steps", f"steps {r.steps}: {self.class_name}'s scheduler "
                                        f"(shift_terminal) needs at least 2")
        m = d["multiple"]
        for name, v in (("width", r.width), ("height", r.height)):
            if v < m or v % m:
                raise RequestError("size", f"{name} {v}: {self.class_name} needs a positive "
                                           f"multiple of {m}")
            if v > MAX_SIDE:
                raise RequestError("size", f"{name} {v}: at most {MAX_SIDE}")
        if max_pixels and r.width * r.height > max_pixels:
            raise RequestError("size", f"size {r.width}x{r.height} is {r.width * r.height:,} "
                                       f"pixels, over the limit of {max_pixels:,}")
        if r.n < 1 or (max_n and r.n > max_n):
            raise RequestError("n", f"n {r.n}: must be "
                                    + (f"1 to {max_n}" if max_n else "at least 1"))
        if self.kind == "video":
            r.frames = d["frames"] if r.frames is None else r.frames
            tm = d["frame_multiple"]
            if r.frames < 1 or (r.frames - 1) % tm:
                raise RequestError("frames", f"frames {r.frames}: {self.class_name} needs "
                                             f"{tm}k + 1 frames (1, {tm + 1}, {2 * tm + 1}, ...)")
            if max_frames and r.frames > max_frames:
                raise RequestError("frames", f"frames {r.frames}: over the limit of {max_frames}")
            if r.n != 1:
                raise RequestError("n", "a video request makes one video (n must be 1)")
            if not 1 <= r.fps <= 240:
                raise RequestError("fps", f"fps {r.fps}: must be 1 to 240")
        elif r.frames is not None:
            raise RequestError("frames", f"frames: {self.class_name} makes images, not videos")
        if r.guidance is not None and r.guidance < 0:
            raise RequestError("guidance", f"guidance {r.guidance}: must be >= 0")
        if r.max_sequence_length < 1:
            raise RequestError("max_sequence_length", "max_sequence_length must be >= 1")
        if r.seed is None:
            r.seed = secrets.randbelow(2 ** 31)
        if not 0 <= r.seed < 2 ** 63 - r.n:
            raise RequestError("seed", f"seed {r.seed}: must be 0 to {2 ** 63 - 1 - r.n} "
                                       f"(image k takes seed + k, below 2^63)")
        if r.preview_every < 0:
            raise RequestError("preview_every", "preview_every must be >= 0")
        if r.loras is not None:
            self._check_loras(r.loras)
        if r.preview_every > r.steps:
            raise RequestError("preview_every", f"preview_every {r.preview_every}: over the "
                                                f"{r.steps} steps, no preview would be made")
        if r.preview_every and not self._flow_matching():
            raise RequestError("preview_every", f"previews need a flow-matching scheduler; "
                                                f"{type(self.pipe.scheduler).__name__} is not one")
        self._guidance_kwargs(r)  # refuses a combination the pipeline would ignore
        return r

    def _flow_matching(self) -> bool:
        s = self.pipe.scheduler
        return (type(s).__name__ == "FlowMatchEulerDiscreteScheduler" or
                getattr(s.config, "prediction_type", None) == "flow_prediction")

    def _guidance_kwargs(self, r: Request) -> dict:
        """`guidance`, `true_cfg` and `negative_prompt` as this pipeline's arguments, every one
        given explicitly (the pipeline's default where the request has none); refuses what the
        pipeline would silently ignore. docs/service.md has the table."""
        name, g, neg, cfg = self.class_name, r.guidance, r.negative_prompt, r.true_cfg
        embeds = bool(self.pipe.transformer.config.get("guidance_embeds", False))

        def default(arg):
            return self._sig[arg].default
        if cfg is not None and not (name in FLUX1 and embeds):
            raise RequestError("true_cfg", f"true_cfg applies to a guidance-distilled FluxPipeline "
                                           f"only; for {name} use guidance")
        if name in FLUX1 and embeds:  # FLUX.1-dev: embedded guidance, true CFG optional
            kw = {"guidance_scale": default("guidance_scale") if g is None else g}
            if cfg is not None:
                if cfg <= 1:
                    raise RequestError("true_cfg", f"true_cfg {cfg}: must be > 1 (1 is no true CFG)")
                kw.update(true_cfg_scale=cfg, negative_prompt=neg or "")
            elif neg is not None:
                raise RequestError("negative_prompt", "this FluxPipeline is guidance-distilled: a "
                                   "negative prompt needs true CFG (true_cfg > 1) as well")
            return kw
        if name in FLUX1 + QWEN:  # true CFG: true_cfg_scale + negative
            scale = default("true_cfg_scale") if g is None else g
            if scale > 1:
                return {"true_cfg_scale": scale, "negative_prompt": neg or ""}
            if neg is not None:
                raise RequestError("negative_prompt", f"a negative prompt needs guidance > 1 "
                                                      f"(true CFG), got {scale}")
            return {"true_cfg_scale": scale}
        if name == "Flux2Pipeline":  # FLUX.2 [dev]: guidance-distilled, no negative prompt
            if neg is not None:
                raise RequestError("negative_prompt", "Flux2Pipeline is guidance-distilled and "
                                                      "takes no negative prompt")
            return {"guidance_scale": default("guidance_scale") if g is None else g}
        scale = default("guidance_scale") if g is None else g
        if name == "Flux2KleinPipeline":  # CFG with guidance_scale; negative as embeddings
            if getattr(self.pipe.config, "is_distilled", False):
                if (g is not None and g > 1) or neg is not None:
                    raise RequestError("guidance", "this Flux2KleinPipeline is step-distilled: it "
                                                   "uses neither guidance nor a negative prompt")
                return {"guidance_scale": 1.0}
        if neg is not None and scale <= 1:  # Klein, Wan: CFG with guidance_scale > 1
            raise RequestError("negative_prompt", f"a negative prompt needs guidance > 1, got {scale}")
        kw = {"guidance_scale": scale}
        if neg is not None:
            kw["negative_prompt"] = neg  # Klein: encoded in run() (the pipeline takes embeddings)
        return kw

    def pipeline_kwargs(self, r: Request) -> dict:
        """Every argument of the pipeline call for a checked request, except generator and
        callbacks (what a direct diffusers call with the same settings passes)."""
        kw = {"prompt": r.prompt, "height": r.height, "width": r.width,
              "num_inference_steps": r.steps, "max_sequence_length": r.max_sequence_length,
              **self._guidance_kwargs(r)}
        if self.kind == "video":
            kw["num_frames"] = r.frames
            kw["num_videos_per_prompt"] = 1
            kw["output_type"] = "np"
        else:
            kw["num_images_per_prompt"] = r.n
            kw["output_type"] = "pil"
        if r.images:
            kw["image"] = r.images if len(r.images) > 1 else r.images[0]
        if "max_area" in self._sig:  # Kontext scales its output to max_area (default 1024^2)
            kw["max_area"] = r.width * r.height  # whatever height and width say: these ones
        if r.mask is not None:
            kw["mask_image"] = r.mask
        if r.strength is not None:
            kw["strength"] = r.strength
        return kw

    # -- one generation ---------------------------------------------------------------------------
    def run(self, req: Request, on_event: Callable[..., None] | None = None,
            cancel: threading.Event | None = None, checked: bool = False) -> Result:
        """Generates `req`. on_event(name, **data) gets "start", "step" (step, steps, seconds,
        s_per_step), "preview" (step, images) and "resume" (the record). Raises Cancelled when
        `cancel` is set (checked before the start and between two steps)."""
        import torch
        r = req if checked else self.check(req)
        emit = on_event or (lambda *a, **k: None)
        kw = self.pipeline_kwargs(r)
        with self._lock:
            if cancel is not None and cancel.is_set():
                raise Cancelled()
            pipe, t = self.pipe, self.transformer
            lora_weights = self._set_loras(r.loras)
            gens = [torch.Generator("cpu").manual_seed(r.seed + k) for k in range(r.n)]
            call_kw = dict(kw)
            if self.class_name == "Flux2KleinPipeline" and "negative_prompt" in call_kw:
                neg = call_kw.pop("negative_prompt")
                with torch.inference_mode():
                    call_kw["negative_prompt_embeds"] = pipe.encode_prompt(
                        prompt=neg, device=self.device, num_images_per_prompt=1,
                        max_sequence_length=r.max_sequence_length)[0]
            marks = {"first": None, "last": None}
            step_seconds: list[float] = []
            x0 = {}

            def pre_hook(module, args):
                if marks["first"] is None:
                    marks["first"] = marks["last"] = time.perf_counter()

            def on_step(p, i, timestep, tensors):
                now = time.perf_counter()
                start = marks["last"] if marks["last"] is not None else now
                step_seconds.append(now - start)
                marks["last"] = now
                steps = int(getattr(p, "_num_timesteps", 0) or len(p.scheduler.timesteps))
                done = i + 1
                emit("step", step=done, steps=steps, seconds=step_seconds[-1],
                     s_per_step=(now - marks["first"]) / done)
                if r.preview_every and (done % r.preview_every == 0) and "x0" in x0:
                    emit("preview", step=done, steps=steps,
                         images=self._decode_preview(x0["x0"], r))
                if cancel is not None and cancel.is_set():
                    raise Cancelled()
                return {}

            sched = pipe.scheduler
            orig_step = sched.step
            if r.preview_every:
                def step(model_output, timestep, sample, *a, **k):
                    out = orig_step(model_output, timestep, sample, *a, **k)
                    idx = sched.step_index - 1  # the step just taken
                    sigma = sched.sigmas[idx].to(torch.float32)
                    x0["x0"] = sample.to(torch.float32) - sigma * model_output.to(torch.float32)
                    return out
                sched.step = step
            ts = self.transformers
            resumes_before = [len(getattr(x, "resumes", [])) for x in ts]

            def listener(rec):  # the step redone: the one after those done
                emit("resume", step=len(step_seconds) + 1, **rec)
            listeners = [x.resume_listeners for x in ts
                         if getattr(x, "resume_listeners", None) is not None]  # resume on
            for each in listeners:
                each.append(listener)
            hook = t.register_forward_pre_hook(pre_hook)
            emit("start", steps=r.steps, seeds=[r.seed + k for k in range(r.n)],
                 pipeline_kwargs=described(kw))
            t0 = time.perf_counter()
            try:
                with torch.inference_mode():
                    out = pipe(**call_kw, generator=gens if r.n > 1 else gens[0],
                               callback_on_step_end=on_step)
            finally:
                hook.remove()
                for each in listeners:
                    each.remove(listener)
                if r.preview_every:
                    del sched.step  # the class's method again
            seconds = time.perf_counter() - t0
            resumes = [rec for x, n in zip(ts, resumes_before)
                       for rec in getattr(x, "resumes", [])[n:]]
        if self.kind == "video":
            import numpy as np
            frames = np.asarray(out.frames[0], dtype=np.float32)
            images = []
        else:
            frames, images = None, list(out.images)
        return Result(kind=self.kind, images=images, frames=frames, fps=r.fps,
                      seeds=[r.seed + k for k in range(r.n)], width=r.width, height=r.height,
                      steps=r.steps, pipeline_kwargs=described(kw), seconds=seconds,
                      step_seconds=step_seconds, resumes=resumes, loras=lora_weights)

    # -- previews: the predicted final image, decoded as the pipeline decodes its result --------
    def _decode_preview(self, x0, r: Request) -> list:
        """PIL images of x0 (the pipeline's latent layout), one per batch element; a video's
        first frame. The decode follows each pipeline's own (diffusers 0.42)."""
        import torch
        pipe = self.pipe
        vae = pipe.vae
        lat = x0.to(vae.dtype)
        with torch.inference_mode():
            if self.class_name in FLUX1:
                lat = pipe._unpack_latents(lat, r.height, r.width, pipe.vae_scale_factor)
                lat = lat / vae.config.scaling_factor + vae.config.shift_factor
                img = vae.decode(lat, return_dict=False)[0]
                return pipe.image_processor.postprocess(img, output_type="pil")
            if self.class_name in QWEN:  # the latents being denoised (an edit's are apart)
                lat = pipe._unpack_latents(lat, r.height, r.width, pipe.vae_scale_factor)
                mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1)
                std = 1.0 / torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1)
                lat = lat / std.to(lat) + mean.to(lat)
                img = vae.decode(lat, return_dict=False)[0][:, :, 0]
                return pipe.image_processor.postprocess(img, output_type="pil")
            if self.class_name in ("Flux2Pipeline", "Flux2KleinPipeline"):
                lh = 2 * (r.height // (pipe.vae_scale_factor * 2)) // 2
                lw = 2 * (r.width // (pipe.vae_scale_factor * 2)) // 2
                lat = lat.reshape(lat.shape[0], lh, lw, lat.shape[-1]).permute(0, 3, 1, 2)
                mean = vae.bn.running_mean.view(1, -1, 1, 1).to(lat)
                std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(lat)
                lat = pipe._unpatchify_latents(lat * std + mean)
                img = vae.decode(lat, return_dict=False)[0]
                return pipe.image_processor.postprocess(img, output_type="pil")
            if self.class_name == "WanPipeline":
                mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1)
                std = 1.0 / torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1)
                lat = lat / std.to(lat) + mean.to(lat)
                video = vae.decode(lat, return_dict=False)[0]
                frames = pipe.video_processor.postprocess_video(video, output_type="pil")
                return [v[0] for v in frames]
        raise RequestError("preview_every", f"no preview for {self.class_name}")

    @property
    def transformers(self) -> list:
        """The pipeline's drop-ins: the transformer, and Wan 2.2 A14B's transformer_2."""
        return [t for t in (self.transformer, self.transformer_2) if t is not None]

    def close(self) -> None:
        for t in self.transformers:
            t.close()


def read_image(source, mode: str, name: str = "--image", max_pixels: int | None = None):
    """An input image (a path or bytes) decoded whole, as diffusers' load_image reads a file
    (its EXIF orientation applied), in `mode` ("RGB"; "L" for a mask); MeshditError naming it
    for what PIL cannot read (another format, a truncated file, a decompression bomb) and, before
    decoding, for more than `max_pixels` pixels."""
    import io
    import warnings

    from PIL import Image, ImageOps
    shown = source if isinstance(source, str) else f"{name} ({len(source):,} bytes)"
    if isinstance(source, str) and not os.path.isfile(source):
        raise MeshditError(f"meshdit: {shown}: no such file")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(source if isinstance(source, str) else io.BytesIO(source))
            if max_pixels and img.size[0] * img.size[1] > max_pixels:  # before it is decoded
                raise MeshditError(f"meshdit: {shown}: {img.size[0]}x{img.size[1]} is over the "
                                   f"{max_pixels:,} pixels an input image may have")
            img.load()
            img = ImageOps.exif_transpose(img)
    except Image.UnidentifiedImageError:
        raise MeshditError(f"meshdit: {shown}: not an image (PNG, JPEG, WebP, ...: what PIL "
                           f"reads)") from None
    except (Image.DecompressionBombWarning, Image.DecompressionBombError):
        raise MeshditError(f"meshdit: {shown}: over PIL's limit on an image's pixels "
                           f"({Image.MAX_IMAGE_PIXELS:,})") from None
    except (OSError, ValueError, SyntaxError) as e:
        raise MeshditError(f"meshdit: {shown}: not an image PIL reads "
                           f"({' '.join(str(e).split())[:120]})") from None
    if mode == "L" and ("A" in img.getbands() or (img.mode == "P" and "transparency" in img.info)):
        alpha = img.convert("RGBA").getchannel("A")
        if mode == "L" and alpha.getextrema()[0] < 255:
            # OpenAI's mask: the transparent pixels are the area to edit (white for diffusers);
            # an opaque one is read as diffusers reads a mask (white repaints)
            return alpha.point(lambda v: 255 if v == 0 else 0)
    return img.convert(mode)


def described(kw: dict) -> dict:
    """The pipeline's arguments with each input image as its text ('image 64x48 RGB'): what is
    printed and reported (JSON) of a call."""
    def one(v):
        if isinstance(v, (list, tuple)):
            return [one(x) for x in v]
        size = getattr(v, "size", None)
        if hasattr(v, "mode") and isinstance(size, tuple):  # a PIL image
            return f"image {size[0]}x{size[1]} {v.mode}"
        return v
    return {k: one(v) for k, v in kw.items()}


def plan_line(info: dict) -> str:
    """The mesh as `meshdit run` prints its plan, from the server's info."""
    wb = [int(x) for x in str(info.get("weight_bytes", "0")).split(",") if x.strip().isdigit()]
    mib = max(wb) / 1048576.0 if wb else 0.0
    cfg = f"cfg {info.get('cfg')} x " if str(info.get("cfg", "1")) not in ("1", "") else ""
    return (f"plan: model {info.get('family')}, world {info.get('world')} = {cfg}tp {info.get('tp')} x "
            f"ring {info.get('ring')} x ulysses {info.get('ulysses')} (mesh order "
            f"{info.get('mesh_order')}), device {info.get('device')}, dtype {info.get('dtype')}, "
            f"weights {mib:.1f} MiB per rank")


# ---- encoding the results ------------------------------------------------------------------------
def image_bytes(img, fmt: str = "png") -> bytes:
    import io
    buf = io.BytesIO()
    img.save(buf, format={"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}[fmt])
    return buf.getvalue()


def video_bytes(frames, fps: int) -> bytes:
    """An MP4 (H.264 through imageio-ffmpeg, diffusers' export_to_video) of [F, H, W, 3] frames."""
    from diffusers.utils import export_to_video
    fd, path = tempfile.mkstemp(suffix=".mp4", prefix="meshdit-")
    os.close(fd)
    try:
        export_to_video(list(frames), path, fps=fps)
        with open(path, "rb") as f:
            return f.read()
    finally:
        os.unlink(path)


# ---- the command ---------------------------------------------------------------------------------
class _Once:
    """An option given twice is refused (argparse keeps the last one, silently)."""

    def __call__(self, parser, namespace, values, option_string=None):
        seen = namespace.__dict__.setdefault("_given", set())
        if self.dest in seen:
            parser.error(f"{option_string} given twice")
        seen.add(self.dest)
        super().__call__(parser, namespace, values, option_string)


class _StoreOnce(_Once, argparse._StoreAction):
    pass


class _StoreTrueOnce(_Once, argparse._StoreTrueAction):
    pass


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register("action", None, _StoreOnce)
        self.register("action", "store", _StoreOnce)
        self.register("action", "store_true", _StoreTrueOnce)

    def parse_args(self, args=None, namespace=None):
        a = super().parse_args(args, namespace)
        a.__dict__.pop("_given", None)
        return a

    def error(self, message):  # one line, exit 2
        sys.stderr.write(f"{self.prog}: error: {message} (see --help)\n")
        sys.exit(2)


def _size(text: str) -> tuple[int, int]:
    m = SIZE_RE.fullmatch(text.lower())
    if m is None:
        raise argparse.ArgumentTypeError(f"'{text}' is not WIDTHxHEIGHT (e.g. 1024x768)")
    w, h = int(m[1]), int(m[2])
    if w < 1 or h < 1:
        raise argparse.ArgumentTypeError(f"'{text}': width and height must be positive")
    return w, h


def add_engine_options(ap: argparse.ArgumentParser) -> None:
    """--model, the layout, the device, the LoRAs and the step cache: shared by `generate` and
    `api`."""
    ap.add_argument("--model", required=True,
                    help="a diffusers pipeline folder (model_index.json, transformer/, ...), or a "
                         "hub id already in the local Hugging Face cache")
    g = ap.add_argument_group("the mesh (meshdit serve's options)")
    g.add_argument("--cfg", type=int, default=1, choices=[1, 2],
                   help="2: a second group of ranks computes each guided step's other branch at "
                        "once (twice the ranks; docs/python.md)")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    g.add_argument("--ring", type=int, default=1, help="ring-attention degree")
    g.add_argument("--ulysses", type=int, default=1, help="Ulysses degree")
    g.add_argument("--mesh-order", help="e.g. tp,ring,ulysses")
    g.add_argument("--device", choices=["cpu", "cuda"], help="the mesh's device")
    g.add_argument("--dtype", choices=["f32", "bf16"], help="the mesh's compute dtype")
    g.add_argument("--binary", help="the meshdit C binary (default $MESHDIT_BIN, or meshdit on PATH)")
    g.add_argument("--launcher", help="the command that starts the ranks (default mpiexec -n WORLD)")
    g.add_argument("--step-timeout", type=int, help="the step watchdog, whole seconds (>= 1)")
    g.add_argument("--max-memory", help="per rank, e.g. 8G")
    g.add_argument("--no-resume", action="store_true",
                   help="fail instead of relaunching the mesh when a rank is lost")
    g.add_argument("--lora", action="append", default=[], metavar="FILE[:WEIGHT]",
                   help="a LoRA file (any format the pipeline's load_lora_weights reads) at a "
                        "weight (default 1); repeatable (docs/lora.md)")
    g.add_argument("--lora-2", action="append", default=[], metavar="FILE[:WEIGHT]",
                   help="a LoRA file for Wan 2.2 A14B's transformer_2 (the low-noise expert's "
                        "file of a pair; diffusers' load_into_transformer_2=True): repeatable")
    g.add_argument("--cache", metavar="SPEC",
                   help="a step cache, as meshdit run's: first_block[:threshold=X], "
                        "mag:mag_ratios=A/B/...[,...], taylorseer[:...], text_kv (docs/cache.md)")
    p = ap.add_argument_group("the rest of the pipeline (in this process)")
    p.add_argument("--pipeline-device", default="cpu", help="text encoders and VAE (default cpu)")
    p.add_argument("--pipeline-dtype", default="float32", help="float32 (default), bfloat16, float16")


def lora_arg(text: str, opt: str = "--lora") -> tuple[str, float]:
    """FILE[:WEIGHT] -> (file, weight): the part after the last ':' is the weight when it is a
    number (a path may hold ':'); the file must exist. MeshditError naming the argument."""
    path, sep, w = text.rpartition(":")
    if sep and re.fullmatch(r"-?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?", w):
        weight = float(w)
    else:
        path, weight = text, 1.0
    if not math.isfinite(weight) or abs(weight) > MAX_SCALE:
        raise MeshditError(f"meshdit: {opt} {text}: the weight must be a finite number of "
                           f"magnitude at most {MAX_SCALE:g}")
    if not os.path.exists(path):
        raise MeshditError(f"meshdit: {opt} {text}: no file {path}")
    return path, weight


def cache_config(spec: str):
    """`meshdit run --cache`'s SPEC as the diffusers cache config the transformer enables:
    first_block[:threshold=X], mag:mag_ratios=A/B/...[,threshold=..,max_skip_steps=..,
    retention_ratio=..,num_inference_steps=..], taylorseer[:cache_interval=N,...,
    taylor_factors_dtype=bfloat16|float32], text_kv. The drop-in then checks it as for any
    enable_cache call. MeshditError naming the part it cannot read."""
    import torch
    from diffusers import hooks

    kind, _, rest = spec.partition(":")
    classes = {"first_block": hooks.FirstBlockCacheConfig, "mag": hooks.MagCacheConfig,
               "taylorseer": hooks.TaylorSeerCacheConfig, "text_kv": hooks.TextKVCacheConfig}
    if kind not in classes:
        raise MeshditError(f"meshdit: --cache {spec}: unknown cache '{kind}' (first_block, mag, "
                           f"taylorseer, text_kv)")
    cls = classes[kind]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kw = {}
    for item in filter(None, rest.split(",")):
        key, eq, val = item.partition("=")
        if not eq or key not in fields or key in kw:
            why = ("given twice" if key in kw else "not key=value" if not eq
                   else f"no such field of {cls.__name__}")
            raise MeshditError(f"meshdit: --cache {spec}: '{item}': {why}")
        try:
            if key == "mag_ratios":
                kw[key] = [float(x) for x in val.split("/")]
            elif key == "taylor_factors_dtype":
                kw[key] = {"bfloat16": torch.bfloat16, "float32": torch.float32}[val]
            elif key in ("max_skip_steps", "num_inference_steps", "cache_interval",
                         "disable_cache_before_step", "disable_cache_after_step", "max_order"):
                kw[key] = int(val)
            else:
                kw[key] = float(val)
        except (ValueError, KeyError):
            raise MeshditError(f"meshdit: --cache {spec}: '{item}': not a value of "
                               f"{key}") from None
    try:
        config = cls(**kw)
        from .transformer import _cache_spec
        _cache_spec(config)  # what the drop-in will refuse, refused before anything loads
    except (ValueError, TypeError, NotImplementedError) as e:
        why = " ".join(str(e).split()).removeprefix("meshdit: ")
        raise MeshditError(f"meshdit: --cache {spec}: {why}") from None
    return config


def check_engine_args(ap, a) -> None:
    """The --lora and --cache values refused as usage errors (exit 2) before anything loads."""
    try:
        for opt, x in [("--lora", x) for x in a.lora] + [("--lora-2", x) for x in a.lora_2]:
            lora_arg(x, opt)
        if a.cache is not None:
            cache_config(a.cache)
    except MeshditError as e:
        ap.error(str(e).removeprefix("meshdit: "))


def engine_from_args(a, log=print) -> Engine:
    for k in ("tp", "ring", "ulysses"):
        if getattr(a, k) < 1:
            raise MeshditError(f"meshdit: --{k} {getattr(a, k)}: must be >= 1")
    loras, loras_2 = [lora_arg(x) for x in a.lora], [lora_arg(x, "--lora-2") for x in a.lora_2]
    cache = cache_config(a.cache) if a.cache is not None else None
    mesh = dict(cfg=a.cfg if a.cfg > 1 else None, tp=a.tp, ring=a.ring, ulysses=a.ulysses,
                mesh_order=a.mesh_order, device=a.device, dtype=a.dtype, binary=a.binary,
                launcher=a.launcher, step_timeout=a.step_timeout, max_memory=a.max_memory)
    return Engine(a.model, pipeline_device=a.pipeline_device, pipeline_dtype=a.pipeline_dtype,
                  resume=not a.no_resume, log=log, loras=loras, loras_2=loras_2, cache=cache,
                  **mesh)


class StepBar:
    """A per-step progress bar with s/step on stderr (one line per step when not a terminal)."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()

    def __call__(self, name, **d):
        if name == "step":
            n, total, sps = d["step"], d["steps"], d["s_per_step"]
            width = 24
            full = int(width * n / total)
            eta = sps * (total - n)
            line = (f"step {n:>{len(str(total))}}/{total} [{'#' * full}{'.' * (width - full)}] "
                    f"{sps:.3f} s/step, {d['seconds']:.3f} s this step, eta {eta:.1f} s")
            if self.tty:
                self.stream.write("\r" + line + ("\n" if n == total else ""))
            else:
                self.stream.write(line + "\n")
            self.stream.flush()
        elif name == "resume":
            lay = d["layout"]
            self.stream.write(f"\nmeshdit: lost the mesh in step {d['step']} ({d['error']}); "
                              f"relaunched tp {lay['tp']} x ring {lay['ring']} x ulysses "
                              f"{lay['ulysses']} and redid the step: {d['seconds']:.2f} s lost\n")
            self.stream.flush()


def _umask() -> int:
    m = os.umask(0)
    os.umask(m)
    return m


def main_generate(argv: list[str]) -> int:
    ap = _Parser(prog="meshdit generate", description="A prompt in, a PNG or MP4 out: a diffusers "
                 "pipeline with its transformer on a meshdit mesh.")
    add_engine_options(ap)
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--negative-prompt")
    ap.add_argument("--steps", type=int, help="denoising steps (default: the pipeline's)")
    ap.add_argument("--guidance", type=float,
                    help="guidance scale, mapped onto the pipeline's own argument (docs/service.md)")
    ap.add_argument("--true-cfg", type=float,
                    help="guidance-distilled FluxPipeline only: true CFG scale with the negative prompt")
    ap.add_argument("--size", type=_size, help="WIDTHxHEIGHT (default: the pipeline's)")
    ap.add_argument("--frames", type=int, help="video pipelines: number of frames")
    ap.add_argument("--fps", type=int, help="video pipelines: the MP4's frame rate (default 16)")
    ap.add_argument("--seed", type=int, help="default: a random seed, printed")
    ap.add_argument("--max-sequence-length", type=int, help="text tokens (default: the pipeline's)")
    ap.add_argument("--out", help="FILE.png (image pipelines) or FILE.mp4 (video pipelines); "
                                  "default meshdit-SEED.png / .mp4")
    ap.add_argument("--image", action="append", metavar="FILE",
                    help="an input image of an edit pipeline (FluxKontextPipeline, "
                         "FluxImg2ImgPipeline, FluxInpaintPipeline, QwenImageEditPipeline; "
                         "Flux2KleinPipeline and QwenImageEditPlusPipeline take up to 4): "
                         "repeatable")
    ap.add_argument("--mask", metavar="FILE",
                    help="FluxInpaintPipeline's mask (white: the area to repaint)")
    ap.add_argument("--strength", type=float,
                    help="img2img / inpaint: how far from the input image, in (0, 1] "
                         "(default: the pipeline's)")
    a = ap.parse_args(argv)
    if a.out is not None and not a.out.lower().endswith((".png", ".mp4")):
        ap.error(f"--out '{a.out}': must end in .png or .mp4")
    check_engine_args(ap, a)
    where = os.path.dirname(os.path.abspath(a.out or "x.png"))  # checked before any work
    if a.out is not None and os.path.isdir(a.out):
        ap.error(f"--out '{a.out}' is a directory")
    if not os.path.isdir(where):
        ap.error(f"--out: no directory {where}")
    if not os.access(where, os.W_OK | os.X_OK):
        ap.error(f"--out: cannot write in {where}")
    w, h = a.size if a.size else (None, None)
    try:
        images = [read_image(f, "RGB") for f in a.image] if a.image else None
        mask = read_image(a.mask, "L") if a.mask else None
    except MeshditError as e:
        ap.error(str(e).removeprefix("meshdit: "))
    req = Request(prompt=a.prompt, negative_prompt=a.negative_prompt, steps=a.steps,
                  guidance=a.guidance, true_cfg=a.true_cfg, width=w, height=h,
                  frames=a.frames, fps=16 if a.fps is None else a.fps, seed=a.seed,
                  max_sequence_length=a.max_sequence_length, images=images, mask=mask,
                  strength=a.strength)

    def refused(e: RequestError) -> int:
        print(f"meshdit: error: --{(e.param or 'request').replace('_', '-')}: {e}", file=sys.stderr)
        return 2
    try:
        a.model = resolve_model(a.model)  # before torch is imported: a missing model fails fast
        try:  # what needs no pipeline is refused before one is loaded
            index = read_model_index(a.model)
            check_values(req, index["_class_name"])
            if a.lora_2 and not (index.get("transformer_2") or [None])[0]:
                raise RequestError("lora_2", f"{index['_class_name']} here has no transformer_2 "
                                             f"(Wan 2.2 A14B's low-noise expert)")
        except RequestError as e:
            return refused(e)
        engine = engine_from_args(a)
    except MeshditError as e:
        print(str(e) if str(e).startswith("meshdit") else f"meshdit: error: {e}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as e:  # diffusers' own: a component's folder missing, ...
        print(f"meshdit: error: cannot load the pipeline from {a.model}: "
              f"{' '.join(str(e).split())}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("meshdit: interrupted", file=sys.stderr)
        return 130
    try:
        want = ".mp4" if engine.kind == "video" else ".png"
        if a.fps is not None and engine.kind != "video":
            print(f"meshdit: error: --fps: {engine.class_name} makes images, not videos",
                  file=sys.stderr)
            return 2
        if a.out is not None and not a.out.lower().endswith(want):
            print(f"meshdit: error: --out '{a.out}': {engine.class_name} makes "
                  f"{'videos' if want == '.mp4' else 'images'}: use a {want} file", file=sys.stderr)
            return 2
        try:
            req = engine.check(req)
        except RequestError as e:
            return refused(e)
        kw = engine.pipeline_kwargs(req)
        shown = {k: v for k, v in described(kw).items() if k not in ("prompt", "output_type")}
        print(f"{req.width}x{req.height}" + (f", {req.frames} frames" if req.frames else "") +
              f", seed {req.seed}; {engine.class_name}(" +
              ", ".join(f"{k}={v!r}" for k, v in shown.items()) + ")", flush=True)
        res = engine.run(req, on_event=StepBar(), checked=True)
        out = a.out or f"meshdit-{req.seed}{want}"
        data = (video_bytes(res.frames, res.fps) if res.kind == "video"
                else image_bytes(res.images[0], "png"))
        tmp = None
        try:  # whole or not at all: a temporary file in the same folder, then renamed
            fd, tmp = tempfile.mkstemp(prefix=".meshdit-", suffix=want,
                                       dir=os.path.dirname(os.path.abspath(out)))
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.chmod(tmp, 0o666 & ~_umask())
            os.replace(tmp, out)
        except OSError as e:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
            print(f"meshdit: error: cannot write {out}: {e.strerror or e}", file=sys.stderr)
            return 1
        sps = sum(res.step_seconds) / max(1, len(res.step_seconds))
        extra = (f", {len(res.resumes)} lost rank(s) recovered in "
                 f"{sum(x['seconds'] for x in res.resumes):.2f} s" if res.resumes else "")
        what = (f"{res.frames.shape[0]} frames of {res.width}x{res.height} at {res.fps} fps"
                if res.kind == "video" else f"{res.width}x{res.height}")
        print(f"wrote {out} ({what}; {res.steps} steps in {res.seconds:.2f} s, "
              f"{sps:.3f} s/step{extra})", flush=True)
        return 0
    except MeshditError as e:
        print(f"meshdit: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # the mesh is closed below: every rank exits
        print("meshdit: interrupted", file=sys.stderr)
        return 130
    finally:
        engine.close()
