"""`meshdit.Transformer`: a diffusers transformer whose forward runs on a `meshdit serve` mesh.

A pipeline keeps its text encoders, scheduler and VAE in this process; only the transformer
lives on the mesh. The object stands in for the family's diffusers model: it is a diffusers
``ModelMixin`` (so ``FluxPipeline.from_pretrained(DIR, transformer=t)`` accepts it), has
``.config`` (the checkpoint's config.json, attribute access as diffusers' FrozenDict), ``.dtype``,
``.device``, ``cache_context(name)``, and ``forward``/``__call__`` with the family's diffusers
argument names and return types. ControlNet residuals go to the mesh (stacked, docs/models.md);
arguments meshdit does not implement (IP-adapter inputs) raise ``NotImplementedError``; nothing
is silently ignored. diffusers' LoRA
API (``pipe.load_lora_weights``, ``set_adapters``, ``fuse_lora``, the attention kwargs' ``scale``,
...) works: the adapters are fused on the mesh (meshdit/_lora.py, docs/lora.md).

What every other public method of diffusers' models does here is one table, `METHODS`: it works
(implemented here, or inherited with its meaning intact) or it raises ``NotImplementedError``
naming itself. ``torch.compile`` of the object works: the forward is kept out of dynamo's trace
(it is one call to the mesh), so the compiled object returns exactly what the plain one does.

Needs torch and diffusers (the rest of the package does not).
"""
from __future__ import annotations

import contextlib
import functools
import json
import math
import numbers
import os
import re
import secrets
import sys
import shutil
import threading
import time
import warnings
from typing import Any

import numpy as np
import torch
from diffusers.configuration_utils import FrozenDict
from diffusers.loaders.peft import PeftAdapterMixin
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from diffusers.models.modeling_utils import ModelMixin
from diffusers.utils import apply_lora_scale

from . import _blob, _lora
from ._sessions import Planner, fingerprint
from .client import Client, MeshditError, ServerError
from .server import Server

_BF16 = torch.bfloat16

# The forward is one request to the mesh: nothing in it is a graph for dynamo to trace (tracing
# the socket and blob code only recursed until it failed), so torch.compile of the object, or
# t.compile(), runs it as it is and the result equals the uncompiled one.
_eager = torch.compiler.disable


def _locked(forward):
    """The forward under the object's lock, outside diffusers' apply_lora_scale: a forward's LoRA
    scale changes the probe's peft state until it returns, and another thread's forward must not
    see it (several threads may share one object)."""
    @functools.wraps(forward)
    def wrapper(self, *args, **kwargs):
        for key, v in kwargs.items():  # the scale apply_lora_scale takes, refused before peft
            if key.endswith("attention_kwargs") and isinstance(v, dict) and "scale" in v:
                names = list(getattr(self, "peft_config", None) or {})
                _lora.check_weight(v["scale"], f"{key}['scale'] (the LoRA scale of the forward, "
                                               f"adapters {names})")
        with self._lock:
            return forward(self, *args, **kwargs)
    return wrapper


def _to_raw(name: str, value) -> _blob.Raw:
    """A forward argument as request bytes: floats in their own precision (f64 as f32, which the
    server computes in anyway), integers and bools as they are; CPU copy only when needed."""
    t = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.dtype == torch.float64:
        t = t.to(torch.float32)
    t = t.contiguous()
    if t.dtype == _BF16:
        return _blob.Raw("BF16", tuple(t.shape), memoryview(t.view(torch.int16).numpy().reshape(-1).view(np.uint8)))
    try:
        return _blob.raw(t.numpy())
    except TypeError:
        raise TypeError(f"meshdit: argument '{name}' has dtype {t.dtype}, which meshdit does not "
                        f"take") from None


def _refuse(**args) -> None:
    """Raises for an argument meshdit would otherwise have to ignore. An attention-kwargs dict
    arrives here without its ``scale`` (diffusers' apply_lora_scale took it: the LoRA scale of
    this forward, applied to the adapters' coefficients as diffusers applies it)."""
    for name, v in args.items():
        if v is None or v is False or (isinstance(v, dict) and not v):
            continue
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v == 0:
            continue  # a count or a value at its default
        what = (", ".join(f"{k}={x!r}" if k == "scale" else repr(k) for k, x in sorted(v.items()))
                if isinstance(v, dict) else "a value")
        raise NotImplementedError(
            f"meshdit: '{name}' with {what} is not supported (IP-adapter inputs and KV caches "
            f"are not implemented); meshdit runs the checkpoint's own weights and the adapters "
            f"loaded on it on the inputs it is given")


def _controlnet(samples, name: str):
    """A ControlNet's residuals as diffusers passes them (a list of N tensors [B, S_img, C], or a
    tensor [N, B, S_img, C], which diffusers indexes alike) as meshdit's one tensor
    [B, N, S_img, C] (docs/models.md); None stays None."""
    if samples is None:
        return None
    if isinstance(samples, torch.Tensor):
        if samples.ndim != 4:
            raise ValueError(f"meshdit: '{name}' as a tensor must be [N, B, S_img, C] (diffusers "
                             f"indexes its first dim), not {list(samples.shape)}")
        return samples.transpose(0, 1).contiguous()
    if not isinstance(samples, (list, tuple)) or not samples:
        raise ValueError(f"meshdit: '{name}' must be a non-empty list of tensors [B, S_img, C] "
                         f"(one per residual), got {type(samples).__name__}"
                         f"{' (empty)' if isinstance(samples, (list, tuple)) else ''}")
    for k, t in enumerate(samples):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"meshdit: '{name}'[{k}] is {type(t).__name__}, not a tensor "
                             f"[B, S_img, C]")
    shapes = {tuple(t.shape) for t in samples}
    if len(shapes) != 1 or len(next(iter(shapes))) != 3:
        raise ValueError(f"meshdit: '{name}': every residual must be [B, S_img, C] of one shape, "
                         f"got {sorted(list(s) for s in shapes)}")
    return torch.stack([t.detach() for t in samples], dim=1)


def _controlnet_inputs(block, single=None, repeat=False) -> dict:
    """The ControlNet arguments of a forward as meshdit's inputs (docs/models.md)."""
    out = {"controlnet_block_samples": _controlnet(block, "controlnet_block_samples")}
    if single is not None:
        out["controlnet_single_block_samples"] = _controlnet(single, "controlnet_single_block_samples")
    if repeat and block is not None:  # XLabs': residual i mod N after block i (diffusers reads
        out["controlnet_blocks_repeat"] = torch.tensor([1], dtype=torch.int64)  # it only then)
    return out


# ---- the checkpoint: a Hub id from the local cache, the files meshdit reads --------------------
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_WEIGHTS = "diffusion_pytorch_model.safetensors"
_INDEX = "diffusion_pytorch_model.safetensors.index.json"


def _resolve(checkpoint, subfolder: str | None, revision: str | None,
             cache_dir: str | None) -> str:
    """The transformer directory: `checkpoint` (joined with `subfolder`) when it is a directory;
    a Hub id (``ORG/NAME``) from the local Hugging Face cache only (huggingface_hub,
    local_files_only: meshdit never downloads); anything else as it is, for the server to
    refuse with its own line."""
    path = os.path.join(checkpoint, subfolder) if subfolder else checkpoint
    if (not isinstance(checkpoint, str) or os.path.exists(checkpoint)
            or not _REPO_ID.fullmatch(checkpoint)):
        return path
    from huggingface_hub import snapshot_download
    from huggingface_hub import constants as hub

    where = f"{checkpoint}" + (f" (subfolder '{subfolder}')" if subfolder else "")
    try:
        root = snapshot_download(checkpoint, revision=revision, cache_dir=cache_dir,
                                 local_files_only=True)
    except (OSError, ValueError):  # LocalEntryNotFoundError, a malformed id
        root = None
    path = os.path.join(root, subfolder) if root and subfolder else root
    if not root or not os.path.isfile(os.path.join(path, "config.json")):
        got = "has no snapshot of it" if not root else f"has no {os.path.join(subfolder or '', 'config.json')} in its snapshot"
        include = f" --include '{subfolder}/*'" if subfolder else ""
        raise MeshditError(f"meshdit: '{checkpoint}' is not a directory and the local Hugging Face "
                           f"cache ({cache_dir or hub.HF_HUB_CACHE}) {got}: download {where} "
                           f"first (`hf download {checkpoint}{include}`); meshdit reads local files only")
    return path


