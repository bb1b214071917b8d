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

``inflight`` 2 loads the next tile before summing this one. ``--chains``: before each tile, a
chain of that many dependent loads from a small index table (it stays in L2; it maps each tile to
itself), as an item's metadata (ticket, chunk, tables) comes before its first tile; with two in
flight, the next tile's chain runs while this tile is summed. ``--syncs`` (one tile in flight):
the fused kernel's protocol per tile, ``ticket``: the tile's index drawn from one global counter
(a relaxed atomic, the next drawn while this tile is in flight) instead of a static stride;
``release``: the ticket, and the tile's 16 x 16 float32 partial added into a workspace (relaxed
reductions) followed by an acq_rel atomic on a per-item counter, as a shrink item finishes.
Reported: GB/s over the copy bandwidth measured in the same run, and the mean time per tile a
program sees.

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
def _chain(idx_ptr, i, CHAIN: tl.constexpr):
    """``i`` after CHAIN dependent loads of the identity table (each address waits for the last)."""
    for _ in tl.static_range(CHAIN):
        i = tl.load(idx_ptr + i)
    return i


SYNCS = ("none", "ticket", "release")


@triton.jit
def _tile_stream_kernel(w_ptr, out_ptr, idx_ptr, sync_ptr, acc_ptr, n_tiles, NUM_PROGRAMS, K_ELEMS,
                        TILES_PER_ROWBLOCK, R: tl.constexpr, C: tl.constexpr, TILED: tl.constexpr,
                        INFLIGHT: tl.constexpr, CHAIN: tl.constexpr, SYNC: tl.constexpr):
    if SYNC > 0:
        _synced_stream(w_ptr, out_ptr, sync_ptr, acc_ptr, n_tiles, K_ELEMS, TILES_PER_ROWBLOCK, R, C, SYNC)
    else:
        _plain_stream(w_ptr, out_ptr, idx_ptr, n_tiles, NUM_PROGRAMS, K_ELEMS, TILES_PER_ROWBLOCK, R, C, TILED,
                      INFLIGHT, CHAIN)


@triton.jit
def _plain_stream(w_ptr, out_ptr, idx_ptr, n_tiles, NUM_PROGRAMS, K_ELEMS, TILES_PER_ROWBLOCK,
                  R: tl.constexpr, C: tl.constexpr, TILED: tl.constexpr, INFLIGHT: tl.constexpr,
                  CHAIN: tl.constexpr):
    pid = tl.program_id(0)
    offs_r = tl.arange(0, R)
    offs_c = tl.arange(0, C)
    acc = tl.zeros((R, C), dtype=tl.float32)
    i = pid
    if INFLIGHT == 2:
        nxt = _chain(idx_ptr, i, CHAIN)
        if TILED:
            ptrs = w_ptr + nxt.to(tl.int64) * (R * C) + offs_r[:, None] * C + offs_c[None, :]
        else:
            rb = nxt // TILES_PER_ROWBLOCK
            kt = nxt % TILES_PER_ROWBLOCK
            ptrs = w_ptr + (rb.to(tl.int64) * R + offs_r[:, None]) * K_ELEMS + kt * C + offs_c[None, :]
        tile = tl.load(ptrs, mask=(offs_r < tl.where(nxt < n_tiles, R, 0))[:, None], other=0.0)
    while i < n_tiles:
        nxt = i + NUM_PROGRAMS
        if INFLIGHT == 2:
            nxt = tl.where(nxt < n_tiles, _chain(idx_ptr, tl.minimum(nxt, n_tiles - 1), CHAIN), nxt)
        else:
            i = _chain(idx_ptr, i, CHAIN)
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
        i = i + NUM_PROGRAMS if INFLIGHT == 1 else nxt
    tl.store(out_ptr + pid, tl.sum(acc))


