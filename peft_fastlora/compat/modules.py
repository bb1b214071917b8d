"""torch modules and transformers models: devices and streams, forward hooks, layer shapes, dtypes,
attention implementations and the model's limits.
"""

from __future__ import annotations

import contextlib
import operator
import weakref
from typing import Optional, Sequence, Tuple

import torch
import transformers
from torch import nn
from transformers.pytorch_utils import Conv1D


TRANSFORMERS_VERSION = transformers.__version__


_DTENSOR = None  # the DTensor class, imported once (checked on every LoRA forward)


def is_dtensor(t) -> bool:
    global _DTENSOR
    if _DTENSOR is None:
        try:
            from torch.distributed.tensor import DTensor
        except ImportError:  # torch without distributed tensors: nothing is one
            DTensor = ()
        _DTENSOR = DTensor
    return isinstance(t, _DTENSOR)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (the tensor itself otherwise)."""
    return t.to_local() if is_dtensor(t) else t


def multi_device_reason(model: nn.Module) -> Optional[str]:
    """Why a model split over several devices (accelerate's ``device_map``) cannot take the decode
    graphs and base-model kernels (None: its parameters are on one device)."""
    devices = sorted({str(p.device) for p in model.parameters()})
    if len(devices) > 1:
        return f"the model spans {', '.join(devices)} (accelerate's device_map)"
    return None


def uncapturable_layers_reason(model: nn.Module) -> Optional[str]:
    """Why a CUDA graph cannot capture this model's forward, for layers known to read their
    activations back (None: none found): bitsandbytes' 8-bit ``Linear8bitLt`` with an outlier
    threshold (transformers' ``llm_int8_threshold``, 6.0 by default) looks for outlier columns with
    a host-side ``argwhere``; with a threshold of 0 its matmul is all device work and is captured."""
    int8 = [m for m in model.modules()
            if type(m).__name__ == "Linear8bitLt" and type(m).__module__.startswith("bitsandbytes")]
    searching = sum(float(getattr(getattr(m, "state", None), "threshold", 0.0) or 0.0) > 0 for m in int8)
    if searching:
        return (f"{searching} bitsandbytes 8-bit layers with an outlier threshold (their matmul reads the "
                "activations back: not capturable; llm_int8_threshold=0.0 lets graphs capture them)")
    return None


def on_device(device: Optional[torch.device]):
    """Make ``device`` the current CUDA device inside the block (Triton launches on the current
    device, not on its tensors'); a no-op for other devices."""
    if device is None or device.type != "cuda":
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def on_stream(stream):
    """Make ``stream`` the current CUDA stream inside the block; a no-op for None (or any stream
    that is not a CUDA one)."""
    return torch.cuda.stream(stream) if isinstance(stream, torch.cuda.Stream) else contextlib.nullcontext()


def has_forward_hooks(module: nn.Module) -> bool:
    """Forward hooks on this module that a fused or folded GEMM, which bypasses its forward, would
    skip: torch's, and accelerate's except the one ``device_map`` without offloading puts on every
    layer, which only moves the inputs to the device the weights are on (fastlora's sites take their
    fast path only for inputs already there)."""
    if module._forward_hooks or module._forward_pre_hooks:
        return True
    hook = getattr(module, "_hf_hook", None)
    return hook is not None and not _only_moves_inputs_to_weights(module, hook)


def _only_moves_inputs_to_weights(module: nn.Module, hook) -> bool:
    try:
        from accelerate.hooks import AlignDevicesHook
    except ImportError:
        return False
    if type(hook) is not AlignDevicesHook or hook.offload or hook.io_same_device or hook.execution_device is None:
        return False
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor):
        return False
    try:
        return torch.device(hook.execution_device) == weight.device
    except (TypeError, RuntimeError):
        return False


def is_conv1d(module: nn.Module) -> bool:
    return isinstance(module, Conv1D)


def linear_in_out(base: nn.Module) -> Tuple[int, int]:
    """(in, out) of this rank's weight (a tensor-parallel layer's shard)."""
    if isinstance(base, nn.Linear):
        if not base.weight.is_floating_point():  # bitsandbytes' packed bytes: the layer says its shape
            return base.in_features, base.out_features
        out_features, in_features = local(base.weight).shape
        return in_features, out_features
    if is_conv1d(base):  # GPT-2: weight is (in, out)
        return base.weight.shape[0], base.weight.shape[1]
    raise TypeError(f"not a linear layer: {type(base).__name__}")


def attn_implementation(model: nn.Module) -> Optional[str]:
    """The model's ``config._attn_implementation`` (None for a model without a transformers config)."""
    cfg = getattr(model, "config", None)
    return getattr(cfg, "_attn_implementation", None) if cfg is not None else None


def set_attn_implementation(model: nn.Module, name: str) -> None:
    setter = getattr(model, "set_attn_implementation", None)
    if setter is not None:
        setter(name)
    else:  # older transformers: the config attribute is the switch
        model.config._attn_implementation = name


def model_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the model's first floating-point parameter (float32 when it has none)."""
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def cb_vocab_size(model: nn.Module) -> int:
    """Columns of the model's logits."""
    head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    if head is not None and hasattr(head, "out_features"):
        return int(head.out_features)
    return int(model.config.get_text_config().vocab_size)


def input_vocab_size(model: nn.Module) -> int:
    """How many token ids the model's input embedding takes."""
    embed = model.get_input_embeddings() if callable(getattr(model, "get_input_embeddings", None)) else None
    if embed is not None and hasattr(embed, "num_embeddings"):
        return int(embed.num_embeddings)
    return int(model.config.get_text_config().vocab_size)


def position_limit(model: nn.Module) -> Optional[int]:
    """The model's ``max_position_embeddings`` (None when its config has none)."""
    limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    return int(limit) if isinstance(limit, int) and limit > 0 else None


def is_plain_weight(t: torch.Tensor) -> bool:
    """A weight fastlora's kernels and fused copies can read as it is: a plain tensor (or a
    tensor-parallel shard), not a tensor subclass holding quantized data (torchao's)."""
    return type(t.data) is torch.Tensor or is_dtensor(t)


def quantized_weight_name(t: torch.Tensor) -> str:
    """The class of a weight's data, for reports ("Int8Tensor")."""
    return type(t.data).__name__


# A tensor's version counter (bumped by in-place ops on it, not by ones through ``.data``); an
# attrgetter, as an engine step reads those of thousands of parameters.
version_of = operator.attrgetter("_version")


def versions_of(tensors) -> Optional[tuple]:
    """The tensors' version counters, or None where one keeps none (an inference tensor)."""
    try:
        return tuple(map(version_of, tensors))
    except RuntimeError:
        return None


def _storage_users(t: torch.Tensor) -> int:
    """How many references hold ``t``'s storage (a tensor's ``.data`` or ``.detach()`` alias is
    one more); -1 where this torch does not say."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    return -1 if count is None else count(t.untyped_storage()._cdata)


def _rehomable(t, device, dtype, alone: int) -> bool:
    return (type(t) in (torch.Tensor, nn.Parameter) and not is_dtensor(t) and t.device == device
            and t.dtype == dtype and t.layout == torch.strided and t.device.type != "meta"
            and not t.is_inference() and t.is_leaf and t._base is None and t.is_contiguous()
            and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()
            and t.grad is None and t._backward_hooks is None and not weakref.getweakrefs(t)
            and t._use_count() == 1 and _storage_users(t) == alone)


@torch.no_grad()
@torch.inference_mode(False)  # (called inside a forward under inference mode: no inference buffer)
def share_version_counter(tensors: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """Re-home ``tensors`` (dense leaf tensors of one device and dtype, each alone on its whole
    storage) onto one new buffer: each Python object is swapped (``torch.utils.swap_tensors``) onto
    a view of the buffer holding its values, keeping its identity, attributes and
    ``requires_grad``. Views share their base's version counter, so an in-place op on any of them
    (an optimizer step, ``copy_``) moves the buffer's ``_version``: one read tells whether any
    changed. Returns the buffer, or None, with nothing changed, where one of them cannot be
    re-homed (a subclass, a DTensor, an inference tensor, a view, a gradient or hooks held, another
    tensor sharing its data, such as a ``.data`` alias kept somewhere, which would go stale)."""
    if not tensors:
        return None
    device, dtype = tensors[0].device, tensors[0].dtype
    alone = _storage_users(torch.empty(1))  # a tensor no alias shares its storage with
    if alone < 0:
        return None
    storages = {t.untyped_storage().data_ptr() for t in tensors if _rehomable(t, device, dtype, alone)}
    if len(storages) != len(tensors) or len({id(t) for t in tensors}) != len(tensors):
        return None
    buffer = torch.empty(sum(t.numel() for t in tensors), dtype=dtype, device=device)
    news, offset = [], 0
    for t in tensors:
        view = buffer[offset:offset + t.numel()].view(t.shape)
        offset += t.numel()
        view.copy_(t)
        new = (nn.Parameter(view, requires_grad=t.requires_grad) if type(t) is nn.Parameter
               else view.detach().requires_grad_(t.requires_grad))
        new.__dict__.update(t.__dict__)  # (swap_tensors swaps the attribute dicts too)
        news.append(new)
    swapped = []
    try:
        for t, new in zip(tensors, news):
            torch.utils.swap_tensors(t, new)
            swapped.append((t, new))
    except RuntimeError:  # (a reference swap_tensors refuses): every tensor back as it was
        for t, new in reversed(swapped):
            torch.utils.swap_tensors(t, new)
        return None
    if device.type == "cuda":  # the old storages (now in ``news``) are freed on return, while the
        for old in news:  # copies from them may still be queued on this stream (an engine's)
            old.record_stream(torch.cuda.current_stream(device))
    return buffer


def foreach_copy(dsts, srcs, non_blocking: bool = False) -> None:
    """``dst.copy_(src)`` for each pair in one multi-tensor call (torch's ``_foreach_copy_``: one
    launch per group of same-device, same-dtype tensors on CUDA)."""
    torch._foreach_copy_(dsts, srcs, non_blocking=non_blocking)