def _checkpoint_files(ckpt: str) -> list[str]:
    """The files of a checkpoint directory that meshdit reads (src/io/checkpoint.c): config.json
    and either the index and the shards it names, or the one weights file."""
    index = os.path.join(ckpt, _INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f).get("weight_map", {}).values()))
        return ["config.json", _INDEX, *shards]
    return ["config.json", _WEIGHTS]


def _size(v) -> int:
    """diffusers' max_shard_size: bytes, or a string like "5GB" (10^9) or "500MiB" (2^20)."""
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(I?)B?\s*", str(v).upper())
    if not m:
        raise ValueError(f"meshdit: max_shard_size={v!r} is not a size (an int, or like '5GB')")
    power = "KMGT".index(m.group(2)) + 1 if m.group(2) else 0
    return int(float(m.group(1)) * (1024 if m.group(3) else 1000) ** power)


# diffusers' ModelMixin.from_pretrained arguments (a pipeline's from_pretrained passes most of
# them to each model), each with the values that change nothing for meshdit; another value is
# refused by name. `None` in a tuple means the default; ANY: no value changes what meshdit does.
_ANY = object()
_LOAD_ARGS = {
    "device_map": (None,), "offload_folder": (None,), "offload_state_dict": (None, False),
    "variant": (None,), "use_safetensors": (None, True), "use_flashpack": (False,),
    "quantization_config": (None,), "output_loading_info": (False,), "force_download": (False,),
    "proxies": (None,), "dduf_entries": (None,), "low_cpu_mem_usage": _ANY, "disable_mmap": _ANY,
    "local_files_only": _ANY, "token": _ANY,
}
_SERVE_OPTIONS = ("comm", "max_memory", "max_sessions", "max_session_bytes", "session_idle",
                  "max_request_bytes", "max_queue_bytes", "step_timeout", "load_timeout",
                  "endpoint", "extra", "env", "startup_timeout", "watch_owner", "loopback")


