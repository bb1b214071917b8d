"""Early launch of the LoRA expands that follow a cuBLAS GEMM in a captured decode step.

A kernel launched with PDL right after one launched without it (a cuBLAS GEMM) is captured as a
*programmatic* edge from the GEMM's programmatic port. cuBLAS never signals that port, so the
port opens only as the GEMM's last block exits: the expand pays its whole launch and ramp-up
behind the GEMM, where an expand behind one of our PDL GEMMs launches while the GEMM runs.

``launch_early`` moves such edges, in a captured graph that is not instantiated yet, to the GEMM's
*launch-order* port, which opens once every block of the GEMM has started. The expand then runs
what comes before its ``griddepcontrol.wait`` (its plan, tables and B) while the GEMM streams,
and the wait still holds it until the GEMM has completed and its writes are visible: only the
pre-wait part moves. That is sound only for kernels whose pre-wait part reads nothing their
upstream kernel writes; ``EARLY_KERNELS`` names them (``ops/pdl.py`` states the rule for every
PDL kernel). Kernels that the expand lets launch early in turn keep pdl.py's rules, and those
never let a pre-wait read see a GEMM's output.

The graph is edited through the CUDA driver (``libcuda``, CUDA 12.3 or later for edge data).
Where any of that is missing, nothing is moved and the graph is the one captured.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Callable, Iterable, List, NamedTuple, Optional

logger = logging.getLogger(__name__)

# Triton kernels whose pre-wait part reads only what no kernel of the step writes
EARLY_KERNELS = frozenset({"_lora_expand_kernel", "_lora_expand_wide_kernel"})

# CUgraphEdgeData's values (cuda.h)
PORT_DEFAULT, PORT_PROGRAMMATIC, PORT_LAUNCH_ORDER = 0, 1, 2
TYPE_DEFAULT, TYPE_PROGRAMMATIC = 0, 1
_KERNEL_NODE = 0  # CU_GRAPH_NODE_TYPE_KERNEL


class Edge(NamedTuple):
    src: int
    dst: int
    from_port: int
    to_port: int
    type: int


def edges_to_move(edges: Iterable[Edge], kernel_name: Callable[[int], Optional[str]]) -> List[Edge]:
    """The edges ``launch_early`` moves: programmatic edges leaving their source's programmatic
    port into a kernel named in ``EARLY_KERNELS`` (``kernel_name(node)``: None for other nodes),
    from a source launched without PDL (no programmatic edge into it: cuBLAS, PyTorch). A source
    launched with PDL is one of fastlora's kernels, which signal their port at their start: there
    the move gains nothing."""
    edges = list(edges)
    pdl_launched = {e.dst for e in edges if e.type == TYPE_PROGRAMMATIC}
    return [e for e in edges
            if e.type == TYPE_PROGRAMMATIC and e.from_port == PORT_PROGRAMMATIC
            and e.src not in pdl_launched and kernel_name(e.dst) in EARLY_KERNELS]


class _EdgeData(ctypes.Structure):
    _fields_ = [("from_port", ctypes.c_ubyte), ("to_port", ctypes.c_ubyte), ("type", ctypes.c_ubyte),
                ("reserved", ctypes.c_ubyte * 5)]


class _KernelParams(ctypes.Structure):  # CUDA_KERNEL_NODE_PARAMS_v2
    _fields_ = [("func", ctypes.c_void_p), ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_mem_bytes", ctypes.c_uint), ("kernel_params", ctypes.c_void_p),
                ("extra", ctypes.c_void_p), ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p),
                ("spare", ctypes.c_ubyte * 64)]  # room should a later driver write a longer struct


class DriverError(RuntimeError):
    pass


class EditFailed(RuntimeError):
    """The graph's edit or its instantiation failed: the graph is not to be used, and early launch
    is off for the process (``unavailable`` says why). ``graph``: the graph, for the caller to let go
    of once another capture holds the memory pool."""

    graph = None


class _Driver:
    """The few driver entry points the edit needs, typed once."""

    def __init__(self):
        lib = ctypes.CDLL("libcuda.so.1")
        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        p = ctypes.POINTER
        self._fns = {}
        for name, args in (
                ("cuGraphGetEdges_v2", [vp, p(vp), p(vp), p(_EdgeData), p(sz)]),
                ("cuGraphNodeGetType", [vp, p(ctypes.c_int)]),
                ("cuGraphKernelNodeGetParams_v2", [vp, p(_KernelParams)]),
                ("cuFuncGetName", [p(ctypes.c_char_p), vp]),
                ("cuKernelGetName", [p(ctypes.c_char_p), vp]),
                ("cuGraphRemoveDependencies_v2", [vp, p(vp), p(vp), p(_EdgeData), sz]),
                ("cuGraphAddDependencies_v2", [vp, p(vp), p(vp), p(_EdgeData), sz])):
            fn = getattr(lib, name)  # AttributeError: a driver older than CUDA 12.3
            fn.argtypes, fn.restype = args, ctypes.c_int
            self._fns[name] = fn

    def call(self, name: str, *args) -> None:
        rc = self._fns[name](*args)
        if rc != 0:
            raise DriverError(f"{name} returned CUresult {rc}")

    def edges(self, graph) -> List[Edge]:
        n = ctypes.c_size_t(0)
        self.call("cuGraphGetEdges_v2", graph, None, None, None, ctypes.byref(n))
        count = n.value
        src, dst, data = (ctypes.c_void_p * count)(), (ctypes.c_void_p * count)(), (_EdgeData * count)()
        self.call("cuGraphGetEdges_v2", graph, src, dst, data, ctypes.byref(n))
        return [Edge(src[i] or 0, dst[i] or 0, data[i].from_port, data[i].to_port, data[i].type)
                for i in range(min(count, n.value))]

    def kernel_name(self, node: int) -> Optional[str]:
        kind = ctypes.c_int(-1)
        self.call("cuGraphNodeGetType", ctypes.c_void_p(node), ctypes.byref(kind))
        if kind.value != _KERNEL_NODE:
            return None
        params = _KernelParams()
        self.call("cuGraphKernelNodeGetParams_v2", ctypes.c_void_p(node), ctypes.byref(params))
        name = ctypes.c_char_p()
        if params.func:
            self.call("cuFuncGetName", ctypes.byref(name), ctypes.c_void_p(params.func))
        elif params.kern:
            self.call("cuKernelGetName", ctypes.byref(name), ctypes.c_void_p(params.kern))
        return name.value.decode(errors="replace") if name.value else None

    def move_to_launch_order(self, graph, edge: Edge) -> None:
        src, dst = (ctypes.c_void_p * 1)(edge.src), (ctypes.c_void_p * 1)(edge.dst)
        old = (_EdgeData * 1)()
        old[0].from_port, old[0].to_port, old[0].type = edge.from_port, edge.to_port, edge.type
        new = (_EdgeData * 1)()
        new[0].from_port, new[0].to_port, new[0].type = PORT_LAUNCH_ORDER, edge.to_port, TYPE_PROGRAMMATIC
        self.call("cuGraphRemoveDependencies_v2", graph, src, dst, old, 1)
        try:
            self.call("cuGraphAddDependencies_v2", graph, src, dst, new, 1)
        except DriverError:
            self.call("cuGraphAddDependencies_v2", graph, src, dst, old, 1)
            raise


_driver: Optional[_Driver] = None
unavailable: Optional[str] = None  # why the driver's graph edits cannot be used here (None: they can)


def _get_driver() -> Optional[_Driver]:
    global _driver, unavailable
    if _driver is None and unavailable is None:
        try:
            _driver = _Driver()
        except (OSError, AttributeError) as e:
            unavailable = f"no CUDA 12.3 driver graph API ({type(e).__name__}: {e})"
            logger.info("fastlora: expands launch after cuBLAS GEMMs complete: %s", unavailable)
    return _driver


def names(graph_handle: int) -> dict:
    """node -> kernel name (None for other nodes) of a captured, kept graph: for probes and tests."""
    drv = _get_driver()
    if drv is None:
        return {}
    graph = ctypes.c_void_p(graph_handle)
    found = drv.edges(graph)
    nodes = {e.src for e in found} | {e.dst for e in found}
    return {node: drv.kernel_name(node) for node in nodes}


def edges(graph_handle: int) -> List[Edge]:
    """The edges of a captured, kept graph (for probes and tests); [] where the driver cannot say."""
    drv = _get_driver()
    return drv.edges(ctypes.c_void_p(graph_handle)) if drv is not None else []


def wanted() -> bool:
    """Whether captures should keep their graph for ``edit`` (on, and not found unusable)."""
    return unavailable is None


def disable(reason: str) -> None:
    """Early launch off for the process, ``reason`` kept in ``unavailable`` (the runner's stats)."""
    global unavailable
    unavailable = reason
    logger.info("fastlora: expands launch after cuBLAS GEMMs complete: %s", reason)


def launch_early(graph_handle: int) -> List[Edge]:
    """Move ``edges_to_move``'s edges of a captured graph (``CUDAGraph.raw_cuda_graph()``, before
    it is instantiated) to the launch-order port; returns them as they were ([] where the driver
    lacks the API). Should the driver refuse the new edge, the old one is put back and
    ``DriverError`` raised; the edges moved before it stay moved."""
    drv = _get_driver()
    if drv is None:
        return []
    graph = ctypes.c_void_p(graph_handle)
    cache = {}

    def kernel_name(node: int) -> Optional[str]:
        if node not in cache:
            cache[node] = drv.kernel_name(node)
        return cache[node]

    moving = edges_to_move(drv.edges(graph), kernel_name)
    for edge in moving:
        drv.move_to_launch_order(graph, edge)
    return moving


def edit(graph) -> int:
    """``launch_early`` on a kept ``torch.cuda.CUDAGraph`` just captured, then its instantiation;
    returns the number of edges moved. Any failure turns early launch off for the process and
    raises ``EditFailed`` (the caller captures again, unedited). The graph is not freed here: it
    holds a use of the capture's memory pool until the new capture holds one (torch's allocators
    refuse a capture into a pool whose last graph has gone)."""
    global unavailable
    try:
        moved = launch_early(graph.raw_cuda_graph())
        graph.instantiate()
    except Exception as e:  # noqa: BLE001 - a driver or instantiation error: capture plain from now on
        unavailable = f"editing a captured graph failed ({type(e).__name__}: {e})"
        logger.warning("fastlora: expands launch after cuBLAS GEMMs complete from now on: %s", unavailable)
        failed = EditFailed(unavailable)
        failed.graph = graph
        raise failed from e
    return len(moved)
