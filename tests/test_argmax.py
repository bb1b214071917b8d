"""``ops.argmax``: torch.argmax's answer over a row's chunks (Triton's interpreter on CPU;
``test_argmax_gpu.py`` runs it on the GPU), and the decode loop's copy that calls it."""

import pytest
import torch

import peft_fastlora as fastlora
import peft_fastlora.ops.argmax as argmax_ops
from peft_fastlora.decode import deferred_stop
from peft_fastlora.ops.argmax import MIN_COLS, argmax_rows, takes

from _helpers import count_calls


def _hard_rows(rows, cols, dtype, seed=0):
    """Random rows, then the cases torch's rules decide: a maximum repeated in another chunk and in
    the same chunk, NaNs (two in one row), a row of -inf, +inf twice, -0.0 against 0.0."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g).to(dtype)
    top = x.float().max().item() + 1
    x[0, [cols - 1, 7, 4100]] = top  # the first of three equal maxima, in two chunks
    if rows > 1:
        x[1, [cols // 2, 3]] = float("nan")
    if rows > 2:
        x[2] = float("-inf")
    if rows > 3:
        x[3, [9000, 12]] = float("inf")
    if rows > 4:
        x[4] = -1.0
        x[4, [5000, 200]] = torch.tensor([0.0, -0.0], dtype=dtype)  # equal: the first column wins
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,cols", [(1, MIN_COLS), (5, MIN_COLS + 1), (6, 50257), (2, 128256)])
def test_equals_torch_argmax(dtype, rows, cols):
    x = _hard_rows(rows, cols, dtype, seed=rows)
    got = argmax_rows(x)
    assert got.dtype == torch.int64 and torch.equal(got, torch.argmax(x, dim=-1))


def test_row_stride_and_random_rows():
    """Rows one stride apart (a slice of wider logits, as ``logits[:, -1]`` of a step is), and many
    random rows with low-resolution values (bf16 ties are common)."""
    wide = torch.randn(4, 3, MIN_COLS + 100)
    x = wide[:, -1, : MIN_COLS + 37]
    assert torch.equal(argmax_rows(x), torch.argmax(x, dim=-1))
    x = torch.randint(-3, 4, (16, MIN_COLS + 5)).to(torch.bfloat16)  # many equal maxima a row
    assert torch.equal(argmax_rows(x), torch.argmax(x, dim=-1))


def test_what_it_takes():
    x = torch.randn(2, MIN_COLS)
    assert takes(x, -1, False) and takes(x, 1, False)
    for args in ((x, 0, False), (x, None, False), (x, -1, True), (x.double(), -1, False), (x[:, :-1], -1, False),
                 (x.T.contiguous().T, -1, False), (x[0], -1, False), (x[:0], -1, False),
                 (x.clone().requires_grad_(), -1, False), (torch.ones(2, MIN_COLS, dtype=torch.long), -1, False)):
        assert not takes(*args)
    with pytest.raises(ValueError, match="argmax_rows takes"):
        argmax_rows(x.double())


def test_the_loops_torch_forwards_other_names_and_other_argmax_calls():
    shim = deferred_stop._TORCH
    assert shim.cat is torch.cat and shim.float32 is torch.float32 and shim.Tensor is torch.Tensor
    x = torch.randn(3, 40)  # too narrow for the kernel: torch's own
    assert torch.equal(shim.argmax(x, dim=-1), torch.argmax(x, dim=-1))
    assert torch.equal(shim.argmax(x), torch.argmax(x))
    assert torch.equal(shim.argmax(x, 0, True), torch.argmax(x, 0, True))


def test_greedy_graphed_call_chooses_tokens_through_the_kernel(monkeypatch):
    """A graphed greedy call whose stop check is deferred takes each step's token through the
    kernel (its column limit lowered to the tiny vocabulary) and gives PEFT's tokens; with
    ``FAST_ARGMAX`` off, torch's argmax and the same tokens."""
    from _models import tiny_peft_llama
    from test_deferred_stop import _DoneEvent, _inputs

    monkeypatch.setattr(deferred_stop, "DEVICE_TYPES", {"cuda", "cpu"})
    monkeypatch.setattr(torch, "Event", _DoneEvent)
    monkeypatch.setattr(argmax_ops, "MIN_COLS", 16)
    model = tiny_peft_llama()
    kw, names = _inputs(), ["a", "__base__", "b", "a"]
    ref = model.generate(**kw, adapter_names=names)
    for on in (True, False):
        monkeypatch.setattr(deferred_stop, "FAST_ARGMAX", on)
        calls = count_calls(monkeypatch, argmax_ops, ["argmax_rows"])
        with fastlora.patched(model, cuda_graphs="emulate") as report:
            out = model.generate(**kw, adapter_names=names)
            assert report.stop_check == "deferred"
        assert torch.equal(out, ref)
        assert (calls["argmax_rows"] == kw["max_new_tokens"]) if on else calls["argmax_rows"] == 0, calls
