"""Which launches use programmatic dependent launch (``ops/pdl.py``), per setting, without a GPU:
a CUDA tensor is stood in for, and the device's compute capability is declared."""

import threading
import types

import pytest
import torch

from peft_fastlora.ops import pdl

CUDA = types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0))


@pytest.fixture
def capability(monkeypatch):
    def declare(major):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (major, 0))
        pdl._capable.cache_clear()
    yield declare
    pdl._capable.cache_clear()


@pytest.mark.parametrize("setting", [pdl.FULL, pdl.WAIT_ONLY, pdl.OFF])
def test_mode_per_setting(capability, setting):
    capability(9)
    with pdl.launches(setting):
        assert pdl.mode(CUDA) == setting
    assert pdl.mode(CUDA) == pdl.FULL, "the default comes back on exit"


def test_a_setting_stays_in_its_thread(capability):
    capability(9)
    seen = []
    with pdl.launches(pdl.OFF):
        t = threading.Thread(target=lambda: seen.append(pdl.mode(CUDA)))
        t.start()
        t.join()
        assert pdl.mode(CUDA) == pdl.OFF
    assert seen == [pdl.FULL]


def test_unknown_setting_is_refused():
    with pytest.raises(ValueError, match="OFF, WAIT_ONLY or FULL"):
        with pdl.launches(3):
            pass


def test_never_before_hopper_nor_on_the_cpu(capability):
    capability(8)
    with pdl.launches(pdl.FULL):
        assert pdl.mode(CUDA) == pdl.OFF
        assert pdl.mode(torch.zeros(1)) == pdl.OFF
