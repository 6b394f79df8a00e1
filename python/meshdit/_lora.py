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
import copy
import json
import math
import re
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
# state: the active adapters, each one's scaling, the merged ones, the disabled flag. That state
# is per layer, and layers differ: a layer holds only the adapters that target it, and one with
# any adapter merged skips its unmerged ones (peft's Linear.forward), so after fuse_lora of one
# adapter another still acts where the first does not reach; deleting the only active adapter
# makes each layer activate the first adapter it holds. meshdit runs that state unchanged, on
# real peft LoRA layers in this process, the probes: the modules the adapters target are
# partitioned into groups by the adapters that cover them, and each group has one probe, a linear
# of one input and SLOTS outputs (zero weights) where each adapter of the group is a rank-1 LoRA
# whose A is 1 and whose B is its slot's unit vector, at lora_alpha = r = 1. A probe's output for
# the input 1 is then, slot by slot, the coefficient peft applies to that adapter's B A in every
# layer of its group (its set_adapters weight, times the scale of the forward, for an active
# adapter; what fuse_lora merged, kept through unfuse, disable and unload as peft keeps it). Each
# forward sends those coefficients as its "lora" set and the server fuses W0 + sum c_i s_i B_i A_i
# (s_i the adapter's own alpha / r per module) before it runs, unless that set is fused already;
# an adapter whose groups have different coefficients goes as sub-adapters, one per coefficient,
# each its factors on those groups' modules only (those of this forward and the previous one stay
# loaded: _prune). A probe stays as long as diffusers keeps the LoRA layers it stands for, that
# is until unload_lora (collect).
PROBE = "meshdit_probe"  # no "lora" in a probe's name: diffusers' unload_lora skips such modules
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
        # groups: {probe's name: {"modules": its modules, "slots": its adapters' slots}}
        st = {"prefix": f"py{secrets.token_hex(16)}-", "next": 0, "slots": {},
              "startup": startup, "groups": {}, "probes": 0, "fused": set()}
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
    probes of the modules it adapts as peft adds one to those layers (so which adapters are
    active afterwards, in each group, is peft's answer)."""
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
    modules = _modules(tensors)
    try:
        targets = _refine(t, st, modules)
        cfg = LoraConfig(r=1, lora_alpha=1, target_modules=targets, lora_dropout=0.0,
                         init_lora_weights=False)
        with torch.no_grad():
            # one injection into all of them, as diffusers injects into all the adapter's layers
            # at once: peft then sets the new adapter active in every LoRA layer of the model
            inject_adapter_in_model(cfg, t, adapter_name=adapter_name)
            for name in targets:
                layer = t._modules[name]
                layer.lora_A[adapter_name].to(torch.float64).weight.fill_(1.0)
                layer.lora_B[adapter_name].to(torch.float64).weight.zero_()
                layer.lora_B[adapter_name].weight[slot, 0] = 1.0
        t._hf_peft_config_loaded = True
    except BaseException:
        with contextlib.suppress(Exception):
            t._client.lora_unload(server_name)
        cfgs = getattr(t, "peft_config", None)
        if cfgs is not None and adapter_name in cfgs:  # as diffusers drops a failed adapter's
            for name in st["groups"]:
                with contextlib.suppress(Exception):
                    t._modules[name].delete_adapter(adapter_name)
            cfgs.pop(adapter_name)
        collect(t)  # (a split leaves two groups in one state; a new group holds nothing)
        raise
    for name in targets:
        st["groups"][name]["slots"].add(slot)
    # subs: {modules: the server's name of this adapter on those modules only} (lora_value)
    st["slots"][slot] = {"name": adapter_name, "server": server_name, "meta": meta,
                         "tensors": tensors, "modules": modules, "subs": {}}


def _modules(tensors) -> frozenset:
    """The modules an adapter's factors adapt: each key's part before ``.lora_``, the layers
    diffusers injects it into (load_lora_adapter passes the state dict to peft's inject)."""
    return frozenset(k.rsplit(".lora_", 1)[0] for k in tensors if ".lora_" in k)


def _refine(t, st, modules) -> list[str]:
    """The probes of the groups that make up `modules`, the partition refined to hold it: a group
    partly in `modules` is split, its probe copied for the part inside (the copy carries peft's
    state, merged weights, active adapters, disabled flag: the state of those layers); modules
    no group holds form a new group whose probe is a plain linear, so that peft makes it a fresh
    LoRA layer as it does a layer of the model that no adapter holds."""
    targets, fresh = [], set(modules)
    for name, g in list(st["groups"].items()):
        inside = g["modules"] & modules
        fresh -= g["modules"]
        if not inside:
            continue
        if inside != g["modules"]:
            g["modules"] -= inside
            name = _add_probe(t, st, copy.deepcopy(t._modules[name]), inside, g["slots"])
        targets.append(name)
    if fresh:
        probe = torch.nn.Linear(1, SLOTS, bias=False, dtype=torch.float64)
        torch.nn.init.zeros_(probe.weight)
        probe.requires_grad_(False)
        targets.append(_add_probe(t, st, probe, fresh, ()))
    order = _layer_order(t, st)  # the probes in the order of their groups' first layers
    first = {n: min(order.get(m, len(order)) for m in g["modules"])
             for n, g in st["groups"].items()}
    st["groups"] = {n: st["groups"][n] for n in sorted(st["groups"], key=first.get)}
    for name in st["groups"]:
        t._modules[name] = t._modules.pop(name)
    return targets


def _layer_order(t, st) -> dict[str, int]:
    """Each module's place in diffusers' own model of this family and config (built on the meta
    device: no memory, a tenth of a second for Flux's 12B): peft answers active_adapters and
    diffusers' get_adapter_name from the model's first LoRA layer, so the probes keep the order
    of the layers they stand for. {} (the probes in the order they were made) for a model that
    diffusers does not build."""
    if "order" not in st:
        import diffusers
        try:
            with torch.device("meta"):
                model = getattr(diffusers, t.class_name).from_config(dict(t.config))
            st["order"] = {f"transformer.{n}": i for i, (n, _) in enumerate(model.named_modules())}
        except Exception:  # noqa: BLE001 - no such class in this diffusers, a config it refuses
            st["order"] = {}
    return st["order"]


def _add_probe(t, st, probe, modules, slots) -> str:
    # a name no other probe's ends with after a ".": peft's target_modules match by suffix
    name = f"{PROBE}_{st['probes']}"
    st["probes"] += 1
    t._modules[name] = probe  # (add_module is refused to users: see METHODS)
    st["groups"][name] = {"modules": frozenset(modules), "slots": set(slots)}
    return name


def _coefficients(t) -> dict[str, list[float]]:
    """What peft applies to each slot's adapter now, group by group: {probe: its output for 1}.
    A coefficient within 1e-12 of 0 is 0: what x * s / s leaves of a merge unmerged after a
    scale (peft's own arithmetic; in real weights it is far below their rounding)."""
    st = t.__dict__.get("_meshdit_lora")
    one = torch.ones(1, dtype=torch.float64)
    with torch.no_grad():
        return {name: [0.0 if abs(v) < 1e-12 else v for v in t._modules[name](one).tolist()]
                for name in (st["groups"] if st else ())}


def collect(t, c=None) -> None:
    """Frees the slots of adapters gone from peft (deleted, unloaded) whose coefficient is 0 in
    every group (a merged one stays in the weights, as in diffusers), and unloads them and their
    sub-adapters from the server. A probe stays exactly as long as the layers it stands for are
    diffusers' LoRA layers: delete_adapters leaves them in the model, holding nothing (their
    disabled flag, active adapters and merges still count for a later adapter, and
    active_adapters reads them), and only unload_lora (recurse_remove_peft_layers) makes them
    the base layers again. So a probe goes once it is no peft LoRA layer any more (its base
    linear, after unload_lora) and holds no merged weight: then those layers are the model's
    plain ones, as a fresh probe stands for them. `c`: the coefficients, when the caller has
    them."""
    st = t.__dict__.get("_meshdit_lora")
    if st is None:
        return
    c = _coefficients(t) if c is None else c
    live = set(getattr(t, "peft_config", None) or {})
    for slot, a in list(st["slots"].items()):
        if a["name"] not in live and not any(v[slot] for v in c.values()):
            del st["slots"][slot]
            for g in st["groups"].values():
                g["slots"].discard(slot)
            if t._client is not None:
                for name in (a["server"], *a["subs"].values()):
                    with contextlib.suppress(Exception):
                        t._client.lora_unload(name)
    from peft.tuners.tuners_utils import BaseTunerLayer

    for name in list(st["groups"]):
        layer = t._modules[name]  # a LoRA layer, or its base linear after unload_lora
        if not (isinstance(layer, BaseTunerLayer) or any(c[name])):
            del t._modules[name], st["groups"][name]


def lora_value(t) -> str | None:
    """The forward's "lora": the server's start-up adapters and this drop-in's at their
    coefficients, or None when it holds none (the server's start-up set). An adapter whose
    groups have one coefficient goes whole; one whose groups differ (a fuse, a delete that
    peft answers per layer) goes as its parts, the modules of each nonzero coefficient (`_sub`:
    the parts of this forward and of the previous one stay loaded, the others are unloaded)."""
    st = t.__dict__.get("_meshdit_lora")
    if st is None or not st["groups"]:
        return None
    c = _coefficients(t)  # one read of the probes per forward
    collect(t, c)
    if not st["groups"]:  # no LoRA layer and nothing merged left: the start-up set again
        return None
    plan = []  # (adapter, the modules of its part or None for the whole, coefficient)
    for slot, a in sorted(st["slots"].items()):
        parts, covered = {}, 0  # coefficient -> the groups of the adapter that apply it
        for name, g in st["groups"].items():
            if slot in g["slots"]:
                parts.setdefault(c[name][slot], []).append(name)
                covered += len(g["modules"])
        if covered < len(a["modules"]):  # a group whose probe went: nothing of it is left there
            parts.setdefault(0.0, [])
        for v in parts:  # weight x scale within the server's bound
            check_weight(v, f"the coefficient of adapter '{a['name']}' (its set_adapters "
                            f"weight times the forward's scale, and what fuse_lora merged)")
        if len(parts) == 1:
            plan += [(a, None, v) for v in parts if v != 0]
            continue
        plan += [(a, frozenset().union(*(st["groups"][n]["modules"] for n in names)), v)
                 for v, names in parts.items() if v != 0]
    _prune(t, st, {(a["server"], mods) for a, mods, _ in plan if mods is not None})
    mine = [f"{a['server'] if mods is None else _sub(t, st, a, mods)}={v!r}"
            for a, mods, v in plan]
    # the parts the server fuses with this forward: kept through the next one (_prune)
    st["fused"] = {a["subs"][mods] for a, mods, _ in plan if mods is not None}
    return ",".join(st["startup"] + mine)


def _prune(t, st, need) -> None:
    """Unloads the parts (sub-adapters) that neither this forward (`need`: (adapter's server
    name, modules)) nor the previous one uses, so that what a drop-in holds on the server stays
    bounded (its adapters, and the parts of two forwards) however many different parts a loop
    of fuses makes. The previous forward's parts are fused on the server now: unloading one
    takes it out of the fused weights (a fuse of its own), so they wait for the next forward.
    A part gone is gone from `reload` and `release` too."""
    keep = st.setdefault("fused", set())
    for a in st["slots"].values():
        for mods, name in list(a["subs"].items()):
            if (a["server"], mods) in need or name in keep:
                continue
            try:
                t._client.lora_unload(name)
            except ServerError:  # the server answered: it does not hold it (any more)
                pass
            del a["subs"][mods]


def _sub(t, st, a, mods) -> str:
    """The server's name of adapter `a` on `mods` only, loaded at its first use (and kept while
    a forward uses it, or the next one: _prune). A refusal (the server's 64-adapter limit, all
    clients together, say) is one line naming the user's adapter and the part."""
    name = a["subs"].get(mods)
    if name is None:
        name = f"{st['prefix']}{st['next']}"
        st["next"] += 1
        try:
            t._client.lora_load(name, *_restricted(a, mods))
        except ServerError as e:
            err = e.error.replace(name, repr(a["name"])).removeprefix(f"{e.op}: ")
            held = len(st["slots"]) + sum(len(b["subs"]) for b in st["slots"].values())
            hint = (f" (this drop-in holds {held} of them: delete_adapters() or unload_lora() "
                    f"frees its own)" if "adapters are loaded" in err else "")
            raise ServerError(e.op, f"adapter '{a['name']}' on {len(mods)} of its "
                              f"{len(a['modules'])} modules (the part of it that acts at one "
                              f"coefficient, as fuse_lora or delete_adapters left it acting on "
                              f"some of its layers only, which the server loads as an adapter "
                              f"of its own) was refused: {err}{hint}", e.metadata) from None
        a["subs"][mods] = name
    return name


def _restricted(a, mods):
    """(metadata, tensors) of adapter `a` on the modules `mods`: their keys only (the server
    refuses keys that map to no weight), at the scales they have in the whole adapter. The
    metadata's r, lora_alpha and patterns give a module its scale by its own name, and name no
    module the server must find, so the metadata goes as it is; '.alpha' keys are read together
    (the most common alpha is lora_alpha, the others patterns that may match other modules: the
    server's reading, diffusers' get_peft_kwargs), so those of a part could give other scales:
    the part carries each module's alpha and rank as metadata instead, its patterns anchored to
    the whole name (``^``, as diffusers anchors its rank patterns)."""
    tensors = {k: v for k, v in a["tensors"].items() if k.rsplit(".lora_", 1)[0] in mods}
    alphas = {k.removesuffix(".alpha"): _scalar(v) for k, v in a["tensors"].items()
              if k.endswith(".alpha")}
    if not alphas:
        return a["meta"], tensors
    order = list(dict.fromkeys(k.removesuffix(".alpha").rsplit(".lora_", 1)[0]
                               for k in a["tensors"]))  # the modules in the server's key order
    counts = [sum(alphas.get(o) == alphas[m] for o in order) if m in alphas else 0
              for m in order]
    common = alphas[order[counts.index(max(counts))]]
    bare = {m: m.removeprefix("transformer.") for m in order}
    patterns = [bare[m] for m in order if m in alphas and alphas[m] != common]
    alpha, rank = {}, {}
    for k, v in tensors.items():
        m = k.rsplit(".lora_", 1)[0]
        if k.endswith(("lora_A.weight", "lora_down.weight")):
            hit = next((p for p in patterns if re.match(rf"(.*\.)?({p})$", bare[m])), None)
            alpha["^" + re.escape(bare[m])] = common if hit is None else alphas[
                "transformer." + hit]
            rank["^" + re.escape(bare[m])] = v.shape[0]
    cfg = {"r": next(iter(rank.values())), "lora_alpha": common, "rank_pattern": rank,
           "alpha_pattern": alpha}
    return {"format": "pt", "lora_adapter_metadata": json.dumps(
        {f"transformer.{k}": v for k, v in cfg.items()})}, tensors


def _scalar(r: _blob.Raw) -> float:
    if r.dtype == "BF16":  # the upper half of a float32
        return float((np.frombuffer(r.data, "<u2").astype("<u4") << 16).view("<f4")[0])
    return float(np.frombuffer(r.data, _blob._NP[r.dtype])[0])


def reload(t) -> None:
    """Loads this drop-in's adapters and their parts again on a new server (after a relaunch:
    _resume)."""
    st = t.__dict__.get("_meshdit_lora")
    for a in (st or {}).get("slots", {}).values():
        t._client.lora_load(a["server"], a["meta"], a["tensors"])
        for mods, name in a["subs"].items():
            t._client.lora_load(name, *_restricted(a, mods))


def release(t) -> None:
    """Unloads this drop-in's adapters from a server it shares (close of a connect())."""
    st = t.__dict__.get("_meshdit_lora")
    if st:
        _unload_all(t._client, st)


def _unload_all(client, st) -> None:
    for name in [n for a in st["slots"].values() for n in (a["server"], *a["subs"].values())]:
        try:
            client.lora_unload(name, timeout=1.0)
        except Exception:  # noqa: BLE001 - a server that is gone, or a closed client
            break
    st["slots"].clear()
