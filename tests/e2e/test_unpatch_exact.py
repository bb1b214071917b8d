"""``unpatch`` restores a model exactly, on every architecture the tests build, with and without
PEFT adapters: after patching and serving (``generate`` with per-row adapters through emulated
decode graphs, a continuous-batching manager started and stopped), every module has the same
``__dict__`` entries (the same objects), the same Parameter and buffer objects with their values,
the same hooks, the same classes untouched, the same attention implementation and configs; and
transformers' global attention registry is as it was."""

from __future__ import annotations

import pytest
import torch

import peft_fastlora as fastlora

from _continuous import cb_config, greedy_config, requires_cb
from _models import ARCHS, build_causal_lm, build_peft_lm

_CONTAINERS = ("_parameters", "_buffers", "_modules")


def _entry(value):
    """How a ``__dict__`` value is compared: containers by their members' identities, hook dicts by
    their keys and hooks, plain values by value, anything else by identity."""
    if isinstance(value, (bool, int, float, str, type(None))):
        return ("value", value)
    if isinstance(value, (tuple, frozenset)) and all(isinstance(v, (bool, int, float, str, type(None))) for v in value):
        return ("value", value)
    if isinstance(value, dict):
        return ("dict", tuple((k, id(v)) for k, v in value.items()))
    if isinstance(value, set):
        return ("set", frozenset(id(v) for v in value))
    return ("object", id(value))


def snapshot(model) -> dict:
    modules = {}
    for name, m in model.named_modules(remove_duplicate=False):
        modules[name] = (type(m), {k: _entry(v) for k, v in vars(m).items()})
    classes = {cls: {k: id(v) for k, v in vars(cls).items()} for cls in {type(m) for m in model.modules()}}
    tensors = {name: t.detach().clone() for name, t in list(model.named_parameters()) + list(model.named_buffers())}
    config = model.config.get_text_config()
    return dict(modules=modules, classes=classes, tensors=tensors, attn=config._attn_implementation,
                config=config.to_dict(), generation=model.generation_config.to_dict(),
                registry=_attention_registry())


def _attention_registry() -> dict:
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return {k: id(v) for registry in (ALL_ATTENTION_FUNCTIONS, ALL_MASK_ATTENTION_FUNCTIONS)
            for k, v in registry.items()}


def assert_same(before: dict, after: dict) -> None:
    assert after["attn"] == before["attn"]
    assert after["config"] == before["config"] and after["generation"] == before["generation"]
    assert after["registry"] == before["registry"], "transformers' attention registry changed"
    assert after["classes"] == before["classes"], "a class was changed"
    assert after["modules"].keys() == before["modules"].keys()
    for name, (cls, entries) in before["modules"].items():
        got_cls, got = after["modules"][name]
        assert got_cls is cls, name
        extra, missing = set(got) - set(entries), set(entries) - set(got)
        assert not extra and not missing, f"{name or 'model'}: attributes added {extra}, lost {missing}"
        for key, value in entries.items():
            assert got[key] == value, f"{name or 'model'}.{key} is not what it was"
    assert after["tensors"].keys() == before["tensors"].keys()
    for name, value in before["tensors"].items():
        assert torch.equal(after["tensors"][name], value), name


def _serve(model, names, patched: bool, calls: int = 2):
    """Mixed-adapter ``generate`` ``calls`` times (a second call replays the emulated graphs the
    first captured), then a request through a continuous-batching manager started and stopped."""
    ids = torch.randint(3, 100, (len(names or [0, 0]), 5), generator=torch.Generator().manual_seed(0))
    for _ in range(calls):
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False,
                           pad_token_id=0, **({"adapter_names": names} if names else {}))
    manager = model.init_continuous_batching(generation_config=greedy_config(2), continuous_batching_config=cb_config())
    manager.start()
    rid = manager.add_request([5, 6, 7], max_new_tokens=2, **({"adapter_name": "a1"} if names and patched else {}))
    result = manager.get_result(request_id=rid, timeout=60)
    manager.stop(block=True, timeout=30)
    assert result is not None and result.error is None


@requires_cb
@pytest.mark.parametrize("peft_adapters", [True, False], ids=["peft", "base"])
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_unpatch_restores_the_model_exactly(arch, peft_adapters):
    model = build_peft_lm(arch) if peft_adapters else build_causal_lm(arch)
    names = ["a0", "__base__", "a1", "a2"] if peft_adapters else None
    params = {name: p for name, p in model.named_parameters()}
    _serve(model, names, patched=False)  # unpatched first: what transformers and PEFT cache on first use is in both snapshots
    before = snapshot(model)
    fastlora.patch(model, cuda_graphs="emulate")
    _serve(model, names, patched=True)
    fastlora.unpatch(model)
    assert_same(before, snapshot(model))
    assert all(p is params[name] for name, p in model.named_parameters())  # the same Parameter objects


KERNELS = dict(backend="triton", cuda_graphs="emulate", decode_attention=True, fuse_norms=True, fuse_rotary=True,
               fuse_silu_mul=True, fuse_kv_write=True, stream_gemm=True, fold_shrink=True)


@requires_cb
@pytest.mark.parametrize("arch", ["llama", "gemma2", "qwen3"])
def test_unpatch_restores_the_model_with_every_kernel_on(arch):
    """The same with the Triton backend and every base-model kernel forced on (Triton's
    interpreter on the CPU): attention, norms, rotary, act-mul, KV writes, streamed GEMMs, folds."""
    model = build_peft_lm(arch)
    names = ["a0", "__base__", "a1", "a2"]
    _serve(model, names, patched=False)
    before = snapshot(model)
    report = fastlora.patch(model, **KERNELS)
    assert report.decode_attention == "on" and report.fused_norms > 0
    _serve(model, names, patched=True, calls=1)  # interpreted kernels: one call (two in the test above)
    fastlora.unpatch(model)
    assert_same(before, snapshot(model))
