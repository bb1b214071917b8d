"""Probe (#13, batch 128): what the base model's gated gate/up tile costs when its reduction is
longer by the LoRA columns, i.e. the ceiling of taking a mixed batch's expand as more of that
reduction (``[x | s] @ [W | B].T``, s each row's masked, scaled shrink) rather than as launches
after a folded cuBLAS GEMM.

Session 31 built the expand as a tail loop after the tile's K loop (``LoraTail``, reverted: the tail
cost 6.8 us a layer and the shrink as its own launch 7-9). Concatenated into the weight, the tail
is part of the pipelined loop: this times the library's gated tile (``tma_tiles_h200.json``'s
``glu``) at K = 4,096 plus 0, 128 (gate's and up's columns sharing the slots' shrink) or 256 (gate's
and up's their own, zeros between) columns, and cuBLAS over the folded weight, then the act-mul,
each after an RMSNorm, 32 layers of distinct weights in one CUDA graph, L2 flushed; us a layer.
Nothing here computes the shrink: that is the other half of the question.

    python benchmarks/probe_glu_kext.py --out benchmarks/results/probe_glu_kext_h200.csv
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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/results/probe_glu_kext_h200.csv")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--extra", type=int, nargs="+", default=[0, 128, 256], help="reduction columns past 4,096")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--smoke", action="store_true", help="CPU (TRITON_INTERPRET=1): tiny shapes, no timing")
    args = p.parse_args(argv)
    from bench_kernels import capture, gpu_probe
    from peft_fastlora.base_ops.stream_linears import tma_tiles
    from peft_fastlora.ops.rms_norm import rms_norm
    from peft_fastlora.ops.silu_mul import act_mul
    from peft_fastlora.ops.stream_gemm import stream_gemm_reference
    from peft_fastlora.ops.tma_gemm import TmaConfig, tma_gemm

    if args.smoke:
        device, dtype, k, n, layers, rows, extras = "cpu", torch.float32, 64, 32, 2, 5, [0, 16]
        timer, vers, cfg = None, {"gpu": "cpu (smoke)"}, TmaConfig(16, 16, 1, 4, 2)
    else:
        probe = gpu_probe("probe_glu_kext", args.iters)
        if probe is None:
            return 0
        timer, bw, vers = probe
        device, dtype, k, n = "cuda", torch.bfloat16, 4096, 14336
        layers, rows, extras = args.layers, args.batch, args.extra
        cfg = tma_tiles()["glu"].config
    norm_w = torch.ones(k, device=device, dtype=dtype)
    x = torch.randn(rows, k, device=device, dtype=dtype)
    rows_out = []

    def record(name, kk, fn, check):
        got = fn()
        err = ((got.float() - check.float()).abs().max() / check.float().abs().max()).item()
        assert err < 2 ** -6, (name, err)  # bf16 roundings apart
        row = dict(vers, batch=rows, variant=name, k=kk, rel_err=f"{err:.2e}")
        if timer is not None:
            g = capture(fn)
            row["us_per_layer"] = round(timer(g.replay) / layers, 2)
            row["weight_floor_us"] = round(2 * n * kk * 2 / bw * 1e6, 2)
            del g
        rows_out.append(row)
        print(f"{name:44s} K {kk:5d}: {row.get('us_per_layer', '-')} us a layer", flush=True)

    for extra in extras:
        kk = k + extra
        ws = [torch.randn(2 * n, kk, device=device, dtype=dtype) * kk ** -0.5 for _ in range(layers)]
        xk = torch.randn(rows, kk, device=device, dtype=dtype)
        outs = [torch.empty(rows, n, device=device, dtype=dtype) for _ in range(layers)]

        def tile(ws=ws, xk=xk, outs=outs):
            for w, o in zip(ws, outs):
                rms_norm(x, norm_w, 1e-5)  # the step's predecessor (its output unused here)
                tma_gemm(xk, w, out=o, config=cfg, glu="silu", check=False)
            return outs[0]

        record("gated tile, K extended", kk, tile, stream_gemm_reference(xk, ws[0], glu="silu"))
        del ws, outs
    extra = max(extras)
    ws = [torch.randn(2 * n + extra, k, device=device, dtype=dtype) * k ** -0.5 for _ in range(layers)]
    ys = [torch.empty(rows, 2 * n + extra, device=device, dtype=dtype) for _ in range(layers)]

    def folded():
        for w, y in zip(ws, ys):
            torch.matmul(rms_norm(x, norm_w, 1e-5), w.T, out=y)
            h = act_mul(y[:, :n], y[:, n:2 * n], "silu")
        return h

    xn = rms_norm(x, norm_w, 1e-5)
    record(f"cuBLAS folded ({extra} A rows) + act-mul, no expand", k, folded,
           stream_gemm_reference(xn, ws[-1][: 2 * n], glu="silu"))
    if args.smoke:
        print("smoke: every variant ran and equals the reference")
    return bg.write_out(rows_out, args.out)


if __name__ == "__main__":
    sys.exit(main())
