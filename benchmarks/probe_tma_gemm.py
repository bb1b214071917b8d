"""Probe (#13): the TMA-fed decode GEMM (``ops.tma_gemm``) against cuBLAS at 65-128 rows, per shape
class; writes the library's tile table.

For each GEMM of an 8B Llama layer (q/k/v fused, o, gate/up fused, down), plain and folded (the A
of 8 adapters of rank 16 stacked under each weight, as the mixed step's ``[W; A]`` GEMMs are), and
each batch, 32 layers' worth of distinct weights are multiplied in one CUDA graph, each GEMM after
fastlora's RMSNorm writing its input (as in a step; a PDL launch has a kernel to overlap), and the
replay is timed. Reported: microseconds per GEMM, the weight's bytes over that time against the copy
bandwidth measured in the same run, and the ratio to cuBLAS (``F.linear``); every candidate is first
checked against ``F.linear``. ``--glu``: gate/up with the activation, cuBLAS then ``act_mul`` against
the kernel's ``glu`` epilogue.

Then, per shape class (``base_ops.stream_linears.shape_class``), the tile with the least total time
over the class's shapes and batches, kept only where it beat cuBLAS in every one of them, goes to
``--table`` (the library's ``TMA_TILES``), with the GPU and versions; a class left out keeps cuBLAS.

    python benchmarks/probe_tma_gemm.py --glu --out benchmarks/results/probe_tma_gemm_h200.csv
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench_generate as bg  # noqa: E402
from probe_stream_gemm import MODELS, gate_up_buffers, sites_of  # noqa: E402
from peft_fastlora.base_ops.stream_linears import SPLIT_MAX_N, TMA_TILES, shape_class  # noqa: E402
from peft_fastlora.ops.rms_norm import rms_norm  # noqa: E402
from peft_fastlora.ops.silu_mul import act_mul  # noqa: E402
from peft_fastlora.ops.stream_gemm import StreamWorkspace  # noqa: E402
from peft_fastlora.ops.tma_gemm import MAX_ROWS, SHARED_BYTES, TmaConfig, shared_bytes, tma_gemm  # noqa: E402

# (block_n, block_k, num_warps, num_stages): the pipeline's buffers within SHARED_BYTES at 128 rows
TILES = [(128, 64, 8, 4), (128, 64, 8, 6), (128, 64, 4, 4), (128, 128, 8, 3), (64, 128, 4, 4), (64, 64, 4, 6),
         (256, 64, 8, 3), (256, 64, 8, 4)]
SPLITS = (1, 2, 4)  # K ranges; layers wider than SPLIT_MAX_N take one
# and for the widest tiles (the least re-reading of x from the L2), the K ranges that give about one
# program per SM at the 8B's 4,096 and 6,144 outputs (16 and 24 column blocks of 256)
WIDE_SPLITS = {256: (5, 8), 128: (3,)}
GLU_TILES = [(64, 64, 8, 4), (64, 128, 8, 3), (128, 64, 8, 3), (128, 64, 8, 4)]


def sweep(n: int):
    if n > SPLIT_MAX_N:
        pairs = [(tile, 1) for tile in TILES]
    else:
        pairs = list(itertools.product(TILES, SPLITS))
        pairs += [(tile, s) for tile in TILES for s in WIDE_SPLITS.get(tile[0], ())]
    return [TmaConfig(bn, bk, s, w, st) for (bn, bk, w, st), s in pairs
            if shared_bytes(TmaConfig(bn, bk, s, w, st), MAX_ROWS, 2) <= SHARED_BYTES]


def name_of(c: TmaConfig) -> str:
    return "tma_n{}_k{}_s{}_w{}_st{}".format(*c)


def timed(args, timer, capture, fn, layers):
    """Microseconds per layer of ``fn`` (a graph of all layers), or None where it does not run."""
    try:
        g = capture(fn)
    except Exception as e:  # a tile that does not fit (shared memory) is no candidate
        print(f"  {type(e).__name__}: {str(e)[:160]}", flush=True)
        return None
    us = timer(g.replay) / layers
    del g
    return us


def gemm_sweep(args, timer, bw, capture, vers):
    rows, results = [], {}  # results[(class, config or "cublas")][(site, fold, batch)] = us
    layers = MODELS[args.model][4]
    for site, fold in itertools.product(args.sites, args.fold_rows):
        k, n = sites_of(args.model, fold)[site]
        cls = shape_class(n, k)
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(layers)]
        norm_w = torch.ones(k, device="cuda", dtype=torch.bfloat16)
        work = StreamWorkspace("cuda", 8 * MAX_ROWS * n, n)  # the most K ranges of the sweep
        for bs in args.batches:
            x = torch.randn(bs, k, device="cuda", dtype=torch.bfloat16)
            outs = [torch.empty(bs, n, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]
            ref = F.linear(x, ws[0]).float()
            times = {}
            for cfg in [None] + sweep(n):
                if cfg is None:
                    gemm = lambda a, w, o: torch.matmul(a, w.T, out=o)  # noqa: E731
                else:
                    gemm = lambda a, w, o, cfg=cfg: tma_gemm(a, w, out=o, config=cfg, workspace=work, check=False)  # noqa: E731
                    try:
                        err = (tma_gemm(x, ws[0], config=cfg, workspace=work).float() - ref).abs().max().item()
                    except Exception as e:  # a tile that does not compile is no candidate
                        print(f"{site} {name_of(cfg)} b{bs}: {type(e).__name__}: {str(e)[:160]}", flush=True)
                        continue
                    if err > 0.05:  # a wrong kernel is no candidate
                        print(f"{site} {name_of(cfg)} b{bs}: max error {err}", flush=True)
                        continue
                us = timed(args, timer, capture,
                           lambda: [gemm(rms_norm(x, norm_w, 1e-5), w, o) for w, o in zip(ws, outs)], layers)
                if us is not None:
                    times[cfg] = us
                    results.setdefault((cls, cfg or "cublas"), {})[(site, k, fold, bs)] = us
            base = times[None]
            for cfg, us in times.items():
                rows.append(dict(vers, fold_rows=fold, site=site, shape_class=cls, n=n, k=k, batch=bs,
                                 impl=name_of(cfg) if cfg else "cublas", us=round(us, 2),
                                 of_copy_bw=round(n * k * 2 / (us * 1e-6) / bw, 3), vs_cublas=round(us / base, 3)))
            best = min((c for c in times if c), key=times.get, default=None)
            if best is not None:
                print(f"{site:8s} fold {fold:3d} b{bs:<3d} cublas {base:7.2f} us ({n * k * 2 / (base * 1e-6) / bw:.2f} "
                      f"of copy bw); best {name_of(best)} {times[best]:7.2f} us ({n * k * 2 / (times[best] * 1e-6) / bw:.2f})",
                      flush=True)
        ws = outs = work = None
        torch.cuda.empty_cache()
        bg.write_out(rows, args.out)  # after each site: what ran is kept if a later one fails or times out
        write_table(args, vers, results)
    return rows, results


def glu_sweep(args, timer, bw, capture, vers, results):
    """gate/up (plain) with the activation: cuBLAS then ``act_mul`` against the ``glu`` epilogue."""
    k, n2 = sites_of(args.model)["gate_up"]
    n = n2 // 2
    layers = MODELS[args.model][4]
    ws = [torch.randn(n2, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(layers)]
    norm_w = torch.ones(k, device="cuda", dtype=torch.bfloat16)
    rows = []
    for bs in args.batches:
        x, both, outs, ref = gate_up_buffers(ws, bs)
        impls = [("cublas+act_mul", None, lambda a, w, o, t: act_mul(*torch.matmul(a, w.T, out=t).split(n, dim=1), "silu"))]
        impls += [(name_of(c) + "_glu", c, lambda a, w, o, t, c=c: tma_gemm(a, w, out=o, config=c, check=False, glu="silu"))
                  for c in (TmaConfig(bn, bk, 1, w, st) for bn, bk, w, st in GLU_TILES)]
        times = {}
        for name, cfg, fn1 in impls:
            try:
                err = (fn1(x, ws[0], outs[0], both[0]).float() - ref).abs().max().item()
            except Exception as e:  # a tile that does not compile is no candidate
                print(f"glu {name} b{bs}: {type(e).__name__}: {str(e)[:160]}", flush=True)
                continue
            if err > 0.05:
                print(f"glu {name} b{bs}: max error {err}", flush=True)
                continue
            us = timed(args, timer, capture,
                       lambda: [fn1(rms_norm(x, norm_w, 1e-5), w, o, t) for w, o, t in zip(ws, outs, both)], layers)
            if us is not None:
                times[name] = us
                results.setdefault(("glu", cfg or "cublas"), {})[("gate_up_act", k, 0, bs)] = us
        for name, us in times.items():
            rows.append(dict(vers, fold_rows=0, site="gate_up_act", shape_class="glu", n=n2, k=k, batch=bs, impl=name,
                             us=round(us, 2), of_copy_bw=round(n2 * k * 2 / (us * 1e-6) / bw, 3),
                             vs_cublas=round(us / times["cublas+act_mul"], 3)))
        best = min(times, key=times.get)
        print(f"gate_up+act b{bs:<3d} cublas+act_mul {times['cublas+act_mul']:7.2f} us, best {best} {times[best]:7.2f} us",
              flush=True)
    return rows


def choose(results) -> dict:
    """Per class, the tile of least total time over the class's measurements (keyed (site, K, fold,
    batch)), where it beat cuBLAS in every one of them, with the shallowest K measured."""
    table = {}
    for cls in sorted({c for c, _ in results}):
        base = results.get((cls, "cublas"), {})
        best, best_total = None, None
        for (c, cfg), times in results.items():
            if c != cls or cfg == "cublas" or set(times) != set(base):
                continue
            if all(times[key] < base[key] for key in base):
                total = sum(times.values())
                if best_total is None or total < best_total:
                    best, best_total = cfg, total
        if best is not None:
            table[cls] = dict(best._asdict(), min_k=min(key[1] for key in base))
            print(f"{cls}: {name_of(best)} ({best_total:.1f} us against cuBLAS's {sum(base.values()):.1f} us "
                  f"over {len(base)} measurements)", flush=True)
        else:
            print(f"{cls}: no tile beat cuBLAS in every measurement: cuBLAS kept", flush=True)
    return table


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/results/probe_tma_gemm_h200.csv")
    p.add_argument("--table", default=TMA_TILES, help="where the tile table goes (the library's by default)")
    p.add_argument("--batches", type=int, nargs="+", default=[80, 128])
    p.add_argument("--sites", nargs="+", default=["qkv", "o", "gate_up", "down"])
    p.add_argument("--model", choices=["8b"], default="8b")
    p.add_argument("--fold-rows", type=int, nargs="+", default=[0, 128],
                   help="A rows stacked under each weight (0: the plain layer; 128: 8 adapters of rank 16)")
    p.add_argument("--glu", action="store_true", help="also gate/up with the activation in the epilogue")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--smoke", action="store_true", help="CPU (TRITON_INTERPRET=1): each sweep tile on a tiny shape")
    p.add_argument("--from-csv", nargs="+", metavar="CSV",
                   help="no GPU: the table from these probe CSVs' measurements (one machine's run each)")
    args = p.parse_args(argv)
    if args.from_csv:
        return table_from_csv(args)
    if args.smoke:
        x, w = torch.randn(70, 96), torch.randn(40, 96)
        ws = StreamWorkspace("cpu", 4 * 70 * 40, 40)
        for cfg in sweep(4096):
            small = cfg._replace(block_n=min(cfg.block_n, 32), block_k=min(cfg.block_k, 32), num_stages=2)
            torch.testing.assert_close(tma_gemm(x, w, config=small, workspace=ws), x @ w.T, rtol=1e-4, atol=1e-4)
        for bn, bk, warps, stages in GLU_TILES:
            small = TmaConfig(min(bn, 32), min(bk, 32), 1, warps, 2)
            torch.testing.assert_close(tma_gemm(x, torch.cat([w, w]), config=small, glu="silu"),
                                       F.silu(x @ w.T) * (x @ w.T), rtol=1e-4, atol=1e-4)
        a, b = ("down", 14336, 0, 128), ("down", 4096, 0, 128)
        assert choose({("deep", "cublas"): {a: 2.0, b: 2.0}, ("deep", TmaConfig()): {a: 1.5, b: 1.9}}) == {
            "deep": dict(TmaConfig()._asdict(), min_k=4096)}
        assert choose({("deep", "cublas"): {a: 2.0, b: 1.0}, ("deep", TmaConfig()): {a: 1.5, b: 1.1}}) == {}
        print("smoke: every sweep tile equals x @ w.T (and the GLU tiles act(gate) * up); a class keeps only a tile that beat cuBLAS everywhere")
        return 0
    from bench_kernels import capture, gpu_probe

    start = gpu_probe("probe_tma_gemm", args.iters)
    if start is None:
        return 0
    timer, bw, vers = start
    rows, results = gemm_sweep(args, timer, bw, capture, vers)
    if args.glu:
        rows += glu_sweep(args, timer, bw, capture, vers, results)
        bg.write_out(rows, args.out)
    write_table(args, vers, results)
    return 0


def table_from_csv(args) -> int:
    """The tile table chosen from the measurements of earlier runs' CSVs (each run's rows compared
    with its own cuBLAS rows; a later CSV's measurement of the same key replaces an earlier one's)."""
    import csv
    import re

    results, vers = {}, {}
    for path in args.from_csv:
        with open(path) as f:
            for row in csv.DictReader(f):
                vers = {k: row[k] for k in ("gpu", "torch", "triton")}
                match = re.match(r"tma_n(\d+)_k(\d+)_s(\d+)_w(\d+)_st(\d+)", row["impl"])
                cfg = TmaConfig(*map(int, match.groups())) if match else "cublas"
                key = (row["site"], int(row["k"]), int(row["fold_rows"]), int(row["batch"]))
                results.setdefault((row["shape_class"], cfg), {})[key] = float(row["us"])
    args.batches = sorted({key[3] for times in results.values() for key in times})
    args.fold_rows = sorted({key[2] for times in results.values() for key in times})
    write_table(args, dict(vers, from_csv=[os.path.basename(p) for p in args.from_csv]), results)
    return 0


def write_table(args, vers, results) -> None:
    """The tile table of the classes measured so far (a class measured on part of its shapes is
    chosen on those; the last write covers them all)."""
    table = dict(vers, source="benchmarks/probe_tma_gemm.py", batches=args.batches, fold_rows=args.fold_rows,
                 classes=choose(results))
    with open(args.table, "w") as f:
        json.dump(table, f, indent=1)
        f.write("\n")
    print("tile table written to", args.table, flush=True)


if __name__ == "__main__":
    sys.exit(main())
