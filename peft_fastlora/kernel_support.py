"""Where fastlora's Triton kernels can run, and what they take: one answer for every caller.

Importing this module imports neither Triton nor the kernels (``import peft_fastlora`` stays
light); ``interpreting`` imports them on first use. Triton is optional: without it (a CPU install)
no kernel runs, and every caller takes its torch path.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch

# the floating dtypes every kernel and backend takes
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

_interpreting: Optional[bool] = None
_triton_missing: Optional[str] = None
_triton_checked = False
_sm_counts: Dict[int, int] = {}


def triton_missing() -> Optional[str]:
    """Why fastlora's Triton kernels cannot run in this process (None: Triton imports)."""
    global _triton_missing, _triton_checked
    if not _triton_checked:
        try:
            import triton  # noqa: F401
        except ModuleNotFoundError as e:
            _triton_missing = ("the triton package is not installed" if e.name == "triton"
                               else f"triton cannot be imported ({e})")
        except Exception as e:  # installed but broken
            _triton_missing = f"triton cannot be imported ({type(e).__name__}: {e})"
        _triton_checked = True
    return _triton_missing


def interpreting() -> bool:
    """True when the kernels were built for Triton's interpreter (``TRITON_INTERPRET=1`` set before
    they were imported), which runs them on CPU tensors."""
    global _interpreting
    if _interpreting is None:
        try:
            from .ops import interpreting as kernels_interpreted
        except ImportError:  # no Triton here
            _interpreting = False
        else:
            _interpreting = kernels_interpreted()
    return _interpreting


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
