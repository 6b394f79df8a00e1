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

import contextlib
import json
import math
from typing import Any, Mapping

import numpy as np
import torch

from . import _blob
from .client import ServerError

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
    """The safetensors blob of one adapter, from what diffusers hands ``load_lora_adapter``
    (`adapter_parts`, as one file's bytes)."""
    meta, tensors = adapter_parts(state_dict, network_alphas, metadata, prefix)
    return b"".join(bytes(p) for p in _blob.encode(meta, tensors))


def adapter_parts(state_dict: Mapping[str, Any], network_alphas: Mapping[str, Any] | None = None,
                  metadata: Mapping[str, Any] | None = None, prefix: str | None = "transformer"):
    """(metadata, tensors) of one adapter's safetensors, from what diffusers hands
    ``load_lora_adapter``.

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
    if metadata is not None:  # {} too: diffusers builds LoraConfig() from it (r 8, alpha 8)
        cfg = {k: (sorted(v) if isinstance(v, set) else v) for k, v in metadata.items()}
        cfg = {(k if k.startswith("transformer.") else f"transformer.{k}"): v for k, v in cfg.items()}
        meta["lora_adapter_metadata"] = json.dumps(cfg, sort_keys=True)
    return meta, tensors


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


# ---- the drop-in's adapters: diffusers' LoRA API, its state kept by peft itself ---------------
# diffusers' LoRA calls (load_lora_adapter, set_adapters, fuse_lora / unfuse_lora, delete_adapters,
# disable_lora / enable_lora, unload_lora, the `scale` of the attention kwargs, and the pipeline's
# get_active_adapters / fused_loras that walk the model's peft layers) all act on peft's per-layer
# state: the active adapters, each one's scaling, the merged ones, the disabled flag. meshdit runs
# that state unchanged, on one real peft LoRA layer in this process, the probe: a linear of one
# input and SLOTS outputs (zero weights), where each adapter is a rank-1 LoRA whose A is 1 and
# whose B is its slot's unit vector, at lora_alpha = r = 1. The probe's output for the input 1 is
# then, slot by slot, the coefficient peft applies to that adapter's B A in every layer it
# adapts (its set_adapters weight, times the scale of the forward, for an active adapter; what
# fuse_lora merged, kept through unfuse, disable and unload as peft keeps it). Each forward sends
# those coefficients as its "lora" set and the server fuses W0 + sum c_i s_i B_i A_i (s_i the
# adapter's own alpha / r per module) before it runs, unless that set is fused already.
PROBE = "meshdit_probe"  # no "lora" in it: diffusers' unload_lora skips modules so named
SLOTS = 16  # adapters one drop-in holds at once (loaded, or merged and still in the weights)


MAX_WEIGHT = 1e6  # |weight x scale| the server takes for an adapter (src/serve/proto.c)


def check_weight(value, what: str) -> float:
    """`value` as a float, or ValueError naming `what` (the argument and the adapter): a LoRA
    weight or scale must be a finite number of magnitude at most MAX_WEIGHT. (A NaN scale would
    otherwise stay in peft's scaling, x * nan / nan, and fail every later forward.)"""
    try:
        w = float(value)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"meshdit: {what} must be a number, got {value!r}") from None
    if isinstance(value, bool) or not math.isfinite(w) or abs(w) > MAX_WEIGHT:
        raise ValueError(f"meshdit: {what} is {value!r}: it must be a finite number of "
                         f"magnitude at most {MAX_WEIGHT:g}")
    return w


def _state(t) -> dict:
    st = t.__dict__.get("_meshdit_lora")
    if st is None:
        import secrets
        startup = [f"{a['name']}={float(a['weight'])!r}"
                   for a in json.loads(t.info.get("adapters", "[]")) if a.get("fused")]
        # server-side names: unguessable (the server lists no client's adapters), so no other
        # client can name, fuse or unload them
        st = {"prefix": f"py{secrets.token_hex(16)}-", "next": 0, "slots": {},
              "startup": startup}
        t.__dict__["_meshdit_lora"] = st
        if t._server is None:  # a shared server (connect): its adapters go with this object
            import weakref
            weakref.finalize(t, _unload_all, t._client, st)
    return st