class Transformer(ModelMixin, PeftAdapterMixin):
    """The family-neutral part. Make one with `from_pretrained` or `connect`; they return the
    family's subclass (`FluxTransformer`, `MiniMaxH3Transformer`)."""

    family: str = ""
    class_name: str = ""
    per_step: frozenset = frozenset()  # inputs that change every step: never kept in a session

    def __init__(self, client: Client, info: dict, server: Server | None = None,
                 torch_dtype: torch.dtype = torch.float32, sessions: bool = True,
                 checkpoint: str | None = None):
        super().__init__()
        self._client, self._server, self.info = client, server, dict(info)
        self._internal_dict = FrozenDict(json.loads(info["config"]))
        self._dtype, self._device = torch_dtype, torch.device("cpu")
        self._checkpoint = os.path.abspath(checkpoint) if checkpoint else None
        cap = min(4, int(info.get("max_sessions", "0"))) if sessions else 0
        self._planner = Planner(cap)
        self._stale: list[str] = []  # sessions to end on the server before the next request
        self._lock = threading.RLock()
        self._cache_name = None
        self._cache_config = None  # diffusers' cache config given to enable_cache
        self._cache_spec = None  # its --cache text
        self._cache_gen = None  # the server-side generation of the cache state
        self.attention_backend: str | None = None  # the exact-attention choice recorded
        self.training = False  # the mesh runs inference only (a diffusers model after loading)
        self.stats = {"forwards": 0, "request_bytes": [], "step_seconds": [], "wall_seconds": [],
                      "cache": [], "lora_fuse_seconds": [], "cfg_hits": 0, "cfg_misses": 0}
        # cfg=2: the session of each branch's other branch (a forward whose step inputs equal
        # the previous forward's, under another session), and the previous forward's
        self._cfg_pairs: dict = {}
        self._cfg_last = self._cfg_prev = self._cfg_asked = None

    # ---- making one ---------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, checkpoint: str, *, tp: int = 1, ring: int = 1, ulysses: int = 1,
                        cfg: int = 1,
                        mesh_order: str | None = None, device: str | None = None,
                        dtype=None, launcher=None, binary: str | None = None,
                        torch_dtype: torch.dtype | None = None, sessions: bool = True,
                        timeout: float | None = None, subfolder: str | None = None,
                        revision: str | None = None, cache_dir: str | None = None,
                        resume: bool | dict = False, **options) -> "Transformer":
        """Starts ``meshdit serve`` on `checkpoint` with the given layout and connects.

        checkpoint: a diffusers transformer directory, or a Hub id (``ORG/NAME``, with
        `subfolder`, `revision`, `cache_dir` as diffusers') found in the local Hugging Face cache
        (never downloaded). device/dtype are the mesh's (``cpu``/``cuda``, ``f32``/``bf16``; a
        torch dtype float32/bfloat16 is taken as that); torch_dtype is what `.dtype` reports to
        the pipeline (default: float32, or `dtype` when that is a torch dtype). Other keyword
        arguments are serve options (comm, max_memory, max_sessions, step_timeout, endpoint,
        ...) or diffusers' loading arguments at values that change nothing (what a pipeline's
        from_pretrained passes: device_map=None, variant=None, low_cpu_mem_usage, ...); another
        value of those raises NotImplementedError naming it. cfg=2: twice the ranks, and the
        second half computes the other branch of each guided step (the unconditional forward)
        while the first computes the conditional one (docs/python.md, "cfg=2"). timeout: seconds
        a forward may take
        (None: no bound; the server process is watched, so a server that dies ends the wait
        with its error line). resume: True or options: a forward whose server job ends (a lost
        rank) relaunches the job and is redone (meshdit/_resume.py)."""
        if isinstance(dtype, torch.dtype):  # diffusers' `dtype=torch.bfloat16` spelling
            mesh = {torch.float32: "f32", torch.bfloat16: "bf16"}.get(dtype)
            if mesh is None:
                raise ValueError(f"meshdit: dtype={dtype}: the mesh computes in float32 or "
                                 f"bfloat16 (dtype='f32' or 'bf16')")
            torch_dtype = dtype if torch_dtype is None else torch_dtype
            dtype = mesh
        serve = {}
        for k, v in options.items():
            if k in _SERVE_OPTIONS and not (k == "max_memory" and isinstance(v, dict)):
                serve[k] = v
            elif k in _LOAD_ARGS or k == "max_memory":
                ok = _LOAD_ARGS.get(k, ())
                if ok is not _ANY and v not in ok:
                    raise NotImplementedError(
                        f"meshdit: from_pretrained({k}={v!r}) is not supported: meshdit loads "
                        f"the checkpoint's weights shard-on-read onto the mesh it starts "
                        f"(tp=, ring=, ulysses=, device=, dtype=, max_memory= one size per rank)")
            else:
                raise TypeError(f"meshdit: from_pretrained() got an unexpected keyword argument "
                                f"'{k}'")
        checkpoint = _resolve(checkpoint, subfolder, revision, cache_dir)
        start = functools.partial(Server, checkpoint, cfg=cfg, tp=tp, ring=ring, ulysses=ulysses,
                                  mesh_order=mesh_order, device=device, dtype=dtype,
                                  launcher=launcher, binary=binary, timeout=timeout, **serve)
        server = start()
        try:
            t = cls._attach(server.client, server, torch_dtype or torch.float32, sessions,
                            checkpoint)
            if resume:
                from . import _resume
                _resume.enable(t, start, resume)
            return t
        except BaseException:
            server.close()
            raise

    @classmethod
    def connect(cls, endpoint: str, *, torch_dtype: torch.dtype = torch.float32,
                sessions: bool = True, timeout: float | None = 600.0,
                checkpoint: str | None = None) -> "Transformer":
        """Attaches to a running server (``close()`` then leaves it running). checkpoint: the
        directory that server loaded, as seen from here; only `save_pretrained` and
        `num_parameters` read it (the server does not say where its files are)."""
        client = Client(endpoint, timeout=timeout)
        try:
            return cls._attach(client, None, torch_dtype, sessions, checkpoint)
        except BaseException:
            client.close()
            raise

    @classmethod
    def _attach(cls, client, server, torch_dtype, sessions, checkpoint=None):
        info = client.info()
        sub = _FAMILIES.get(info.get("family"))
        if sub is None:
            raise MeshditError(f"meshdit: the server runs family '{info.get('family')}', which "
                               f"this package does not know")
        if cls is not Transformer and not issubclass(sub, cls):
            raise MeshditError(f"meshdit: the server runs {sub.class_name}, not {cls.class_name}")
        return sub(client, info, server, torch_dtype, sessions, checkpoint)

    # ---- what a pipeline reads ----------------------------------------------------------------
    @property
    def config(self) -> FrozenDict:
        return self._internal_dict

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def device(self) -> torch.device:
        return self._device

    def to(self, *args, **kwargs):
        """Records the device and dtype the pipeline asks for (outputs come back in the dtype and
        on the device of `hidden_states`); the weights stay on the mesh."""
        for a in list(args) + list(kwargs.values()):
            if isinstance(a, torch.dtype):
                self._dtype = a
            elif isinstance(a, (str, torch.device)):
                self._device = torch.device(a)
        return self

    def half(self):
        return self.to(torch.float16)

    def float(self):
        return self.to(torch.float32)

    def bfloat16(self):
        return self.to(torch.bfloat16)

    def double(self):
        return self.to(torch.float64)

    def type(self, dst_type):
        return self.to(dst_type)

    def cpu(self):
        return self.to("cpu")

    def cuda(self, device=None):
        return self.to(torch.device("cuda", device) if isinstance(device, int) else device or "cuda")

    def xpu(self, device=None):
        return self.to(torch.device("xpu", device) if isinstance(device, int) else device or "xpu")

    def ipu(self, device=None):
        return self.to(torch.device("ipu", device) if isinstance(device, int) else device or "ipu")

    def mtia(self, device=None):
        return self.to(torch.device("mtia", device) if isinstance(device, int) else device or "mtia")

    def to_empty(self, *, device, recurse: bool = True):
        return self.to(device)

    @contextlib.contextmanager
    def cache_context(self, name: str, **kwargs):
        prev, self._cache_name = self._cache_name, name
        try:
            yield
        finally:
            self._cache_name = prev

    # ---- the methods of torch and diffusers models that mean something here (METHODS) ---------
    def train(self, mode: bool = True):
        """eval() and train(False) are what the mesh does (inference); train(True) is refused."""
        if mode:
            raise NotImplementedError("meshdit: train(True) is not supported: the mesh runs "
                                      "inference only (no dropout, no gradients)")
        self.training = False
        return self

    def requires_grad_(self, requires_grad: bool = True):
        """requires_grad_(False) is what the mesh's weights are; True is refused."""
        if requires_grad:
            raise NotImplementedError("meshdit: requires_grad_(True) is not supported: no "
                                      "gradient flows through the mesh")
        return self

    def zero_grad(self, set_to_none: bool = True) -> None:
        """There are no gradients: nothing to clear."""

    @property
    def is_gradient_checkpointing(self) -> bool:
        return False

    def disable_gradient_checkpointing(self) -> None:
        """Gradient checkpointing is never on: nothing to disable."""

    @property
    def attn_processors(self) -> dict:
        """No attention module runs in this process: no processors."""
        return {}

    # ---- step caches: diffusers' CacheMixin API, the cache run on the mesh (docs/cache.md) ----
    @property
    def is_cache_enabled(self) -> bool:
        return self._cache_config is not None

    def enable_cache(self, config) -> None:
        """diffusers' `enable_cache`: FirstBlockCacheConfig runs on the mesh with diffusers'
        arithmetic; another diffusers cache config raises NotImplementedError naming it. The
        config is read now: one changed later is refused at the next forward (`_cache_meta`)."""
        spec = _cache_spec(config)  # a refused call below must leave the active spec as it is
        kind = spec.split(":")[0]
        if self.family not in CACHE_FAMILIES[kind]:
            raise NotImplementedError(f"meshdit: {type(config).__name__} is not implemented for "
                                      f"{self.class_name} (meshdit runs it on "
                                      f"{', '.join(CACHE_FAMILIES[kind])})")
        if self.is_cache_enabled:
            raise ValueError(f"Caching has already been enabled with {type(self._cache_config)}. "
                             "To apply a new caching technique, please disable the existing one "
                             "first.")
        self._cache_config, self._cache_spec = config, spec
        self._new_cache_generation()

    def disable_cache(self) -> None:
        """diffusers' `disable_cache`: every block of every step again."""
        if self._cache_config is None:
            warnings.warn("Caching techniques have not been enabled, so there's nothing to "
                          "disable.", stacklevel=2)
            return
        self._end_cache_generation()
        self._cache_config = self._cache_spec = None

    def _reset_stateful_cache(self, recurse: bool = True) -> None:
        """What a pipeline calls when a generation ends (maybe_free_model_hooks): the next
        forward starts a fresh cache state, as diffusers' hooks reset theirs."""
        if self._cache_config is not None:
            self._new_cache_generation()

    def _new_cache_generation(self) -> None:
        self._end_cache_generation()
        self._cache_gen = "gen-" + secrets.token_hex(16)

    def _end_cache_generation(self) -> None:
        gen, self._cache_gen = self._cache_gen, None
        if gen is not None and self._client is not None:
            with contextlib.suppress(MeshditError):
                self._client.end_cache_generation(gen, timeout=5.0)

    def _cache_meta(self) -> dict | None:
        """The forward's cache keys (None: no cache). diffusers' hooks read their config object
        at every forward, so a field changed after enable_cache would change diffusers' run but
        not the spec taken then: a config that no longer gives that spec is refused here."""
        if self._cache_config is None:
            return None
        changed = ValueError(f"meshdit: the {type(self._cache_config).__name__} given to "
                             f"enable_cache was changed after enable_cache; call disable_cache() "
                             f"and enable_cache() again to run the changed config")
        try:
            now = _cache_spec(self._cache_config)
        except (ValueError, TypeError, NotImplementedError) as e:
            raise changed from e
        if now != self._cache_spec:
            raise changed
        name = self._cache_name
        if name is None and isinstance(self._cache_config, _hooks().MagCacheConfig):
            name = "inference"  # diffusers' MagCache hooks take this context when none is set
        if name is None:
            raise ValueError("No cache context is set. Wrap the denoiser call in "
                             "`model.cache_context(name, ...)` before calling it.")
        return {"cache": self._cache_spec, "cache_context": name,
                "cache_generation": self._cache_gen}

    # ---- LoRA: diffusers' PeftAdapterMixin, its state in peft's own layer (meshdit/_lora.py) ----
    def load_lora_adapter(self, pretrained_model_name_or_path_or_dict, prefix="transformer",
                          hotswap: bool = False, **kwargs) -> None:
        """diffusers' load_lora_adapter (what pipe.load_lora_weights calls after the family's
        converters): the factors are loaded on the mesh, every key mapped to a weight or the
        whole adapter refused naming the keys; set_adapters, fuse_lora, unfuse_lora,
        delete_adapters, disable_lora/enable_lora and unload_lora are diffusers' own."""
        with self._lock:
            if self._client is None:
                raise MeshditError(f"meshdit: this {type(self).__name__} is closed")
            _lora.load_adapter(self, pretrained_model_name_or_path_or_dict, prefix=prefix,
                               hotswap=hotswap, **kwargs)

    def set_adapters(self, adapter_names, weights=None):
        """diffusers' set_adapters; a weight per block (a dict, diffusers' UNet form) is refused:
        the mesh fuses one weight per adapter."""
        ws = weights if isinstance(weights, list) else [weights]
        if any(isinstance(w, dict) for w in ws):
            raise NotImplementedError("meshdit: set_adapters() with per-block weights (a dict) "
                                      "is not supported: one weight per adapter")
        names = [adapter_names] if isinstance(adapter_names, str) else list(adapter_names)
        for name, w in zip(names, ws if isinstance(weights, list) else ws * len(names)):
            if w is not None:
                _lora.check_weight(w, f"set_adapters(): the weight of adapter '{name}'")
        with self._lock:
            return PeftAdapterMixin.set_adapters(self, adapter_names, weights)

    def fuse_lora(self, lora_scale=1.0, safe_fusing=False, adapter_names=None):
        """diffusers' fuse_lora; a lora_scale that is not a finite number of magnitude at most
        1e6 (the server's bound on a weight) is refused before peft merges anything."""
        names = adapter_names or list(getattr(self, "peft_config", None) or {})
        _lora.check_weight(lora_scale, f"fuse_lora(lora_scale=...) for adapters {names}")
        return PeftAdapterMixin.fuse_lora(self, lora_scale, safe_fusing=safe_fusing,
                                          adapter_names=adapter_names)

    def set_attention_backend(self, backend: str) -> None:
        """meshdit computes exact softmax attention (its own tiled kernel, on the mesh). A backend
        that computes the same function (native SDPA and its variants, flash, flex, xformers,
        aiter) is recorded in `attention_backend` and changes nothing; SageAttention's (int8 Q/K,
        fp8/fp16 P·V: another function) is refused; an unknown name is diffusers' ValueError."""
        from diffusers.models.attention_dispatch import AttentionBackendName

        name = str(getattr(backend, "value", backend)).lower()
        known = {b.value for b in AttentionBackendName}
        if name not in known:
            raise ValueError(f"meshdit: set_attention_backend({backend!r}): not one of "
                             f"diffusers' backends ({', '.join(sorted(known))})")
        if "sage" in name:
            raise NotImplementedError(
                f"meshdit: set_attention_backend({name!r}) is not supported: it quantizes the "
                f"attention (SageAttention), and meshdit computes exact attention on the mesh")
        self.attention_backend = name

    def reset_attention_backend(self) -> None:
        self.attention_backend = None

    def set_use_memory_efficient_attention_xformers(self, valid: bool, attention_op=None) -> None:
        """xformers' memory-efficient attention is exact attention: recorded, as
        set_attention_backend("xformers")."""
        self.attention_backend = "xformers" if valid else None

    def enable_xformers_memory_efficient_attention(self, attention_op=None) -> None:
        self.set_use_memory_efficient_attention_xformers(True, attention_op)

    def disable_xformers_memory_efficient_attention(self) -> None:
        self.set_use_memory_efficient_attention_xformers(False)

    def set_use_npu_flash_attention(self, valid: bool) -> None:
        self.attention_backend = "_native_npu" if valid else None

    def enable_npu_flash_attention(self) -> None:
        self.set_use_npu_flash_attention(True)

    def disable_npu_flash_attention(self) -> None:
        self.set_use_npu_flash_attention(False)

    def set_use_xla_flash_attention(self, use_xla_flash_attention: bool, partition_spec=None,
                                    **kwargs) -> None:
        if partition_spec is not None or kwargs:
            raise NotImplementedError("meshdit: set_use_xla_flash_attention(partition_spec=...) "
                                      "is not supported: the mesh's layout is from_pretrained's "
                                      "tp=, ring=, ulysses=")
        self.attention_backend = "_native_xla" if use_xla_flash_attention else None

    def enable_xla_flash_attention(self, partition_spec=None, **kwargs) -> None:
        self.set_use_xla_flash_attention(True, partition_spec, **kwargs)

    def disable_xla_flash_attention(self) -> None:
        self.set_use_xla_flash_attention(False)

    def fuse_qkv_projections(self) -> None:
        """Fusing Q, K, V into one GEMM changes no result; the mesh's GEMM layout is its own."""

    def unfuse_qkv_projections(self) -> None:
        """See fuse_qkv_projections."""

    def compile_repeated_blocks(self, *args, **kwargs) -> None:
        """The blocks run on the mesh, not in this process: there is nothing here to compile
        (torch.compile of the object itself works, see `_eager`)."""

    def num_parameters(self, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
        """The number of weights in the checkpoint the mesh loaded (read from its safetensors
        headers): what diffusers' model of this checkpoint counts."""
        for k, v in (("only_trainable", only_trainable), ("exclude_embeddings", exclude_embeddings)):
            if v:
                raise NotImplementedError(f"meshdit: num_parameters({k}=True) is not supported: "
                                          f"the weights are on the mesh (none trains)")
        ckpt = self._own_checkpoint("num_parameters")
        n = 0
        for name in _checkpoint_files(ckpt)[1:]:
            if name.endswith(".safetensors"):
                with open(os.path.join(ckpt, name), "rb") as f:
                    head = json.loads(f.read(int.from_bytes(f.read(8), "little")))
                n += sum(int(np.prod(e["shape"])) for k, e in head.items() if k != "__metadata__")
        return n

    # ---- the config and the checkpoint ----------------------------------------------------------
    def to_json_string(self) -> str:
        """The checkpoint's config.json as the server loaded it."""
        return self.info["config"]

    def to_json_file(self, json_file_path) -> None:
        with open(json_file_path, "w", encoding="utf-8") as f:
            f.write(self.to_json_string())

    def save_config(self, save_directory, push_to_hub: bool = False, **kwargs) -> None:
        if push_to_hub or kwargs:
            name = "push_to_hub" if push_to_hub else sorted(kwargs)[0]
            raise NotImplementedError(f"meshdit: save_config({name}=...) is not supported: it "
                                      f"writes config.json only")
        os.makedirs(save_directory, exist_ok=True)
        self.to_json_file(os.path.join(save_directory, "config.json"))

    @classmethod
    def load_config(cls, pretrained_model_name_or_path, subfolder: str | None = None,
                    revision: str | None = None, cache_dir: str | None = None) -> dict:
        """A checkpoint's config.json as a dict (a directory, or a Hub id in the local cache),
        as diffusers' ConfigMixin.load_config reads it."""
        path = _resolve(pretrained_model_name_or_path, subfolder, revision, cache_dir)
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            return json.load(f)

    def _own_checkpoint(self, what: str) -> str:
        if self._checkpoint is None:
            raise MeshditError(f"meshdit: {what}: this {type(self).__name__} was attached with "
                               f"connect() and does not know the directory its server loaded; "
                               f"pass connect(..., checkpoint=DIR)")
        return self._checkpoint

    def save_pretrained(self, save_directory, safe_serialization: bool = True,
                        variant: str | None = None, max_shard_size=None,
                        push_to_hub: bool = False, **kwargs) -> None:
        """Writes the checkpoint the mesh loaded: its config.json and safetensors files (and
        index), copied byte for byte, so `save_directory` loads in diffusers' model of the family
        and in meshdit alike. Arguments that would write other files (a variant's names,
        .bin files, shards resized below the checkpoint's own, an upload) are refused by name,
        before anything is written. In a pipeline's save_pretrained diffusers' model_index.json
        then names this class (meshdit.transformer.FluxTransformer, ...) as it does any
        component's, so `FluxPipeline.from_pretrained(SAVED)` starts meshdit on one rank (pass
        transformer= for another layout or for diffusers' own model)."""
        refused = {k: v for k, v in kwargs.items()
                   if not (k == "is_main_process" and v is True)}
        if not safe_serialization:
            refused["safe_serialization"] = False
        if variant is not None:
            refused["variant"] = variant
        if push_to_hub:
            refused["push_to_hub"] = True
        if refused:
            k, v = next(iter(refused.items()))
            raise NotImplementedError(f"meshdit: save_pretrained({k}={v!r}) is not supported: it "
                                      f"copies the checkpoint the mesh loaded, as it is")
        ckpt = self._own_checkpoint("save_pretrained")
        names = _checkpoint_files(ckpt)
        for name in names:
            if not os.path.isfile(os.path.join(ckpt, name)):
                raise MeshditError(f"meshdit: save_pretrained: {os.path.join(ckpt, name)} is gone "
                                   f"(the checkpoint the mesh loaded)")
        with open(os.path.join(ckpt, "config.json")) as f:
            if json.load(f) != json.loads(self.info["config"]):
                raise MeshditError(f"meshdit: save_pretrained: {ckpt}/config.json changed since "
                                   f"the server loaded it")
        if max_shard_size is not None:
            limit = _size(max_shard_size)
            for name in names[1:]:
                size = os.path.getsize(os.path.join(ckpt, name))
                if name.endswith(".safetensors") and size > limit:
                    raise NotImplementedError(
                        f"meshdit: save_pretrained(max_shard_size={max_shard_size!r}) is not "
                        f"supported: the checkpoint's {name} is {size:,} bytes, and meshdit copies "
                        f"its files as they are")
        os.makedirs(save_directory, exist_ok=True)
        for name in names:
            src, dst = os.path.join(ckpt, name), os.path.join(save_directory, name)
            if os.path.exists(dst) and os.path.samefile(src, dst):
                continue  # saved onto itself
            tmp = dst + ".meshdit-partial"
            shutil.copyfile(src, tmp)
            os.replace(tmp, dst)

    # ---- the forward --------------------------------------------------------------------------
    def _run(self, inputs: dict[str, Any], like: torch.Tensor) -> dict[str, torch.Tensor]:
        """Sends the inputs that are not None, returns the outputs as `like`'s dtype and device."""
        if self._client is None:
            raise MeshditError(f"meshdit: this {type(self).__name__} is closed")
        t0 = time.perf_counter()
        if not isinstance(like, torch.Tensor):
            like = torch.as_tensor(like)
        raws = {n: _to_raw(n, v) for n, v in inputs.items() if v is not None}
        with self._lock:
            meta, out = self._forward(raws)
        self.stats["forwards"] += 1
        self.stats["request_bytes"].append(int(meta.get("bytes_received", 0)))
        self.stats["step_seconds"].append(float(meta.get("step_seconds", "nan")))
        res = {k: torch.from_numpy(np.array(v)).to(dtype=like.dtype, device=like.device)
               for k, v in out.items()}
        self.stats["wall_seconds"].append(time.perf_counter() - t0)
        if "lora_fuse_seconds" in meta:  # this forward fused a new adapter set first
            self.stats["lora_fuse_seconds"].append(float(meta["lora_fuse_seconds"]))
        if "cache_skipped" in meta:
            self.stats["cache"].append({
                "branch": self._cache_name or "inference", "skipped": meta["cache_skipped"] == "1",
                "diff": float(meta["cache_diff"]),
                "blocks_computed": int(meta["cache_blocks_computed"]),
                "blocks_skipped": int(meta["cache_blocks_skipped"]),
                "flops_saved": float(meta["cache_flops_saved"])})
        return res

    def _forward(self, raws):
        """One forward through the planner. A session whose server-side state is not known for
        sure (an error reply, a timeout, an interrupt) is forgotten here and ended on the server
        before the next request, so a later forward never builds on stale tensors."""
        cache = self._cache_meta()  # a refused cache config: before anything is sent
        for s in self._stale:
            with contextlib.suppress(MeshditError):
                self._client.end_session(s, timeout=5.0)
        self._stale.clear()
        lora = _lora.lora_value(self)  # the adapters this forward runs with, as peft has them
        session, send, keep, ended, fps = self._planner.plan(raws, self.per_step)
        for s in ended:
            self._client.end_session(s)
        second, cfg_next = self._cfg_plan(session, raws)
        try:
            meta, out = self._client.forward(send, session=session, keep=keep, cache=cache,
                                             lora=lora, cfg_next=cfg_next)
        except ServerError as e:
            if session is None:
                raise
            self._planner.forget(session)
            self._stale.append(session)
            if "limit" in e.error and f"session '{session}'" in e.error:
                self._planner.capacity = 0  # over a server limit: no sessions from now on
            elif not _session_lost(e.error, session, raws, send):
                raise  # the inputs' error, or the cache's: sending it all again changes nothing
            # the session lost tensors it should hold (ended by the server, say): resend all
            return self._client.forward(raws, cache=cache, lora=lora)
        except BaseException:
            if session is not None:
                self._planner.forget(session)
                self._stale.append(session)
            raise
        self._planner.commit(session, fps)
        asked, self._cfg_asked = self._cfg_asked, (self._cfg_pairs.get(session) if cfg_next else None)
        if cfg_next and meta.get("cfg_speculated") != "1":
            self._cfg_pairs.pop(session, None)  # the server had nothing to compute it with
        if meta.get("cfg") == "hit":
            self.stats["cfg_hits"] += 1
        elif second or asked == session:  # a second branch not answered from the other group
            self.stats["cfg_misses"] += 1
            if second and asked == session:  # same step inputs, other bytes: a wrong pair
                self._cfg_pairs.pop(self._cfg_prev, None)
        return meta, out

    def _cfg_plan(self, session, raws):
        """cfg=2: whether this forward is the second branch of a guided step (the previous
        forward had the same step inputs under another session), and the server token of this
        session's other branch, for the server to compute at once (None: no pair known). The
        server answers the other branch from that forward only if its inputs are the same bytes:
        a pairing guessed wrong costs time, never a wrong answer."""
        if self.info.get("cfg") != "2" or session is None:
            return False, None
        fp = tuple((n, fingerprint(raws[n])) for n in sorted(n for n in raws if n in self.per_step))
        prev = self._cfg_last
        self._cfg_last = (session, fp)
        self._cfg_prev = prev[0] if prev is not None else None
        second = prev is not None and prev[0] != session and prev[1] == fp
        if second:
            if len(self._cfg_pairs) >= 64:  # sessions come and go: a bounded memory of pairs
                self._cfg_pairs.clear()
            self._cfg_pairs[prev[0]] = session
        other = self._cfg_pairs.get(session)
        token = self._client._tokens.get(other) if other is not None and not second else None
        return second, token

    # ---- ending it ----------------------------------------------------------------------------
    def close(self) -> None:
        """Ends this object's sessions, then the server it started (or just the connection)."""
        if self._client is None:
            return
        with self._lock:
            if self._cache_config is not None:
                self._end_cache_generation()
            sessions = self._stale + list(self._planner.open)
            self._stale.clear()
            for s in sessions:
                self._planner.forget(s)
            # a server this object started ends with its sessions; a shared one is told (briefly:
            # a server that is gone must not hold up close)
            if self._server is None:
                _lora.release(self)
                for s in sessions:
                    try:
                        self._client.end_session(s, timeout=1.0)
                    except MeshditError:
                        break
        if self._server is not None:
            self._server.close()
        else:
            self._client.close()
        self._client = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        i = self.info
        return (f"{type(self).__name__}(meshdit serve at {self._client.endpoint if self._client else 'closed'}, "
                f"tp={i.get('tp')} ring={i.get('ring')} ulysses={i.get('ulysses')}, "
                f"device={i.get('device')}, dtype={i.get('dtype')})")


# ---- every public method of a diffusers transformer, and what it does here ---------------------
# The public methods and properties of diffusers' transformer classes (ModelMixin, torch.nn.Module
# and the mixins: ConfigMixin, PeftAdapterMixin, CacheMixin, AttentionMixin,
# FromOriginalModelMixin, PushToHubMixin): "works" (defined above, or inherited with its meaning
# intact) or "refused" (NotImplementedError naming it, with the reason below). Nothing is accepted
# and ignored: a no-op is listed as works only where doing nothing is what the call means for a
# model whose weights and attention are on the mesh. tests/python/test_dropin.py checks that the
# table covers every such name of the five families' diffusers classes, and calls each entry.
_NO_WEIGHTS = "the weights are on the mesh; save_pretrained writes the checkpoint"
_NO_MODULES = "the transformer's modules run on the mesh; one added here would never run"
_NO_GRAD = "no gradient flows through the mesh (inference only)"
_NO_OFFLOAD = ("accelerate's offload hooks (pipe.enable_model_cpu_offload, "
               "enable_sequential_cpu_offload) do not apply to the meshdit transformer: its "
               "weights are on the mesh, not in this process. Place the pipeline's other "
               "components yourself (pipe.vae.to('cuda'), ...)")
_NO_COPY = ("a meshdit Transformer is a connection to its mesh and cannot be copied or pickled: "
            "share it (threads may), or open another with from_pretrained / connect")


def _session_lost(error: str, session: str, raws, send) -> bool:
    """Whether a forward's error reply says its session lost tensors the forward did not send:
    the session is not open (src/serve/session.c: ended, dropped when idle, or a client that
    holds no token for it), or the model lacks an input the session should have held
    (src/models/inputs.c). Any other error is the forward's own."""
    if f"session '{session}' is not open" in error:
        return True
    missing = re.search(r"inputs: tensor '([^']*)' is missing", error)
    return missing is not None and missing[1] in raws and missing[1] not in send


def _hooks():
    """diffusers.hooks, imported when a cache is first asked for."""
    from diffusers import hooks
    return hooks


def _whole(config, field: str) -> int:
    """config.field as an int: a whole number (2 or 2.0). diffusers computes with the value as
    given (a step count of 2.5 is compared as 2.5), so a value int() would truncate is refused."""
    v = getattr(config, field)
    if not isinstance(v, bool):  # True is an int to Python, not a step count to a user
        if isinstance(v, numbers.Integral):
            return int(v)
        if isinstance(v, numbers.Real) and math.isfinite(v) and float(v).is_integer():
            return int(v)
    raise NotImplementedError(f"meshdit: {type(config).__name__}.{field}={v!r} is not "
                              f"implemented (meshdit takes whole numbers)")


# the server's bounds on a cache spec's values (src/models/cache.c, mdt_cache_spec_parse): a
# value outside them is refused when the config is enabled, not by every forward after it
_STEPS_MAX, _RATIOS_MAX, _TAYLOR_ORDERS = 1 << 20, 1024, 4
# the caches each family's forward runs (its mdt_cache_begin call): another fails every forward
CACHE_FAMILIES = {"first_block": ("flux", "qwenimage", "wan"), "mag": ("flux", "qwenimage", "wan"),
                  "taylorseer": ("flux", "qwenimage"), "text_kv": ("wan",)}


def _within(config, field: str, lo: int, hi: int) -> int:
    v = _whole(config, field)
    if not lo <= v <= hi:
        raise ValueError(f"meshdit: {type(config).__name__}.{field}={v} is not in [{lo}, {hi}]")
    return v


def _at_least(config, field: str, lo: float) -> float:
    v = getattr(config, field)
    try:
        x = float(v)
    except (TypeError, ValueError, OverflowError):
        x = math.nan
    if isinstance(v, bool) or not (math.isfinite(x) and x >= lo):
        raise ValueError(f"meshdit: {type(config).__name__}.{field} must be a finite number "
                         f">= {lo:g}, got {v!r}")
    return x


def _cache_spec(config) -> str:
    """The server's --cache text for a diffusers cache config: FirstBlockCacheConfig,
    MagCacheConfig, TaylorSeerCacheConfig or TextKVCacheConfig with the fields diffusers gives
    them; NotImplementedError naming any other config or field."""
    import dataclasses

    hooks = _hooks()
    if isinstance(config, hooks.FirstBlockCacheConfig):
        fields = {f.name for f in dataclasses.fields(config)}
        extra = sorted(fields - {"threshold"})
        if extra:
            raise NotImplementedError(f"meshdit: FirstBlockCacheConfig field(s) {extra} are not "
                                      f"implemented (meshdit takes threshold)")
        return f"first_block:threshold={_at_least(config, 'threshold', 0.0)!r}"
    if isinstance(config, hooks.MagCacheConfig):
        fields = {f.name for f in dataclasses.fields(config)}
        extra = sorted(fields - {"threshold", "max_skip_steps", "retention_ratio",
                                 "num_inference_steps", "mag_ratios", "calibrate"})
        if extra:
            raise NotImplementedError(f"meshdit: MagCacheConfig field(s) {extra} are not "
                                      f"implemented")
        if config.calibrate:
            raise NotImplementedError("meshdit: MagCacheConfig(calibrate=True) is not "
                                      "implemented: calibrate with diffusers' own transformer, "
                                      "then pass its mag_ratios")
        ratios = torch.as_tensor(config.mag_ratios, dtype=torch.float32).reshape(-1).tolist()
        if not 1 <= len(ratios) <= _RATIOS_MAX or not all(math.isfinite(r) for r in ratios):
            raise ValueError(f"meshdit: MagCacheConfig.mag_ratios must be 1 to {_RATIOS_MAX} "
                             f"finite numbers, got {len(ratios)} ({ratios[:4]}...)")
        return (f"mag:threshold={_at_least(config, 'threshold', 0.0)!r},"
                f"max_skip_steps={_within(config, 'max_skip_steps', 0, _STEPS_MAX)},"
                f"retention_ratio={_at_least(config, 'retention_ratio', 0.0)!r},"
                f"num_inference_steps={_within(config, 'num_inference_steps', 1, _RATIOS_MAX)},"
                f"mag_ratios={'/'.join(repr(float(r)) for r in ratios)}")
    if isinstance(config, hooks.TaylorSeerCacheConfig):
        fields = {f.name for f in dataclasses.fields(config)}
        extra = sorted(fields - {"cache_interval", "disable_cache_before_step",
                                 "disable_cache_after_step", "max_order", "taylor_factors_dtype",
                                 "skip_predict_identifiers", "cache_identifiers", "use_lite_mode"})
        for name, default in (("skip_predict_identifiers", None), ("cache_identifiers", None),
                              ("use_lite_mode", False)):
            if getattr(config, name) != default:
                extra.append(name)
        if extra:
            raise NotImplementedError(f"meshdit: TaylorSeerCacheConfig field(s) {sorted(extra)} "
                                      f"are not implemented (meshdit hooks diffusers' default "
                                      f"modules: every block's attention)")
        dt = config.taylor_factors_dtype
        if dt not in (torch.bfloat16, torch.float32, None):
            raise NotImplementedError(f"meshdit: TaylorSeerCacheConfig.taylor_factors_dtype={dt} "
                                      f"is not implemented (bfloat16 or float32)")
        after = config.disable_cache_after_step
        steps = (-_STEPS_MAX, _STEPS_MAX)
        return (f"taylorseer:cache_interval={_within(config, 'cache_interval', 1, _STEPS_MAX)},"
                f"disable_cache_before_step="
                f"{_within(config, 'disable_cache_before_step', *steps)},"
                f"disable_cache_after_step="
                f"{'none' if after is None else _within(config, 'disable_cache_after_step', *steps)},"
                f"max_order={_within(config, 'max_order', 0, _TAYLOR_ORDERS)},"
                f"taylor_factors_dtype={'bfloat16' if dt == torch.bfloat16 else 'float32'}")
    if isinstance(config, hooks.TextKVCacheConfig):
        return "text_kv"  # exact: Wan's cross-attention K/V kept across the steps
    known = [n for n in dir(hooks) if n.endswith("Config")]
    if type(config).__name__ in known:
        raise NotImplementedError(f"meshdit: {type(config).__name__} is not implemented (meshdit "
                                  f"runs FirstBlockCacheConfig on the mesh)")
    raise ValueError(f"Cache config {type(config)} is not supported.")


METHODS: dict[str, tuple[str, str]] = {
    # making, saving, configuring
    "from_pretrained": ("works", "starts meshdit serve on a directory or a locally cached Hub id"),
    "save_pretrained": ("works", "copies the checkpoint the mesh loaded (config + safetensors)"),
    "config": ("works", "the server's config.json"),
    "save_config": ("works", "writes that config.json"),
    "to_json_string": ("works", "that config.json's text"),
    "to_json_file": ("works", "writes that text"),
    "load_config": ("works", "a checkpoint's config.json as a dict"),
    "register_to_config": ("refused", "the config is the checkpoint's the server loaded"),
    "from_config": ("refused", "meshdit loads a checkpoint: from_pretrained(DIR)"),
    "get_config_dict": ("refused", "use load_config(DIR)"),
    "extract_init_dict": ("refused", "meshdit builds no torch model from a config"),
    "register_for_auto_class": ("refused", "meshdit's classes are not auto classes"),
    "from_single_file": ("refused", "meshdit reads diffusers-layout directories"),
    "push_to_hub": ("refused", "save_pretrained(DIR), then `hf upload`"),
    # dtype and device: what the pipeline is told (outputs follow hidden_states)
    "dtype": ("works", "torch_dtype, or the last .to()"), "device": ("works", "the last .to()"),
    **{n: ("works", "records the dtype/device; the weights stay on the mesh") for n in (
        "to", "cpu", "cuda", "xpu", "ipu", "mtia", "to_empty", "half", "float", "bfloat16",
        "double", "type")},
    # the forward and its hooks
    "forward": ("works", "the family's diffusers forward, on the mesh"),
    "compile": ("works", "torch.compile of the call; the forward itself is not traced"),
    "compile_repeated_blocks": ("works", "nothing to compile here: the blocks are on the mesh"),
    "cache_context": ("works", "the context pipelines enter around a call"),
    "register_forward_hook": ("works", "the hook sees each forward's inputs and outputs"),
    "register_forward_pre_hook": ("works", "the hook sees each forward's inputs"),
    "eval": ("works", "the mesh runs inference"), "train": ("works", "train(False); True refused"),
    "requires_grad_": ("works", "requires_grad_(False); True refused"),
    "zero_grad": ("works", "no gradients to clear"),
    "is_gradient_checkpointing": ("works", "False"),
    "disable_gradient_checkpointing": ("works", "it is never on"),
    "enable_gradient_checkpointing": ("refused", _NO_GRAD),
    "register_backward_hook": ("refused", _NO_GRAD),
    "register_full_backward_hook": ("refused", _NO_GRAD),
    "register_full_backward_pre_hook": ("refused", _NO_GRAD),
    # the module tree and its tensors: one module, no tensors in this process
    **{n: ("works", "this object alone: no submodules, no tensors in this process") for n in (
        "modules", "named_modules", "children", "named_children", "parameters",
        "named_parameters", "buffers", "named_buffers", "get_submodule", "get_parameter",
        "get_buffer", "apply", "share_memory", "extra_repr")},
    "num_parameters": ("works", "counted from the checkpoint's safetensors headers"),
    "get_memory_footprint": ("refused", "the weights are on the mesh: t.info['weight_bytes']"),
    "state_dict": ("refused", _NO_WEIGHTS + " (to diffusers' Flux LoRA loader: {})"),
    **{n: ("refused", _NO_WEIGHTS) for n in (
        "load_state_dict", "get_extra_state", "set_extra_state",
        "register_state_dict_pre_hook", "register_state_dict_post_hook",
        "register_load_state_dict_pre_hook", "register_load_state_dict_post_hook",
        "dequantize")},
    **{n: ("refused", _NO_MODULES) for n in (
        "add_module", "register_module", "register_buffer", "register_parameter",
        "set_submodule")},
    # attention: meshdit computes exact softmax attention with its own kernel
    "set_attention_backend": ("works", "exact backends recorded; SageAttention refused"),
    "reset_attention_backend": ("works", "clears the record"),
    **{n: ("works", "exact attention: recorded as set_attention_backend") for n in (
        "set_use_memory_efficient_attention_xformers", "enable_xformers_memory_efficient_attention",
        "disable_xformers_memory_efficient_attention", "set_use_npu_flash_attention",
        "enable_npu_flash_attention", "disable_npu_flash_attention",
        "set_use_xla_flash_attention", "enable_xla_flash_attention",
        "disable_xla_flash_attention")},
    "attn_processors": ("works", "{}: no attention module runs in this process"),
    "set_attn_processor": ("refused", "attention runs on the mesh; a processor would never run"),
    "fuse_qkv_projections": ("works", "fusing changes no result; the mesh's GEMMs are its own"),
    "unfuse_qkv_projections": ("works", "see fuse_qkv_projections"),
    # memory and parallelism: the mesh's own
    "enable_group_offload": ("refused", "the weights stay resident on the mesh (max_memory=)"),
    "enable_layerwise_casting": ("refused", "the mesh computes in f32 or bf16: dtype='bf16'"),
    "enable_parallelism": ("refused", "the mesh is the parallelism: from_pretrained(tp=, ring=, "
                                      "ulysses=)"),
    # caches and LoRA
    "is_cache_enabled": ("works", "whether enable_cache holds a config"),
    "enable_cache": ("works", "FirstBlockCacheConfig, MagCacheConfig, TaylorSeerCacheConfig and "
                             "TextKVCacheConfig on the mesh; other configs refused"),
    "disable_cache": ("works", "every block of every step again"),
    "load_lora_adapter": ("works", "the factors loaded on the mesh, fused before a forward"),
    **{n: ("works", "diffusers' own, on peft's state; the mesh fuses what it says") for n in (
        "set_adapters", "set_adapter", "active_adapters", "delete_adapters", "enable_adapters",
        "disable_adapters", "enable_lora", "disable_lora", "fuse_lora", "unfuse_lora",
        "unload_lora")},
    "save_lora_adapter": ("refused", "the adapter's factors are on the mesh; save the file it "
                                     "came from"),
    "add_adapter": ("refused", "a new trainable adapter: " + _NO_GRAD),
    "enable_lora_hotswap": ("refused", "hotswapping is not implemented: delete_adapters(name), "
                                       "then load the new adapter"),
    # pipe.load_ip_adapter() calls this on the transformer
    "_load_ip_adapter_weights": ("refused", "IP-adapters are not implemented"),
    # copies: deepcopy and pickle took the connection's lock and failed on it
    **{n: ("refused", _NO_COPY) for n in ("__deepcopy__", "__copy__", "__reduce_ex__")},
}


def _refusal(name: str, why: str):
    def refused(*args, **kwargs):
        raise NotImplementedError(f"meshdit: {name}() is not supported: {why}")
    refused.__name__ = refused.__qualname__ = name
    refused.__doc__ = f"Refused (meshdit): {why}."
    return refused


for _name, (_verdict, _why) in METHODS.items():
    if _verdict == "refused":
        setattr(Transformer, _name, _refusal(_name, _why))


def _state_dict(refused):
    """state_dict's refusal, but for diffusers' Flux LoRA loader, which reads it to widen the
    modules of this process that a Control LoRA's factors outgrow: there are none ({}), and the
    server checks every factor's shape against its weight."""
    def state_dict(*args, **kwargs):
        caller = sys._getframe(1).f_code.co_name
        if caller == "_maybe_expand_lora_state_dict":
            return {}
        if caller == "cpu_offload":  # accelerate's, under pipe.enable_sequential_cpu_offload()
            raise NotImplementedError(f"meshdit: {_NO_OFFLOAD}")
        if caller == "_load_norm_into_transformer":
            raise NotImplementedError("meshdit: LoRAs that replace norm layers (Flux Control "
                                      "LoRAs) are not supported: meshdit fuses LoRA factors only")
        return refused(*args, **kwargs)
    state_dict.__name__ = state_dict.__qualname__ = "state_dict"
    state_dict.__doc__ = refused.__doc__
    return state_dict


Transformer.state_dict = _state_dict(Transformer.state_dict)


def _offload_hook(self):  # no hook: hasattr(t, "_hf_hook") is False, as for a module without
    raise AttributeError("_hf_hook")


def _refuse_offload_hook(self, hook):  # accelerate's add_hook_to_module: module._hf_hook = hook
    raise NotImplementedError(f"meshdit: {_NO_OFFLOAD}")


# pipe.enable_model_cpu_offload() wrapped the forward in a hook that reads next(parameters())
# and stopped every later forward with a bare StopIteration: refused where the hook is set
Transformer._hf_hook = property(_offload_hook, _refuse_offload_hook)

# the block lists of diffusers' transformers, which run on the mesh here: code that reaches into
# them (Flux2KleinKVPipeline sets KV-cache attention processors on every block when it is built)
# got torch's bare "'Flux2Transformer' object has no attribute 'transformer_blocks'"
_BLOCK_LISTS = frozenset({"transformer_blocks", "single_transformer_blocks", "blocks", "layers"})
_module_getattr = torch.nn.Module.__getattr__


def _getattr(self, name):
    try:
        return _module_getattr(self, name)
    except AttributeError:
        if name not in _BLOCK_LISTS:
            raise
    # still an AttributeError, so hasattr() and getattr(t, name, default) read it as absent
    raise AttributeError(f"meshdit: {type(self).__name__} has no '{name}': the transformer's "
                         f"blocks run on the mesh, not in this process; code that reaches into "
                         f"them (attention processors, per-block hooks, Flux2KleinKVPipeline's "
                         f"KV cache) is not supported") from None


Transformer.__getattr__ = _getattr


class FluxTransformer(Transformer):
    """Stands in for diffusers' FluxTransformer2DModel."""

    family, class_name = "flux", "FluxTransformer2DModel"
    per_step = frozenset({"hidden_states", "timestep", "controlnet_block_samples",
                          "controlnet_single_block_samples"})

    @_eager
    @_locked
    @apply_lora_scale("joint_attention_kwargs")
    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor = None,
                pooled_projections: torch.Tensor = None, timestep: torch.LongTensor = None,
                img_ids: torch.Tensor = None, txt_ids: torch.Tensor = None,
                guidance: torch.Tensor = None, joint_attention_kwargs: dict | None = None,
                controlnet_block_samples=None, controlnet_single_block_samples=None,
                return_dict: bool = True, controlnet_blocks_repeat: bool = False):
        _refuse(joint_attention_kwargs=joint_attention_kwargs)
        if guidance is not None and not self.config.get("guidance_embeds", False):
            raise ValueError("meshdit: 'guidance' was given, but this FluxTransformer2DModel has "
                             "no guidance embedding (config guidance_embeds is false)")
        out = self._run({"hidden_states": hidden_states,
                         "encoder_hidden_states": encoder_hidden_states,
                         "pooled_projections": pooled_projections, "timestep": timestep,
                         "img_ids": img_ids, "txt_ids": txt_ids, "guidance": guidance,
                         **_controlnet_inputs(controlnet_block_samples,
                                              controlnet_single_block_samples,
                                              bool(controlnet_blocks_repeat))},
                        like=hidden_states)
        if not return_dict:
            return (out["sample"],)
        return Transformer2DModelOutput(sample=out["sample"])


