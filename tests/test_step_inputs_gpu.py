"""``ops.step_inputs.advance_inputs`` on the GPU: every CPU case with fresh random buffers, and the
launch captured in a CUDA graph and replayed step after step (as ``decode.step_advance`` runs it)
equal to the torch ops run as many times."""

import pytest
import torch

from _graphs import captured
from peft_fastlora.ops.step_inputs import advance_inputs, advance_inputs_reference
from test_step_inputs import CASES, buffers, check_case

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
