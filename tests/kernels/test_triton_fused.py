"""The fused decode path (shrink + expand in one persistent launch) against the torch reference,
under the Triton interpreter; shared helpers and tolerances come from test_triton_kernels."""

from __future__ import annotations
import pytest
import torch
from peft_fastlora.backend.torch_native import TorchNativeLoRABackend  # noqa: E402
from peft_fastlora.backend.triton import TritonLoRABackend  # noqa: E402
from peft_fastlora.batch import NO_ADAPTER, ForwardBatch, ForwardMode  # noqa: E402

from test_triton_kernels import (  # noqa: E402
    TOLERANCES,
    DTYPE_IDS,
    CPU,
    SLOT_RANKS,
    SLOT_SCALINGS,
    K,
    MAX_LORAS,
    NUM_SLOTS,
    COMPOSITIONS,
    assert_close,
    make_backends,
    layer_tables,
    make_a,
    make_b,
    token_slots,
    poisoned_base,
    check_untouched,
)


# ---- fused decode path: shrink + expand in one launch ------------------------------------------
FUSED_SITES = {"linear": [0, 45], "gate_up": [0, 33, 66], "qkv": [0, 40, 59, 78]}
FUSED_BS = 20  # 18 rows of one adapter in "skewed": a chunk of 16 and one of 2


@pytest.fixture
def fused_calls(monkeypatch):
    """The block_m of every fused launch the Triton backend makes."""
    import peft_fastlora.backend.triton as tb

    calls, launch = [], tb._ops.lora_fused

    def counted(*args, **kwargs):
        calls.append(kwargs["block_m"])
        return launch(*args, **kwargs)

    monkeypatch.setattr(tb._ops, "lora_fused", counted)
    return calls


def run_fused_site(be, site, x, a, b, base, ranks, scalings, **extra):
    kw = dict(base_output=base, layer_ranks=ranks, layer_scalings=scalings, **extra)
    if site == "linear":
        return be.run_lora(x, a, b, **kw)  # what LinearSite calls
    if site == "gate_up":
        return be.run_gate_up_lora(x, a, b, **kw)
    return be.run_qkv_lora(x, a, b, output_offset=FUSED_SITES[site], **kw)


def site_inputs(site, tok, dtype, k=K):
    offsets = FUSED_SITES[site]
    ranks, scalings = layer_tables(len(offsets) - 1)
    x = torch.randn(len(tok), k, dtype=dtype)
    a, b = make_a(len(offsets) - 1, k, ranks, dtype), make_b(offsets, ranks, dtype)
    return x, a, b, poisoned_base(tok, offsets[-1], dtype), ranks, scalings


def assert_workspace_clean(tri, timeouts=0):
    """The fused kernel leaves its counters and accumulator zero for the next call or replay."""
    for ws in tri._workspaces.values():
        assert int(ws.sync[0]) == 0 and not ws.sync[2:].any(), "a counter was left set"
        assert not ws.acc.any(), "the accumulator was left non-zero"
    assert tri.fused_timeouts() == timeouts


@pytest.mark.parametrize("comp", ["mixed", "skewed", "all_base"])
@pytest.mark.parametrize("site", list(FUSED_SITES))
@pytest.mark.parametrize("dtype,atol,rtol", TOLERANCES, ids=DTYPE_IDS)
def test_fused_decode(dtype, atol, rtol, site, comp, fused_calls):
    """Mixed ranks, a rank-0 module, NaN padding, rows with no adapter: one launch per call."""
    seq_lens = [1] * FUSED_BS
    wi = COMPOSITIONS[comp](FUSED_BS)
    tri, ref = make_backends(wi, seq_lens)
    tok = token_slots(wi, seq_lens)
    x, a, b, base, ranks, scalings = site_inputs(site, tok, dtype)
    out = base.clone()
    got = run_fused_site(tri, site, x, a, b, out, ranks, scalings)
    want = run_fused_site(ref, site, x, a, b, base.clone(), ranks, scalings)
    assert fused_calls == [16] and got is out
    assert not got.isnan().any(), "read padding past a rank, or another slot"
    check_untouched(got, base, tok)
    assert_close(got, want, atol, rtol, f"fused {site} ({comp})")
    assert_workspace_clean(tri)


def test_fused_strided_base_output(fused_calls):
    """A base output that is a column slice of a wider tensor (row stride != N)."""
    dtype, atol, rtol = TOLERANCES[0]
    seq_lens, wi = [1] * 6, [0, 3, NO_ADAPTER, 1, 3, 2]
    tri, ref = make_backends(wi, seq_lens)
    x, a, b, base, ranks, scalings = site_inputs("linear", token_slots(wi, seq_lens), dtype)
    wide = torch.randn(len(wi), base.shape[1] + 10, dtype=dtype)
    before = wide.clone()
    n = base.shape[1]
    tri.run_lora(x, a, b, base_output=wide[:, 3 : 3 + n], layer_ranks=ranks, layer_scalings=scalings)
    want = ref.run_lora(x, a, b, base_output=before[:, 3 : 3 + n].clone(), layer_ranks=ranks,
                        layer_scalings=scalings)
    assert fused_calls == [16]
    assert_close(wide[:, 3 : 3 + n], want, atol, rtol, "fused (strided base output)")
    assert torch.equal(wide[:, :3], before[:, :3]) and torch.equal(wide[:, 3 + n :], before[:, 3 + n :])