class MiniMaxH3Transformer(Transformer):
    """Stands in for diffusers' MiniMaxH3Transformer3DModel."""

    family, class_name = "minimax-h3", "MiniMaxH3Transformer3DModel"
    per_step = frozenset({"hidden_states", "audio_hidden_states", "timestep"})

    @_eager
    @_locked
    @apply_lora_scale("attention_kwargs")
    def forward(self, hidden_states: torch.Tensor, audio_hidden_states: torch.Tensor,
                encoder_hidden_states: torch.Tensor, timestep: torch.Tensor,
                timestep_indices: torch.Tensor, token_tags: torch.Tensor,
                position_ids: torch.Tensor, video_indices: torch.Tensor,
                audio_indices: torch.Tensor, text_indices: torch.Tensor,
                attention_kwargs: dict | None = None, return_dict: bool = True):
        _refuse(attention_kwargs=attention_kwargs)
        out = self._run({"hidden_states": hidden_states,
                         "audio_hidden_states": audio_hidden_states,
                         "encoder_hidden_states": encoder_hidden_states, "timestep": timestep,
                         "timestep_indices": timestep_indices, "token_tags": token_tags,
                         "position_ids": position_ids, "video_indices": video_indices,
                         "audio_indices": audio_indices, "text_indices": text_indices},
                        like=hidden_states)
        if not return_dict:
            return out["sample"], out["audio_sample"]
        from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3TransformerOutput
        return MiniMaxH3TransformerOutput(sample=out["sample"], audio_sample=out["audio_sample"])


