"""``ops.step_inputs.advance_inputs`` against its torch ops (``advance_inputs_reference``), under
Triton's interpreter: boolean and additive masks of every float dtype, one and two masks, masks
with more rows than the counters (a bucket's padding rows) and strided views, int32 and int64
counters, none of either, the column clamped at the last one, rows over several of the program's
blocks, and buffers the kernel does not take (the torch ops then). Comparisons are exact."""

import pytest
import torch

from peft_fastlora.ops import step_inputs
from peft_fastlora.ops.step_inputs import advance_inputs, advance_inputs_reference, kernel_takes


def random_mask(rows, length, dtype, gen, device="cpu", wider=0):
    """A (rows, 1, 1, length) mask, some columns visible at random; ``wider``: a view of a wider buffer."""
    keep = torch.rand(rows, 1, 1, length + wider, generator=gen) < 0.5
    if dtype == torch.bool:
        full = keep
    else:
        full = torch.where(keep, 0.0, torch.finfo(dtype).min).to(dtype)
    return full.to(device)[..., :length]


def buffers(case, gen, device="cpu"):
    """(masks, counters, column, last_column) of one case: a dict of rows, length, dtypes, ..."""
    rows, length = case["rows"], case["length"]
    mask_rows = case.get("mask_rows", [rows] * len(case["masks"]))
    masks = [random_mask(n, length, d, gen, device, case.get("wider", 0)) for n, d in zip(mask_rows, case["masks"])]
    counters = []
    for kind in case["counters"]:
        if kind == "position_ids":
            counters.append(torch.randint(0, 1000, (rows, 1), generator=gen, dtype=torch.int64).to(device))
        elif kind == "position_ids_int32":
            counters.append(torch.randint(0, 1000, (rows, 1), generator=gen).to(torch.int32).to(device))
        else:  # cache_position
            counters.append(torch.randint(0, 1000, (1,), generator=gen, dtype=torch.int64).to(device))
    column = torch.tensor([case["column"]], dtype=torch.int64, device=device)
    return masks, counters, column, case.get("last", length - 1)


CASES = [
    dict(rows=1, length=7, masks=[torch.bool], counters=["position_ids", "cache_position"], column=3),
    dict(rows=5, length=33, masks=[torch.float32], counters=["position_ids", "cache_position"], column=0),
    dict(rows=3, length=9, masks=[torch.bfloat16], counters=["cache_position"], column=8),  # the last column
    dict(rows=4, length=9, masks=[torch.float16], counters=[], column=8, last=7),  # past the clamp
    dict(rows=6, length=20, masks=[torch.bool, torch.float32], counters=["position_ids_int32"], column=11),
    dict(rows=37, length=65, masks=[torch.bfloat16, torch.bfloat16], counters=["position_ids", "cache_position"],
         column=40, mask_rows=[48, 40]),  # padding rows in the masks (each its own count)
    dict(rows=9, length=17, masks=[torch.bool], counters=["position_ids"], column=5, wider=6),  # a view
    dict(rows=2, length=5, masks=[], counters=["position_ids", "cache_position"], column=1),
]


def check_case(case, device="cpu", seed=0, max_block=step_inputs.MAX_BLOCK):
    gen = torch.Generator().manual_seed(seed)
    masks, counters, column, last = buffers(case, gen, device)
    want = [t.clone() for t in masks], [t.clone() for t in counters], column.clone()
    assert kernel_takes(masks, counters, column)
    advance_inputs(masks, counters, column, last, max_block=max_block)
    advance_inputs_reference(*want, last)
    for got, ref in zip(masks + counters + [column], want[0] + want[1] + [want[2]]):
        assert got.dtype == ref.dtype and torch.equal(got, ref), (case, got, ref)
    return masks, counters, column


@pytest.mark.parametrize("case", CASES, ids=range(len(CASES)))
def test_equals_the_torch_ops(case):
    check_case(case)


def test_rows_over_several_blocks():
    check_case(dict(rows=37, length=12, masks=[torch.bool, torch.float32], counters=["position_ids", "cache_position"],
                    column=4, mask_rows=[50, 20]), max_block=16)


