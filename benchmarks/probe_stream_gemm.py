"""Probe (#13): the weight-streaming decode GEMM (``ops.stream_gemm``) against cuBLAS, per shape.

For each GEMM of an 8B Llama layer (q/k/v fused, o, gate/up fused, down, and the LM head) and each
batch, 32 layers' worth of distinct weights are multiplied in one CUDA graph (L2 holds none of
them) and the replay is timed, in two chains: the GEMMs back to back (``alone``), and each GEMM
after a small kernel that writes its input (``after_norm``: fastlora's RMSNorm, as in a step, so
that a PDL launch has a kernel to overlap). Reported: microseconds per GEMM and the weight's bytes
over that time against the copy bandwidth measured in the same run, for cuBLAS (``F.linear``) and
each ``StreamConfig`` of the sweep; every candidate is first checked against ``F.linear``.

    python benchmarks/probe_stream_gemm.py --out benchmarks/results/probe_stream_gemm_h200.csv
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench_generate as bg  # noqa: E402
from peft_fastlora.ops import pdl  # noqa: E402
from peft_fastlora.ops.rms_norm import rms_norm  # noqa: E402
from peft_fastlora.ops.stream_gemm import StreamConfig, StreamWorkspace, stream_gemm  # noqa: E402

# (hidden, q, kv, intermediate, layers) of bench_generate's shapes: the two Llamas and Gemma 2 9B
# (whose o and down, 3,584 outputs, are narrower than 4,096)
MODELS = {"8b": (4096, 4096, 1024, 14336, 32), "1b": (2048, 2048, 512, 8192, 16),
          "gemma2-9b": (3584, 4096, 2048, 14336, 42)}
HIDDEN, Q, KV, INTER, LAYERS = MODELS["8b"]


def sites_of(model: str, fold_rows: int = 0) -> dict:
    """Site -> (K, N) of one layer's GEMMs (q/k/v and gate/up fused). ``fold_rows``: the rows of the
    adapters' A stacked under each weight of a folded site (8 adapters of rank 16: 128 a module),
    as the mixed step's ``[W; A]`` GEMMs are."""
    hidden, q, kv, inter, _ = MODELS[model]
    return {"qkv": (hidden, q + 2 * kv + 3 * fold_rows), "o": (q, hidden + fold_rows),
            "gate_up": (hidden, 2 * inter + 2 * fold_rows), "down": (inter, hidden + fold_rows)}


