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
INTERPRETER_SMS = int(os.environ.get("FASTLORA_INTERPRETER_SMS", "") or 4)
