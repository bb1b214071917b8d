"""Probe (#13, batch 128): a mixed-adapter gate/up in one gated GEMM, the LoRA expand as reduction
columns after K (``ops.tma_gemm``'s ``LoraTail``), against the launches the library runs today.

At 65-128 rows the mixed step's gate/up is three launches: cuBLAS over the folded ``[W; A]`` (base
output and every slot's shrink), the expand adding each row's delta into the base output, then the
act-mul. The base model's gate/up is one: the gated TMA tile (activation in its epilogue, no
pre-activation output written). Here the gated tile also takes the delta: a small shrink GEMM
first (``x @ A.T`` over every slot's A rows, gate's then up's), then the gated tile with those
columns, masked to each row's slot and scaled, times B as more of its reduction. Timed as
``probe_gemm_bound.py`` times (32 layers of distinct weights in one CUDA graph, each after an
RMSNorm, L2 flushed before each replay), us a layer; every variant's output checked against the
library's launches (bf16 roundings apart).

    python benchmarks/probe_glu_tail.py --out benchmarks/results/probe_glu_tail_h200.csv
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
import bench_generate as bg  # noqa: E402

# the shrink's candidates: cuBLAS, or the TMA kernel split over K (block_n, block_k, split, warps, stages)
SHRINKS = ["cublas", "64x128x8x4x3", "64x128x16x4x3", "128x64x16x4x4", "64x64x32x4x4"]


def layer_operands(k, n, ranks, rows, device, dtype, gen):
    """One layer's gate/up: the folded weight ``[gate; up; A]`` as the library packs it (A rows
    ``a_rows``, B flat at ``b_offs``), and the same adapters as a ``LoraTail``'s A (gate's rows of
    every slot, then up's) and B ((2n, T)). Returns a dict of both."""
    from bench_kernels import packed_layout

    c = 2  # gate, up
    a_rows, b_offs, t_rows, b_len = packed_layout((0, n, 2 * n), ranks)
    ext = torch.empty(2 * n + t_rows, k, device=device, dtype=dtype)
    ext[: 2 * n].normal_(generator=gen).mul_(k ** -0.5)
    b_flat = torch.empty(b_len, device=device, dtype=dtype)
    t = sum(ranks)
    a_tail = torch.empty(2 * t, k, device=device, dtype=dtype)
    b_tail = torch.zeros(2 * n, t, device=device, dtype=dtype)
    col = 0
    for s, r in enumerate(ranks):
        for j in range(c):
            a = torch.randn(r, k, generator=gen, device=device, dtype=dtype) * k ** -0.5
            b = torch.randn(n, r, generator=gen, device=device, dtype=dtype) * r ** -0.5
            ext[2 * n + a_rows[s, j]: 2 * n + a_rows[s, j] + r] = a
            b_flat[b_offs[s, j]: b_offs[s, j] + n * r] = b.flatten()
            a_tail[j * t + col: j * t + col + r] = a
            b_tail[j * n:(j + 1) * n, col:col + r] = b
        col += r
    return dict(ext=ext, w=ext[: 2 * n], b_flat=b_flat, a_rows=a_rows.to(device), b_offs=b_offs.to(device),
                a_tail=a_tail, b_tail=b_tail, y=torch.empty(rows, 2 * n + t_rows, device=device, dtype=dtype),
                s=torch.empty(rows, 2 * t, device=device, dtype=dtype),
                h=torch.empty(rows, n, device=device, dtype=dtype))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/results/probe_glu_tail_h200.csv")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--smoke", action="store_true", help="CPU (TRITON_INTERPRET=1): tiny shapes, no timing")
    args = p.parse_args(argv)
    from bench_kernels import capture, gpu_probe
    from peft_fastlora import ForwardBatch, get_backend
    from peft_fastlora.base_ops.stream_linears import tma_tiles
    from peft_fastlora.ops.lora_expand import lora_expand
    from peft_fastlora.ops.rms_norm import rms_norm
    from peft_fastlora.ops.silu_mul import act_mul
    from peft_fastlora.ops.stream_gemm import StreamWorkspace
    from peft_fastlora.ops.tma_gemm import LoraTail, TmaConfig, tma_gemm

    if args.smoke:
        device, dtype, k, n, layers, rows = "cpu", torch.float32, 64, 48, 2, 5
        timer, bw, vers = None, 1e11, {"gpu": "cpu (smoke)"}
        glu_cfg = TmaConfig(32, 32, 1, 4, 2)
    else:
        probe = gpu_probe("probe_glu_tail", args.iters)
        if probe is None:
            return 0
        timer, bw, vers = probe
        device, dtype, k, n, layers, rows = "cuda", torch.bfloat16, 4096, 14336, args.layers, args.batch
        glu_cfg = tma_tiles()["glu"].config  # the base model's gated tile
    ranks = [args.rank] * args.adapters
    gen = torch.Generator(device=device).manual_seed(0)
    ops = [layer_operands(k, n, ranks, rows, device, dtype, gen) for _ in range(layers)]
    x = torch.randn(rows, k, generator=gen, device=device, dtype=dtype)
    norm_w = torch.ones(k, device=device, dtype=dtype)
    slots = [i % args.adapters for i in range(rows)]
    scalings = [0.5 + 0.25 * (s % 4) for s in range(args.adapters)]
    backend = get_backend("triton")(args.adapters, device)
    bi = backend.prepare_lora_batch(ForwardBatch.from_shape(rows, 1, device), slots, ranks, scalings,
                                    use_cuda_graph=False)
    plan = (bi.sorted_token_ids, bi.chunk_slot, bi.chunk_start, bi.chunk_len)
    rt = torch.tensor([[r, r] for r in ranks], dtype=torch.int32, device=device)
    sc = torch.tensor([[v, v] for v in scalings], dtype=torch.float32, device=device)
    t = sum(ranks)
    col_slot = torch.tensor([s for s, r in enumerate(ranks) for _ in range(r)], dtype=torch.int32, device=device)
    col_scale = torch.tensor([scalings[s] for s, r in enumerate(ranks) for _ in range(r)], device=device)
    row_slot = torch.tensor(slots, dtype=torch.int32, device=device)
    work = StreamWorkspace(device, 64 * rows * 2 * t, 2 * t)

    def library(o, xn):  # what the mixed step runs today at 65-128 rows
        torch.matmul(xn, o["ext"].T, out=o["y"])
        lora_expand(o["y"][:, 2 * n:], o["b_flat"], (0, n, 2 * n), rt, sc, o["y"][:, : 2 * n], *plan,
                    block_m=bi.block_m, check=False, b_offs=o["b_offs"], b_align=8 if args.rank % 8 == 0 else 1,
                    y_cols=o["a_rows"], max_rank=args.rank)
        return act_mul(o["y"][:, :n], o["y"][:, n: 2 * n], "silu")

    def shrink(o, xn, how):
        if how == "cublas":
            return torch.matmul(xn, o["a_tail"].T, out=o["s"])
        bn, bk, split, warps, stages = map(int, how.split("x"))
        if device == "cpu":
            bn, bk, stages = 32, 32, 2
        return tma_gemm(xn, o["a_tail"], out=o["s"], config=TmaConfig(bn, bk, split, warps, stages),
                        workspace=work, check=False)

    def tailed(o, xn):
        tail = LoraTail(o["s"], o["b_tail"], row_slot, col_slot, col_scale)
        return tma_gemm(xn, o["w"], out=o["h"], config=glu_cfg, tail=tail, glu="silu", check=False)

    variants = {
        "library: folded cuBLAS + expand + act-mul": lambda o, xn: library(o, xn),
        "base only: the gated tile, no LoRA": lambda o, xn: tma_gemm(xn, o["w"], out=o["h"], config=glu_cfg,
                                                                     glu="silu", check=False),
        "tail only: the gated tile with the tail (shrink outside)": tailed,
    }
    for how in SHRINKS:
        variants[f"shrink {how} alone"] = lambda o, xn, how=how: shrink(o, xn, how)
        variants[f"shrink {how} + tail"] = lambda o, xn, how=how: (shrink(o, xn, how), tailed(o, xn))[1]

    def run(fn):
        return [fn(o, rms_norm(x, norm_w, 1e-5)) for o in ops]

    want = [h.clone() for h in run(variants["library: folded cuBLAS + expand + act-mul"])]
    for o in ops:  # the shrink columns "tail only" reads
        shrink(o, rms_norm(x, norm_w, 1e-5), "cublas")
    rows_out = []
    for name, fn in variants.items():
        got = run(fn)
        err = ""
        if "alone" not in name and "base only" not in name:
            # bf16: the library rounds gate / up and the delta apart, the tail once
            err = max(((g.float() - w_.float()).abs().max() / w_.float().abs().max()).item()
                      for g, w_ in zip(got, want))
            if err > 2 ** -6:
                print(f"{name}: differs from the library's launches (relative {err:.3g}); not timed", flush=True)
                continue
        row = dict(vers, batch=rows, adapters=args.adapters, rank=args.rank, variant=name,
                   max_rel_err=f"{err:.2e}" if err != "" else "")
        if timer is not None:
            g = capture(lambda fn=fn: run(fn))
            us = timer(g.replay) / layers
            del g
            floor = 2 * n * k * 2 / bw * 1e6
            row.update(us_per_layer=round(us, 2), weight_floor_us=round(floor, 2), x_floor=round(us / floor, 3))
        rows_out.append(row)
        print(f"{name:60s} {row.get('us_per_layer', '-')} us a layer  err {row['max_rel_err']}", flush=True)
    if args.smoke:
        print("smoke: every variant ran and matched the library's launches")
    return bg.write_out(rows_out, args.out)


if __name__ == "__main__":
    sys.exit(main())
