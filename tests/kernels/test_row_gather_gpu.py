"""``ops.row_gather`` on the GPU: the kernel against plain indexing at a vocabulary's width, and
one captured launch replayed under tables written between replays (the continuous-batching
sampler's use: a table of 0 rows copies nothing)."""

import pytest
import torch

from peft_fastlora.ops.row_gather import gather_rows

from test_row_gather import gather_case

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rows_of_a_vocabulary_wide_source(dtype):
    gen = torch.Generator().manual_seed(11)
    for rows, count in ((1, 1), (37, 5), (1025, 300)):
        picked = torch.randint(0, rows, (count,), generator=gen).tolist()
        src, table, dst, want = gather_case("cuda", dtype, rows, 128256, picked, seed=rows)
        gather_rows(src, table, dst)
        assert torch.equal(dst, want)


def test_one_capture_copies_what_each_replays_table_lists():
    src = torch.empty(64, 5000, device="cuda")
    dst = torch.full((65, 5000), -7.0, device="cuda")
    table = torch.zeros(65, dtype=torch.int32, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm: compile before the capture
        gather_rows(src, table, dst)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gather_rows(src, table, dst)
    gen = torch.Generator().manual_seed(5)
    for picked in ([3, 63, 3, 0], [], list(range(64)), [10]):
        src.copy_(torch.randn(64, 5000, generator=gen))
        before = dst.clone()
        table[: len(picked) + 1].copy_(torch.tensor([len(picked)] + picked, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        if picked:
            assert torch.equal(dst[: len(picked)], src[picked])
        assert torch.equal(dst[len(picked):], before[len(picked):])
