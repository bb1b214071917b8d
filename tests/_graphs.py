"""CUDA-graph helpers shared by the GPU tests."""

import gc

import torch


def captured(fn, warmups: int = 1, reset=None):
    """``fn`` run ``warmups`` times on a side stream (compiles, allocates), ``reset()`` (when given)
    to undo what those runs advanced, then ``fn`` captured with the garbage collector off (a
    collected Triton kernel object must not unload its module mid-capture): (graph, its output)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    if reset is not None:
        reset()
    graph = torch.cuda.CUDAGraph()
    gc.disable()
    try:
        with torch.cuda.graph(graph):
            out = fn()
    finally:
        gc.enable()
    return graph, out
