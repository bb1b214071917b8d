"""Batch info: the host-side chunk plan, the in-place device buffers, ``prepare_lora_batch``, and
the input checks every backend call makes against the batch info (``TorchNativeLoRABackend``).

No model here: these are the tables every backend reads, checked against their documented
invariants (``batch.LoRABatchInfo``) on hand-made and random batches.
"""

from __future__ import annotations

import random

import pytest
import torch

from peft_fastlora.backend.torch_native import TorchNativeLoRABackend
from peft_fastlora.batch import (
    NO_ADAPTER,
    BatchInfoBuffers,
    ForwardBatch,
    ForwardMode,
    choose_block_m,
    max_chunks_for,
    plan_chunks,
)

CPU = torch.device("cpu")


def check_plan(weight_indices, seg_lens, block_m):
    """Assert every invariant of ``plan_chunks``; returns the plan."""
    *arrays, slots = plan_chunks(weight_indices, seg_lens, block_m)
    token_slot, sorted_ids, c_slot, c_start, c_len = (a.tolist() for a in arrays)
    # token_slot: the row's slot repeated over the row's tokens, in row order
    expected = [w for w, n in zip(weight_indices, seg_lens) for _ in range(n)]
    assert token_slot == expected
    adapter_tokens = [t for t, s in enumerate(token_slot) if s != NO_ADAPTER]
    # every adapter token exactly once, base tokens in none
    assert sorted(sorted_ids) == adapter_tokens
    assert len(set(sorted_ids)) == len(sorted_ids)
    covered = []
    for slot, start, n in zip(c_slot, c_start, c_len):
        assert 0 < n <= block_m, (slot, start, n)
        toks = sorted_ids[start : start + n]
        assert all(token_slot[t] == slot for t in toks), f"chunk of slot {slot} mixes slots: {toks}"
        covered.extend(toks)
    assert sorted(covered) == adapter_tokens, "chunks must cover every adapter token exactly once"
    assert len(covered) == len(set(covered))
    # chunks of one slot are contiguous in sorted_ids and slots ascend
    assert c_slot == sorted(c_slot)
    assert slots == tuple(sorted({w for w in weight_indices if w != NO_ADAPTER}))
    # within a slot, tokens keep their original order (deterministic plan)
    for s in slots:
        mine = [t for t in sorted_ids if token_slot[t] == s]
        assert mine == sorted(mine)
    return token_slot, sorted_ids, c_slot, c_start, c_len, slots


def test_plan_chunks_hand_made():
    # rows: slot 1 (3 tokens), base (2), slot 0 (5), slot 1 (4); block_m 4
    _, sorted_ids, c_slot, c_start, c_len, slots = check_plan([1, -1, 0, 1], [3, 2, 5, 4], 4)
    assert slots == (0, 1)
    assert sorted_ids == [5, 6, 7, 8, 9, 0, 1, 2, 10, 11, 12, 13]
    assert c_slot == [0, 0, 1, 1]
    assert c_start == [0, 4, 5, 9]
    assert c_len == [4, 1, 4, 3]


def test_plan_chunks_all_base_and_empty():
    token_slot, sorted_ids, c_slot, c_start, c_len, slots = check_plan([-1, -1], [3, 1], 16)
    assert token_slot == [-1] * 4
    assert (sorted_ids, c_slot, c_start, c_len, slots) == ([], [], [], [], ())
    assert check_plan([], [], 16)[0] == []


@pytest.mark.parametrize("seed", range(30))
def test_plan_chunks_random(seed):
    rng = random.Random(seed)
    bs = rng.randint(1, 24)
    n_slots = rng.randint(1, 6)
    block_m = rng.choice([1, 2, 4, 16])
    weight_indices = [rng.randint(-1, n_slots - 1) for _ in range(bs)]
    seg_lens = [rng.choice([0, 1, 1, 3, 7, 20]) for _ in range(bs)]
    _, _, c_slot, _, _, slots = check_plan(weight_indices, seg_lens, block_m)
    assert len(c_slot) <= max_chunks_for(sum(seg_lens), block_m, max(len(slots), 1))


