"""LoRA adapters for the mesh: what diffusers' loaders produce, as the safetensors meshdit reads.

diffusers' ``pipe.load_lora_weights(path_or_dict)`` runs the family's ``lora_state_dict``
(kohya ``lora_unet_*``, BFL/ComfyUI ``diffusion_model.*``, XLabs, musubi, ... converted by
diffusers' own converters), then hands the transformer's part to
``transformer.load_lora_adapter(state_dict, network_alphas=..., metadata=...)``. `adapter_blob`
turns exactly that hand-over into one safetensors blob in the form meshdit reads
(docs/lora.md): ``transformer.MODULE.lora_A.weight`` / ``lora_B.weight`` (and ``lora_B.bias``),
the network alphas as ``transformer.MODULE.alpha`` scalars, the LoRA config as
``lora_adapter_metadata``. meshdit maps every key to a weight of the model or refuses the whole
adapter with a message listing the keys that map to nothing. `family_lora_state_dict` is the
reference conversion itself, for a file or dict given without a pipeline.

Needs torch and diffusers.
"""
from __future__ import annotations

import json
from typing import Any, Mapping

import numpy as np
import torch

from . import _blob

# the family's diffusers LoRA loader mixin, by meshdit's family name
_MIXINS = {
    "flux": "FluxLoraLoaderMixin", "flux2": "Flux2LoraLoaderMixin",
    "qwenimage": "QwenImageLoraLoaderMixin", "wan": "WanLoraLoaderMixin",
    "minimax-h3": "MiniMaxH3LoraLoaderMixin",
}


def _raw(t: torch.Tensor) -> _blob.Raw:
    t = t.detach().to("cpu").contiguous()
    if t.dtype == torch.bfloat16:
        return _blob.Raw("BF16", tuple(t.shape), memoryview(t.view(torch.int16).numpy().reshape(-1).view(np.uint8)))
    if t.dtype == torch.float64:
        t = t.to(torch.float32)
    return _blob.raw(t.numpy())


def adapter_blob(state_dict: Mapping[str, Any], network_alphas: Mapping[str, Any] | None = None,
                 metadata: Mapping[str, Any] | None = None, prefix: str | None = "transformer") -> bytes:
    """The safetensors blob of one adapter, from what diffusers hands ``load_lora_adapter``.

    state_dict: peft/diffusers keys, with `prefix` (``transformer.``) or without (prefix None);
    keys of other components (``text_encoder.``) are left to the pipeline, as diffusers does.
    network_alphas: ``{PREFIX.MODULE.alpha: value}`` or None; metadata: the LoraConfig's fields
    (diffusers' ``lora_adapter_metadata``, with or without the prefix) or None. Both together
    raise ValueError, as in diffusers."""
    if network_alphas and metadata:
        raise ValueError("meshdit: `network_alphas` and `metadata` cannot both be given (as in "
                         "diffusers' load_lora_adapter)")
    pfx = f"{prefix}." if prefix else ""
    tensors: dict[str, _blob.Raw] = {}
    for k, v in state_dict.items():
        if pfx and not k.startswith(pfx):
            continue
        name = "transformer." + k[len(pfx):]
        if not isinstance(v, torch.Tensor):
            raise TypeError(f"meshdit: adapter key '{k}' holds {type(v).__name__}, not a tensor")
        tensors[name] = _raw(v)
    if not tensors:
        raise ValueError(f"meshdit: the adapter holds no '{pfx}' keys (its keys start "
                         f"{sorted({k.split('.')[0] for k in state_dict})[:4]})")
    for k, v in (network_alphas or {}).items():
        if pfx and not k.startswith(pfx):
            continue
        tensors["transformer." + k[len(pfx):]] = _blob.raw(np.asarray(float(v), dtype="<f4"))
    meta = {"format": "pt"}
    if metadata:
        cfg = {k: (sorted(v) if isinstance(v, set) else v) for k, v in metadata.items()}
        cfg = {(k if k.startswith("transformer.") else f"transformer.{k}"): v for k, v in cfg.items()}
        meta["lora_adapter_metadata"] = json.dumps(cfg, sort_keys=True)
    return b"".join(bytes(p) for p in _blob.encode(meta, tensors))


def family_lora_state_dict(family: str, path_or_dict, **kwargs):
    """(state_dict, network_alphas, metadata) of `path_or_dict` as the family's pipeline reads it:
    diffusers' own ``lora_state_dict`` with its converters (kwargs: weight_name, subfolder, ...,
    as diffusers takes them)."""
    import diffusers.loaders.lora_pipeline as lp

    name = _MIXINS.get(family)
    if name is None:
        raise NotImplementedError(f"meshdit: no diffusers LoRA loader for family '{family}'")
    mixin = getattr(lp, name)
    import inspect

    if isinstance(path_or_dict, dict):
        path_or_dict = dict(path_or_dict)  # diffusers' converters pop keys
    if "return_alphas" in inspect.signature(mixin.lora_state_dict).parameters:  # Flux's
        return mixin.lora_state_dict(path_or_dict, return_alphas=True, return_lora_metadata=True,
                                     **kwargs)
    sd, meta = mixin.lora_state_dict(path_or_dict, return_lora_metadata=True, **kwargs)
    return sd, None, meta