class Flux2Transformer(Transformer):
    """Stands in for diffusers' Flux2Transformer2DModel."""

    family, class_name = "flux2", "Flux2Transformer2DModel"
    per_step = frozenset({"hidden_states", "timestep"})

    @_eager
    @_locked
    @apply_lora_scale("joint_attention_kwargs")
    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor = None,
                timestep: torch.LongTensor = None, img_ids: torch.Tensor = None,
                txt_ids: torch.Tensor = None, guidance: torch.Tensor = None,
                joint_attention_kwargs: dict | None = None, return_dict: bool = True,
                kv_cache=None, kv_cache_mode: str | None = None, num_ref_tokens: int = 0,
                ref_fixed_timestep: float = 0.0):
        _refuse(joint_attention_kwargs=joint_attention_kwargs, kv_cache=kv_cache,
                kv_cache_mode=kv_cache_mode, num_ref_tokens=num_ref_tokens,
                ref_fixed_timestep=ref_fixed_timestep)
        if not self.config.get("guidance_embeds", True):
            guidance = None  # diffusers' Flux2 reads guidance only with a guidance embedder
        out = self._run({"hidden_states": hidden_states,
                         "encoder_hidden_states": encoder_hidden_states, "timestep": timestep,
                         "img_ids": img_ids, "txt_ids": txt_ids, "guidance": guidance},
                        like=hidden_states)
        if not return_dict:
            return (out["sample"],)
        from diffusers.models.transformers.transformer_flux2 import Flux2Transformer2DModelOutput
        return Flux2Transformer2DModelOutput(sample=out["sample"])


