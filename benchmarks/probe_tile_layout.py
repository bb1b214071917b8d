"""Probe: what the memory system gives a persistent launch that reads weight tiles one after the
other, as the fused decode LoRA kernel's items do, by tile layout, tile size, tiles in flight per
program and programs per SM.

The fused kernel's traces (``probe_fused_phases.py``) show each program reading ~5 GB/s: a 16 KB
tile of A (16 rank rows x 512 columns, rows 8 KB apart in the packed arena) every ~3 us, and the
launch averaging ~1.3 TB/s. Is that the layout (16 row segments of 1 KB), the one tile in flight
per program, or the programs per SM? Each program here reads its share of ``--gb`` of bf16
weights tile by tile (static assignment, no tickets, no atomics), sums each tile and writes one
number, so the only chain is the tiles themselves:

- ``rows``: a tile is ``r`` rows of ``c`` elements, rows ``K`` = 4096 elements apart (the arena);
- ``tiled``: the same bytes stored tile after tile, each tile one contiguous block.

``inflight`` 2 loads the next tile before summing this one. Reported: GB/s over the copy
bandwidth measured in the same run, and the mean time per tile a program sees.

    python benchmarks/probe_tile_layout.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_generate as bg  # noqa: E402  (write_csv, versions)
from bench_kernels import Timer, copy_bandwidth  # noqa: E402

K = 4096


@triton.jit
def _tile_stream_kernel(w_ptr, out_ptr, n_tiles, NUM_PROGRAMS, K_ELEMS, TILES_PER_ROWBLOCK,
                        R: tl.constexpr, C: tl.constexpr, TILED: tl.constexpr, INFLIGHT: tl.constexpr):
    pid = tl.program_id(0)
    offs_r = tl.arange(0, R)
    offs_c = tl.arange(0, C)
    acc = tl.zeros((R, C), dtype=tl.float32)
    i = pid
    if INFLIGHT == 2:
        nxt = i
        if TILED:
            ptrs = w_ptr + nxt.to(tl.int64) * (R * C) + offs_r[:, None] * C + offs_c[None, :]
        else:
            rb = nxt // TILES_PER_ROWBLOCK
            kt = nxt % TILES_PER_ROWBLOCK
            ptrs = w_ptr + (rb.to(tl.int64) * R + offs_r[:, None]) * K_ELEMS + kt * C + offs_c[None, :]
        tile = tl.load(ptrs, mask=(offs_r < tl.where(nxt < n_tiles, R, 0))[:, None], other=0.0)
    while i < n_tiles:
        nxt = i + NUM_PROGRAMS
        if TILED:
            ptrs = w_ptr + nxt.to(tl.int64) * (R * C) + offs_r[:, None] * C + offs_c[None, :]
            cur = w_ptr + i.to(tl.int64) * (R * C) + offs_r[:, None] * C + offs_c[None, :]
        else:
            rb = nxt // TILES_PER_ROWBLOCK
            kt = nxt % TILES_PER_ROWBLOCK
            ptrs = w_ptr + (rb.to(tl.int64) * R + offs_r[:, None]) * K_ELEMS + kt * C + offs_c[None, :]
            rb0 = i // TILES_PER_ROWBLOCK
            kt0 = i % TILES_PER_ROWBLOCK
            cur = w_ptr + (rb0.to(tl.int64) * R + offs_r[:, None]) * K_ELEMS + kt0 * C + offs_c[None, :]
        if INFLIGHT == 2:
            following = tl.load(ptrs, mask=(offs_r < tl.where(nxt < n_tiles, R, 0))[:, None], other=0.0)  # issued before this tile's sum
            acc += tile.to(tl.float32)
            tile = following
        else:
            acc += tl.load(cur).to(tl.float32)
            # a data dependence on the tile before the next one is issued: one tile in flight
            acc = tl.where(tl.sum(acc) == 12345.0, 0.0, acc)
        i = nxt
    tl.store(out_ptr + pid, tl.sum(acc))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--csv", default="probe_tile_layout_h200.csv")
    p.add_argument("--gb", type=float, default=1.0, help="weights read per launch (well past L2)")
    p.add_argument("--tiles", nargs="+", default=["16x512", "16x256", "16x1024", "32x512"])
    p.add_argument("--programs-per-sm", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--smoke", action="store_true", help="CPU interpreter, a few tiles, no timing")
    return p.parse_args(argv)


def run(w, out, r, c, tiled, inflight, programs):
    n_tiles = w.numel() // (r * c)
    _tile_stream_kernel[(programs,)](w, out, n_tiles, programs, K, K // c, R=r, C=c, TILED=tiled,
                                     INFLIGHT=inflight, num_warps=4, num_stages=1)
    return n_tiles


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.smoke:
        w = torch.arange(64 * K, dtype=torch.float32).reshape(64, K) / K
        out = torch.zeros(4)
        for tiled in (False, True):
            for inflight in (1, 2):
                out.zero_()
                run(w.view(-1), out, 16, 512, tiled, inflight, 4)
                assert abs(float(out.sum()) - float(w.sum())) < 1e-3 * float(w.sum()), (tiled, inflight)
        print("smoke: every layout and depth sums the whole buffer")
        return 0
    timer = Timer(args.iters)
    bandwidth = copy_bandwidth(timer)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    w = torch.randn(int(args.gb * 2**30) // 2, device="cuda", dtype=torch.bfloat16)
    out = torch.zeros(8 * sms, device="cuda", dtype=torch.float32)
    versions = dict(bg.versions(), copy_tb_s=round(bandwidth / 1e12, 3))
    rows = []
    for tile in args.tiles:
        r, c = map(int, tile.split("x"))
        for pps in args.programs_per_sm:
            for tiled in (False, True):
                for inflight in (1, 2):
                    programs = pps * sms
                    n_tiles = run(w, out, r, c, tiled, inflight, programs)
                    us = timer(lambda: run(w, out, r, c, tiled, inflight, programs))
                    nbytes = n_tiles * r * c * 2
                    row = dict(versions, tile=tile, tile_kb=r * c * 2 // 1024, layout="tiled" if tiled else "rows",
                               tiles_in_flight=inflight, programs_per_sm=pps, programs=programs,
                               us=round(us, 1), tb_s=round(nbytes / us / 1e6, 3),
                               of_copy=round(nbytes / us / 1e6 / (bandwidth / 1e12), 3),
                               us_per_tile_per_program=round(us * programs / n_tiles, 3))
                    print(row, flush=True)
                    rows.append(row)
    try:  # what bounds the programs resident per SM (Triton's cache layout; best effort)
        regs = sorted({(k.n_regs, k.n_spills) for cache in _tile_stream_kernel.device_caches.values()
                       for k in cache[0].values()})
    except Exception as e:  # noqa: BLE001
        regs = f"unavailable ({type(e).__name__})"
    print("compiled variants (registers, spills):", regs)
    print("written", bg.write_csv(rows, args.out, args.csv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
