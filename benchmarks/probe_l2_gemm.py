"""Probe (#13): how much faster is a decode GEMM whose weight is already in L2, and can a prefetch on
a parallel graph branch put it there while the step's small kernels run?

Follows ``probe_l2_prefetch.py`` (commit 087f10a, with the prefetch inside fastlora's norm and
act-mul kernels then), which found the prefetch issued inside the small kernels slower everywhere
(the issuing kernel stays until its requests are taken). Here, per GEMM of an 8B layer
and batch, 32 distinct weights in one CUDA graph, each GEMM preceded by a kernel that only waits
``--gap-us`` (standing for a window of small kernels with the memory idle):

- ``gap+gemm``: the chain without prefetch;
- ``prefetch+gap+gemm``: the weight's first ``--mb`` MB prefetched (Hopper's
  ``cp.async.bulk.prefetch.L2``, below), as its leading columns or its leading rows,
  then the wait, then the GEMM (the GEMM's time with its weight in L2, once ``prefetch+gap`` is
  subtracted);
- ``branch``: the prefetch on a side stream forked before the wait and joined before the GEMM: what
  a decode step could do.

    python benchmarks/probe_l2_gemm.py --out benchmarks/results/probe_l2_gemm_h200.csv
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra.cuda import globaltimer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_generate as bg  # noqa: E402  (write_csv)

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
LAYERS = 32


ALIGN, CHUNK = 16, 1 << 14  # bulk prefetches: 16-byte multiples; a contiguous region in 16 KB pieces


class L2Prefetch(NamedTuple):
    tensor: torch.Tensor
    rows: int  # ranges of ``row_bytes`` bytes, ``stride`` bytes apart, from the tensor's first element
    stride: int
    row_bytes: int


def plan(weight: torch.Tensor, max_bytes: int, layout: str) -> Optional[L2Prefetch]:
    """The weight's first ``max_bytes``: its leading columns ("columns") or leading rows ("rows")."""
    n, k = weight.shape
    if layout == "columns":
        per_row = min(k * 2, max_bytes // n) // ALIGN * ALIGN
        return L2Prefetch(weight, n, weight.stride(0) * 2, per_row) if per_row else None
    total = min(n * k * 2, max_bytes) // CHUNK * CHUNK
    return L2Prefetch(weight, total // CHUNK, CHUNK, CHUNK) if total else None


@triton.jit
def _l2_prefetch_kernel(pf_ptr, pf_rows, pf_stride, pf_row_bytes, BLOCK: tl.constexpr):
    base = pf_ptr.to(tl.int64)
    size = tl.full((BLOCK,), 0, tl.int32) + pf_row_bytes
    for start in range(tl.program_id(0) * BLOCK, pf_rows, tl.num_programs(0) * BLOCK):
        r = start + tl.arange(0, BLOCK)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.s32 p, $3, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r,r", [base + r.to(tl.int64) * pf_stride, size, (r < pf_rows).to(tl.int32)],
            dtype=tl.int32, is_pure=False, pack=1)


def l2_prefetch(pf: Optional[L2Prefetch], programs: int) -> None:
    if pf is None:
        return
    programs = max(1, min(programs, triton.cdiv(pf.rows, 32)))
    _l2_prefetch_kernel[(programs,)](pf.tensor, pf.rows, pf.stride, pf.row_bytes, BLOCK=32, num_warps=1)


@triton.jit
def _wait_kernel(ns):
    t0 = globaltimer()
    t = t0
    while t - t0 < ns:
        t = globaltimer()


def wait_ns(ns: int, buf):
    _wait_kernel[(1,)](ns, num_warps=1)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/results/probe_l2_gemm_h200.csv")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    p.add_argument("--mb", type=float, nargs="+", default=[16, 32])
    p.add_argument("--gap-us", type=float, nargs="+", default=[5, 15])
    p.add_argument("--programs", type=int, nargs="+", default=[132])
    p.add_argument("--iters", type=int, default=30)
    args = p.parse_args(argv)
    from bench_kernels import capture, timer_and_bandwidth

    timer, bw = timer_and_bandwidth(args.iters)
    side = torch.cuda.Stream()
    rows = []
    for name, (n, k) in SHAPES.items():
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(LAYERS)]
        nbytes = n * k * 2
        for bs in args.batches:
            x = torch.randn(bs, k, device="cuda", dtype=torch.bfloat16)
            for gap in args.gap_us:
                ns = int(gap * 1e3)
                base = {}

                def timed(label, fn, mb=0.0, programs=0):
                    g = capture(fn)
                    us = timer(g.replay) / LAYERS
                    del g
                    base[label] = us
                    row = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, copy_tb_s=round(bw / 1e12, 3),
                               gemm=name, n=n, k=k, batch=bs, gap_us=gap, variant=label, prefetch_mb=mb,
                               programs=programs, us_per_layer=round(us, 2))
                    rows.append(row)
                    print(f"{name:8s} b{bs:<4d} gap {gap:4.0f} us {label:40s} {us:8.2f} us", flush=True)
                    return us

                gap_alone = timed("gap", lambda: [wait_ns(ns, x) for _ in ws])
                gemm_alone = timed("gemm", lambda: [F.linear(x, w) for w in ws])
                cold = timed("gap+gemm", lambda: [(wait_ns(ns, x), F.linear(x, w)) for w in ws])
                for mb in args.mb:
                    for layout in ("columns", "rows"):
                        pfs = [plan(w, int(mb * 2**20), layout) for w in ws]
                        for programs in args.programs:
                            tag = f"{layout}_{mb:g}mb_p{programs}"
                            pre = timed(f"prefetch+gap {tag}", lambda: [(l2_prefetch(pf, programs), wait_ns(ns, x))
                                                                        for pf in pfs], mb, programs)
                            warm = timed(f"prefetch+gap+gemm {tag}",
                                         lambda: [(l2_prefetch(pf, programs), wait_ns(ns, x), F.linear(x, w))
                                                  for pf, w in zip(pfs, ws)], mb, programs)

                            def branch():
                                main = torch.cuda.current_stream()
                                for pf, w in zip(pfs, ws):
                                    side.wait_stream(main)
                                    with torch.cuda.stream(side):
                                        l2_prefetch(pf, programs)
                                    wait_ns(ns, x)
                                    main.wait_stream(side)
                                    F.linear(x, w)

                            br = timed(f"branch {tag}", branch, mb, programs)
                            print(f"    -> GEMM with {mb:g} MB in L2: {warm - pre:.2f} us (cold {cold - gap_alone:.2f},"
                                  f" alone {gemm_alone:.2f}, byte floor {nbytes / bw * 1e6:.2f});"
                                  f" branch saves {cold - br:.2f} us a GEMM", flush=True)
        ws = None
        torch.cuda.empty_cache()
    return bg.write_out(rows, args.out)


if __name__ == "__main__":
    sys.exit(main())
