"""Which launches use programmatic dependent launch (``ops/pdl.py``), per setting, without a GPU:
a CUDA tensor is stood in for, and the device is declared capable (or not)."""

import types

import pytest
import torch

from peft_fastlora.ops import pdl

CUDA = types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0))


@pytest.mark.parametrize("setting, plain, preamble", [
    (pdl.FULL, pdl.FULL, pdl.FULL),
    (pdl.WAIT_ONLY, pdl.WAIT_ONLY, pdl.WAIT_ONLY),
    (pdl.PREAMBLE_ONLY, pdl.OFF, pdl.FULL),
    (pdl.OFF, pdl.OFF, pdl.OFF),
])
def test_mode_per_setting(monkeypatch, setting, plain, preamble):
    monkeypatch.setattr(pdl, "SETTING", setting)
    monkeypatch.setattr(pdl, "_capable", {0: True})
    assert (pdl.mode(CUDA), pdl.mode(CUDA, preamble=True)) == (plain, preamble)


def test_never_before_hopper_nor_on_the_cpu(monkeypatch):
    monkeypatch.setattr(pdl, "SETTING", pdl.FULL)
    monkeypatch.setattr(pdl, "_capable", {0: False})
    assert pdl.mode(CUDA) == pdl.mode(CUDA, preamble=True) == pdl.OFF
    assert pdl.mode(torch.zeros(1)) == pdl.OFF
