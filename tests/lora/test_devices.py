"""Devices: a model split over devices (accelerate's device_map) and a model on another GPU than the
current one. The two-GPU runs are in ``e2e/test_multi_gpu.py``; these are the CPU-checkable parts."""

import torch

import peft_fastlora as fastlora
from peft_fastlora.compat.modules import multi_device_reason, on_device
from peft_fastlora.backend.torch_native import TorchNativeLoRABackend
from peft_fastlora.batch import ForwardBatch

from _models import build_peft_lm


def _batch_info():
    be = TorchNativeLoRABackend(4, torch.device("cpu"))
    return be, be.prepare_lora_batch(ForwardBatch.from_shape(3, 2, "cpu"), [0, -1, 1], [2, 4], [1.0, 0.5], False)


def test_batch_info_to_copies_every_tensor():
    _, bi = _batch_info()
    moved = bi.to("meta")
    for name, value in vars(bi).items():
        other = getattr(moved, name)
        if isinstance(value, torch.Tensor):
            assert other.device.type == "meta" and other.shape == value.shape and other.dtype == value.dtype, name
        else:
            assert other == value, name
    same = bi.to("cpu")
    for name, value in vars(bi).items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(getattr(same, name), value), name


def test_batch_info_on_another_device_is_copied_once_per_batch_info():
    model = build_peft_lm("llama")
    fastlora.patch(model)
    state = fastlora.get_state(model)
    be, bi = _batch_info()
    assert state.batch_info_on(bi, state.device) is bi
    meta = torch.device("meta")
    first = state.batch_info_on(bi, meta)
    assert first is not bi and first.seg_lens.device == meta
    assert state.batch_info_on(bi, meta) is first  # the same forward: no second copy
    _, bi2 = _batch_info()
    assert state.batch_info_on(bi2, meta) is not first  # a new batch info: a new copy
    fastlora.unpatch(model)


def test_multi_device_reason_names_the_devices():
    model = build_peft_lm("llama")
    assert multi_device_reason(model) is None
    inner = model.get_base_model()
    inner.model.layers[1].to("meta")  # stands in for a second GPU
    why = multi_device_reason(model)
    assert why == "the model spans cpu, meta (accelerate's device_map)", why


def test_on_device_is_a_no_op_off_cuda():
    with on_device(torch.device("cpu")), on_device(None):
        pass


def test_sites_know_their_device():
    model = build_peft_lm("llama")
    fastlora.patch(model)
    state = fastlora.get_state(model)
    assert {s.device for s in state.sites} == {torch.device("cpu")}
    for s in state.sites:
        assert s.pool.lora_a.device == s.device
    fastlora.unpatch(model)
