"""Probe (#14): what a folded GEMM's tail costs, by its number of rows.

The folded decode GEMM is ``x @ [W; A].T``: the base weight and, under it, the A rows of the
adapters in the stacks. For the 8B shape's q/k/v (N = 6144) and o (N = 4096) sites, 32 distinct
weights in one CUDA graph, the GEMM is timed with tails of 0 rows and of the sizes 64 adapters of
ranks 8-64 give (about 1,928 rows a module), exact and rounded up to multiples of 128 and 256.
Reported: us per GEMM, the tail's extra us, and the extra bytes over that time.

    python benchmarks/probe_fold_tail.py --out benchmarks/results/probe_fold_tail_h200.csv
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_generate as bg  # noqa: E402  (write_csv)

LAYERS, K = 32, 4096
SITES = {"qkv": (6144, 3), "o": (4096, 1)}  # base rows, modules whose A rows the tail holds
RANK_ROWS = [1928, 1984, 2048, 2560, 3072, 4096]  # A rows a module: ~64 adapters of ranks 8-64, rounded, more


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/results/probe_fold_tail_h200.csv")
    p.add_argument("--batches", type=int, nargs="+", default=[32, 64])
    p.add_argument("--iters", type=int, default=30)
    args = p.parse_args(argv)
    from bench_kernels import capture, timer_and_bandwidth

    timer, bw = timer_and_bandwidth(args.iters)
    rows = []
    for site, (n, modules) in SITES.items():
        for bs in args.batches:
            x = torch.randn(bs, K, device="cuda", dtype=torch.bfloat16)
            base_us = None
            for per_module in [0] + RANK_ROWS:
                tail = per_module * modules
                ws = [torch.randn(n + tail, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5 for _ in range(LAYERS)]
                g = capture(lambda: [F.linear(x, w) for w in ws])
                us = timer(g.replay) / LAYERS
                g = ws = None  # rebound, not deleted: the lambda above names ws
                torch.cuda.empty_cache()
                base_us = us if base_us is None else base_us
                extra = us - base_us
                tail_bytes = tail * K * 2
                row = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, copy_tb_s=round(bw / 1e12, 3),
                           site=site, batch=bs, base_rows=n, tail_rows=tail, us=round(us, 2),
                           extra_us=round(extra, 2), of_copy_bw=round((n + tail) * K * 2 / (us * 1e-6) / bw, 3),
                           tail_tb_s=round(tail_bytes / (extra * 1e-6) / 1e12, 3) if extra > 0 else "")
                rows.append(row)
                print(f"{site:4s} b{bs:<3d} tail {tail:6d} rows: {us:7.2f} us (+{extra:6.2f}), "
                      f"{row['of_copy_bw']:.2f} of copy bw, tail at {row['tail_tb_s']} TB/s", flush=True)
    return bg.write_out(rows, args.out)


if __name__ == "__main__":
    sys.exit(main())