def plan_by_rows(weight_indices, seg_lens, block_m):
    """The plan built row by row in Python (the reference for the vectorized one)."""
    token_slot, by_slot, t = [], {}, 0
    for slot, n in zip(weight_indices, seg_lens):
        token_slot.extend([slot] * n)
        if slot != NO_ADAPTER:
            by_slot.setdefault(slot, []).extend(range(t, t + n))
        t += n
    sorted_ids, c_slot, c_start, c_len = [], [], [], []
    for slot in sorted(by_slot):
        toks, first = by_slot[slot], len(sorted_ids)
        sorted_ids.extend(toks)
        for off in range(0, len(toks), block_m):
            c_slot.append(slot)
            c_start.append(first + off)
            c_len.append(min(block_m, len(toks) - off))
    return token_slot, sorted_ids, c_slot, c_start, c_len, tuple(sorted(by_slot))


@pytest.mark.parametrize("seed", range(12))
def test_plan_chunks_equals_the_row_by_row_plan(seed):
    """Engine-sized steps (hundreds of rows, prefill chunks among decode rows, rows of no tokens)."""
    rng = random.Random(100 + seed)
    bs = rng.randint(1, 600)
    weight_indices = [rng.randint(-1, 31) for _ in range(bs)]
    seg_lens = [rng.choice([1] * 8 + [0, 2, 37, 300]) for _ in range(bs)]
    block_m = rng.choice([16, 32, 64])
    *arrays, slots = plan_chunks(weight_indices, seg_lens, block_m)
    assert [a.tolist() for a in arrays] + [slots] == list(plan_by_rows(weight_indices, seg_lens, block_m))


def test_max_chunks_bound_is_tight():
    # every slot leaves a partial chunk: ceil(tokens / block_m) + slots is reached, not exceeded
    block_m, n_slots = 4, 5
    weight_indices = list(range(n_slots))
    seg_lens = [block_m + 1] * n_slots  # 5 tokens per slot -> 2 chunks each
    _, _, c_slot, _, _, _ = check_plan(weight_indices, seg_lens, block_m)
    bound = max_chunks_for(sum(seg_lens), block_m, n_slots)
    assert len(c_slot) == 2 * n_slots <= bound
    # the worst case: one token per slot
    _, _, c_slot, _, _, _ = check_plan(list(range(8)), [1] * 8, 16)
    assert len(c_slot) == 8 <= max_chunks_for(8, 16, 8)


def test_choose_block_m_and_forward_batch():
    assert choose_block_m(1) == 16 and choose_block_m(256) == 16
    assert choose_block_m(257) == 32 and choose_block_m(2048) == 32 and choose_block_m(2049) == 64
    fb = ForwardBatch.from_shape(3, 1, "cpu")
    assert fb.forward_mode is ForwardMode.DECODE and fb.num_tokens == 3 and list(fb.seq_lens) == [1, 1, 1]
    fb = ForwardBatch.from_shape(2, 5, "cpu")
    assert fb.forward_mode is ForwardMode.EXTEND and fb.num_tokens == 10


# ---- BatchInfoBuffers -------------------------------------------------------------------------
def _buffers(**kw):
    args = dict(max_bs=8, max_tokens=32, max_slots=6, max_loras=4, block_m=4, device=CPU)
    args.update(kw)
    return BatchInfoBuffers(**args)


