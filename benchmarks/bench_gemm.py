"""The decode steps' base GEMMs, per shape and batch: cuBLAS against fastlora's weight-streaming GEMM
(1-64 rows) and its TMA GEMM (65-128 rows); writes the TMA kernel's tile table the library ships.

For each GEMM of one layer (q/k/v fused, o, gate/up fused, down; ``--fold-rows``: the adapters' A
rows stacked under each weight, as the mixed step's folded ``[W; A]`` GEMMs are) and each batch,
the model's layer count of distinct weights are multiplied in one CUDA graph (L2 holds none of
them), each GEMM after fastlora's RMSNorm writing its input as in a step (``--chains alone``: back
to back), and the replay is timed with the L2 flushed. Reported: microseconds a GEMM, the weight's bytes
over that time as a share of the copy bandwidth measured in the same run, and the ratio to cuBLAS.
Every candidate is first checked against ``F.linear``. Implementations:

- ``cublas``: ``torch.matmul`` (``--bound`` adds ``cublaslt``, the same through
  ``preferred_blas_library("cublaslt")``, and ``inductor`` / ``inductor_triton``: ``torch.compile``
  max-autotune of ``x @ w.T``, Inductor's own search over its Triton templates and ATen's GEMM, or
  the templates alone);
- ``stream_*``: ``ops.stream_gemm`` at each config of its sweep (layers narrower than 4,096 outputs
  take the narrow sweep: more K ranges), for batches up to 64;
- ``tma_*``: ``ops.tma_gemm`` at each tile of its sweep, for batches of 65-128;
- ``read_bound_*``: a kernel that only streams the weight (sums each row): what the bytes alone cost
  a kernel, not a GEMM (at the run's first batch);
- ``--glu``: gate/up with the activation, cuBLAS then ``act_mul`` against the kernels' gated
  epilogue.

``--table PATH``: per shape class (``base_ops.stream_linears.shape_class``), the TMA tile of least
total time over the class's shapes and batches, kept only where it beat cuBLAS in every one of them;
a class left out keeps cuBLAS. ``--from-csv``: the same choice from a committed run's CSV, no GPU.

    python benchmarks/bench_gemm.py --batches 1 16 32 64               # gemm_8b_h200.csv
    python benchmarks/bench_gemm.py --batches 80 128 --fold-rows 0 128 --glu --tag tma \\
        --table peft_fastlora/base_ops/tma_tiles_h200.json
    python benchmarks/bench_gemm.py --batches 128 --bound --tag bound
    python benchmarks/bench_gemm.py --smoke     # CPU (Triton's interpreter): every sweep entry on a tiny shape
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness as hx  # noqa: E402
from peft_fastlora import Tuning  # noqa: E402
from peft_fastlora.base_ops.stream_linears import shape_class  # noqa: E402

SPLIT_MAX_N = Tuning().stream_split_max_n  # the widest layer the library splits
from peft_fastlora.ops import pdl  # noqa: E402
from peft_fastlora.ops.rms_norm import rms_norm  # noqa: E402
from peft_fastlora.ops.silu_mul import act_mul  # noqa: E402
from peft_fastlora.ops.stream_gemm import StreamConfig, StreamWorkspace, stream_gemm  # noqa: E402
from peft_fastlora.ops.tma_gemm import MAX_ROWS, SHARED_BYTES, TmaConfig, shared_bytes, tma_gemm  # noqa: E402

# StreamConfig: (block_n, block_k, split_k, num_warps, num_stages, prefetch bytes, preload)
STREAM_SWEEP = [(64, 128, 1, 4, 6, 0, False), (64, 128, 1, 4, 8, 0, False), (64, 64, 1, 4, 8, 0, False),
                (64, 256, 1, 4, 4, 0, False), (64, 128, 1, 8, 6, 0, False), (64, 128, 1, 4, 6, 0, True),
                (64, 128, 1, 4, 6, 4096, False), (64, 128, 1, 4, 6, 4096, True), (32, 128, 1, 4, 8, 0, False),
                (32, 256, 1, 4, 4, 0, False), (32, 256, 1, 4, 4, 0, True), (128, 64, 1, 4, 6, 0, False),
                (128, 128, 1, 8, 4, 0, False), (16, 512, 1, 4, 4, 0, False), (16, 256, 1, 4, 6, 0, True),
                (64, 128, 2, 4, 6, 0, True), (128, 128, 2, 8, 4, 0, True), (64, 256, 4, 4, 4, 0, False),
                (128, 128, 4, 8, 4, 0, True)]
# layers narrower than 4,096 outputs (a 1B model's q/k/v, o and down): too few column blocks to cover
# the SMs without splitting K, so narrow tiles and 2-8 K ranges
NARROW_SWEEP = [(64, 128, 1, 4, 8, 0, False), (32, 128, 1, 4, 8, 0, False), (64, 128, 2, 4, 6, 0, True),
                (64, 128, 2, 4, 6, 0, False), (64, 128, 4, 4, 6, 0, False), (64, 128, 4, 4, 4, 0, True),
                (64, 256, 4, 4, 4, 0, False), (64, 128, 8, 4, 4, 0, False), (32, 128, 2, 4, 8, 0, False),
                (32, 128, 4, 4, 6, 0, False), (32, 256, 2, 4, 4, 0, False), (32, 256, 4, 4, 4, 0, False),
                (32, 128, 8, 4, 4, 0, False), (16, 256, 2, 4, 6, 0, False), (16, 256, 4, 4, 4, 0, False),
                (128, 128, 4, 8, 4, 0, False), (64, 128, 3, 4, 6, 0, False), (64, 128, 2, 4, 8, 0, False)]
STREAM_GLU = [(64, 128, 1, 8, 4, 0, False), (64, 128, 1, 4, 4, 0, False), (64, 128, 1, 8, 3, 0, False),
              (64, 64, 1, 4, 6, 0, False), (32, 128, 1, 4, 6, 0, False), (32, 256, 1, 4, 3, 0, False),
              (128, 64, 1, 8, 3, 0, False)]
# TmaConfig: (block_n, block_k, num_warps, num_stages), each in 1, 2 or 4 K ranges where the layer is
# narrow enough to split; the widest tiles also at the K ranges that give about one program an SM
TMA_TILES = [(128, 64, 8, 4), (128, 64, 8, 6), (128, 64, 4, 4), (128, 128, 8, 3), (64, 128, 4, 4), (64, 64, 4, 6),
             (256, 64, 8, 3), (256, 64, 8, 4)]
TMA_SPLITS = (1, 2, 4)
TMA_WIDE_SPLITS = {256: (5, 8), 128: (3,)}
TMA_GLU = [(64, 64, 8, 4), (64, 128, 8, 3), (128, 64, 8, 3), (128, 64, 8, 4)]
READ_TILES = [(64, 128, 4, 6), (32, 256, 4, 4), (16, 512, 4, 4)]


def sites_of(shape: str, fold_rows: int = 0) -> dict:
    """Site -> (K, N) of one layer's GEMMs (q/k/v and gate/up fused), ``fold_rows`` A rows a module
    stacked under each weight (8 adapters of rank 16: 128)."""
    s = hx.shape_of(shape)
    h, i = s["hidden_size"], s["intermediate_size"]
    q, kv = s["num_attention_heads"] * s["head_dim"], s["num_key_value_heads"] * s["head_dim"]
    return {"qkv": (h, q + 2 * kv + 3 * fold_rows), "o": (q, h + fold_rows),
            "gate_up": (h, 2 * i + 2 * fold_rows), "down": (i, h + fold_rows)}


def tma_sweep(n: int) -> list:
    if n > SPLIT_MAX_N:
        pairs = [(tile, 1) for tile in TMA_TILES]
    else:
        pairs = [(tile, s) for tile in TMA_TILES for s in TMA_SPLITS + TMA_WIDE_SPLITS.get(tile[0], ())]
    return [TmaConfig(bn, bk, s, w, st) for (bn, bk, w, st), s in pairs
            if shared_bytes(TmaConfig(bn, bk, s, w, st), MAX_ROWS, 2) <= SHARED_BYTES]


def tma_name(c: TmaConfig) -> str:
    return "tma_n{}_k{}_s{}_w{}_st{}".format(*c)


def stream_name(c: StreamConfig) -> str:
    return "stream_n{}_k{}_s{}_w{}_st{}_pf{}{}".format(*c[:6], "_pre" if c[6] else "")


@triton.jit
def _read_bound_kernel(w_ptr, y_ptr, N, K, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       USE_PDL: tl.constexpr):
    pdl.launch_dependents(USE_PDL)
    pdl.wait(USE_PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + tl.arange(0, BLOCK_K)[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for _ in range(0, K, BLOCK_K):
        acc += tl.load(ptrs, mask=(offs_n < N)[:, None], other=0.0).to(tl.float32)
        ptrs += BLOCK_K
    tl.store(y_ptr + offs_n, tl.sum(acc, axis=1), mask=offs_n < N)


def read_bound(w, y, tile):
    """Stream ``w`` once (each row summed into ``y``): the same grid a GEMM of that tile has."""
    bn, bk, warps, stages = tile
    use_pdl = pdl.mode(w)
    _read_bound_kernel[(triton.cdiv(w.shape[0], bn),)](w, y, w.shape[0], w.shape[1], w.stride(0), BLOCK_N=bn,
                                                       BLOCK_K=bk, USE_PDL=use_pdl, num_warps=warps,
                                                       num_stages=stages, launch_pdl=use_pdl > 0)


def compiled_linear(triton_only: bool):
    """A fresh ``x @ w.T`` compiled with max-autotune (a new function object: its own cache entry),
    searching Inductor's Triton templates and ATen's GEMM, or the templates alone."""
    import torch._inductor.config as inductor_config

    inductor_config.max_autotune_gemm_backends = "TRITON" if triton_only else "ATEN,TRITON"

    def linear(x, w):
        return x @ w.T

    return torch.compile(linear, mode="max-autotune-no-cudagraphs", dynamic=False, fullgraph=True)


def candidates(args, n, bs, work, sums):
    """(name, config, gemm(a, w, out)) of every implementation timed at this width and batch (the
    read-only kernel at the run's first batch: it does not depend on the rows)."""
    def blas(lib):
        def gemm(a, w, o):
            torch.backends.cuda.preferred_blas_library(lib)
            return torch.matmul(a, w.T, out=o)
        return gemm

    out = [("cublas", None, blas("cublas"))]
    if args.bound:
        out.append(("cublaslt", None, blas("cublaslt")))
        for name, triton_only in (("inductor", False), ("inductor_triton", True)):
            fn = compiled_linear(triton_only)
            out.append((name, None, lambda a, w, o, fn=fn: fn(a, w)))
    if bs == args.batches[0]:
        out += [("read_bound_n{}_k{}_w{}_st{}".format(*t), t, lambda a, w, o, t=t: read_bound(w, sums, t))
                for t in READ_TILES]
    if bs <= 64:
        sweep = NARROW_SWEEP if n < 4096 else STREAM_SWEEP
        out += [(stream_name(StreamConfig(*c)), StreamConfig(*c), lambda a, w, o, c=StreamConfig(*c):
                 stream_gemm(a, w, out=o, config=c, workspace=work, check=False)) for c in sweep]
    elif bs <= MAX_ROWS:
        out += [(tma_name(c), c, lambda a, w, o, c=c: tma_gemm(a, w, out=o, config=c, workspace=work, check=False))
                for c in tma_sweep(n)]
    return out


def time_chain(timer, fn, layers):
    """Microseconds a layer of ``fn`` (every layer's GEMM) in one graph (None: it does not run)."""
    try:
        graph = hx.capture(fn)
        return timer(graph.replay) / layers
    except Exception as e:  # a tile that does not fit (shared memory) is no candidate
        print(f"  {type(e).__name__}: {str(e)[:160]}", flush=True)
        return None
    finally:
        torch.backends.cuda.preferred_blas_library("cublas")


def checked(name, fn, ref) -> bool:
    """Whether ``fn()`` runs and gives ``ref`` within bf16's reach (a wrong kernel is no candidate)."""
    try:
        err = (fn().float() - ref).abs().max().item()
    except Exception as e:  # a tile that does not compile is no candidate
        print(f"{name}: {type(e).__name__}: {str(e)[:160]}", flush=True)
        return False
    if err > 0.05:
        print(f"{name}: max error {err}", flush=True)
    return err <= 0.05


def gemm_sweep(args, timer, bw, vers, results):
    """The rows of every site, fold and batch; ``results`` collects the TMA measurements for the table."""
    rows, layers, dev = [], hx.shape_of(args.model)["num_hidden_layers"], hx.DEVICE
    for site in args.sites:
        for fold in args.fold_rows:
            k, n = sites_of(args.model, fold)[site]
            cls = shape_class(n, k)
            ws = [torch.randn(n, k, device=dev, dtype=args.dtype) / k ** 0.5 for _ in range(layers)]
            norm_w = torch.ones(k, device=dev, dtype=args.dtype)
            work = StreamWorkspace(dev, 8 * MAX_ROWS * n, n)  # the most K ranges of the sweeps
            sums = torch.empty(n, device=dev, dtype=torch.float32)
            for bs in args.batches:
                x = torch.randn(bs, k, device=dev, dtype=args.dtype)
                outs = [torch.empty(bs, n, device=dev, dtype=args.dtype) for _ in range(layers)]
                ref = F.linear(x, ws[0]).float()
                times = {}
                for name, cfg, gemm in candidates(args, n, bs, work, sums):
                    if not name.startswith("read") and not checked(
                            f"{site} {name} b{bs}", lambda: gemm(x, ws[0], outs[0]), ref):
                        continue
                    for chain in args.chains:
                        if chain == "alone":
                            fn = lambda gemm=gemm: [gemm(x, w, o) for w, o in zip(ws, outs)]  # noqa: E731
                        else:
                            fn = lambda gemm=gemm: [gemm(rms_norm(x, norm_w, 1e-5), w, o)  # noqa: E731
                                                    for w, o in zip(ws, outs)]
                        us = time_chain(timer, fn, layers)
                        if us is None:
                            break
                        times[(name, chain)] = us
                        if chain == "after_norm" and bs > 64 and (name == "cublas" or name.startswith("tma")):
                            results.setdefault((cls, cfg or "cublas"), {})[(site, k, fold, bs)] = us
                for (name, chain), us in times.items():
                    base = times.get(("cublas", chain))
                    rows.append(dict(vers, model=args.model, fold_rows=fold, site=site, shape_class=cls, n=n, k=k,
                                     batch=bs, chain=chain, impl=name, us=round(us, 2),
                                     of_copy_bw=round(n * k * 2 / (us * 1e-6) / bw, 3),
                                     vs_cublas=round(us / base, 3) if base else ""))
                for chain in args.chains:
                    mine = {nm: t for (nm, ch), t in times.items() if ch == chain and nm != "cublas"
                            and not nm.startswith("read")}
                    best = min(mine, key=mine.get, default=None)
                    base = times.get(("cublas", chain), 0)
                    print(f"{site:8s} fold {fold:3d} b{bs:<3d} {chain:10s} cublas {base:8.2f} us; best {best} "
                          f"{mine.get(best, 0):8.2f} us", flush=True)
            ws = outs = work = None
            if dev == "cuda":
                torch.cuda.empty_cache()
            if args.out:  # after each site: what ran is kept if a later one fails
                hx.write_csv(rows, args.path)
    return rows


def glu_sweep(args, timer, bw, vers, results):
    """gate/up (plain) with the activation: cuBLAS then ``act_mul`` against the gated epilogue of the
    streaming GEMM (up to 64 rows) or the TMA GEMM (65-128)."""
    k, n2 = sites_of(args.model)["gate_up"]
    n, layers, dev = n2 // 2, hx.shape_of(args.model)["num_hidden_layers"], hx.DEVICE
    ws = [torch.randn(n2, k, device=dev, dtype=args.dtype) / k ** 0.5 for _ in range(layers)]
    norm_w = torch.ones(k, device=dev, dtype=args.dtype)
    rows = []
    for bs in args.batches:
        x = torch.randn(bs, k, device=dev, dtype=args.dtype)
        both = [torch.empty(bs, n2, device=dev, dtype=args.dtype) for _ in ws]
        outs = [torch.empty(bs, n, device=dev, dtype=args.dtype) for _ in ws]
        ref = act_mul(*F.linear(x, ws[0]).split(n, dim=1), "silu").float()
        impls = [("cublas+act_mul", None,
                  lambda a, w, o, t: act_mul(*torch.matmul(a, w.T, out=t).split(n, dim=1), "silu"))]
        if bs <= 64:
            impls += [(stream_name(StreamConfig(*c)) + "_glu", None, lambda a, w, o, t, c=StreamConfig(*c):
                       stream_gemm(a, w, out=o, config=c, check=False, glu="silu")) for c in STREAM_GLU]
        else:
            impls += [(tma_name(c) + "_glu", c, lambda a, w, o, t, c=c: tma_gemm(a, w, out=o, config=c, check=False,
                                                                                 glu="silu"))
                      for c in (TmaConfig(bn, bk, 1, w, st) for bn, bk, w, st in TMA_GLU)]
        times = {}
        for name, cfg, fn in impls:
            if not checked(f"glu {name} b{bs}", lambda: fn(x, ws[0], outs[0], both[0]), ref):
                continue
            us = time_chain(timer, lambda fn=fn: [fn(rms_norm(x, norm_w, 1e-5), w, o, t)
                                                  for w, o, t in zip(ws, outs, both)], layers)
            if us is not None:
                times[name] = us
                if bs > 64:
                    results.setdefault(("glu", cfg or "cublas"), {})[("gate_up_act", k, 0, bs)] = us
        for name, us in times.items():
            rows.append(dict(vers, model=args.model, fold_rows=0, site="gate_up_act", shape_class="glu", n=n2, k=k,
                             batch=bs, chain="after_norm", impl=name, us=round(us, 2),
                             of_copy_bw=round(n2 * k * 2 / (us * 1e-6) / bw, 3),
                             vs_cublas=round(us / times["cublas+act_mul"], 3) if "cublas+act_mul" in times else ""))
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
            print(f"{cls}: {tma_name(best)} ({best_total:.1f} us against cuBLAS's {sum(base.values()):.1f} us "
                  f"over {len(base)} measurements)", flush=True)
        else:
            print(f"{cls}: no tile beat cuBLAS in every measurement: cuBLAS kept", flush=True)
    return table


def results_from_csv(paths):
    """The TMA and cuBLAS measurements of earlier runs' CSVs at 65-128 rows (a later CSV's measurement
    of the same key replaces an earlier one's), and the versions of the last."""
    import csv

    results, vers = {}, {}
    for path in paths:
        with open(path) as f:
            for row in csv.DictReader(f):
                if not row["impl"].startswith(("tma", "cublas")) or int(row["batch"]) <= 64:
                    continue
                vers = {k: row[k] for k in ("gpu", "torch", "triton")}
                match = re.match(r"tma_n(\d+)_k(\d+)_s(\d+)_w(\d+)_st(\d+)", row["impl"])
                cfg = TmaConfig(*map(int, match.groups())) if match else "cublas"
                key = (row["site"], int(row["k"]), int(row["fold_rows"]), int(row["batch"]))
                results.setdefault((row["shape_class"], cfg), {})[key] = float(row["us"])
    return results, vers


def write_table(path, vers, results) -> None:
    batches = sorted({key[3] for times in results.values() for key in times})
    folds = sorted({key[2] for times in results.values() for key in times})
    table = dict(vers, source="benchmarks/bench_gemm.py", batches=batches, fold_rows=folds, classes=choose(results))
    with open(path, "w") as f:
        json.dump(table, f, indent=1)
        f.write("\n")
    print("tile table written to", path, flush=True)


def smoke() -> int:
    """Every sweep entry against ``x @ w.T`` on a tiny fp32 shape, the read-only kernel's sums and the
    table's choice on made-up times."""
    x, w = torch.randn(3, 96), torch.randn(40, 96)
    for c in STREAM_SWEEP + NARROW_SWEEP:
        cfg = StreamConfig(*c)._replace(block_k=min(c[1], 32), prefetch=0)
        torch.testing.assert_close(stream_gemm(x, w, config=cfg, workspace=StreamWorkspace("cpu", 1000, 10)),
                                   x @ w.T, rtol=1e-4, atol=1e-4)
    x70, ws = torch.randn(70, 96), StreamWorkspace("cpu", 4 * 70 * 40, 40)
    for cfg in tma_sweep(4096):
        small = cfg._replace(block_n=min(cfg.block_n, 32), block_k=min(cfg.block_k, 32), num_stages=2)
        torch.testing.assert_close(tma_gemm(x70, w, config=small, workspace=ws), x70 @ w.T, rtol=1e-4, atol=1e-4)
    wg = torch.randn(80, 96)
    want = F.silu(x70 @ wg[:40].T) * (x70 @ wg[40:].T)
    for bn, bk, warps, _ in TMA_GLU:
        small = TmaConfig(min(bn, 32), min(bk, 32), 1, warps, 2)
        torch.testing.assert_close(tma_gemm(x70, wg, config=small, glu="silu"), want, rtol=1e-4, atol=1e-4)
    sums = torch.empty(40)
    read_bound(w, sums, (16, 32, 4, 2))
    torch.testing.assert_close(sums, w.sum(1), rtol=1e-4, atol=1e-4)
    a, b = ("down", 14336, 0, 128), ("down", 4096, 0, 128)
    assert choose({("deep", "cublas"): {a: 2.0, b: 2.0}, ("deep", TmaConfig()): {a: 1.5, b: 1.9}}) == {
        "deep": dict(TmaConfig()._asdict(), min_k=4096)}
    assert choose({("deep", "cublas"): {a: 2.0, b: 1.0}, ("deep", TmaConfig()): {a: 1.5, b: 1.1}}) == {}
    print("smoke: every sweep entry equals x @ w.T (the gated tiles act(gate) * up), the read-only kernel sums "
          "each row, a class keeps only a tile that beat cuBLAS everywhere")
    return 0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="8b", choices=["8b", "1b", "gemma2-9b", "mistral7b", "32b"])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 32, 64])
    p.add_argument("--sites", nargs="+", default=["qkv", "o", "gate_up", "down"])
    p.add_argument("--fold-rows", type=int, nargs="+", default=[0],
                   help="A rows stacked under each weight (0: the plain layer; 128: 8 adapters of rank 16)")
    p.add_argument("--chains", nargs="+", choices=["after_norm", "alone"], default=["after_norm"],
                   help="each GEMM after an RMSNorm that writes its input (as in a step), or back to back")
    p.add_argument("--glu", action="store_true", help="also gate/up with the activation in the epilogue")
    p.add_argument("--bound", action="store_true",
                   help="also cuBLASLt, Inductor's max-autotune and the read-only kernel")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--tag", default="", help="added to the CSV's name")
    p.add_argument("--table", default=None, help="write the TMA tile table here (the library's: "
                   "peft_fastlora/base_ops/tma_tiles_h200.json)")
    p.add_argument("--from-csv", nargs="+", metavar="CSV", help="no GPU: --table from these runs' measurements")
    hx.add_run_args(p)
    args = p.parse_args(argv)
    if args.from_csv:
        results, vers = results_from_csv(args.from_csv)
        write_table(args.table, dict(vers, from_csv=[os.path.basename(x) for x in args.from_csv]), results)
        return 0
    if args.smoke:
        return smoke()
    if not hx.start(args, "bench_gemm"):
        return 0
    args.dtype = torch.bfloat16
    timer, bw, vers = hx.GpuTimer(args.iters), hx.copy_bandwidth(), hx.versions()
    print(f"{vers['gpu']}: copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    torch.manual_seed(0)
    args.path = hx.out_path(args.out, "_".join(x for x in ("gemm", args.model, args.tag) if x), vers["gpu"])
    results = {}
    rows = gemm_sweep(args, timer, bw, vers, results)
    if args.glu:
        rows += glu_sweep(args, timer, bw, vers, results)
    if args.out:
        hx.write_csv(rows, args.path)
    if args.table:
        write_table(args.table, {k: vers[k] for k in ("gpu", "torch", "triton")}, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
