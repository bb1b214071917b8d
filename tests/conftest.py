"""Test set-up. Without a GPU the Triton kernels run in Triton's interpreter: the variable must be
set before any kernel module (or triton itself) is imported, hence here, at the top."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

HAS_CUDA = torch.cuda.is_available()

# under pytest-xdist each worker is one process per core: torch's own intra-op threads on top of
# that oversubscribe the cores (the CPU suite ran twice as long with them)
if os.environ.get("PYTEST_XDIST_WORKER") and not HAS_CUDA:
    torch.set_num_threads(1)


def pytest_addoption(parser):
    parser.addoption("--server-device", default="cpu", choices=["cpu", "cuda"],
                     help="the device the live server tests (tests/_server.py) serve from: cuda runs the "
                          "endpoint's hostile-input, operations and sampling tests on the GPU")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (run on a GPU machine)")
    config.addinivalue_line("markers", "slow: slower CPU test")
    import _options

    _options.SERVER_DEVICE = config.getoption("server_device")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def cpu_events(monkeypatch):
    """The deferred stop check on CPU tensors (fastlora defers on CUDA only): CPU copies stand in
    for CUDA's, with an event that is done when recorded (``_helpers.DoneEvent``)."""
    from peft_fastlora.decode import stop_flag
    from _helpers import DoneEvent

    monkeypatch.setattr(stop_flag, "DEVICE_TYPES", {"cuda", "cpu"})
    monkeypatch.setattr(torch, "Event", DoneEvent)


@pytest.fixture
def pair_options():
    """``fastlora.patch`` options of the ``pair`` fixture's patched model (a test module overrides
    this fixture to change them)."""
    return {}


@pytest.fixture
def pair(pair_options):
    """(patched model, PEFT reference): ``_models.build_peft_lm("llama")`` (three adapters) patched
    with ``pair_options`` and an unpatched deep copy of it; unpatched after the test."""
    import copy

    import peft_fastlora as fastlora
    from _models import build_peft_lm

    m = build_peft_lm("llama")
    ref = copy.deepcopy(m)
    fastlora.patch(m, **pair_options)
    yield m, ref
    fastlora.unpatch(m)
