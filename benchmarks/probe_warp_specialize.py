"""Probe (#13, batch 128): does Triton's warp specialization make the TMA GEMM (``ops.tma_gemm``) faster
at 128 rows, and does it run at all on this GPU?

Session 30 switched ``tma_gemm.WARP_SPECIALIZE`` on for a tile sweep and an 8B run: neither finished
(a hang or an endless compile, not told apart). So every measurement here runs in a child process
with a timeout, and the parent records ``ok``, ``timeout`` or ``error`` for each:

1. the smallest case first: a textbook TMA matmul kernel (``_plain_kernel``: no PDL, no split-K, no
   epilogue), then the library's kernel with PDL on and off (PDL's wait before a specialized loop is
   one suspect), each one 8B q/k/v GEMM at 128 rows checked against ``F.linear``;
2. then, per 8B site (by default folded, as the mixed step's ``[W; A]``) one child for cuBLAS and one
   each for the 4-warp tiles without and with specialization, each tile timed as
   ``probe_gemm_bound.py`` times (32 layers of distinct weights in one graph, each after an RMSNorm,
   L2 flushed), us a GEMM against the weight's byte floor.

    python benchmarks/probe_warp_specialize.py --out benchmarks/results/probe_warp_specialize_h200.csv
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
import bench_generate as bg  # noqa: E402
from probe_stream_gemm import MODELS, sites_of  # noqa: E402

# (block_n, block_k, num_warps, num_stages): 4-warp tiles (specialization leaves 8-warp ones as they are)
TILES = [(128, 64, 4, 4), (64, 128, 4, 4), (128, 64, 4, 6)]
SPLITS = {"qkv": (1, 2), "o": (2, 4), "gate_up": (1,), "down": (2, 4)}


@triton.jit
def _plain_kernel(x_desc, w_desc, y_ptr, M, N, K, stride_ym, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, WARP_SPEC: tl.constexpr):
    """A textbook TMA-fed ``x @ w.T`` (no PDL, no split, no epilogue): tells Triton's specialization
    of a plain matmul loop apart from what ``tma_gemm`` adds around it."""
    n0 = tl.program_id(0) * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES, warp_specialize=WARP_SPEC):
        acc = tl.dot(x_desc.load([0, k]), tl.trans(w_desc.load([n0, k])), acc)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


def plain_gemm(x, w, out, bn, bk, warps, stages, ws):
    from triton.tools.tensor_descriptor import TensorDescriptor

    block_m = max(16, triton.next_power_of_2(x.shape[0]))
    _plain_kernel[(triton.cdiv(w.shape[0], bn),)](
        TensorDescriptor.from_tensor(x, [block_m, bk]), TensorDescriptor.from_tensor(w, [bn, bk]), out,
        x.shape[0], w.shape[0], x.shape[1], out.stride(0), BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk,
        NUM_STAGES=stages, WARP_SPEC=ws and torch.cuda.is_available(), num_warps=warps)
    return out


def child(a):
    """The measurements of one child, in this process: each tile's GEMM (or cuBLAS) checked against
    ``F.linear``, then timed; a ``RESULT`` line per tile as it finishes."""
    import peft_fastlora.ops.pdl as pdl
    import peft_fastlora.ops.tma_gemm as tma
    from peft_fastlora.ops.rms_norm import rms_norm
    from peft_fastlora.ops.stream_gemm import StreamWorkspace

    pdl.SETTING = pdl.FULL if a.pdl else pdl.OFF
    tma.WARP_SPECIALIZE = bool(a.ws)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    k, n = sites_of("8b", a.fold)[a.site] if device == "cuda" else (96, 40)
    rows = a.batch if device == "cuda" else 5
    layers = MODELS["8b"][4] if device == "cuda" else 2
    torch.manual_seed(0)
    ws = [torch.randn(n, k, device=device, dtype=dtype) / k ** 0.5 for _ in range(layers)]
    x = torch.randn(rows, k, device=device, dtype=dtype)
    outs = [torch.empty(rows, n, device=device, dtype=dtype) for _ in range(layers)]
    norm_w = torch.ones(k, device=device, dtype=dtype)
    work = StreamWorkspace(device, 8 * tma.MAX_ROWS * n, n)
    bw = bg.copy_bandwidth() if device == "cuda" else 1e11
    for tile in (["cublas"] if a.impl == "cublas" else a.tiles):
        if tile == "cublas":
            gemm = lambda x_, w, o: torch.matmul(x_, w.T, out=o)  # noqa: E731
        else:
            bn, bk, split, warps, stages = map(int, tile.split("x"))
            if device == "cpu":  # the interpreter: small tiles
                bn, bk, stages = min(bn, 32), min(bk, 32), 2
            cfg = tma.TmaConfig(bn, bk, split, warps, stages)
            if a.impl == "plain":
                gemm = lambda x_, w, o, c=cfg: plain_gemm(x_, w, o, c.block_n, c.block_k, c.num_warps,  # noqa: E731
                                                          c.num_stages, bool(a.ws))
            else:
                gemm = lambda x_, w, o, cfg=cfg: tma.tma_gemm(x_, w, out=o, config=cfg,  # noqa: E731
                                                               workspace=work, check=False)
        t0 = time.perf_counter()
        got = gemm(x, ws[0], outs[0]).float()
        if device == "cuda":
            torch.cuda.synchronize()
        row = dict(tile=tile, first_call_s=round(time.perf_counter() - t0, 1),  # the compile and first launch
                   err=round((got - F.linear(x.float(), ws[0].float())).abs().max().item(), 5))
        if device == "cuda":
            from bench_kernels import Timer, capture

            g = capture(lambda: [gemm(rms_norm(x, norm_w, 1e-5), w, o) for w, o in zip(ws, outs)])
            us = Timer(20)(g.replay) / layers
            del g
            row.update(us=round(us, 2), floor_us=round(n * k * 2 / bw * 1e6, 2),
                       of_copy_bw=round(n * k * 2 / (us * 1e-6) / bw, 3))
        print("RESULT " + json.dumps(row), flush=True)


def run_child(args, tiles, **kw) -> list:
    """``child`` over ``tiles`` in a process of its own, killed after ``args.timeout`` seconds: a row
    per tile, ``ok`` with its measurement, else ``timeout`` (the first tile without a result is
    where it stopped) or ``error``."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--site", kw["site"], "--fold", str(kw["fold"]),
           "--batch", str(args.batch), "--impl", kw["impl"], "--ws", str(int(kw["ws"])), "--pdl", str(int(kw["pdl"])),
           "--tiles", *tiles]
    t0, status, detail = time.perf_counter(), "error", ""
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        out, err = run.stdout, run.stderr
        if run.returncode:
            detail = ((err or out).strip().splitlines() or [f"rc {run.returncode}"])[-1][:200]
    except subprocess.TimeoutExpired as e:  # its output so far is bytes
        out, status = (e.stdout or b"").decode(errors="replace"), "timeout"
    done = {r["tile"]: r for r in (json.loads(line[len("RESULT "):]) for line in out.splitlines()
                                     if line.startswith("RESULT "))}
    seconds = round(time.perf_counter() - t0, 1)
    return [dict(kw, batch=args.batch, seconds=seconds, **({"status": "ok", **done[t]} if t in done
                                                          else {"tile": t, "status": status, "detail": detail}))
            for t in (["cublas"] if kw["impl"] == "cublas" else tiles)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/results/probe_warp_specialize_h200.csv")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--sites", nargs="+", default=["qkv", "o", "down", "gate_up"])
    p.add_argument("--folds", type=int, nargs="+", default=[128],
                   help="0: the plain layer; 128: the mixed step's [W; A]")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds a child may take")
    p.add_argument("--smoke", action="store_true", help="CPU (TRITON_INTERPRET=1): one child of each kind, tiny")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--site", default="qkv", help=argparse.SUPPRESS)
    p.add_argument("--fold", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--impl", default="tma", choices=["tma", "plain", "cublas"], help=argparse.SUPPRESS)
    p.add_argument("--ws", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--pdl", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--tiles", nargs="+", default=["128x64x1x4x4"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args)
        return 0
    from bench_kernels import probe_versions

    vers = probe_versions() if torch.cuda.is_available() else {"gpu": "cpu (smoke)"}
    rows = []

    def record(tiles, **kw):
        new = [dict(vers, **r) for r in run_child(args, tiles, **kw)]
        rows.extend(new)
        for r in new:
            keys = ("site", "fold", "impl", "tile", "ws", "pdl", "status", "us", "of_copy_bw", "err", "first_call_s",
                    "seconds", "detail")
            print({k: r.get(k) for k in keys if k in r}, flush=True)
        bg.write_out(rows, args.out)
        return new

    # 1. does a specialized launch finish at all: a textbook kernel, then the library's with PDL and without
    first = ["128x64x1x4x4"]
    record(first, site="qkv", fold=0, impl="plain", ws=True, pdl=False)
    works = {pdl: record(first, site="qkv", fold=0, impl="tma", ws=True, pdl=pdl)[0]["status"] == "ok"
             for pdl in (True, False)}
    if args.smoke:
        record(first, site="qkv", fold=0, impl="cublas", ws=False, pdl=True)
        print("smoke: children ran:", [r["status"] for r in rows])
        return 0
    if not any(works.values()):
        print("no specialized launch finished: no sweep", flush=True)
        return 0
    pdl = works[True]  # PDL where it works with specialization, as the library launches
    # 2. the sweep, one child per (site, fold, specialization): cuBLAS, the 4-warp tiles without and with
    for site in args.sites:
        for fold in args.folds:
            record(first, site=site, fold=fold, impl="cublas", ws=False, pdl=pdl)
            tiles = [f"{bn}x{bk}x{split}x{warps}x{stages}" for bn, bk, warps, stages in TILES for split in SPLITS[site]]
            for ws in (False, True):
                record(tiles, site=site, fold=fold, impl="tma", ws=ws, pdl=pdl)
    return 0


if __name__ == "__main__":
    sys.exit(main())