def load_adapter(t, pretrained_model_name_or_path_or_dict, prefix="transformer", hotswap=False,
                 **kwargs) -> None:
    """diffusers' ``PeftAdapterMixin.load_lora_adapter`` for a drop-in: the same state dict
    handling (prefix, kohya-style names turned into peft's, network alphas, metadata), the
    factors loaded on the server under a name of this drop-in's, and the adapter added to the
    probe as peft adds one to every layer (so which adapters are active afterwards is peft's
    answer)."""
    from diffusers.loaders.lora_base import _fetch_state_dict
    from diffusers.utils import convert_unet_state_dict_to_peft, get_adapter_name
    from peft import LoraConfig, inject_adapter_in_model

    adapter_name = kwargs.pop("adapter_name", None)
    network_alphas = kwargs.pop("network_alphas", None)
    metadata = kwargs.pop("metadata", None)
    for k in ("_pipeline", "low_cpu_mem_usage"):
        kwargs.pop(k, None)
    fetch = {k: kwargs.pop(k, d) for k, d in (
        ("weight_name", None), ("use_safetensors", None), ("local_files_only", None),
        ("cache_dir", None), ("force_download", False), ("proxies", None), ("token", None),
        ("revision", None), ("subfolder", None))}
    if kwargs:
        raise TypeError(f"meshdit: load_lora_adapter() got unexpected keyword argument(s) "
                        f"{sorted(kwargs)}")
    if hotswap:
        raise NotImplementedError("meshdit: load_lora_adapter(hotswap=True) is not supported: "
                                  "delete_adapters(name), then load the new one")
    state_dict, metadata = _fetch_state_dict(
        pretrained_model_name_or_path_or_dict=pretrained_model_name_or_path_or_dict,
        user_agent={"file_type": "attn_procs_weights", "framework": "pytorch"},
        allow_pickle=False, metadata=metadata, **fetch)
    if network_alphas is not None and prefix is None:
        raise ValueError("`network_alphas` cannot be None when `prefix` is None.")
    if network_alphas and metadata:
        raise ValueError("Both `network_alphas` and `metadata` cannot be specified.")
    if prefix is not None:
        state_dict = {k.removeprefix(f"{prefix}."): v for k, v in state_dict.items()
                      if k.startswith(f"{prefix}.")}
        if metadata is not None:
            metadata = {k.removeprefix(f"{prefix}."): v for k, v in metadata.items()
                        if k.startswith(f"{prefix}.")}
    if not state_dict:
        import warnings
        warnings.warn(f"meshdit: no LoRA keys for {type(t).__name__} found with prefix={prefix!r}; "
                      f"nothing was loaded", stacklevel=3)
        return
    if adapter_name in getattr(t, "peft_config", {}):
        raise ValueError(f"Adapter name {adapter_name} already in use in the model - please "
                         f"select a new adapter name.")
    if adapter_name is None:
        adapter_name = get_adapter_name(t)
    if "lora_A" not in next(iter(state_dict)) and not any(".lokr_" in k for k in state_dict):
        state_dict = convert_unet_state_dict_to_peft(state_dict)
    if network_alphas:
        network_alphas = {k.removeprefix(f"{prefix}."): v for k, v in network_alphas.items()
                          if prefix is None or k.startswith(f"{prefix}.")}
    meta, tensors = adapter_parts(state_dict, network_alphas, metadata, prefix=None)
    st = _state(t)
    collect(t)
    slot = next((i for i in range(SLOTS) if i not in st["slots"]), None)
    if slot is None:
        raise ValueError(f"meshdit: {SLOTS} adapters are held (loaded, or fused and still in the "
                         f"weights): delete_adapters() or unload_lora_weights() first")
    server_name = f"{st['prefix']}{st['next']}"
    st["next"] += 1
    try:  # the server's checks: every key, every shape
        t._client.lora_load(server_name, meta, tensors)
    except ServerError as e:  # named as the user named it, not by the server-side name
        raise ServerError(e.op, e.error.replace(server_name, str(adapter_name)),
                          e.metadata) from None
    try:
        probe = t._modules.get(PROBE)
        if probe is None:
            probe = torch.nn.Linear(1, SLOTS, bias=False, dtype=torch.float64)
            torch.nn.init.zeros_(probe.weight)
            probe.requires_grad_(False)
            t._modules[PROBE] = probe  # (add_module is refused to users: see METHODS)
        cfg = LoraConfig(r=1, lora_alpha=1, target_modules=[PROBE], lora_dropout=0.0,
                         init_lora_weights=False)
        with torch.no_grad():
            inject_adapter_in_model(cfg, t, adapter_name=adapter_name)
            layer = t._modules[PROBE]
            layer.lora_A[adapter_name].to(torch.float64).weight.fill_(1.0)
            layer.lora_B[adapter_name].to(torch.float64).weight.zero_()
            layer.lora_B[adapter_name].weight[slot, 0] = 1.0
        t._hf_peft_config_loaded = True
    except BaseException:
        with contextlib.suppress(Exception):
            t._client.lora_unload(server_name)
        cfgs = getattr(t, "peft_config", None)
        if cfgs is not None and adapter_name in cfgs:  # as diffusers drops a failed adapter's
            layer = t._modules.get(PROBE)
            with contextlib.suppress(Exception):
                layer.delete_adapter(adapter_name)
            cfgs.pop(adapter_name)
        raise
    st["slots"][slot] = {"name": adapter_name, "server": server_name, "meta": meta,
                         "tensors": tensors}