SITES = sites_of("8b")
# (block_n, block_k, split_k, num_warps, num_stages, prefetch bytes, preload)
SWEEP = [(64, 128, 1, 4, 6, 0, False), (64, 128, 1, 4, 8, 0, False), (64, 64, 1, 4, 8, 0, False),
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
# the gate/up GEMM with the activation in its epilogue (``glu``): half-width tiles, gate's and up's
GLU_SWEEP = [(64, 128, 1, 8, 4, 0, False), (64, 128, 1, 4, 4, 0, False), (64, 128, 1, 8, 3, 0, False),
             (64, 64, 1, 4, 6, 0, False), (32, 128, 1, 4, 6, 0, False), (32, 256, 1, 4, 3, 0, False),
             (128, 64, 1, 8, 3, 0, False)]
# the read bound: a kernel that only streams the weight (sums each row), at these tiles
READ_TILES = [(64, 128, 4, 6), (32, 256, 4, 4), (16, 512, 4, 4)]


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
    bn, bk, warps, stages = tile
    use_pdl = pdl.mode(w)
    _read_bound_kernel[(triton.cdiv(w.shape[0], bn),)](w, y, w.shape[0], w.shape[1], w.stride(0), BLOCK_N=bn,
                                                       BLOCK_K=bk, USE_PDL=use_pdl, num_warps=warps,
                                                       num_stages=stages, launch_pdl=use_pdl > 0)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/results/probe_stream_gemm_h200.csv")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 32, 64, 128])
    p.add_argument("--sites", nargs="+", default=list(SITES))
    p.add_argument("--model", choices=sorted(MODELS), default="8b",
                   help="the layer shapes; 1b sweeps NARROW_SWEEP for its layers narrower than 4,096")
    p.add_argument("--fold-rows", type=int, default=0,
                   help="A rows stacked under each weight, as a folded site's [W; A] (128: 8 adapters of rank 16)")
    p.add_argument("--chains", nargs="+", choices=["alone", "after_norm"], default=["alone", "after_norm"])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--smoke", action="store_true", help="CPU (TRITON_INTERPRET=1): each sweep config on a tiny shape")
    p.add_argument("--glu", action="store_true",
                   help="gate/up only, after a norm: the GEMM then act-mul (cuBLAS, the library's streaming tile) "
                        "against the activation in the GEMM's epilogue (GLU_SWEEP)")
    args = p.parse_args(argv)
    if args.smoke:
        x, w = torch.randn(3, 96), torch.randn(40, 96)
        for c in SWEEP + NARROW_SWEEP:
            cfg = StreamConfig(*c)._replace(block_k=min(c[1], 32), prefetch=0)
            torch.testing.assert_close(stream_gemm(x, w, config=cfg, workspace=StreamWorkspace("cpu", 1000, 10)), x @ w.T, rtol=1e-4, atol=1e-4)
        sums = torch.empty(40)
        read_bound(w, sums, (16, 32, 4, 2))
        torch.testing.assert_close(sums, w.sum(1), rtol=1e-4, atol=1e-4)
        wg = torch.randn(80, 96)
        for c in GLU_SWEEP:
            cfg = StreamConfig(*c)._replace(block_k=min(c[1], 32))
            torch.testing.assert_close(stream_gemm(x, wg, config=cfg, glu="silu"),
                                       F.silu(x @ wg[:40].T) * (x @ wg[40:].T), rtol=1e-4, atol=1e-4)
        print("smoke: every sweep config equals x @ w.T (and the GLU sweep act(gate) * up), the read bound sums "
              "the rows")
        return 0
    from bench_kernels import capture, timer_and_bandwidth

    timer, bw = timer_and_bandwidth(args.iters)
    if args.glu:
        return glu_sweep(args, timer, bw, capture)
    rows = []
    sites = sites_of(args.model, args.fold_rows)
    for site in args.sites:
        k, n = sites[site]
        layers = MODELS[args.model][4]
        sweep = NARROW_SWEEP if n < 4096 else SWEEP
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(layers)]
        norm_w = torch.ones(k, device="cuda", dtype=torch.bfloat16)
        nbytes = n * k * 2
        for bs in args.batches:
            x = torch.randn(bs, k, device="cuda", dtype=torch.bfloat16)
            outs = [torch.empty(bs, n, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]
            ref = F.linear(x, ws[0]).float()
            impls = ([("cublas", None)]
                     + [("stream_n{}_k{}_s{}_w{}_st{}_pf{}{}".format(*c[:6], "_pre" if c[6] else ""), StreamConfig(*c))
                        for c in sweep]
                     + ([("read_bound_n{}_k{}_w{}_st{}".format(*t), t) for t in READ_TILES] if bs == args.batches[0] else []))
            times = {}
            sums = torch.empty(n, device="cuda", dtype=torch.float32)
            work = StreamWorkspace("cuda", 8 * bs * n, n)
            for name, cfg in impls:
                if cfg is None:
                    gemm = lambda a, w, o: torch.matmul(a, w.T, out=o)  # noqa: E731
                elif name.startswith("read"):
                    gemm = lambda a, w, o, cfg=cfg: read_bound(w, sums, cfg)  # noqa: E731
                else:
                    gemm = lambda a, w, o, cfg=cfg: stream_gemm(a, w, out=o, config=cfg, workspace=work, check=False)  # noqa: E731
                try:
                    if isinstance(cfg, StreamConfig):
                        err = (stream_gemm(x, ws[0], config=cfg, workspace=work).float() - ref).abs().max().item()
                        if err > 0.05:  # a wrong kernel is no candidate
                            print(f"{site} {name} b{bs}: max error {err}", flush=True)
                            continue
                except Exception as e:  # a tile that does not fit is no candidate
                    print(f"{site} {name} b{bs}: {type(e).__name__}: {str(e)[:160]}", flush=True)
                    continue
                for chain in args.chains:
                    if chain == "alone":
                        fn = lambda: [gemm(x, w, o) for w, o in zip(ws, outs)]  # noqa: E731
                    else:
                        fn = lambda: [gemm(rms_norm(x, norm_w, 1e-5), w, o) for w, o in zip(ws, outs)]  # noqa: E731
                    try:
                        g = capture(fn)
                    except Exception as e:  # a tile that does not fit (shared memory) is no candidate
                        print(f"{site} {name} b{bs}: {type(e).__name__}: {str(e)[:160]}", flush=True)
                        break
                    times[(name, chain)] = timer(g.replay) / layers
                    del g
            for (name, chain), us in times.items():
                base = times.get(("cublas", chain))
                rows.append(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                                 triton=__import__("triton").__version__, model=args.model,
                                 fold_rows=args.fold_rows, site=site, n=n, k=k, batch=bs,
                                 chain=chain, impl=name, us=round(us, 2),
                                 of_copy_bw=round(nbytes / (us * 1e-6) / bw, 3),
                                 vs_cublas=round(us / base, 3) if base else ""))
            for chain in args.chains:
                mine = {nm: t for (nm, ch), t in times.items() if ch == chain and not nm.startswith("read")}
                best = min(mine, key=mine.get)
                print(f"{site:8s} b{bs:<3d} {chain:10s} cublas {mine['cublas']:8.2f} us "
                      f"({nbytes / (mine['cublas'] * 1e-6) / bw:.2f} of copy bw); best {best} "
                      f"{mine[best]:8.2f} us ({nbytes / (mine[best] * 1e-6) / bw:.2f})", flush=True)
                reads = {nm: t for (nm, ch), t in times.items() if ch == chain and nm.startswith("read")}
                if reads:
                    r = min(reads, key=reads.get)
                    print(f"{'':24s}{r} {reads[r]:8.2f} us ({nbytes / (reads[r] * 1e-6) / bw:.2f})", flush=True)
        ws = outs = None
        torch.cuda.empty_cache()
        bg.write_out(rows, args.out)  # after each site: what ran is kept if a later one fails
    return 0


