"""Each adapter's parameters on one version counter (``compat.modules.share_version_counter``,
``lora.shared_versions``): the same objects, values and attributes, one counter that any in-place
op on any of them moves, refusals that change nothing, and an engine step that reads one counter
per adapter and still serves an edit of a single parameter from its next step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from peft_fastlora import get_state
from peft_fastlora.compat.modules import share_version_counter
from peft_fastlora.lora.shared_versions import SharedVersions

from _continuous import cb_config, collect, greedy_config, peft_alone, random_prompts, requires_cb


def _params(seed: int = 0):
    torch.manual_seed(seed)
    a, b = nn.Linear(5, 3), nn.Linear(3, 7, bias=False)
    return a, b, [a.weight, a.bias, b.weight]


def test_rehomed_tensors_keep_identity_values_attributes_and_gradients():
    a, b, params = _params()
    ids, values = [id(p) for p in params], [p.detach().clone() for p in params]
    a.weight.note = "kept"
    buffer = share_version_counter(params)
    assert buffer is not None and buffer.numel() == sum(p.numel() for p in params)
    assert [id(p) for p in (a.weight, a.bias, b.weight)] == ids
    assert all(torch.equal(p, v) for p, v in zip(params, values))
    assert a.weight.note == "kept" and type(a.weight) is nn.Parameter and a.weight.requires_grad and a.weight.is_leaf
    assert {p.untyped_storage().data_ptr() for p in params} == {buffer.untyped_storage().data_ptr()}
    b(a(torch.randn(2, 5))).sum().backward()
    assert all(p.grad is not None and p.grad.shape == p.shape for p in params)


@pytest.mark.parametrize("edit", ["mul_", "copy_", "optimizer", "data_then_in_place"])
def test_an_in_place_op_on_any_member_moves_the_one_counter(edit):
    a, b, params = _params(1)
    buffer = share_version_counter(params)
    before = buffer._version
    if edit == "optimizer":
        b(a(torch.randn(2, 5))).sum().backward()
    with torch.no_grad():
        if edit == "mul_":
            a.bias.mul_(2.0)
        elif edit == "copy_":
            b.weight.copy_(torch.zeros_like(b.weight))
        elif edit == "optimizer":
            torch.optim.SGD(params, lr=0.1).step()
        else:  # a tensor given through .data keeps its version counter, the shared one
            a.weight.data = torch.ones_like(a.weight)
            a.weight.add_(1.0)
    assert buffer._version != before, edit


@pytest.mark.parametrize("case", ["view", "grad", "subclass", "duplicate", "dtype", "alias", "inference"])
def test_what_cannot_be_rehomed_is_refused_and_left_as_it_was(case):
    a, b, params = _params(2)
    if case == "view":
        params = params + [nn.Linear(4, 4).weight[:2]]
    elif case == "grad":
        a.bias.grad = torch.ones_like(a.bias)
    elif case == "subclass":
        class Tagged(torch.Tensor):
            pass
        params = params + [torch.zeros(3).as_subclass(Tagged)]
    elif case == "duplicate":
        params = params + [a.weight]
    elif case == "dtype":
        params = params + [nn.Parameter(torch.zeros(3, dtype=torch.float64))]
    elif case == "alias":  # a .data alias kept somewhere would stop seeing the parameter's values
        keep = a.weight.data  # noqa: F841
    else:
        with torch.inference_mode():
            params = params + [torch.zeros(3)]
    ptrs = [p.untyped_storage().data_ptr() for p in params]
    assert share_version_counter(params) is None, case
    assert [p.untyped_storage().data_ptr() for p in params] == ptrs, case


def test_shared_versions_reuse_a_buffer_and_forget_what_is_gone():
    a, b, params = _params(3)
    shared = SharedVersions()
    shared.share([params])
    buffer = shared.witness(a.weight)
    assert buffer is not a.weight and all(shared.witness(p) is buffer for p in params)
    ptr = a.weight.data_ptr()
    shared.share([params])  # already on one buffer of ours: nothing moves
    assert a.weight.data_ptr() == ptr and shared.witness(b.weight) is buffer
    a.weight.data = a.weight.detach().clone()  # off the buffer: read from itself
    assert shared.witness(a.weight) is a.weight and shared.witness(b.weight) is buffer
    shared.share([])
    assert shared.witness(b.weight) is b.weight


def test_release_gives_each_parameter_its_own_storage_again():
    a, b, params = _params(4)
    values = [p.detach().clone() for p in params]
    shared = SharedVersions()
    shared.share([params])
    shared.release()
    assert len({p.untyped_storage().data_ptr() for p in params}) == len(params)
    assert all(p.untyped_storage().nbytes() == p.numel() * p.element_size() for p in params)
    assert all(torch.equal(p, v) for p, v in zip(params, values)) and shared.witness(a.weight) is a.weight


def test_shared_inside_inference_mode_leaves_no_inference_tensor():
    a, b, params = _params(5)
    with torch.inference_mode():
        buffer = share_version_counter(params)
    assert buffer is not None and not buffer.is_inference()
    assert not any(p.is_inference() for p in params)
    a.weight.requires_grad_(True)


@requires_cb
def test_an_engine_reads_one_counter_an_adapter_and_serves_a_single_edited_parameter(pair):
    """Patching puts each adapter's parameters on one buffer; an engine step reads one version
    counter per adapter and copies nothing while nothing changed; an in-place edit of one layer's
    A of one adapter is served from the next step, equal to PEFT's."""
    m, ref = pair
    state = get_state(m)
    a1 = [p for mod in m.modules() if hasattr(mod, "lora_A") and "a1" in mod.lora_A
          for p in (mod.lora_A["a1"].weight, mod.lora_B["a1"].weight)]
    assert len({p.untyped_storage().data_ptr() for p in a1}) == 1, "a1's parameters share one buffer"
    prompts, names = random_prompts([6, 4, 5], seed=33), ["a1", "a0", "a1"]
    manager = m.init_continuous_batching(generation_config=greedy_config(5), continuous_batching_config=cb_config())
    manager.start()
    try:
        first_ids = manager.add_requests(prompts, adapter_names=names)
        first = collect(manager, first_ids)
        refresher = state.slots._refresher
        slot = state.registry.slot["a1"]
        assert len(refresher._sources[slot]) == 1, "one counter read for a1"
        with torch.no_grad():
            for model in (m, ref):  # one layer's A of a1, in place
                mod = next(mod for mod in model.modules() if hasattr(mod, "lora_A") and "a1" in mod.lora_A)
                mod.lora_A["a1"].weight.mul_(-4.0)
        ids = manager.add_requests(prompts, adapter_names=names)
        edited = collect(manager, ids)
    finally:
        manager.stop(block=True)
    for rid, prompt, name in zip(ids, prompts, names):
        assert edited[rid] == peft_alone(ref, prompt, name, 5), name
    assert any(edited[r] != first[f] for r, f in zip(ids, first_ids)), "the edit changed a1's tokens"