@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "no_prefetch"])
@pytest.mark.parametrize("rank_block", [16, 32, 64], ids=lambda r: f"rank_block{r}")
@pytest.mark.parametrize("wait_first", [False, True], ids=["split_k", "timeout_fallback"])
def test_fused_launcher_split_k_column_blocks(wait_first, rank_block, prefetch, monkeypatch):
    """Small tiles: K in 5 splits (the last partial), several column blocks per module, more
    items than programs, ranks 1-64 stepped through in blocks of 16 or 32 rows or in one tile.
    ``wait_first`` hands out the expand items first, so every reader gives up waiting and
    recomputes its rows: still exact, counted, and the workspace still cleaned. ``prefetch``: the
    next rank block's tiles loaded before this block's dot, or after it."""
    import importlib

    from peft_fastlora.ops import lora_fused

    module = importlib.import_module("peft_fastlora.ops.lora_fused")
    config = module.fused_config
    monkeypatch.setattr(module, "fused_config", lambda *a, **k: dict(config(*a, **k), prefetch=prefetch))

    dtype, atol, rtol = TOLERANCES[0]
    seq_lens, wi = [1] * FUSED_BS, COMPOSITIONS["skewed"](FUSED_BS)
    tri, ref = make_backends(wi, seq_lens)
    bi, k = tri.batch_info, 300
    x, a, b, base, ranks, scalings = site_inputs("qkv", token_slots(wi, seq_lens), dtype, k=k)
    got = lora_fused(x, a, b, FUSED_SITES["qkv"], ranks, scalings, base.clone(),
                     bi.sorted_token_ids, bi.chunk_slot, bi.chunk_start, bi.chunk_len,
                     tri._workspace(CPU), block_m=bi.block_m, block_k=64, block_n=16,
                     num_programs=4, max_spin=1, wait_first=wait_first, rank_block=rank_block)
    want = ref.run_qkv_lora(x, a, b, output_offset=FUSED_SITES["qkv"], base_output=base.clone(),
                            layer_ranks=ranks, layer_scalings=scalings)
    assert_close(got, want, atol, rtol, "fused launcher")
    # one timeout per reader: 3 chunks (two of slot 3, one of slot 0, every module active) x 7
    # column blocks (3 + 2 + 2 for modules 40, 19 and 19 wide)
    assert_workspace_clean(tri, timeouts=3 * 7 if wait_first else 0)


def test_fused_static_buffers_more_adapters_than_at_capture(fused_calls):
    """Graph-style: the workspace is reserved with the static batch info (a capture allocates
    nothing), and a launch recorded for a 1-adapter batch serves a later 4-adapter batch."""
    dtype, atol, rtol = TOLERANCES[0]
    bs = 8
    tri = TritonLoRABackend(MAX_LORAS, CPU)
    tri.init_cuda_graph_batch_info(bs, 1)
    ws = tri._workspace(CPU)
    addresses = (ws.acc.data_ptr(), ws.sync.data_ptr())
    fb = ForwardBatch.from_shape(bs, 1, CPU)
    captured = tri.prepare_lora_batch(fb, [0] * bs, SLOT_RANKS, SLOT_SCALINGS, use_cuda_graph=True)
    tok = token_slots([0] * bs, [1] * bs)
    inputs = {site: site_inputs(site, tok, dtype) for site in ("linear", "qkv")}
    for site, (x, a, b, base, ranks, scalings) in inputs.items():  # the "capture"
        run_fused_site(tri, site, x, a, b, base.clone(), ranks, scalings, batch_info=captured)

    wi = [0, 1, 2, 3, NO_ADAPTER, 3, 2, 1]
    tri.prepare_lora_batch(fb, wi, SLOT_RANKS, SLOT_SCALINGS, use_cuda_graph=True)
    _, ref = make_backends(wi, [1] * bs)
    for site, (x, a, b, base, ranks, scalings) in inputs.items():
        base[token_slots(wi, [1] * bs) < 0] = 1234.5
        got = run_fused_site(tri, site, x, a, b, base.clone(), ranks, scalings, batch_info=captured)
        want = run_fused_site(ref, site, x, a, b, base.clone(), ranks, scalings)
        assert_close(got, want, atol, rtol, f"fused {site} replayed on refreshed static batch info")
    assert len(fused_calls) == 4
    assert (ws.acc.data_ptr(), ws.sync.data_ptr()) == addresses, "the workspace was reallocated"
    assert_workspace_clean(tri)


