"""The environment variables fastlora reads: all of them, here, once at import. They are escape
hatches for debugging, not tunables (those are ``Tuning``'s fields, passed to ``patch``).

- ``FASTLORA_PDL=0``: the decode-path kernels launch one after another instead of with
  programmatic dependent launch (``ops/pdl.py``), for a suspected kernel-level race on a Hopper GPU.
"""

from __future__ import annotations

import os

PDL_OFF = os.environ.get("FASTLORA_PDL", "").strip().lower() in ("0", "off", "false")
