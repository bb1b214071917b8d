"""Probe (#13): can a Triton weight-streaming GEMM beat cuBLAS on a decode step's GEMM shapes?

For each GEMM of an 8B Llama layer (q/k/v fused, o, gate/up fused, down; with and without the
folded LoRA rows of 8 slots at rank 16 under the weight) and each batch, 32 layers' worth of
distinct weights are multiplied in one CUDA graph (so L2 holds none of them) and the replay is
timed: ``F.linear`` (cuBLAS, whatever kernels it picks, split-K reductions included) against a
Triton weight-streaming kernel (below) at several tiles. Reported: microseconds per GEMM and the
weight's bytes over that time, against the copy bandwidth measured in the same run.

    python benchmarks/probe_skinny_gemm.py --out benchmarks/results/probe_skinny_gemm_h200.csv
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_generate as bg  # noqa: E402  (write_csv)

HIDDEN, Q, KV, INTER, LAYERS, SLOTS, RANK = 4096, 4096, 1024, 14336, 32, 8, 16
# site: (K, N of the base weight, rows the fold adds: every slot's A of every stacked module)
SITES = {"qkv": (HIDDEN, Q + 2 * KV, SLOTS * 3 * RANK), "o": (HIDDEN, HIDDEN, SLOTS * RANK),
         "gate_up": (HIDDEN, 2 * INTER, SLOTS * 2 * RANK), "down": (INTER, HIDDEN, SLOTS * RANK)}


# ---- the candidate: each program owns BLOCK_N output columns (rows of w) for every row of x and
# walks the whole reduction (no split-K, no second kernel); w_tile @ x_tile.T puts the weight's many
# columns, not the few rows, on the tensor core's M side. float32 accumulation, one rounding.
@triton.jit
def _skinny_gemm_kernel(
    # pointers
    x_ptr, w_ptr, y_ptr,
    # dimensions
    M, N, K,
    # strides (unit stride on K for x and w, on N for y)
    stride_xm, stride_wn, stride_ym,
    # meta-parameters
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    m_ok = offs_m < M
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
            x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
        else:
            k_ok = (k + offs_k) < K
            w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(w, tl.trans(x), acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    y_ptrs = y_ptr + offs_m.to(tl.int64)[None, :] * stride_ym + offs_n[:, None]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])


class SkinnyConfig(NamedTuple):
    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4


MAX_ROWS = 128  # one program covers every row of x up to here; more rows tile over the grid's y


def skinny_gemm(x: torch.Tensor, w: torch.Tensor, out: Optional[torch.Tensor] = None,
                config: SkinnyConfig = SkinnyConfig()) -> torch.Tensor:
    """``x @ w.T``.

    Args:
        x: (M, K), unit stride on K.
        w: (N, K), unit stride on K (an ``nn.Linear`` weight, or rows of one).
        out: optional (M, N) output, unit stride on N; allocated when None.
    """
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and w {tuple(w.shape)}: expected (M, K) and (N, K)")
    if x.dtype != w.dtype or x.device != w.device:
        raise ValueError(f"x ({x.dtype}, {x.device}) and w ({w.dtype}, {w.device}) differ")
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError("x and w need unit stride on K")
    m, k = x.shape
    n = w.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    elif out.shape != (m, n) or out.stride(1) != 1 or out.dtype != x.dtype:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype}: expected ({m}, {n}) {x.dtype}, unit stride on N")
    if m == 0 or n == 0:
        return out
    block_m = max(16, min(MAX_ROWS, triton.next_power_of_2(m)))
    grid = (triton.cdiv(n, config.block_n), triton.cdiv(m, block_m))
    _skinny_gemm_kernel[grid](x, w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0),
                              BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                              EVEN_K=k % config.block_k == 0,
                              num_warps=config.num_warps, num_stages=config.num_stages)
    return out


# (block_n, block_k, num_warps, num_stages)
CONFIGS = [(32, 128, 4, 4), (32, 256, 4, 3), (64, 128, 4, 4), (64, 128, 4, 6), (64, 256, 4, 3),
           (128, 64, 4, 4), (128, 128, 8, 3), (128, 128, 4, 4)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/results/probe_skinny_gemm_h200.csv")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--smoke", action="store_true", help="CPU (TRITON_INTERPRET=1), tiny shapes, one check")
    args = p.parse_args(argv)
    if args.smoke:
        x, w = torch.randn(3, 96), torch.randn(40, 96)
        for cfg in CONFIGS[:2]:
            torch.testing.assert_close(skinny_gemm(x, w, config=SkinnyConfig(*cfg)), x @ w.T, rtol=1e-4, atol=1e-4)
        print("smoke: skinny_gemm equals x @ w.T")
        return 0
    from bench_kernels import Timer, capture, copy_bandwidth

    timer = Timer(args.iters)
    bw = copy_bandwidth(timer)
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    torch.manual_seed(0)
    rows = []
    for site, (k, n_base, tail) in SITES.items():
        for folded in (False, True):
            n = n_base + (tail if folded else 0)
            ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(LAYERS)]
            nbytes = n * k * 2
            for bs in args.batches:
                x = torch.randn(bs, k, device="cuda", dtype=torch.bfloat16)
                outs = [torch.empty(bs, n, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]
                ref = F.linear(x, ws[0])
                impls = [("cublas", None)] + [(f"skinny_n{c[0]}_k{c[1]}_w{c[2]}_s{c[3]}", SkinnyConfig(*c))
                                              for c in CONFIGS]
                times = {}
                for name, cfg in impls:
                    if cfg is None:
                        fn = lambda: [F.linear(x, w) for w in ws]  # noqa: E731
                    else:
                        fn = lambda cfg=cfg: [skinny_gemm(x, w, o, cfg) for w, o in zip(ws, outs)]  # noqa: E731
                    try:
                        if cfg is not None:
                            err = (skinny_gemm(x, ws[0], config=cfg).float() - ref.float()).abs().max().item()
                            if err > 0.05:  # a wrong kernel is no candidate
                                print(f"{site} {name} b{bs}: max error {err}", flush=True)
                                continue
                        g = capture(fn)
                    except Exception as e:  # a tile that does not fit (shared memory) is no candidate
                        print(f"{site} {name} b{bs}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                        continue
                    times[name] = timer(g.replay) / LAYERS
                    del g
                for name, us in times.items():
                    row = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, site=site,
                               folded=folded, n=n, k=k, batch=bs, impl=name, us=round(us, 2),
                               tb_s=round(nbytes / (us * 1e-6) / 1e12, 3), of_copy_bw=round(nbytes / (us * 1e-6) / bw, 3),
                               vs_cublas=round(us / times["cublas"], 3))
                    rows.append(row)
                best = min(times, key=times.get)
                print(f"{site:8s} folded={folded!s:5s} b{bs:<4d} cublas {times['cublas']:7.2f} us "
                      f"({nbytes / (times['cublas'] * 1e-6) / bw:.2f} of copy bw); best {best} "
                      f"{times[best]:7.2f} us ({nbytes / (times[best] * 1e-6) / bw:.2f})", flush=True)
            ws = outs = None
            torch.cuda.empty_cache()
    return bg.write_out(rows, args.out)


if __name__ == "__main__":
    sys.exit(main())
