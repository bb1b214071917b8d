"""Where fastlora's Triton kernels can run, and what they take: one answer for every caller; and
Triton itself, or stand-ins where it is not installed.

CUDA builds of torch bring Triton; a CPU install need not have it (the ``torch_native`` backend
serves CPU models). Every kernel module imports ``triton`` and ``tl`` from here, so that it imports
without Triton: its torch references, configs and constants stay usable, and only launching one of
its kernels fails, with ``ModuleNotFoundError``. Callers ask ``kernel_runs_on`` (False without
Triton) before they launch. The kernels are built for Triton's interpreter when ``TRITON_INTERPRET=1``
was set before this module was imported (``INTERPRETING``), which runs them on CPU tensors.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch

try:
    import triton
    import triton.language as tl
except ModuleNotFoundError as e:
    TRITON_MISSING = ("the triton package is not installed" if e.name == "triton"
                      else f"triton cannot be imported ({e})")
except Exception as e:  # installed but broken
    TRITON_MISSING = f"triton cannot be imported ({type(e).__name__}: {e})"
else:
    TRITON_MISSING = None
AVAILABLE = TRITON_MISSING is None


if not AVAILABLE:
    class _Kernel:
        """A ``@triton.jit`` function without Triton: defining it works, launching it raises."""

        def __init__(self, fn):
            self.fn = fn
            self.__name__ = getattr(fn, "__name__", "kernel")

        def __getitem__(self, grid):
            return self

        def __call__(self, *args, **kwargs):
            raise ModuleNotFoundError(
                f"fastlora's Triton kernel {self.__name__} needs the triton package, which is not "
                "installed (CUDA builds of torch bring it; or pip install triton)")

    def _jit(fn=None, **_options):
        return _Kernel(fn) if fn is not None else _Kernel

    class _Namespace:
        """What the kernel modules use of a Triton module at import time; anything else raises."""

        def __init__(self, name: str, **members):
            self._name = name
            self.__dict__.update(members)

        def __getattr__(self, attr):
            raise AttributeError(f"{self._name}.{attr}: the triton package is not installed")

    def _cdiv(a: int, b: int) -> int:
        return -(-a // b)

    def _next_power_of_2(n: int) -> int:  # Triton's bit steps, so that 0 gives 0 as there
        n -= 1
        for shift in (1, 2, 4, 8, 16, 32):
            n |= n >> shift
        return n + 1

    # the launchers' size helpers are plain integer math: configs computed without Triton agree
    triton = _Namespace("triton", jit=_jit, cdiv=_cdiv, next_power_of_2=_next_power_of_2)  # noqa: F811
    tl = _Namespace("triton.language", constexpr=lambda value=None: value)  # noqa: F811


if AVAILABLE:
    @triton.jit
    def _probe_kernel(x_ptr):
        pass

    # the JIT hands back its interpreter's function type when TRITON_INTERPRET=1 was set
    INTERPRETING = type(_probe_kernel).__name__ == "InterpretedFunction"
else:
    INTERPRETING = False

# the floating dtypes every kernel and backend takes
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

_sm_counts: Dict[int, int] = {}


def triton_missing() -> Optional[str]:
    """Why fastlora's Triton kernels cannot run in this process (None: Triton imports)."""
    return TRITON_MISSING


def interpreting() -> bool:
    """True when the kernels are built for Triton's interpreter, which runs them on CPU tensors."""
    return INTERPRETING


def kernel_runs_on(*tensors: torch.Tensor) -> bool:
    """All tensors on the current CUDA device (Triton launches there, whatever the tensors'
    device), or all on the CPU under Triton's interpreter (the CPU tests); never without Triton."""
    if triton_missing() is not None:
        return False
    if all(t.is_cuda for t in tensors):
        index = torch.cuda.current_device()
        return all(t.device.index == index for t in tensors)
    return all(t.device.type == "cpu" for t in tensors) and interpreting()


def num_sms(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device (cached)."""
    if device_index not in _sm_counts:
        _sm_counts[device_index] = torch.cuda.get_device_properties(device_index).multi_processor_count
    return _sm_counts[device_index]
