"""Probe (#13): how fast can an 8B layer's GEMMs go at 128 rows? The best kernel we can find for each
shape, measured alone, against the weight's byte floor.

#13 asks for the mixed 8B step within 1.50x its byte floor at batch 128, and allows a target out of
physical reach to be shown so by "the best achievable kernel for that GEMM shape measured alone".
At 128 rows a GEMM is near the ridge (2 x 128 FLOPs per weight element read: 256 FLOPs a byte pair),
so both the weight stream and the tensor cores bound it. For each site (q/k/v, o, gate/up, down;
plain, or with the adapters' A stacked under the weight as the mixed step's folded GEMMs are), 32
layers' worth of distinct weights run in one CUDA graph, each GEMM after fastlora's RMSNorm writing
its input (as in a step), L2 flushed before each replay; reported per GEMM:

- ``cublas``: ``torch.matmul`` (the library's path at 128 rows but for the gated gate/up tile);
- ``cublaslt``: the same with ``torch.backends.cuda.preferred_blas_library("cublaslt")``;
- ``inductor``: ``torch.compile(mode="max-autotune-no-cudagraphs")`` of ``x @ w.T``: Inductor's own
  search over its Triton GEMM templates (and cuBLAS), the tuned choice then timed in our graph
  (its AUTOTUNE tables go to the log); ``inductor_triton`` limits the search to Triton templates;
- ``read``: a kernel that only streams the weight (``probe_stream_gemm.read_bound``, best tile):
  what the bytes alone cost a kernel, not a GEMM.

    python benchmarks/probe_gemm_bound.py --out benchmarks/results/probe_gemm_bound_h200.csv
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench_generate as bg  # noqa: E402
from probe_stream_gemm import MODELS, READ_TILES, read_bound, sites_of  # noqa: E402
from peft_fastlora.ops.rms_norm import rms_norm  # noqa: E402

IMPLS = ("cublas", "cublaslt", "inductor", "inductor_triton", "read")


def compiled_linear(triton_only: bool, exhaustive: bool):
    """A fresh ``x @ w.T`` compiled with max-autotune (a new function object: its own cache entry)."""
    import torch._inductor.config as ic

    ic.max_autotune_gemm_backends = "TRITON" if triton_only else "ATEN,TRITON"
    ic.max_autotune_gemm_search_space = "EXHAUSTIVE" if exhaustive else "DEFAULT"

    def linear(x, w):
        return x @ w.T

    return torch.compile(linear, mode="max-autotune-no-cudagraphs", dynamic=False, fullgraph=True)


def site_rows(args, timer, bw, capture, vers, site, k, n, bs):
    layers = MODELS["8b"][4]
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(layers)]
    norm_w = torch.ones(k, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(bs, k, device="cuda", dtype=torch.bfloat16)
    outs = [torch.empty(bs, n, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]
    ref = (rms_norm(x, norm_w, 1e-5).float() @ ws[0].float().T)
    rows, times = [], {}
    for impl in args.impls:
        if impl == "read":
            sums = torch.empty(n, device="cuda", dtype=torch.float32)
            best = None
            for tile in READ_TILES:
                g = capture(lambda t=tile: [(rms_norm(x, norm_w, 1e-5), read_bound(w, sums, t)) for w in ws])
                us = timer(g.replay) / layers
                best = us if best is None else min(best, us)
                del g
            times[impl] = best
            continue
        try:
            if impl.startswith("inductor"):
                fn = compiled_linear(impl == "inductor_triton", args.exhaustive)
                print(f"--- {impl} {site} b{bs}: autotune", flush=True)
                out = fn(rms_norm(x, norm_w, 1e-5), ws[0])  # the search, outside any capture
                gemm = lambda a, w, o, fn=fn: fn(a, w)  # noqa: E731
            else:
                torch.backends.cuda.preferred_blas_library("cublaslt" if impl == "cublaslt" else "cublas")
                gemm = lambda a, w, o: torch.matmul(a, w.T, out=o)  # noqa: E731
                out = gemm(rms_norm(x, norm_w, 1e-5), ws[0], outs[0])
            err = (out.float() - ref).abs().max().item()
            if err > 0.05:  # a wrong kernel is no candidate
                print(f"{site} {impl} b{bs}: max error {err}", flush=True)
                continue
            g = capture(lambda: [gemm(rms_norm(x, norm_w, 1e-5), w, o) for w, o in zip(ws, outs)])
            times[impl] = timer(g.replay) / layers
            del g
        except Exception as e:  # one implementation failing leaves the others' rows
            print(f"{site} {impl} b{bs}: {type(e).__name__}: {str(e)[:300]}", flush=True)
    torch.backends.cuda.preferred_blas_library("cublas")
    nbytes = n * k * 2
    for impl, us in times.items():
        rows.append(dict(vers, site=site, fold_rows=args.fold_rows, n=n, k=k, batch=bs, impl=impl,
                         us=round(us, 2), floor_us=round(nbytes / bw * 1e6, 2),
                         of_copy_bw=round(nbytes / (us * 1e-6) / bw, 3),
                         tflops=round(2 * bs * n * k / (us * 1e-6) / 1e12, 1),
                         vs_cublas=round(us / times["cublas"], 3) if "cublas" in times else ""))
        print(f"{site:8s} b{bs:<3d} {impl:16s} {us:8.2f} us  {rows[-1]['of_copy_bw']:.2f} of copy bw  "
              f"{rows[-1]['tflops']:6.1f} TFLOP/s", flush=True)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/results/probe_gemm_bound_h200.csv")
    p.add_argument("--batches", type=int, nargs="+", default=[128])
    p.add_argument("--sites", nargs="+", default=["qkv", "o", "gate_up", "down"])
    p.add_argument("--fold-rows", type=int, default=0,
                   help="A rows stacked under each weight (128: 8 adapters of rank 16, as the mixed step's)")
    p.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
    p.add_argument("--exhaustive", action="store_true", help="Inductor's exhaustive GEMM search space")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--smoke", action="store_true",
                   help="CPU (TRITON_INTERPRET=1): the sites' shapes and the read-only kernel on a tiny weight")
    args = p.parse_args(argv)
    if args.smoke:
        sites = sites_of("8b", args.fold_rows)
        w = torch.randn(40, 96)
        sums = torch.empty(40)
        read_bound(w, sums, (16, 32, 4, 2))
        torch.testing.assert_close(sums, w.sum(1), rtol=1e-4, atol=1e-4)
        print("smoke: sites", {s: sites[s] for s in args.sites}, "; the read-only kernel sums each weight row")
        return 0
    from bench_kernels import capture, gpu_probe

    start = gpu_probe("probe_gemm_bound", args.iters)
    if start is None:
        return 0
    timer, bw, vers = start
    rows = []
    sites = sites_of("8b", args.fold_rows)
    for site in args.sites:
        k, n = sites[site]
        for bs in args.batches:
            rows += site_rows(args, timer, bw, capture, vers, site, k, n, bs)
            bg.write_out(rows, args.out)  # what ran is kept if a later site fails or times out
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