def test_buffers_refresh_in_place():
    buf = _buffers()
    bi1 = buf.fill(4, 12, [3, 3, 3, 3], [0, 1, -1, 0], [2, 4, 0, 0], [0.5, 2.0, 0.0, 0.0])
    ptrs = {f: getattr(bi1, f).data_ptr() for f in
            ("seg_lens", "seg_indptr", "weight_indices", "lora_ranks", "scalings", "token_slot",
             "sorted_token_ids", "chunk_slot", "chunk_start", "chunk_len")}
    snapshot = bi1.chunk_slot.clone()
    assert bi1.seg_indptr.tolist() == [0, 3, 6, 9, 12]
    assert bi1.weight_indices.tolist() == [0, 1, -1, 0]
    assert bi1.lora_ranks.tolist() == [2, 4, 0, 0]
    assert bi1.scalings.tolist() == [0.5, 2.0, 0.0, 0.0]
    assert bi1.token_slot.tolist() == [0] * 3 + [1] * 3 + [-1] * 3 + [0] * 3
    assert bi1.slots_in_batch == (0, 1)
    # the chunk arrays are cut to what 12 tokens can take; the buffers hold what 32 can
    assert bi1.max_chunks == bi1.chunk_slot.numel() == max_chunks_for(12, 4, 4) == 6 < buf.max_chunks

    # a second, different fill: same addresses, new contents, nothing left over from the first
    bi2 = buf.fill(2, 2, [1, 1], [3, -1], [1, 1, 1, 8], [1.0, 1.0, 1.0, 3.0])
    for f, p in ptrs.items():
        assert getattr(bi2, f).data_ptr() == p, f"{f} was reallocated"
    assert not torch.equal(bi2.chunk_slot, snapshot)
    assert bi2.chunk_slot.tolist() == [3, NO_ADAPTER] and bi2.chunk_len.tolist() == [1, 0]
    # beyond the cut too: a grid captured at a larger token count reads only unused chunks there
    assert buf._view(buf.dev, "chunk_slot").tolist() == [3] + [NO_ADAPTER] * (buf.max_chunks - 1)
    assert buf._view(buf.dev, "chunk_len").tolist() == [1] + [0] * (buf.max_chunks - 1)
    assert bi2.weight_indices.tolist() == [3, -1]
    assert bi2.scalings.tolist() == [1.0, 1.0, 1.0, 3.0]
    # the whole token table beyond this batch is "no adapter" (padded graph tokens cost nothing)
    full = buf._view(buf.dev, "token_slot")
    assert full.tolist() == [3, -1] + [NO_ADAPTER] * (buf.max_tokens - 2)


def test_buffers_skip_a_refill_of_the_batch_they_hold(monkeypatch):
    """A decode call refills the same batch at every step: the second fill writes nothing (the device
    buffers already hold it); a different batch, then the first again, are written."""
    buf = _buffers()
    first = (4, 4, [1, 1, 1, 1], [0, 1, -1, 0], [2, 4, 0, 0], [0.5, 2.0, 0.0, 0.0])
    other = (2, 2, [1, 1], [3, -1], [1, 1, 1, 8], [1.0, 1.0, 1.0, 3.0])
    copies = []
    dev_copy = type(buf.dev).copy_
    monkeypatch.setattr(type(buf.dev), "copy_", lambda t, *a, **k: copies.append(t) or dev_copy(t, *a, **k))
    bi1 = buf.fill(*first)
    want = bi1.chunk_slot.tolist(), bi1.weight_indices.tolist(), bi1.scalings.tolist()
    n = len(copies)
    assert buf.fill(*first) is bi1 and len(copies) == n  # nothing written
    buf.fill(*first[:5], [0.5, 2.0, 0.0, 1.0])  # another scaling is another batch
    assert len(copies) > n and bi1.scalings.tolist() == [0.5, 2.0, 0.0, 1.0]
    buf.fill(*other)
    again = buf.fill(*first)
    assert (again.chunk_slot.tolist(), again.weight_indices.tolist(), again.scalings.tolist()) == want


def test_buffers_capacity_errors():
    buf = _buffers()
    with pytest.raises(ValueError, match="exceeds the buffers"):
        buf.fill(9, 9, [1] * 9, [0] * 9, [1], [1.0])
    with pytest.raises(ValueError, match="exceeds the buffers"):
        buf.fill(2, 40, [20, 20], [0, 0], [1], [1.0])
    with pytest.raises(ValueError, match="slots exceed"):
        buf.fill(1, 1, [1], [0], [1] * 7, [1.0] * 7)


