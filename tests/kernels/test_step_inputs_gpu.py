"""``ops.step_inputs.advance_inputs`` on the GPU: every CPU case with fresh random buffers, and the
launch captured in a CUDA graph and replayed step after step (as ``decode.step_advance`` runs it)
equal to the torch ops run as many times."""

import pytest
import torch

from _graphs import captured
from peft_fastlora.ops.step_inputs import advance_inputs, advance_inputs_reference
from test_step_inputs import CASES, _clone_record, buffers, check_case, random_record

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("case", CASES, ids=range(len(CASES)))
def test_equals_the_torch_ops(case, seed):
    check_case(case, "cuda", seed)


def test_rows_of_a_large_bucket():
    check_case(dict(rows=300, length=520, masks=[torch.bfloat16], counters=["position_ids", "cache_position"],
                    column=260, mask_rows=[512]), "cuda")


def test_captured_and_replayed_step_after_step():
    gen = torch.Generator().manual_seed(9)
    case = dict(rows=24, length=40, masks=[torch.bool, torch.bfloat16], counters=["position_ids", "cache_position"],
                column=30, mask_rows=[32, 32])
    masks, counters, column, last = buffers(case, gen, "cuda")
    want = [t.clone() for t in masks], [t.clone() for t in counters], column.clone()
    saved = [t.clone() for t in masks + counters + [column]]

    def reset():
        for t, s in zip(masks + counters + [column], saved):
            t.copy_(s)

    graph, _ = captured(lambda: advance_inputs(masks, counters, column, last), reset=reset)
    reset()  # capture does not run the work; be sure
    for step in range(12):  # past the last column: the clamp holds it there
        graph.replay()
        advance_inputs_reference(*want, last)
        torch.cuda.synchronize()
        for got, ref in zip(masks + counters + [column], want[0] + want[1] + [want[2]]):
            assert torch.equal(got, ref), step
    assert int(column) == last


def test_the_record_captured_and_replayed_with_new_tokens_and_flags():
    """A ``StepRecord`` in the captured launch: each replay's tokens (new every step) land in the
    history's next column and the done flag follows ``unfinished`` as rows finish, up to all."""
    gen = torch.Generator().manual_seed(11)
    case = dict(rows=96, length=30, masks=[torch.bool], counters=["position_ids", "cache_position"], column=3,
                mask_rows=[96])
    masks, counters, column, last = buffers(case, gen, "cuda")
    record = random_record(96, 33, 5, gen, "cuda")
    record.unfinished.fill_(1)
    want = [t.clone() for t in masks], [t.clone() for t in counters], column.clone(), _clone_record(record)
    graph, _ = captured(lambda: advance_inputs(masks, counters, column, last, record))
    for t, w in zip(masks + counters + [column] + list(record), want[0] + want[1] + [want[2]] + list(want[3])):
        t.copy_(w)  # the capture's warm-up ran the work: start again from the same state
    for step in range(31):  # past the history's last column: the clamp holds it there
        new = torch.randint(0, 128256, (96,), device="cuda")
        record.tokens.copy_(new)
        want[3].tokens.copy_(new)
        finished = torch.arange(96, device="cuda") < 4 * (step + 1)  # rows finish a few at a time
        for rec in (record, want[3]):
            rec.unfinished.masked_fill_(finished, 0)
        graph.replay()
        advance_inputs_reference(*want[:3], last, want[3])
        torch.cuda.synchronize()
        for got, ref in zip(list(record) + masks + counters, list(want[3]) + want[0] + want[1]):
            assert torch.equal(got, ref), step
        assert bool(record.done) == bool(finished.all()), step
    assert int(record.column) == 32