def _first_rows(entry) -> int | None:
    """The rows of an img_shapes entry's first image (frames x height x width); None if unreadable."""
    first = entry[0] if isinstance(entry, list) and entry else entry
    try:
        return int(first[0]) * int(first[1]) * int(first[2])
    except (TypeError, ValueError, IndexError):
        return None


def _img_shapes(img_shapes, batch: int, zero_cond_t: bool = False):
    """diffusers' `img_shapes` as meshdit's int64 [B, n, 3] tensor (docs/models.md, Qwen-Image),
    read as diffusers' QwenEmbedRope reads it: a list is one entry per prompt (pipelines pass
    one per prompt, not per image) and only its first entry counts (diffusers warns when the
    others differ; so does this); that entry is one (frames, height, width) or a list of them
    (an image and its reference images), in patches. A tensor goes as it is. With zero_cond_t
    (Qwen-Image-Edit-2511) diffusers reads every entry's first image for the rows it modulates
    at timestep 0: entries whose first images differ in rows are refused (one entry for all
    elements here)."""
    if img_shapes is None or isinstance(img_shapes, torch.Tensor):
        return img_shapes
    if isinstance(img_shapes, list) and not img_shapes:
        raise ValueError("meshdit: img_shapes is an empty list")
    first = img_shapes[0] if isinstance(img_shapes, list) else img_shapes
    if zero_cond_t and isinstance(img_shapes, list) and \
            len({_first_rows(s) for s in img_shapes}) > 1:
        raise ValueError(f"meshdit: img_shapes {img_shapes}: with zero_cond_t the rows of each "
                         f"entry's first image are the ones modulated at timestep t, and they "
                         f"differ across the batch; meshdit runs one entry for every element: "
                         f"send elements whose first images differ as separate batches")
    if isinstance(img_shapes, list) and any(s != first for s in img_shapes[1:]):
        warnings.warn(f"meshdit: img_shapes {img_shapes} differ across the batch: as diffusers' "
                      f"QwenEmbedRope, the first entry {first} gives every element's positions",
                      stacklevel=3)
    shapes = first if isinstance(first, list) else [first]
    try:
        t = torch.tensor([tuple(int(d) for d in s) for s in shapes], dtype=torch.int64)
    except (TypeError, ValueError) as e:
        raise ValueError(f"meshdit: img_shapes must hold (frames, height, width) triples ({e})") from None
    if t.ndim != 2 or t.shape[1] != 3 or t.shape[0] == 0:
        raise ValueError(f"meshdit: img_shapes' first entry {first!r} is not (frames, height, "
                         f"width) or a list of them")
    return t.unsqueeze(0).expand(batch, -1, -1).contiguous()