@pytest.mark.parametrize("block_m", [1, 4, 16])
@pytest.mark.parametrize("max_loras", [1, 3, 8])
def test_max_chunks_for_bounds_every_plan_and_is_reached(block_m, max_loras):
    """No plan of n tokens over at most max_loras adapters has more chunks than the bound, and
    one plan (every adapter but one with a single token) has exactly that many."""
    rng = random.Random(block_m * 10 + max_loras)
    for n in range(0, 70):
        bound = max_chunks_for(n, block_m, max_loras)
        for _ in range(30):
            slots = [rng.randrange(-1, max_loras) for _ in range(n)]
            assert len(plan_chunks(slots, [1] * n, block_m)[2]) <= bound, (n, slots)
        k = min(n, max_loras)
        worst = list(range(k - 1)) + [k - 1] * (n - k + 1) if k else []
        assert len(plan_chunks(worst, [1] * n, block_m)[2]) == bound, (n, k)


def test_buffers_max_chunks_guard():
    # max_loras=1 but two slots with partial chunks: more chunks than the grid covers
    buf = _buffers(max_tokens=4, max_loras=1)
    assert buf.max_chunks == 1
    buf.fill(2, 2, [1, 1], [0, 0], [1, 1], [1.0, 1.0])  # one slot: fine
    with pytest.raises(ValueError, match="max_loras_per_batch"):
        buf.fill(3, 3, [1, 1, 1], [0, 1, 2], [1, 1, 1], [1.0] * 3)


# ---- prepare_lora_batch -------------------------------------------------------------------------
def test_prepare_lora_batch_builds_the_plan():
    be = TorchNativeLoRABackend(4, CPU)
    fb = ForwardBatch.from_shape(3, 2, CPU)
    bi = be.prepare_lora_batch(fb, [1, -1, 1], [4, 2], [1.0, 0.5], use_cuda_graph=False)
    assert be.batch_info is bi
    assert bi.bs == 3 and bi.num_tokens == 6
    assert bi.token_slot.tolist() == [1, 1, -1, -1, 1, 1]
    n = int((bi.chunk_len > 0).sum())
    assert bi.chunk_slot[:n].tolist() == [1]
    assert bi.sorted_token_ids[: int(bi.chunk_len[0])].tolist() == [0, 1, 4, 5]
    assert bi.slots_in_batch == (1,)


def test_prepare_lora_batch_reuses_eager_buffers():
    be = TorchNativeLoRABackend(4, CPU)
    bi1 = be.prepare_lora_batch(ForwardBatch.from_shape(4, 1, CPU), [0, 1, 0, -1], [2, 2], [1.0, 1.0], False)
    p = bi1.token_slot.data_ptr()
    bi2 = be.prepare_lora_batch(ForwardBatch.from_shape(3, 1, CPU), [1, 1, 0], [2, 2], [1.0, 1.0], False)
    assert bi2.token_slot.data_ptr() == p  # decode steps refresh the same buffers
    assert bi2.token_slot.tolist() == [1, 1, 0]
    # a larger batch gets larger buffers, with the right contents
    bi3 = be.prepare_lora_batch(ForwardBatch.from_shape(40, 1, CPU), [0] * 40, [2, 2], [1.0, 1.0], False)
    assert bi3.token_slot.tolist() == [0] * 40


def _eager_bytes(be):
    return sum(b.dev.numel() * 4 + b.dev_scalings.numel() * 4 for b in be._eager_buffers.values())


