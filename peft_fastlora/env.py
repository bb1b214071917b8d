"""The environment variables fastlora reads: all of them, here, once at import. They are escape
hatches for debugging, not tunables (those are ``Tuning``'s fields, passed to ``patch``).

- ``FASTLORA_PDL=0``: the decode-path kernels launch one after another instead of with
  programmatic dependent launch (``ops/pdl.py``), for a suspected kernel-level race on a Hopper GPU.
- ``FASTLORA_INTERPRETER_SMS=n``: under Triton's interpreter, launches are planned for ``n``
  streaming multiprocessors (default 4: few programs run fastest there); a tool that records the
  launches a GPU would get (``benchmarks/kernel_resources.py``) sets that GPU's count.
"""

from __future__ import annotations

import os

PDL_OFF = os.environ.get("FASTLORA_PDL", "").strip().lower() in ("0", "off", "false")


def _positive_int(name: str, default: int) -> int:
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{name} must be a positive integer, got {text!r}")
    return int(text)


INTERPRETER_SMS = _positive_int("FASTLORA_INTERPRETER_SMS", 4)
