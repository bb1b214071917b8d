"""The greedy token selection on the GPU: ``ops.greedy_select`` against torch's own ops on CUDA
(a 128k vocabulary, every float dtype, NaN / infinities / ties, suppressed and stop ids, up to 200
rows, launches one after another on one workspace), then server-like traffic through
``generate`` with CUDA graphs: fastlora's greedy loop against transformers' loop (the same graphs,
``defer_stop_check=False``) and against PEFT. float32 models: tokens compare exactly."""

import pytest
import torch

import peft_fastlora as fastlora
from peft_fastlora.ops.greedy_select import EMPTY_KEY, greedy_select, greedy_select_reference, workspace_for

from _graphs import generate_model, random_calls

pytestmark = pytest.mark.gpu
VOCAB = 128256


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 32, 128, 200])
def test_kernel_equals_torch_on_cuda(dtype, rows):
    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, VOCAB, device="cuda", generator=g).to(dtype)
    x[0, VOCAB - 1] = 100.0  # the last column
    if rows > 1:
        x[1, 17], x[1, VOCAB // 2] = 100.0, 100.0  # a tie across programs: the first wins
    if rows > 2:
        x[2, 5], x[2, 70000] = float("nan"), float("nan")
    if rows > 3:
        x[3] = float("-inf")
    if rows > 4:
        x[4, 9], x[4, 4000] = float("inf"), float("inf")
    best = torch.argmax(x.float(), dim=-1)
    unfinished = (torch.arange(rows, device="cuda") % 3 != 1).long()
    pad = torch.tensor(7, device="cuda")
    stop = best[: min(rows, 5) : 2].clone()
    suppress = best[min(rows, 5) - 1 : min(rows, 5)].clone()
    for stop_ids, sup in ((None, None), (stop, None), (stop, suppress), (None, suppress)):
        un_k, un_r = unfinished.clone(), unfinished.clone()
        pad_arg = pad if stop_ids is not None else None
        ids = torch.full((rows, 3), -1, dtype=torch.long, device="cuda")
        got = greedy_select(x, ids[:, 1], un_k if stop_ids is not None else None, pad_arg, stop_ids, sup)
        want = greedy_select_reference(x, torch.empty_like(best), un_r, pad_arg, stop_ids, sup)
        assert torch.equal(got, want), (dtype, rows, (got != want).nonzero()[:5])
        assert torch.equal(un_k, un_r)
        assert (ids[:, 0] == -1).all() and (ids[:, 2] == -1).all()
    ws = workspace_for(x.device, rows)
    assert (ws.slots[:rows] == EMPTY_KEY).all() and (ws.tickets[:rows] == 0).all()


def test_many_launches_in_a_row_on_one_workspace():
    # no host sync between launches: each must find the slots the previous one reset
    xs = [torch.randn(r, VOCAB, device="cuda", dtype=torch.bfloat16) for r in (3, 64, 1, 64, 17) * 8]
    outs = [greedy_select(x, torch.empty(x.shape[0], dtype=torch.long, device="cuda")) for x in xs]
    for x, o in zip(xs, outs):
        assert torch.equal(o, torch.argmax(x.float(), dim=-1))


def test_random_traffic_fused_equals_transformers_loop_and_peft():
    """``random_calls``: the fused loop's tokens against transformers' loop over the same graphs,
    and a sample of calls against PEFT."""
    model = generate_model(n_adapters=8)
    calls = random_calls(model)
    results = {}
    for fused in (True, False):  # off: the stop check read every step, transformers' loop
        fastlora.patch(model, defer_stop_check=fused)
        try:
            results[fused] = ([model.generate(**kw, adapter_names=names) for names, kw in calls],
                              dict(fastlora.get_state(model).graph_runner.stats))
        finally:
            fastlora.unpatch(model)
    (on, stats_on), (off, stats_off) = results[True], results[False]
    for i, (a, b) in enumerate(zip(on, off)):
        assert torch.equal(a, b), (i, calls[i][1])
    for i in range(0, len(calls), 5):  # PEFT itself on a sample (its mixed path is slow)
        names, kw = calls[i]
        assert torch.equal(on[i], model.generate(**kw, adapter_names=names)), i
    assert stats_on["fused_selection_calls"] == len(calls), stats_on
    assert stats_off["fused_selection_calls"] == 0, stats_off
    assert stats_on["eager_steps"] == 0 and stats_on["steps_undone"] >= 2, stats_on  # calls 3 and 11 at least
    # off: the stop check is read every step, so no step is ever run past a finished batch
    assert stats_off["deferred_stop_calls"] == 0 and stats_off["steps_undone"] == 0, stats_off