def _coefficients(t) -> list[float] | None:
    """What peft applies to each slot's adapter now (the probe's output for 1), or None. A
    coefficient within 1e-12 of 0 is 0: what x * s / s leaves of a merge unmerged after a scale
    (peft's own arithmetic; in real weights it is far below their rounding)."""
    probe = t._modules.get(PROBE)
    if probe is None:
        return None
    with torch.no_grad():
        c = probe(torch.ones(1, dtype=torch.float64)).tolist()
    return [0.0 if abs(v) < 1e-12 else v for v in c]


def collect(t, c=None) -> None:
    """Frees the slots of adapters gone from peft (deleted, unloaded) whose coefficient is 0 (a
    merged one stays in the weights, as in diffusers), and unloads them from the server; the
    probe goes with the last slot. `c`: the coefficients, when the caller has them."""
    st = t.__dict__.get("_meshdit_lora")
    c = _coefficients(t) if c is None else c
    if st is None or c is None:
        return
    live = set(getattr(t, "peft_config", None) or {})
    for slot, a in list(st["slots"].items()):
        if a["name"] not in live and c[slot] == 0:
            del st["slots"][slot]
            if t._client is not None:
                with contextlib.suppress(Exception):
                    t._client.lora_unload(a["server"])
    if not st["slots"] and not live:
        del t._modules[PROBE]


def lora_value(t) -> str | None:
    """The forward's "lora": the server's start-up adapters and this drop-in's at their
    coefficients, or None when it never loaded one (the server's start-up set)."""
    st = t.__dict__.get("_meshdit_lora")
    if st is None or t._modules.get(PROBE) is None:
        return None
    c = _coefficients(t)  # one read of the probe per forward
    collect(t, c)
    if t._modules.get(PROBE) is None:  # the last adapter gone: the server's start-up set again
        return None
    for slot, a in st["slots"].items():  # weight x scale within the server's bound
        check_weight(c[slot], f"the coefficient of adapter '{a['name']}' (its set_adapters "
                              f"weight times the forward's scale, and what fuse_lora merged)")
    mine = [f"{a['server']}={c[slot]!r}" for slot, a in sorted(st["slots"].items()) if c[slot] != 0]
    return ",".join(st["startup"] + mine)


def reload(t) -> None:
    """Loads this drop-in's adapters again on a new server (after a relaunch: _resume)."""
    st = t.__dict__.get("_meshdit_lora")
    for a in (st or {}).get("slots", {}).values():
        t._client.lora_load(a["server"], a["meta"], a["tensors"])


def release(t) -> None:
    """Unloads this drop-in's adapters from a server it shares (close of a connect())."""
    st = t.__dict__.get("_meshdit_lora")
    if st:
        _unload_all(t._client, st)


def _unload_all(client, st) -> None:
    for a in list(st["slots"].values()):
        try:
            client.lora_unload(a["server"], timeout=1.0)
        except Exception:  # noqa: BLE001 - a server that is gone, or a closed client
            break
    st["slots"].clear()
