"""Programmatic dependent launch (Hopper and later) for the decode-path kernels.

Inside a decode step most kernels are a few microseconds long, and the GPU spends a good part of
each one launching it and waiting for the one before to drain. Launched with PDL, a kernel may
start while the kernel before it in the stream finishes; it runs its preamble (addresses, the
batch plan, weights) early, then waits (``griddepcontrol.wait``) for the previous kernel to
complete and its writes to be visible before it reads activations.

Every kernel launched with ``USE_PDL`` here keeps three rules, which keep the stream's order
intact for everything else:

- before ``wait()`` it reads only inputs no kernel of the step writes (weights, the LoRA stacks,
  the batch plan copied before the step) or only kernels launched without PDL write (torch's
  attention masks: such a kernel completes before any later one starts), and stores nothing;
- every program calls ``wait()`` before it returns, early returns included, so a kernel never
  completes before the one it follows: the next kernel's wait then covers all earlier ones;
- it lets the next kernel launch early (``launch_dependents()`` at its start; not in ``WAIT_ONLY``).

In a captured decode step, ``decode.early_launch`` lets the kernels it names (the expands) launch
as soon as every block of the cuBLAS GEMM before them has started, and the kernels after them can
follow: the kernels so named read before their wait nothing the GEMM writes, and kernels after
them read before theirs only what was written before the GEMM started.

Kernels from cuBLAS or PyTorch are launched as usual and keep full stream order. ``mode`` says
how a launch on a tensor's device uses PDL: ``FULL`` on CUDA devices of compute capability 9.0 or
more, else ``OFF`` (and everywhere with ``FASTLORA_PDL=0``, ``env.py``). ``launches(setting)``
scopes another setting to the launches (and captures) inside it, in this thread only, for the GPU
tests that compare launches with and without PDL bit for bit: ``OFF``, ``WAIT_ONLY`` (launched
with PDL, but the next kernel launches only as this one's programs exit) or ``FULL``.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Iterator

import torch

from ..env import PDL_OFF
from ..kernel_support import tl, triton

OFF, WAIT_ONLY, FULL = 0, 1, 2
_setting: contextvars.ContextVar[int] = contextvars.ContextVar("fastlora_pdl", default=OFF if PDL_OFF else FULL)


@contextlib.contextmanager
def launches(setting: int) -> Iterator[None]:
    """Kernels launched (or captured) inside use PDL as ``setting`` says (``OFF``, ``WAIT_ONLY``
    or ``FULL``) where the device has it; this thread only, restored on exit."""
    if setting not in (OFF, WAIT_ONLY, FULL):
        raise ValueError(f"a PDL setting is OFF, WAIT_ONLY or FULL, got {setting!r}")
    token = _setting.set(setting)
    try:
        yield
    finally:
        _setting.reset(token)


@functools.lru_cache(maxsize=None)
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def mode(t: torch.Tensor) -> int:
    """How a kernel launched for ``t`` (on the current CUDA device) uses PDL: ``OFF``, ``WAIT_ONLY``
    or ``FULL``. Pass the result as the kernel's ``USE_PDL`` and ``launch_pdl=mode > 0``."""
    setting = _setting.get()
    if setting == OFF or not t.is_cuda:
        return OFF
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    return setting if _capable(index) else OFF


@triton.jit
def launch_dependents(USE_PDL: tl.constexpr):
    if USE_PDL == 2:  # FULL
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def wait(USE_PDL: tl.constexpr):
    if USE_PDL > 0:
        tl.extra.cuda.gdc_wait()
