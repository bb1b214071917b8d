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
more, else ``OFF`` (and everywhere with ``FASTLORA_PDL=0``, ``env.py``). ``SETTING`` exists for
the GPU tests that compare launches with and without PDL bit for bit: ``OFF``, ``WAIT_ONLY`` (launched with PDL, but the next kernel launches only as this
one's programs exit) or ``PREAMBLE_ONLY`` (``FULL`` for the kernels that have a preamble to run
before the wait, the expand and the norms, and off for the others).
"""

from __future__ import annotations

from typing import Dict

import torch

from ..env import PDL_OFF
from ..kernel_support import tl, triton

OFF, WAIT_ONLY, FULL = 0, 1, 2
PREAMBLE_ONLY = 3  # a setting, not a kernel mode: FULL where the kernel has a preamble, else OFF
SETTING = OFF if PDL_OFF else FULL
_capable: Dict[int, bool] = {}


def mode(t: torch.Tensor, preamble: bool = False) -> int:
    """How a kernel launched for ``t`` (on the current CUDA device) uses PDL: ``OFF``, ``WAIT_ONLY``
    or ``FULL``. ``preamble``: the kernel reads something before its wait. Pass the result as the
    kernel's ``USE_PDL`` and ``launch_pdl=mode > 0``."""
    if SETTING == OFF or not t.is_cuda or (SETTING == PREAMBLE_ONLY and not preamble):
        return OFF
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    if index not in _capable:
        _capable[index] = torch.cuda.get_device_capability(index)[0] >= 9
    if not _capable[index]:
        return OFF
    return FULL if SETTING == PREAMBLE_ONLY else SETTING


@triton.jit
def launch_dependents(USE_PDL: tl.constexpr):
    if USE_PDL == 2:  # FULL
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def wait(USE_PDL: tl.constexpr):
    if USE_PDL > 0:
        tl.extra.cuda.gdc_wait()