@triton.jit
def _synced_stream(w_ptr, out_ptr, sync_ptr, acc_ptr, n_tiles, K_ELEMS, TILES_PER_ROWBLOCK,
                   R: tl.constexpr, C: tl.constexpr, SYNC: tl.constexpr):
    """Rows layout, one tile in flight, tiles drawn from a ticket (``SYNC`` 1), and each one's
    partial reduced into a workspace and counted with an acq_rel atomic (``SYNC`` 2)."""
    offs_r = tl.arange(0, R)
    offs_c = tl.arange(0, C)
    offs_p = tl.arange(0, 16)
    acc = tl.zeros((R, C), dtype=tl.float32)
    i = tl.atomic_add(sync_ptr, 1, sem="relaxed")
    while i < n_tiles:
        rb = i // TILES_PER_ROWBLOCK
        kt = i % TILES_PER_ROWBLOCK
        tile = tl.load(w_ptr + (rb.to(tl.int64) * R + offs_r[:, None]) * K_ELEMS + kt * C + offs_c[None, :])
        nxt = tl.atomic_add(sync_ptr, 1, sem="relaxed")  # while the tile is in flight, as the kernel does
        acc += tile.to(tl.float32)
        if SYNC == 2:
            part = tl.reshape(tl.sum(tl.reshape(acc, (R, 16, C // 16)), axis=2), (R, 16))
            tl.atomic_add(acc_ptr + (i % 1024) * (R * 16) + offs_r[:, None] * 16 + offs_p[None, :], part,
                          sem="relaxed")
            tl.debug_barrier()
            tl.atomic_add(sync_ptr + 32 + (i % 1024), 1, sem="acq_rel")
        acc = tl.where(tl.sum(acc) == 12345.0, 0.0, acc)  # this tile before the next one is issued
        i = nxt
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--csv", default="probe_tile_layout_h200.csv")
    p.add_argument("--gb", type=float, default=1.0, help="weights read per launch (well past L2)")
    p.add_argument("--tiles", nargs="+", default=["16x512", "16x256", "16x1024", "32x512"])
    p.add_argument("--programs-per-sm", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--chains", type=int, nargs="+", default=[0], help="dependent index loads before each tile")
    p.add_argument("--layouts", nargs="+", default=["rows", "tiled"], choices=["rows", "tiled"])
    p.add_argument("--syncs", nargs="+", default=["none"], choices=SYNCS,
                   help="the fused kernel's protocol per tile (rows layout, one tile in flight)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--smoke", action="store_true", help="CPU interpreter, a few tiles, no timing")
    return p.parse_args(argv)


def run(w, out, idx, r, c, tiled, inflight, programs, chain=0, sync="none", ws=None):
    n_tiles = w.numel() // (r * c)
    level = SYNCS.index(sync)
    if level:
        ws[0].zero_()  # the ticket and counters
    sync_ptr, acc = ws if ws is not None else (idx, out)
    _tile_stream_kernel[(programs,)](w, out, idx, sync_ptr, acc, n_tiles, programs, K, K // c, R=r, C=c,
                                     TILED=tiled, INFLIGHT=inflight, CHAIN=chain, SYNC=level, num_warps=4,
                                     num_stages=1)
    return n_tiles


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.smoke:
        w = torch.arange(64 * K, dtype=torch.float32).reshape(64, K) / K
        out = torch.zeros(4)
        idx = torch.arange(w.numel() // (16 * 512), dtype=torch.int32)
        ws = (torch.zeros(32 + 1024, dtype=torch.int32), torch.zeros(1024 * 16 * 16))
        for tiled, inflight, chain, sync in [(False, 1, 0, "ticket"), (False, 1, 0, "release")] + [
                (t, f, ch, "none") for t in (False, True) for f in (1, 2) for ch in (0, 2)]:
            out.zero_()
            run(w.view(-1), out, idx, 16, 512, tiled, inflight, 4, chain, sync, ws)
            assert abs(float(out.sum()) - float(w.sum())) < 1e-3 * float(w.sum()), (tiled, inflight, chain, sync)
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
        idx = torch.arange(w.numel() // (r * c), device="cuda", dtype=torch.int32)
        ws = (torch.zeros(32 + 1024, device="cuda", dtype=torch.int32),
              torch.zeros(1024 * r * 16, device="cuda", dtype=torch.float32))
        variants = [(p, t, f, ch, "none") for p in args.programs_per_sm for t in [x == "tiled" for x in args.layouts]
                    for f in (1, 2) for ch in args.chains] if "none" in args.syncs else []
        variants += [(p, False, 1, 0, sy) for p in args.programs_per_sm for sy in args.syncs if sy != "none"]
        for pps, tiled, inflight, chain, sync in variants:
            programs = pps * sms
            n_tiles = run(w, out, idx, r, c, tiled, inflight, programs, chain, sync, ws)
            us = timer(lambda: run(w, out, idx, r, c, tiled, inflight, programs, chain, sync, ws))
            nbytes = n_tiles * r * c * 2
            row = dict(versions, tile=tile, tile_kb=r * c * 2 // 1024, layout="tiled" if tiled else "rows",
                       chain=chain, sync=sync, tiles_in_flight=inflight, programs_per_sm=pps, programs=programs,
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
