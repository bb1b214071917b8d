"""Probe (#13): can a Triton weight-streaming GEMM beat cuBLAS on a decode step's GEMM shapes?

For each GEMM of an 8B Llama layer (q/k/v fused, o, gate/up fused, down; with and without the
folded LoRA rows of 8 slots at rank 16 under the weight) and each batch, 32 layers' worth of
distinct weights are multiplied in one CUDA graph (so L2 holds none of them) and the replay is
timed: ``F.linear`` (cuBLAS, whatever kernels it picks, split-K reductions included) against
``ops.skinny_gemm`` at several tiles. Reported: microseconds per GEMM and the weight's bytes over
that time, against the copy bandwidth measured in the same run.

    python benchmarks/probe_skinny_gemm.py --out benchmarks/results/probe_skinny_gemm_h200.csv
"""

from __future__ import annotations

import argparse
import csv
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HIDDEN, Q, KV, INTER, LAYERS, SLOTS, RANK = 4096, 4096, 1024, 14336, 32, 8, 16
# site: (K, N of the base weight, rows the fold adds: every slot's A of every stacked module)
SITES = {"qkv": (HIDDEN, Q + 2 * KV, SLOTS * 3 * RANK), "o": (HIDDEN, HIDDEN, SLOTS * RANK),
         "gate_up": (HIDDEN, 2 * INTER, SLOTS * 2 * RANK), "down": (INTER, HIDDEN, SLOTS * RANK)}
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
    from peft_fastlora.ops.skinny_gemm import SkinnyConfig, skinny_gemm

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
            del ws
            torch.cuda.empty_cache()
    with open(args.out, "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=list(rows[0]))
        wr.writeheader()
        wr.writerows(rows)
    print("written", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
