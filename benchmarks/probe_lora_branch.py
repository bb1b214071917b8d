"""Probe (#13, batch 128): a folded site's LoRA on a parallel branch of the decode graph, off the base
GEMM's critical path.

A mixed step's folded q/k/v and o sites run cuBLAS over ``[W; A]`` (the base outputs and every arena
row's shrink) and then the expand, a launch on the critical path that cannot start before cuBLAS
ends (cuBLAS does not let a PDL launch start early: ``probe_cublas_wait.py``); session 36's timeline
charges each about 4.4 us a layer at 128 rows. Here the site forks after the kernel that writes its
input: the main branch runs cuBLAS over ``W`` alone, a second branch the shrink (cuBLAS over A's
arena rows), zeroes a delta buffer and runs the expand into it; the branches join before the kernel
that reads the site's output, which would add the delta (here that kernel is the library's as it
is, a stand-in for its time: the add is one more read of the delta). What the branch can save is the
expand's launch and the fold's extra rows on the critical path, if its kernels find room on the SMs
beside the GEMM's.

Per site, 32 layers of distinct weights in one CUDA graph, us a layer, the 8B shapes, 8 adapters of
rank 16 (every ninth row of no adapter):

- q/k/v: RMSNorm, then the variant, then ``ops.rotary_kv`` (the rotary and the KV write);
- o: the variant on an attention output, then ``ops.rms_norm.add_rms_norm`` (the residual add and
  the post-attention norm).

Variants: ``library`` (folded GEMM, expand), ``branch`` (above), ``base`` (the GEMM over ``W`` and the
consumer, no LoRA: the floor of what any LoRA form can reach). The branch's ``y + delta`` is checked
against the library's output before any timing.

    python benchmarks/probe_lora_branch.py --out benchmarks/results/probe_lora_branch_h200.csv
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
from probe_rotary_lora import attention_setup, rotary_inputs  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/results/probe_lora_branch_h200.csv")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    p.add_argument("--sites", nargs="+", default=["qkv", "o"], choices=["qkv", "o"])
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--smoke", action="store_true", help="CPU (TRITON_INTERPRET=1): tiny shapes, no timing, no branch")
    args = p.parse_args(argv)
    from bench_kernels import capture, packed_layout
    from peft_fastlora import ForwardBatch, get_backend
    from peft_fastlora.ops.lora_expand import lora_expand
    from peft_fastlora.ops.rms_norm import add_rms_norm, rms_norm
    from peft_fastlora.ops.rotary_kv import rotary_kv_write

    setup = attention_setup(args, "probe_lora_branch", [20])
    if setup is None:
        return 0
    device, dtype, k, nq, nkv, d, layers, timer, vers, batches = setup
    branch = torch.cuda.Stream() if device == "cuda" else None
    ranks = [args.rank] * args.adapters
    scalings = [0.5 + 0.25 * (s % 4) for s in range(args.adapters)]
    gen = torch.Generator(device=device).manual_seed(0)
    norm_w = torch.ones(k, device=device, dtype=dtype)
    rows_out = []
    for site in args.sites:
        offsets = (0, nq * d, (nq + nkv) * d, (nq + 2 * nkv) * d) if site == "qkv" else (0, nq * d)
        n, c = offsets[-1], len(offsets) - 1
        a_rows, b_offs, t_rows, b_len = packed_layout(offsets, ranks)
        ws = [torch.randn(n + t_rows, k, generator=gen, device=device, dtype=dtype) * k ** -0.5 for _ in range(layers)]
        bs = [torch.randn(b_len, generator=gen, device=device, dtype=dtype) * args.rank ** -0.5 for _ in range(layers)]
        a_rows, b_offs = a_rows.to(device), b_offs.to(device)
        rt = torch.tensor([[r] * c for r in ranks], dtype=torch.int32, device=device)
        sc = torch.tensor([[v] * c for v in scalings], dtype=torch.float32, device=device)
        for rows in batches:
            slots = [i % (args.adapters + 1) for i in range(rows)]
            slots = [-1 if sl == args.adapters else sl for sl in slots]  # -1: a row of no adapter
            backend = get_backend("triton")(args.adapters, device)
            bi = backend.prepare_lora_batch(ForwardBatch.from_shape(rows, 1, device), slots, ranks, scalings,
                                            use_cuda_graph=False)
            plan = (bi.sorted_token_ids, bi.chunk_slot, bi.chunk_start, bi.chunk_len)
            x = torch.randn(rows, k, generator=gen, device=device, dtype=dtype)
            residual = torch.randn(rows, n, generator=gen, device=device, dtype=dtype)
            y = torch.empty(rows, n + t_rows, device=device, dtype=dtype)
            s = torch.empty(rows, t_rows, device=device, dtype=dtype)
            delta = torch.empty(rows, n, device=device, dtype=dtype)
            cos, sin, k_cache, v_cache, length = rotary_inputs(rows, nkv, d, dtype, device, gen)

            def expand(shrink, b, out):
                lora_expand(shrink, b, offsets, rt, sc, out, *plan, block_m=bi.block_m, check=False, b_offs=b_offs,
                            b_align=8 if args.rank % 8 == 0 else 1, y_cols=a_rows, max_rank=args.rank)

            def site_input():
                return rms_norm(x, norm_w, 1e-5) if site == "qkv" else x

            def consumer(out):
                if site == "o":
                    return add_rms_norm(out, residual, norm_w, 1e-5)[0]
                q = out[:, : offsets[1]].view(rows, 1, nq, d).transpose(1, 2)
                kk = out[:, offsets[1]: offsets[2]].view(rows, 1, nkv, d).transpose(1, 2)
                v = out[:, offsets[2]: n].view(rows, 1, nkv, d).transpose(1, 2)
                return rotary_kv_write(q, kk, v, cos, sin, k_cache, v_cache, length)

            def library(w, b):
                torch.matmul(site_input(), w.T, out=y)
                expand(y[:, n:], b, y[:, :n])
                return consumer(y[:, :n])

            def lora_branch(w, b, xin):
                s.copy_(xin @ w[n:].T)  # (a fresh output: matmul's out= would not take the strided view)
                delta.zero_()
                expand(s, b, delta)

            def branched(w, b):
                xin = site_input()
                if branch is None:  # (the smoke: one stream)
                    lora_branch(w, b, xin)
                else:
                    branch.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(branch):
                        lora_branch(w, b, xin)
                torch.matmul(xin, w[:n].T, out=y[:, :n])
                if branch is not None:
                    torch.cuda.current_stream().wait_stream(branch)
                return consumer(y[:, :n])

            def base(w, b):
                torch.matmul(site_input(), w[:n].T, out=y[:, :n])
                return consumer(y[:, :n])

            # the branch's y + delta against the library's output (before its consumer)
            library(ws[0], bs[0])
            want = y[:, :n].float().clone()
            branched(ws[0], bs[0])
            if branch is not None:
                torch.cuda.synchronize()
            got = (y[:, :n].float() + delta.float())
            err = ((got - want).abs().max() / want.abs().max()).item()
            lora_size = ((want - y[:, :n].float()).abs().max() / want.abs().max()).item()
            ok = err <= (2 ** -7 if dtype != torch.float32 else 1e-5) and lora_size > 2 ** -6
            print(f"{site} batch {rows}: branch y + delta against the library's output, relative {err:.2e} "
                  f"(the delta itself {lora_size:.2e}){'' if ok else ': WRONG'}", flush=True)
            if not ok:
                return 1
            for name, fn in (("library: folded GEMM + expand", library), ("branch: GEMM | shrink + expand", branched),
                             ("base: GEMM, no LoRA", base)):
                row = dict(vers, site=site, batch=rows, adapters=args.adapters, rank=args.rank, variant=name,
                           rel_err=f"{err:.2e}" if name.startswith("branch") else "")
                if timer is not None:
                    g = capture(lambda fn=fn: [fn(w, b) for w, b in zip(ws, bs)])
                    row["us_per_layer"] = round(timer(g.replay) / layers, 2)
                    del g
                rows_out.append(row)
                print(f"{site:4s} batch {rows:4d} {name:32s} {row.get('us_per_layer', '-')} us a layer", flush=True)
        ws = bs = None
        if device == "cuda":
            torch.cuda.empty_cache()
    if args.smoke:
        print("smoke: the branch's output plus its delta matched the library's")
    return bg.write_out(rows_out, args.out)


if __name__ == "__main__":
    sys.exit(main())