def test_eager_buffers_stop_growing_after_the_largest_call():
    """Each row tile has its own buffers; after the largest forward, a forward of a tile not seen
    yet must not allocate (a server's memory would creep up with every new shape otherwise)."""
    be = TorchNativeLoRABackend(4, CPU)
    slots, scal = [2, 2, 2], [1.0] * 3
    be.prepare_lora_batch(ForwardBatch.from_shape(39, 119, CPU), [0, 1, 2] * 13, slots, scal, False)
    high = _eager_bytes(be)
    ptrs = {b: buf.dev.data_ptr() for b, buf in be._eager_buffers.items()}
    for rows, length in [(1, 1), (3, 50), (12, 100), (30, 60), (39, 119), (7, 300), (2, 1)]:
        bi = be.prepare_lora_batch(ForwardBatch.from_shape(rows, length, CPU), [r % 3 for r in range(rows)],
                                   slots, scal, False)
        assert bi.block_m == choose_block_m(rows * length)
        assert bi.token_slot.tolist() == [(t // length) % 3 for t in range(rows * length)]
    assert _eager_bytes(be) == high
    assert {b: buf.dev.data_ptr() for b, buf in be._eager_buffers.items()} == ptrs


@pytest.mark.parametrize("case, exc, match", [
    ("rows", ValueError, "weight_indices has 2 entries for a batch of 3 rows"),
    ("ranks_vs_scalings", ValueError, "lora_ranks .* and scalings"),
    ("slot_too_big", ValueError, "weight index 2 is not a slot"),
    ("slot_negative", ValueError, "weight index -2 is not a slot"),
    ("too_many", ValueError, "3 distinct adapters in one batch exceed max_loras_per_batch=2"),
    ("graph_without_init", RuntimeError, "init_cuda_graph_batch_info"),
    ("seq_lens_rows", ValueError, "seq_lens has 2 entries for a batch of 3 rows"),
    ("seq_lens_negative", ValueError, r"negative token count \(-1\)"),
])
def test_prepare_lora_batch_validation(case, exc, match):
    be = TorchNativeLoRABackend(2, CPU)
    fb = ForwardBatch.from_shape(3, 1, CPU)
    args = dict(weight_indices=[0, 1, -1], lora_ranks=[2, 2], scalings=[1.0, 1.0], use_cuda_graph=False)
    if case == "rows":
        args["weight_indices"] = [0, 1]
    elif case == "ranks_vs_scalings":
        args["scalings"] = [1.0]
    elif case == "slot_too_big":
        args["weight_indices"] = [0, 2, -1]
    elif case == "slot_negative":
        args["weight_indices"] = [0, -2, -1]
    elif case == "too_many":
        args.update(weight_indices=[0, 1, 2], lora_ranks=[1, 1, 1], scalings=[1.0] * 3)
    elif case == "graph_without_init":
        args["use_cuda_graph"] = True
    elif case == "seq_lens_rows":
        fb = ForwardBatch(3, [1, 1], ForwardMode.EXTEND, CPU)
    elif case == "seq_lens_negative":
        fb = ForwardBatch(3, [2, -1, 3], ForwardMode.EXTEND, CPU)
    with pytest.raises(exc, match=match):
        be.prepare_lora_batch(fb, **args)


def test_graph_buffers_keep_their_addresses():
    be = TorchNativeLoRABackend(4, CPU)
    bufs = be.init_cuda_graph_batch_info(max_bs_in_cuda_graph=8, num_tokens_per_bs=1)
    bi1 = be.prepare_lora_batch(ForwardBatch.from_shape(8, 1, CPU), [0] * 8, [2, 2, 2], [1.0] * 3, True)
    bi2 = be.prepare_lora_batch(ForwardBatch.from_shape(5, 1, CPU), [2, 1, 0, -1, 2], [2, 2, 2], [1.0] * 3, True)
    assert bi1.sorted_token_ids.data_ptr() == bi2.sorted_token_ids.data_ptr() == bufs.dev.data_ptr() + \
        bufs._offsets["sorted_token_ids"][0] * 4
    # grid size follows the token count, not the mix: later mixes with more adapters still fit
    assert bi1.max_chunks == max_chunks_for(8, bufs.block_m, 4)
    assert bi2.max_chunks == bi2.chunk_slot.numel() == max_chunks_for(5, bufs.block_m, 4)
    assert bi2.slots_in_batch == (0, 1, 2)
    assert bi2.token_slot.tolist() == [2, 1, 0, -1, 2]


# ---- the backend contract's input checks ----------------------------------------------------------
def _contract_setup():
    be = TorchNativeLoRABackend(4, torch.device("cpu"))
    fb = ForwardBatch.from_shape(2, 3, "cpu")  # 6 tokens
    bi = be.prepare_lora_batch(fb, [0, 1], [2, 2], [1.0, 1.0], use_cuda_graph=False)
    x = torch.randn(6, 16)
    a = torch.randn(2, 3 * 2, 16)
    b = torch.randn(2, 8 + 4 + 4, 2)
    return be, bi, x, a, b


@pytest.mark.parametrize("case, exc, match", [
    ("x_float64", TypeError, "x has unsupported dtype torch.float64"),
    ("weights_dtype", TypeError, "weights must be torch.float32, got torch.float16"),
    ("x_not_contiguous", ValueError, "x must be contiguous"),
    ("weights_not_contiguous", ValueError, "weights must be contiguous"),
    ("x_3d", ValueError, "x must have 2 dimensions"),
    ("input_dim", ValueError, "x has input_dim 12, lora A weights 16"),
    ("tokens", ValueError, "input has 5 tokens but the batch info describes 6"),
    ("offsets_len", ValueError, "output_offset needs 4 entries"),
    ("offsets_end", ValueError, "output offsets end at 20, lora B has 16 rows"),
    ("base_output_shape", ValueError, r"base_output must be \(6, 16\)"),
    ("base_output_stride", ValueError, "unit stride"),
    ("ranks_dtype", ValueError, "layer_ranks must be a contiguous"),
    ("stack_num", ValueError, "not a multiple of stack_num=4"),
    ("gate_up_odd", ValueError, "odd output dim"),
])
def test_backend_contract_errors(case, exc, match):
    be, bi, x, a, b = _contract_setup()
    offsets = [0, 8, 12, 16]
    kw = dict(output_offset=offsets, batch_info=bi)
    if case == "x_float64":
        x, a, b = x.double(), a.double(), b.double()
    elif case == "weights_dtype":
        a = a.half()
    elif case == "x_not_contiguous":
        x = torch.randn(16, 6).t()
    elif case == "weights_not_contiguous":
        a = torch.randn(2, 16, 6).transpose(1, 2)
    elif case == "x_3d":
        x = x.view(2, 3, 16)
    elif case == "input_dim":
        x = torch.randn(6, 12)
    elif case == "tokens":
        x = torch.randn(5, 16)
    elif case == "offsets_len":
        kw["output_offset"] = [0, 8, 16]
    elif case == "offsets_end":
        kw["output_offset"] = [0, 8, 14, 20]
    elif case == "base_output_shape":
        kw["base_output"] = torch.zeros(6, 15)
    elif case == "base_output_stride":
        kw["base_output"] = torch.zeros(16, 6).t()
    elif case == "ranks_dtype":
        kw["layer_ranks"] = torch.full((2, 3), 2, dtype=torch.int64)
    with pytest.raises(exc, match=match):
        if case == "stack_num":
            be.run_lora_a_sgemm(x, torch.randn(2, 6, 16), stack_num=4, batch_info=bi)
        elif case == "gate_up_odd":
            be.run_gate_up_lora(x, torch.randn(2, 4, 16), torch.randn(2, 7, 2), batch_info=bi)
        else:
            be.run_qkv_lora(x, a, b, **kw)
    # the same call with valid arguments works (the error came from the argument, not the setup)
    be, bi, x, a, b = _contract_setup()
    out = be.run_qkv_lora(x, a, b, output_offset=offsets, batch_info=bi)
    assert out.shape == (6, 16)