@pytest.mark.parametrize("case", ["fused_decode_off", "prefill_block_m32"])
def test_run_lora_two_kernel_paths(case, fused_calls):
    """Where the fused kernel does not apply, run_lora and the stacked calls take the shrink and
    expand kernels, with the same results."""
    dtype, atol, rtol = TOLERANCES[1]
    seq_lens = [1] * 6 if case == "fused_decode_off" else [150, 130]
    wi = [0, 3, NO_ADAPTER, 1, 3, 2][: len(seq_lens)]
    tri, ref = make_backends(wi, seq_lens)
    tri.fused_decode = case != "fused_decode_off"
    tok = token_slots(wi, seq_lens)
    for site in ("linear", "qkv"):
        x, a, b, base, ranks, scalings = site_inputs(site, tok, dtype)
        got = run_fused_site(tri, site, x, a, b, base.clone(), ranks, scalings)
        want = run_fused_site(ref, site, x, a, b, base.clone(), ranks, scalings)
        check_untouched(got, base, tok)
        assert_close(got, want, atol, rtol, f"{site} ({case})")
    assert fused_calls == []


def test_fused_launch_choice():
    """Mixed ranks: blocks of 16 rows, one tile live, a register cap; uniform ranks: blocks of 32
    with the next tile prefetched; padded rank 16: one tile either way; ``rank_block`` wins."""
    from peft_fastlora.ops import fused_config

    mixed = fused_config(64, 4096, [4096], torch.bfloat16, mixed_ranks=True)
    uniform = fused_config(64, 4096, [4096], torch.bfloat16)
    assert (mixed["r_sub"], mixed["prefetch"], mixed["max_registers"]) == (16, False, 128)
    assert (uniform["r_sub"], uniform["prefetch"], uniform["max_registers"]) == (32, True, None)
    assert mixed["block_k"] == 512 and uniform["block_k"] == 256
    for m in (True, False):
        small = fused_config(16, 4096, [4096], torch.bfloat16, mixed_ranks=m)
        assert (small["r_sub"], small["block_r"], small["prefetch"], small["max_registers"]) == (16, 16, True, None)
    assert fused_config(64, 4096, [4096], torch.bfloat16, rank_block=64, mixed_ranks=True)["r_sub"] == 64


def test_fused_workspace_is_sized_once_for_every_launch(fused_calls):
    """The fused kernel's workspace is sized at the first buffers for the most chunks any fused
    launch can plan. Decode buckets are captured first (small plans); an eager forward of a few
    hundred tokens over every adapter (a short prefill) then has many more chunks, and must not
    grow it: a grown-out buffer stays held for the graphs that captured it."""
    dtype, atol, rtol = TOLERANCES[0]
    tri = TritonLoRABackend(MAX_LORAS, CPU)
    tri.new_graph_buffers(4, 4, max_slots=NUM_SLOTS)  # a 4-row decode bucket
    ws = tri._workspace(CPU)
    acc, sync = ws.acc, ws.sync
    seq_lens = [17, 1, 30, 9, 60, 2, 33, 3, 41, 4, 2, 1]  # 203 tokens, every slot in several runs
    wi = [[0, 1, 2, 3, NO_ADAPTER][i % 5] for i in range(len(seq_lens))]
    ref = TorchNativeLoRABackend(MAX_LORAS, CPU)
    fb = ForwardBatch(len(seq_lens), seq_lens, ForwardMode.EXTEND, CPU)
    for b in (tri, ref):
        b.prepare_lora_batch(fb, wi, SLOT_RANKS, SLOT_SCALINGS, use_cuda_graph=False)
    chunks = int((tri.batch_info.chunk_len > 0).sum())
    assert tri.batch_info.block_m == 16 and chunks > 4  # more than the 4-row bucket's plans hold
    tok = token_slots(wi, seq_lens)
    x, a, b, base, ranks, scalings = site_inputs("linear", tok, dtype)
    got = run_fused_site(tri, "linear", x, a, b, base.clone(), ranks, scalings)
    want = run_fused_site(ref, "linear", x, a, b, base.clone(), ranks, scalings)
    assert fused_calls == [16]
    assert_close(got, want, atol, rtol, "fused linear, 203 tokens")
    assert ws.acc is acc and ws.sync is sync and not ws._retired, "the workspace grew"
    assert_workspace_clean(tri)


@pytest.mark.parametrize("rank_block", [0, -16, 16.0])
def test_a_bad_rank_block_is_refused(rank_block):
    with pytest.raises(ValueError, match="rank_block must be a positive int or None"):
        TritonLoRABackend(MAX_LORAS, CPU, rank_block=rank_block)