def test_repeated_steps_reach_the_clamp():
    """Six steps from two columns before the last: the column stops at the last and stays."""
    gen = torch.Generator().manual_seed(3)
    case = dict(rows=3, length=8, masks=[torch.float32], counters=["position_ids", "cache_position"], column=5)
    masks, counters, column, last = buffers(case, gen)
    want = [t.clone() for t in masks], [t.clone() for t in counters], column.clone()
    for _ in range(6):
        advance_inputs(masks, counters, column, last)
        advance_inputs_reference(*want, last)
    assert int(column) == last and torch.equal(masks[0], want[0][0])
    assert all(torch.equal(a, b) for a, b in zip(counters, want[1]))
    assert bool((masks[0][..., 5:] == 0).all())  # every column walked over is visible


def test_buffers_the_kernel_does_not_take_get_the_torch_ops():
    gen = torch.Generator().manual_seed(4)
    two_queries = torch.full((3, 1, 2, 6), -1.0)  # not one query a row
    masks = [random_mask(3, 6, torch.bool, gen) for _ in range(3)]  # three masks
    column = torch.tensor([2])
    assert not kernel_takes([two_queries], [], column)
    assert not kernel_takes(masks, [], column)
    assert not kernel_takes([], [torch.zeros(3, 2, dtype=torch.int64)], column)
    assert not kernel_takes([], [], torch.tensor([2], dtype=torch.int32))
    want = two_queries.clone()
    advance_inputs([two_queries], [], column, 5)
    assert bool((two_queries[..., 2] == 0).all())
    assert torch.equal(two_queries, want.index_fill_(-1, torch.tensor([2]), 0.0))
    assert int(column) == 3


def random_record(rows, width, column, gen, device="cpu", all_done=False):
    """A ``StepRecord`` of random tokens and flags (``all_done``: every row finished)."""
    unfinished = torch.zeros(rows, dtype=torch.int64) if all_done else (torch.rand(rows, generator=gen) < 0.3).long()
    return step_inputs.StepRecord(
        tokens=torch.randint(0, 50000, (rows,), generator=gen).to(device),
        history=torch.randint(-5, 0, (rows, width), generator=gen).to(device),
        column=torch.tensor([column], dtype=torch.int64, device=device),
        unfinished=unfinished.to(device),
        done=torch.tensor([not all_done], device=device))  # the opposite of the answer


def _clone_record(record):
    return step_inputs.StepRecord(*(t.clone() for t in record))


@pytest.mark.parametrize("rows,width,column,all_done,max_block", [
    (1, 6, 0, False, None), (5, 9, 4, True, None), (37, 40, 39, False, 16), (37, 40, 12, True, 16),
    (3, 4, 3, False, None),
])
def test_the_record_equals_the_torch_ops(rows, width, column, all_done, max_block):
    """The tokens land in the history's column (clamped at its last), the column moves on, and the
    done flag is ``unfinished.max() == 0``; the masks and counters move as without a record."""
    gen = torch.Generator().manual_seed(rows + column)
    case = dict(rows=rows, length=12, masks=[torch.bool], counters=["position_ids", "cache_position"], column=4,
                mask_rows=[rows + 3])
    masks, counters, mcol, last = buffers(case, gen)
    record = random_record(rows, width, column, gen, all_done=all_done)
    want = [t.clone() for t in masks], [t.clone() for t in counters], mcol.clone(), _clone_record(record)
    history_before = record.history.clone()
    assert kernel_takes(masks, counters, mcol, record)
    advance_inputs(masks, counters, mcol, last, record, max_block=max_block or step_inputs.MAX_BLOCK)
    advance_inputs_reference(*want[:3], last, want[3])
    for got, ref in zip(masks + counters + [mcol] + list(record), want[0] + want[1] + [want[2]] + list(want[3])):
        assert got.dtype == ref.dtype and torch.equal(got, ref), (got, ref)
    assert torch.equal(record.history[:, column], record.tokens)
    others = torch.arange(width) != column
    assert torch.equal(record.history[:, others], history_before[:, others])
    assert int(record.column) == min(column + 1, width - 1) and bool(record.done) == all_done


def test_a_bad_record_is_refused():
    gen = torch.Generator().manual_seed(9)
    rec = random_record(4, 6, 0, gen)
    column = torch.tensor([1])
    with pytest.raises(ValueError, match="int64"):
        advance_inputs([], [], column, 3, rec._replace(tokens=rec.tokens.int()))
    with pytest.raises(ValueError, match="rows"):
        advance_inputs([], [], column, 3, rec._replace(unfinished=rec.unfinished[:3]))
    for max_block in (0, 24, 16.0):
        with pytest.raises(ValueError, match="max_block must be a power of 2"):
            advance_inputs([], [], column, 3, rec, max_block=max_block)