class QwenImageTransformer(Transformer):
    """Stands in for diffusers' QwenImageTransformer2DModel. `img_shapes` goes as an int64
    [B, n, 3] tensor, `encoder_hidden_states_mask` as it is."""

    family, class_name = "qwenimage", "QwenImageTransformer2DModel"
    per_step = frozenset({"hidden_states", "timestep", "controlnet_block_samples"})

    @_eager
    @_locked
    @apply_lora_scale("attention_kwargs")
    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor = None,
                encoder_hidden_states_mask: torch.Tensor = None,
                timestep: torch.LongTensor = None, img_shapes=None,
                guidance: torch.Tensor = None, attention_kwargs: dict | None = None,
                controlnet_block_samples=None, additional_t_cond=None,
                return_dict: bool = True):
        _refuse(guidance=guidance, attention_kwargs=attention_kwargs)
        inputs = {**_controlnet_inputs(controlnet_block_samples),
                  "hidden_states": hidden_states,
                  "encoder_hidden_states": encoder_hidden_states,
                  "encoder_hidden_states_mask": encoder_hidden_states_mask,
                  "timestep": timestep,
                  "img_shapes": _img_shapes(img_shapes, hidden_states.shape[0],
                                            bool(self.config.get("zero_cond_t", False)))}
        if self.config.get("use_additional_t_cond", False):
            inputs["additional_t_cond"] = additional_t_cond  # Qwen-Image-Layered's is_rgb
        elif additional_t_cond is not None:
            raise ValueError("meshdit: 'additional_t_cond' is given but the checkpoint's config "
                             "has use_additional_t_cond false, so it has no embedding for it "
                             "(diffusers ignores it then; meshdit refuses to)")
        out = self._run(inputs, like=hidden_states)
        if not return_dict:
            return (out["sample"],)
        return Transformer2DModelOutput(sample=out["sample"])


class WanTransformer(Transformer):
    """Stands in for diffusers' WanTransformer3DModel (Wan 2.1/2.2: T2V, I2V, TI2V)."""

    family, class_name = "wan", "WanTransformer3DModel"
    per_step = frozenset({"hidden_states", "timestep"})

    @_eager
    @_locked
    @apply_lora_scale("attention_kwargs")
    def forward(self, hidden_states: torch.Tensor, timestep: torch.LongTensor,
                encoder_hidden_states: torch.Tensor,
                encoder_hidden_states_image: torch.Tensor | None = None,
                return_dict: bool = True, attention_kwargs: dict | None = None):
        _refuse(attention_kwargs=attention_kwargs)
        out = self._run({"hidden_states": hidden_states, "timestep": timestep,
                         "encoder_hidden_states": encoder_hidden_states,
                         "encoder_hidden_states_image": encoder_hidden_states_image},
                        like=hidden_states)
        if not return_dict:
            return (out["sample"],)
        return Transformer2DModelOutput(sample=out["sample"])


_FAMILIES = {c.family: c for c in (FluxTransformer, MiniMaxH3Transformer, Flux2Transformer,
                                   QwenImageTransformer, WanTransformer)}
