"""Triton where it is installed, stand-ins where it is not.

CUDA builds of torch bring Triton; a CPU install need not have it (the ``torch_native`` backend
serves CPU models). Every kernel module imports ``triton`` and ``tl`` from here, so that it imports
without Triton: its torch references, configs and constants stay usable, and only launching one of
its kernels fails, with ``ModuleNotFoundError``. Callers ask ``kernel_support.kernel_runs_on``
(False without Triton) before they launch.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton here (kernel_support.triton_missing says why, for the report)
    AVAILABLE = False
else:
    AVAILABLE = True


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


__all__ = ["AVAILABLE", "tl", "triton"]