def gate_up_buffers(ws, bs):
    """For ``bs`` rows over these [gate; up] weights: an input, each layer's GEMM output and
    act-mul output, and the reference ``silu(gate) * up`` of the first layer (float32)."""
    from peft_fastlora.ops.silu_mul import act_mul

    n2, k = ws[0].shape
    x = torch.randn(bs, k, device="cuda", dtype=torch.bfloat16)
    both = [torch.empty(bs, n2, device="cuda", dtype=torch.bfloat16) for _ in ws]
    outs = [torch.empty(bs, n2 // 2, device="cuda", dtype=torch.bfloat16) for _ in ws]
    ref = act_mul(*F.linear(x, ws[0]).split(n2 // 2, dim=1), "silu").float()
    return x, both, outs, ref


def glu_sweep(args, timer, bw, capture):
    """gate/up after a norm, 32 layers' weights in one graph: the GEMM then ``act_mul`` against
    ``stream_gemm(glu="silu")``; microseconds per layer, the weight's bytes over that time."""
    from peft_fastlora.base_ops.stream_linears import _config
    from peft_fastlora.ops.silu_mul import act_mul

    k, n2 = SITES["gate_up"]
    n = n2 // 2
    ws = [torch.randn(n2, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(LAYERS)]
    norm_w = torch.ones(k, device="cuda", dtype=torch.bfloat16)
    rows = []
    for bs in args.batches:
        x, both, outs, ref = gate_up_buffers(ws, bs)
        lib = _config(bs, n2, k)

        def unfused(gemm):
            return lambda a, w, o, t: act_mul(*gemm(a, w, t).split(n, dim=1), "silu")

        impls = [("cublas+act_mul", unfused(lambda a, w, t: torch.matmul(a, w.T, out=t))),
                 ("stream+act_mul", unfused(lambda a, w, t: stream_gemm(a, w, out=t, config=lib, check=False)))]
        impls += [("glu_n{}_k{}_w{}_st{}".format(c[0], c[1], c[3], c[4]),
                   lambda a, w, o, t, cfg=StreamConfig(*c): stream_gemm(a, w, out=o, config=cfg, check=False, glu="silu"))
                  for c in GLU_SWEEP]
        times = {}
        for name, fn1 in impls:
            try:
                err = (fn1(x, ws[0], outs[0], both[0]).float() - ref).abs().max().item()
                if err > 0.05:
                    print(f"glu {name} b{bs}: max error {err}", flush=True)
                    continue
                g = capture(lambda: [fn1(rms_norm(x, norm_w, 1e-5), w, o, t) for w, o, t in zip(ws, outs, both)])
            except Exception as e:  # a tile that does not fit is no candidate
                print(f"glu {name} b{bs}: {type(e).__name__}: {str(e)[:160]}", flush=True)
                continue
            times[name] = timer(g.replay) / LAYERS
            del g
        for name, us in times.items():
            rows.append(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                             triton=__import__("triton").__version__, site="gate_up_act", n=n2, k=k, batch=bs,
                             chain="after_norm", impl=name, us=round(us, 2),
                             of_copy_bw=round(n2 * k * 2 / (us * 1e-6) / bw, 3),
                             vs_cublas=round(us / times["cublas+act_mul"], 3) if "cublas+act_mul" in times else ""))
        best = min(times, key=times.get)
        print(f"gate_up+act b{bs:<3d} cublas+act_mul {times.get('cublas+act_mul', 0):7.2f} us, stream+act_mul "
              f"{times.get('stream+act_mul', 0):7.2f} us, best {best} {times[best]:7.2f} us", flush=True)
    return bg.write_out(rows, args.out)


if __name__ == "__main__":
    sys.exit(main())
