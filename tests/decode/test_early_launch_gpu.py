"""``decode.early_launch`` on the GPU: the expands behind cuBLAS GEMMs set to launch early in a
captured graph, the bits through replays with new inputs, and a driver that refuses the edit.

The chain: a long folded GEMM (``x @ [W; A].T``, cuBLAS), the expand of its shrink columns into
its base columns, an RMSNorm of the result (a PDL kernel the expand lets launch early in turn), a
second folded GEMM of that and its expand. Moved edges let each expand launch while its GEMM
still runs: an expand that did not wait for its GEMM would add stale shrink columns to stale
base columns, so every replay's inputs are new and every result is compared bit for bit with the
same chain captured without the edit.
"""

import pytest
import torch
import torch.nn.functional as F

from peft_fastlora.batch import NO_ADAPTER
from peft_fastlora.decode import capture as cuda_graph
from peft_fastlora.decode import early_launch
from peft_fastlora.ops import lora_expand, rms_norm

pytestmark = pytest.mark.gpu
ROWS, K, N, SLOTS, R = 128, 8192, 4096, 4, 16
RANKS = [16, 8, 16, 8]
DEV, DT = "cuda", torch.bfloat16


@pytest.fixture(autouse=True)
def hopper(monkeypatch):
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    monkeypatch.setattr(early_launch, "unavailable", None)


def _i32(values):
    return torch.tensor(values, device=DEV, dtype=torch.int32)


def _plan():
    """Chunks of at most 16 rows of one slot; every seventh row has no adapter."""
    slots = [t % SLOTS if t % 7 else NO_ADAPTER for t in range(ROWS)]
    ids = sorted((t for t in range(ROWS) if slots[t] >= 0), key=lambda t: (slots[t], t))
    chunks, start = [], 0
    for s in range(SLOTS):
        n = sum(1 for t in ids if slots[t] == s)
        chunks += [(s, start + c0, min(16, n - c0)) for c0 in range(0, n, 16)]
        start += n
    pad = 3  # idle programs: the plan's tail, as a graph's bucket leaves it
    return (_i32(ids + [0] * (ROWS - len(ids))), _i32([c[0] for c in chunks] + [NO_ADAPTER] * pad),
            _i32([c[1] for c in chunks] + [0] * pad), _i32([c[2] for c in chunks] + [0] * pad))


def _operands(seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, device=DEV, generator=g) * scale).to(DT)

    def site(k):
        wa = randn(N + SLOTS * R, k, scale=k ** -0.5)
        for s, r in enumerate(RANKS):  # A rows past a slot's rank: anything (never read)
            wa[N + s * R + r:N + (s + 1) * R] = float("nan")
        return wa, randn(SLOTS * N * R, scale=0.25)

    return dict(
        x=torch.empty(ROWS, K, device=DEV, dtype=DT), site1=site(K), site2=site(N), norm_w=randn(N),
        b_offs=torch.tensor([[s * N * R] for s in range(SLOTS)], device=DEV, dtype=torch.int64),
        y_cols=_i32([[s * R] for s in range(SLOTS)]), ranks=_i32([[r] for r in RANKS]),
        scalings=torch.tensor([[0.5], [2.0], [1.0], [0.25]], device=DEV), plan=_plan())


def _chain(x, site1, site2, norm_w, b_offs, y_cols, ranks, scalings, plan):
    def folded(inp, site):
        wa, b = site
        full = F.linear(inp, wa)  # cuBLAS: base columns, then every slot's shrink columns
        lora_expand(full[:, N:], b, [0, N], ranks, scalings, full[:, :N], *plan, block_m=16, b_offs=b_offs,
                    b_align=8, y_cols=y_cols, max_rank=R)
        return full[:, :N]

    h = rms_norm(folded(x, site1), norm_w, 1e-5)
    return h, folded(h, site2)


def _capture(ops):
    pool = cuda_graph.GraphPool()
    graph, out = cuda_graph.capture(lambda: _chain(**ops), pool, lambda: None)
    return graph, out, pool


def _replays(graph, out, ops, steps):
    got = []
    for step in range(steps):
        g = torch.Generator(device=DEV).manual_seed(100 + step)
        ops["x"].copy_(torch.randn(ops["x"].shape, device=DEV, generator=g))
        graph.replay()
        got.append(tuple(o.clone() for o in out))
    torch.cuda.synchronize()
    return got


def _assert_same(a, b):
    assert len(a) == len(b)
    for step, (x, y) in enumerate(zip(a, b)):
        for i, (u, v) in enumerate(zip(x, y)):
            assert not u.isnan().any(), (step, i, "read a rank's NaN padding")
            assert torch.equal(u, v), (step, i)


def test_expands_behind_long_cublas_gemms_launch_early_and_keep_their_bits():
    ops = _operands()
    graph, out, pool = _capture(ops)
    assert graph.fastlora_early_edges == 2, graph.fastlora_early_edges
    names = early_launch.names(graph.raw_cuda_graph())
    moved = [e for e in early_launch.edges(graph.raw_cuda_graph()) if e.from_port == early_launch.PORT_LAUNCH_ORDER]
    assert len(moved) == 2 and {names[e.dst] for e in moved} <= early_launch.EARLY_KERNELS, moved
    assert all(e.type == early_launch.TYPE_PROGRAMMATIC for e in moved)
    got = _replays(graph, out, ops, 24)

    early_launch.unavailable = "a plain capture to compare with"  # (the hopper fixture resets it)
    plain, plain_out, plain_pool = _capture(ops)
    assert plain.fastlora_early_edges == 0
    _assert_same(got, _replays(plain, plain_out, ops, 24))
    # and the deltas are there: the chain without its expands differs
    assert not torch.equal(got[-1][1], F.linear(got[-1][0], ops["site2"][0])[:, :N])


def test_a_driver_that_refuses_the_new_edge_leaves_a_plain_graph(monkeypatch):
    """The first moved edge is refused: the old edge goes back, the edited graph is discarded, the
    step is captured again unedited and early launch stays off for the process."""
    real_call = early_launch._Driver.call

    def refuse_launch_order(self, name, *args):
        if name == "cuGraphAddDependencies_v2" and args[3][0].from_port == early_launch.PORT_LAUNCH_ORDER:
            raise early_launch.DriverError(f"{name} returned CUresult 801 (injected)")
        return real_call(self, name, *args)

    ops = _operands(seed=1)
    monkeypatch.setattr(early_launch._Driver, "call", refuse_launch_order)
    graph, out, pool = _capture(ops)
    assert graph.fastlora_early_edges == 0
    assert "injected" in early_launch.unavailable and not early_launch.wanted()
    got = _replays(graph, out, ops, 8)
    monkeypatch.setattr(early_launch._Driver, "call", real_call)
    plain, plain_out, plain_pool = _capture(ops)  # early launch now off: plain as well
    assert plain.fastlora_early_edges == 0
    _assert_same(got, _replays(plain, plain_out, ops, 8))
