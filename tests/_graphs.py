"""CUDA-graph helpers shared by the GPU tests."""

import torch


def captured(fn):
    """``fn`` run once on a side stream (compiles, allocates), then captured: (graph, its output)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out
