"""What ``generate``'s decode takes on a patched model, decided once per build: ``DecodePlan``.

Each choice is ``None`` where the feature is on, else the reason it is off; ``report_fields`` gives
the report's words for them. Per call, ``generate.call_blocker``, ``deferred_stop.call_reason`` and
``greedy_loop.blocker`` may still send one call the slower way (a beam search, a sampling call).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

from . import deferred_stop, greedy_loop, stop_flag
from .generate import graphs_wanted


@dataclass(frozen=True)
class DecodePlan:
    """The decode choices of one build of a patched model.

    Attributes:
        graphs_off: why decode steps are not replayed from CUDA graphs (None: they are).
        emulate: graphs are emulated (``cuda_graphs="emulate"``: the CPU tests' runner).
        stop_check_off: why graphed calls read the stop flag every step (None: one step late).
        token_selection_off: why greedy graphed calls keep transformers' token selection (None: one
            kernel selects, and the next inputs are written on the GPU where ``step_advance`` takes
            the call).
    """

    graphs_off: Optional[str]
    emulate: bool = False
    stop_check_off: Optional[str] = "no decode graphs"
    token_selection_off: Optional[str] = "no decode graphs"

    def report_fields(self) -> Dict[str, str]:
        """``PatchReport``'s ``cuda_graphs`` and, with graphs on, ``stop_check`` and ``token_selection``."""
        if self.graphs_off is not None:
            return {"cuda_graphs": f"off ({self.graphs_off})"}
        return {
            "cuda_graphs": "emulated" if self.emulate else "on",
            "stop_check": "deferred" if self.stop_check_off is None else f"per step ({self.stop_check_off})",
            "token_selection": ("one kernel for greedy calls, their next inputs written on the GPU"
                                if self.token_selection_off is None else f"transformers' ({self.token_selection_off})"),
        }


def decide(state) -> DecodePlan:
    """The decode plan of the model as ``state`` has built it (options, device, sites, report)."""
    graphs_off = graphs_wanted(state)
    if graphs_off is not None:
        return DecodePlan(graphs_off)
    stop_off = deferred_stop.unavailable_reason(state.options)
    if stop_off is None and state.device.type not in stop_flag.DEVICE_TYPES:
        stop_off = f"not on {', '.join(sorted(stop_flag.DEVICE_TYPES))}"
    selection_off = "the stop check is read every step" if stop_off else greedy_loop.patch_blocker(state.inner)
    return DecodePlan(None, state.options.cuda_graphs == "emulate", stop_off, selection_off)
