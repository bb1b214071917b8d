"""``decode.early_launch`` without a GPU: which captured edges move, and what a failed edit leaves.

The edit itself (driver calls on a real graph, the bits through replays) is in
``test_early_launch_gpu.py``.
"""

import pytest

from peft_fastlora.decode import early_launch as el
from peft_fastlora.decode.early_launch import Edge

GEMM, EXPAND, WIDE, NORM, MEMSET, OWN_GEMM = 1, 2, 3, 4, 5, 6
NAMES = {GEMM: "nvjet_hsh_128x64_64x4_1x2_v_bz_coopA_NTN", EXPAND: "_lora_expand_kernel",
         WIDE: "_lora_expand_wide_kernel", NORM: "_add_rms_norm_kernel", MEMSET: None,
         OWN_GEMM: "_stream_gemm_kernel"}


def _moved(edges):
    return el.edges_to_move(edges, NAMES.get)


def test_programmatic_edges_into_an_expand_move():
    edges = [Edge(GEMM, EXPAND, el.PORT_PROGRAMMATIC, 0, el.TYPE_PROGRAMMATIC),
             Edge(GEMM, WIDE, el.PORT_PROGRAMMATIC, 0, el.TYPE_PROGRAMMATIC)]
    assert _moved(edges) == edges


@pytest.mark.parametrize("edge, why", [
    (Edge(GEMM, EXPAND, el.PORT_DEFAULT, 0, el.TYPE_DEFAULT), "a full edge: the expand was launched without PDL"),
    (Edge(GEMM, EXPAND, el.PORT_LAUNCH_ORDER, 0, el.TYPE_PROGRAMMATIC), "already at the launch-order port"),
    (Edge(GEMM, NORM, el.PORT_PROGRAMMATIC, 0, el.TYPE_PROGRAMMATIC), "a kernel not named early"),
    (Edge(MEMSET, EXPAND, el.PORT_DEFAULT, 0, el.TYPE_DEFAULT), "from a node that is not a kernel"),
])
def test_other_edges_stay(edge, why):
    assert _moved([edge]) == [], why


def test_an_expand_behind_a_kernel_launched_with_pdl_stays():
    """Such a source is fastlora's own and signals its port at its start already."""
    into_own = Edge(NORM, OWN_GEMM, el.PORT_PROGRAMMATIC, 0, el.TYPE_PROGRAMMATIC)
    own_to_expand = Edge(OWN_GEMM, EXPAND, el.PORT_PROGRAMMATIC, 0, el.TYPE_PROGRAMMATIC)
    into_cublas = Edge(NORM, GEMM, el.PORT_DEFAULT, 0, el.TYPE_DEFAULT)
    cublas_to_wide = Edge(GEMM, WIDE, el.PORT_PROGRAMMATIC, 0, el.TYPE_PROGRAMMATIC)
    assert _moved([into_own, own_to_expand, into_cublas, cublas_to_wide]) == [cublas_to_wide]


def test_the_early_kernels_are_the_expands():
    import importlib

    expand = importlib.import_module("peft_fastlora.ops.lora_expand")
    wide = importlib.import_module("peft_fastlora.ops.lora_expand_wide")
    # the names the driver reports are the Triton functions' names
    assert el.EARLY_KERNELS == {expand._lora_expand_kernel.fn.__name__, wide._lora_expand_wide_kernel.fn.__name__}


def test_wanted_until_a_failure(monkeypatch):
    monkeypatch.setattr(el, "unavailable", None)
    assert el.wanted()
    monkeypatch.setattr(el, "unavailable", "editing a captured graph failed (...)")
    assert not el.wanted()


def test_disable_keeps_the_reason(monkeypatch):
    monkeypatch.setattr(el, "unavailable", None)
    el.disable("torch 2.7 cannot keep a captured graph to edit (no keep_graph)")
    assert not el.wanted() and "keep_graph" in el.unavailable


class _FakeGraph:
    def __init__(self):
        self.calls = []

    def raw_cuda_graph(self):
        self.calls.append("raw")
        return 1234

    def instantiate(self):
        self.calls.append("instantiate")

    def reset(self):
        self.calls.append("reset")


def test_an_edit_that_fails_turns_early_launch_off(monkeypatch):
    monkeypatch.setattr(el, "unavailable", None)

    def refused(handle):
        assert handle == 1234
        raise el.DriverError("cuGraphAddDependencies_v2 returned CUresult 1")

    monkeypatch.setattr(el, "launch_early", refused)
    graph = _FakeGraph()
    with pytest.raises(el.EditFailed, match="CUresult 1"):
        el.edit(graph)
    assert graph.calls == ["raw"]  # never instantiated; not reset (it holds the pool until the recapture)
    assert "CUresult 1" in el.unavailable and not el.wanted()


def test_an_edit_instantiates_and_counts(monkeypatch):
    monkeypatch.setattr(el, "unavailable", None)
    edges = [Edge(GEMM, EXPAND, el.PORT_PROGRAMMATIC, 0, el.TYPE_PROGRAMMATIC)] * 3
    monkeypatch.setattr(el, "launch_early", lambda handle: edges)
    graph = _FakeGraph()
    assert el.edit(graph) == 3
    assert graph.calls == ["raw", "instantiate"]
    assert el.unavailable is None
