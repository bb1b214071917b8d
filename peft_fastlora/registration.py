"""``register_adapter(s)`` / ``unregister_adapter``: adapters served by name without PEFT modules;
``from_folders``: a base model and a folder of saved adapters to a patched model serving them.

A registered adapter lives in CPU memory (``lora.store``) and reaches the GPU only in a slot of the
stacks, when a call uses it; ``generate(..., adapter_names=[...])``, ``generate_batch`` and
``add_request`` accept its name like a PEFT adapter's. It must target modules that the model's PEFT
adapters already made LoRA layers (those layers are the sites the stacks serve).
"""

from __future__ import annotations

import logging
import os
from typing import Mapping, Optional

import torch
from peft import LoraConfig

from .compat.modules import model_dtype
from .compat.peft import get_peft_model_quietly
from .lora.slots import BASE
from .patch import get_state, patch
from .lora.store import SCAFFOLD_ADAPTER, build_stored, read_folder

logger = logging.getLogger("peft_fastlora")


def _patched_state(model, what: str):
    state = get_state(model)
    if state is None:
        raise ValueError(f"fastlora.{what}: the model is not patched (call fastlora.patch first)")
    return state


def register_adapter(model, name: str, path: Optional[str] = None, *,
                     state_dict: Optional[Mapping[str, torch.Tensor]] = None, config=None) -> None:
    """Serve a saved LoRA adapter under ``name`` on a patched model.

    ``path``: a folder written by PEFT's ``save_pretrained`` (``adapter_config.json`` and the
    weights); or ``state_dict`` (PEFT's saved key format, as ``get_peft_model_state_dict`` returns
    it) with its ``config`` (a ``LoraConfig``). Everything is checked before the model is touched:
    a bad file, key or shape, or an unsupported variant raises ``ValueError`` (or
    ``FileNotFoundError``) naming it, and the model serves as before.
    """
    if (path is None) == (state_dict is None):
        raise ValueError("fastlora.register_adapter: give either a folder path or a state_dict (with its config)")
    if state_dict is not None and config is None:
        raise ValueError("fastlora.register_adapter: a state_dict needs its LoraConfig (config=...)")
    register_adapters(model, {name: path if path is not None else (state_dict, config)})


def register_adapters(model, adapters: Mapping[str, object]) -> None:
    """``register_adapter`` for many at once, with one rebuild of the stacks: ``adapters`` maps
    each name to a folder path or to a ``(state_dict, LoraConfig)`` pair. All are checked first;
    if one is bad, none is registered."""
    state = _patched_state(model, "register_adapter")
    if not state.has_lora or not state.takes_adapter_names:
        raise ValueError("fastlora.register_adapter: this model has LoRA layers on PEFT's path or no LoRA "
                         "layer fastlora serves (see the patch report); registered adapters need fastlora's "
                         "path for every LoRA layer")
    peft_config = getattr(state.model, "peft_config", None) or {}
    layers, dtype = state.served_layers(), model_dtype(state.inner)
    pin = state.device.type == "cuda" and torch.cuda.is_available()
    ready = {}
    for name, source in adapters.items():
        if not isinstance(name, str) or not name or name == BASE:
            raise ValueError(f"fastlora.register_adapter: invalid adapter name {name!r}")
        if name in peft_config or name in state.stored:
            raise ValueError(f"fastlora.register_adapter: an adapter named {name!r} already exists")
        if isinstance(source, (str, os.PathLike)):
            config, state_dict, where = read_folder(os.fspath(source))
        elif isinstance(source, tuple) and len(source) == 2:
            (state_dict, config), where = source, f"the state_dict of {name!r}"
        else:
            raise ValueError(f"fastlora.register_adapter: {name!r}: give a folder path or a (state_dict, "
                             f"LoraConfig) pair, got {type(source).__name__}")
        ready[name] = build_stored(name, config, state_dict, where, layers, dtype=dtype, pin=pin)
    with state.exclusive():  # not while a generate call or an engine step runs
        state.stored.update(ready)
        try:
            state.rescan()
        except BaseException:  # out of memory for the larger stacks, say: serve as before
            for name in ready:
                state.stored.pop(name, None)
            state.rescan()
            raise
    for stored in ready.values():
        logger.info("fastlora: registered adapter %r from %s (%d modules, %.1f MiB in CPU memory)",
                    stored.name, stored.source, len(stored.modules), stored.nbytes() / 2**20)


LAYERS_ADAPTER = SCAFFOLD_ADAPTER  # from_folders: the PEFT adapter of zeros that makes the LoRA layers


def from_folders(base_model, adapters, **patch_kwargs):
    """A patched ``PeftModel`` over ``base_model`` serving saved LoRA adapters by name, none of
    them loaded into PEFT.

    ``adapters``: a folder holding one saved adapter per sub-folder (the sub-folder's name is the
    adapter's), or a mapping name -> folder. A PEFT adapter of rank 1 and zero weights
    (``"fastlora_layers"``: it changes nothing) over every module the adapters target makes the
    LoRA layers; ``fastlora.patch(model, **patch_kwargs)`` (``max_loras_per_batch=M`` for M GPU
    slots); then ``register_adapters``. Everything is validated as there, before it returns."""
    if isinstance(adapters, (str, os.PathLike)):
        root = os.fspath(adapters)
        if not os.path.isdir(root):
            raise FileNotFoundError(f"fastlora.from_folders: {root!r} is not a folder")
        adapters = {d: os.path.join(root, d) for d in sorted(os.listdir(root))
                    if os.path.isfile(os.path.join(root, d, "adapter_config.json"))}
        if not adapters:
            raise ValueError(f"fastlora.from_folders: {root!r} has no sub-folder with an adapter_config.json")
    targets, parameters = set(), set()
    for name, folder in adapters.items():
        config = LoraConfig.from_pretrained(os.fspath(folder))
        found = config.target_modules
        if isinstance(found, str):
            raise ValueError(f"fastlora.from_folders: {name!r} targets modules by the pattern {found!r}; list "
                             f"them, or build the PeftModel yourself and call register_adapters")
        targets |= set(found or ())
        parameters |= set(getattr(config, "target_parameters", None) or ())  # routed experts' 3-D weights
    scaffold = LoraConfig(r=1, target_modules=sorted(targets) or None,
                          **({"target_parameters": sorted(parameters)} if parameters else {}))
    model = get_peft_model_quietly(base_model, scaffold, adapter_name=LAYERS_ADAPTER)
    model.eval()
    patch(model, **patch_kwargs)
    register_adapters(model, dict(adapters))
    return model


def unregister_adapter(model, name: str) -> None:
    """Stop serving a registered adapter (requests still using it in a continuous-batching
    manager fail with an error naming it)."""
    state = _patched_state(model, "unregister_adapter")
    if name not in state.stored:
        raise ValueError(f"fastlora.unregister_adapter: no registered adapter named {name!r}")
    with state.exclusive():
        del state.stored[name]
        state.rescan()  # now: the name must stop being served at once
