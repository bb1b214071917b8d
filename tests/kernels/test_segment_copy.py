"""``ops.segment_copy``: runs of one source buffer into contiguous blocks of several destination
tensors, against plain slicing. A copy is exact: every dtype is compared bit for bit. On CPU under
Triton's interpreter (conftest), and on the GPU with large runs."""

import random

import pytest
import torch

pytest.importorskip("triton")

from peft_fastlora.ops.segment_copy import SEGMENT_BLOCK, segment_copy  # noqa: E402

DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


def _case(device, dtype, lengths, seed, n_dst=3, gap=5):
    """A random source and destinations of sentinel values; each run a random place in the source
    and the next free place (after a gap the copy must not write) in a random destination."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    src = torch.randn(sum(lengths) + 100, generator=g).to(dtype).to(device)
    sizes = [sum(lengths) + gap * (len(lengths) + 1)] * n_dst
    dsts = [torch.full((n,), -7.0, dtype=dtype, device=device) for n in sizes]
    want = [d.clone() for d in dsts]
    segments, at = [], [gap] * n_dst
    for n in lengths:
        d = rng.randrange(n_dst)
        s = rng.randrange(0, src.numel() - n + 1)
        segments += (dsts[d][at[d]:].data_ptr(), s, n)
        want[d][at[d]: at[d] + n] = src[s: s + n]
        at[d] += n + gap
    return src, dsts, want, segments


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_runs_land_in_place_and_nowhere_else(device, dtype):
    """Odd lengths around the kernel's step (1, a step less one, a step, a step and one, several),
    a run of length 0, more runs than destinations; the gaps between runs keep their values."""
    lengths = [1, SEGMENT_BLOCK - 1, SEGMENT_BLOCK, SEGMENT_BLOCK + 1, 0, 3 * SEGMENT_BLOCK + 7, 13, 40, 2]
    if device == "cuda":
        lengths += [64 * 4096, 4096 * 16 + 3]  # A and B blocks of an 8B layer's rank-64 / rank-16 adapter
    src, dsts, want, segments = _case(device, dtype, lengths, seed=len(lengths))
    segment_copy(src, segments, dtype)
    for got, expected in zip(dsts, want):
        assert torch.equal(got.view(torch.uint8 if dtype != torch.float32 else torch.int32),
                           expected.view(torch.uint8 if dtype != torch.float32 else torch.int32))


@pytest.mark.parametrize("device", DEVICES)
def test_more_runs_than_programs(device):
    """Programs step over the table: runs past the grid's size are copied too."""
    src, dsts, want, segments = _case(device, torch.float32, [random.Random(k).randint(1, 50) for k in range(40)], 3)
    segment_copy(src, segments, torch.float32, max_programs=3)
    assert all(torch.equal(a, b) for a, b in zip(dsts, want))


def test_bad_inputs_are_named():
    src = torch.zeros(10)
    with pytest.raises(ValueError, match="triples"):
        segment_copy(src, [1, 2], torch.float32)
    with pytest.raises(ValueError, match="dtype"):
        segment_copy(src, [], torch.bfloat16)
    with pytest.raises(ValueError, match="1-D"):
        segment_copy(torch.zeros(2, 5), [], torch.float32)
    segment_copy(src, [], torch.float32)  # nothing to copy: no launch, no error
