"""Probe (#13): does asking the next GEMM's weight into L2 from the small kernel before it shorten
a decode step?

An 8B Llama layer's kernel chain, 32 layers of distinct random weights in one CUDA graph (so L2
holds none of them between replays; the timer also flushes it): RMSNorm -> q/k/v GEMM -> a small
kernel standing for rotary and attention -> o GEMM -> residual add + RMSNorm -> gate/up GEMM ->
SiLU-mul -> down GEMM -> residual add. The GEMMs are cuBLAS (``F.linear``); the small kernels are
fastlora's, each given (``prefetch=``) the first ``budget`` bytes of the next GEMM's weight
(``ops.l2_prefetch``: Hopper's bulk L2 prefetch, issued at the kernel's start). Variants: no
prefetch; budgets in MB per GEMM, laid out as the leading columns of every row or as the leading
rows; the same prefetch as a launch of its own before the small kernel; the four GEMMs alone.

Reported: ms per step (32 layers), against no prefetch and against the weights' byte floor at the
copy bandwidth measured in the same run.

    python benchmarks/probe_l2_prefetch.py --out benchmarks/results/probe_l2_prefetch_h200.csv
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench_generate as bg  # noqa: E402  (write_csv)

HIDDEN, Q, KV, INTER, LAYERS = 4096, 4096, 1024, 14336, 32
EPS = 1e-5


def build(layers: int, device="cuda", dtype=torch.bfloat16):
    torch.manual_seed(0)
    mk = lambda n, k: torch.randn(n, k, device=device, dtype=dtype) / k ** 0.5  # noqa: E731
    return [dict(qkv=mk(Q + 2 * KV, HIDDEN), o=mk(HIDDEN, Q), gate_up=mk(2 * INTER, HIDDEN), down=mk(HIDDEN, INTER),
                 norm=torch.ones(HIDDEN, device=device, dtype=dtype)) for _ in range(layers)]


def plans(weights, budget_mb: float, layout: str):
    from peft_fastlora.ops import l2_prefetch

    out = []
    for w in weights:
        b = int(budget_mb * 2**20)
        out.append({k: l2_prefetch.plan(w[k], b, layout) for k in ("qkv", "o", "gate_up", "down")})
    return out


def step(x, weights, pfs, separate=False, gemms_only=False):
    """One decode step's layer chain; ``pfs[l][name]``: the prefetch of that GEMM's weight (or None)."""
    from peft_fastlora.ops import act_mul, add_rms_norm, rms_norm
    from peft_fastlora.ops.l2_prefetch import l2_prefetch

    h = x
    for w, pf in zip(weights, pfs):
        if gemms_only:
            F.linear(x, w["qkv"]), F.linear(x, w["o"]), F.linear(x, w["gate_up"])
            F.linear(x.new_empty(x.shape[0], INTER), w["down"])
            continue

        def small(fn, name, **kw):
            if separate:
                l2_prefetch(pf[name])
                return fn(**kw)
            return fn(prefetch=pf[name], **kw)

        a = small(lambda **kw: rms_norm(h, w["norm"], EPS, **kw), "qkv")
        qkv = F.linear(a, w["qkv"])
        attn = small(lambda **kw: rms_norm(qkv[:, :Q], w["norm"], EPS, **kw), "o")  # rotary + attention's stand-in
        o = F.linear(attn, w["o"])
        m, h = small(lambda **kw: add_rms_norm(o, h, w["norm"], EPS, **kw), "gate_up")
        gu = F.linear(m, w["gate_up"])
        act = small(lambda **kw: act_mul(gu[:, :INTER], gu[:, INTER:], "silu", **kw), "down")
        h = h + F.linear(act, w["down"])
    return h


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/results/probe_l2_prefetch_h200.csv")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    p.add_argument("--budgets", type=float, nargs="+", default=[4, 8, 16, 24, 32],
                   help="MB of each GEMM's weight asked into L2")
    p.add_argument("--layouts", nargs="+", default=["columns", "rows"])
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--layers", type=int, default=LAYERS)
    args = p.parse_args(argv)
    from bench_kernels import Timer, capture, copy_bandwidth

    timer = Timer(args.iters)
    bw = copy_bandwidth(timer)
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    weights = build(args.layers)
    wbytes = sum(w[k].numel() * 2 for w in weights for k in ("qkv", "o", "gate_up", "down"))
    floor_ms = wbytes / bw * 1e3
    none = [dict(qkv=None, o=None, gate_up=None, down=None) for _ in weights]
    variants = [("gemms_only", 0, "-", none, False, True), ("none", 0, "-", none, False, False)]
    for layout in args.layouts:
        for mb in args.budgets:
            pf = plans(weights, mb, layout)
            variants.append((f"{layout}_{mb:g}mb", mb, layout, pf, False, False))
    best = max(args.budgets)
    variants.append((f"separate_columns_{best:g}mb", best, "columns", plans(weights, best, "columns"), True, False))
    rows = []
    for bs in args.batches:
        x = torch.randn(bs, HIDDEN, device="cuda", dtype=torch.bfloat16)
        ref = step(x, weights, none)
        times = {}
        for name, mb, layout, pf, separate, gemms in variants:
            if not gemms:  # a prefetch changes no value
                got = step(x, weights, pf, separate)
                if not torch.equal(got, ref):
                    print(f"b{bs} {name}: output differs from the run without prefetch", flush=True)
            g = capture(lambda: step(x, weights, pf, separate, gemms))
            times[name] = timer(g.replay) / 1e3
            del g
            pf_mb = sum(q.nbytes for d in pf for q in d.values() if q is not None) / 2**20 / len(weights)
            rows.append(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                             triton=__import__("triton").__version__, copy_tb_s=round(bw / 1e12, 3),
                             batch=bs, variant=name, budget_mb=mb, layout=layout, separate_launch=separate,
                             prefetched_mb_per_layer=round(pf_mb, 1), ms_per_step=round(times[name], 4),
                             vs_none=round(times[name] / times.get("none", times[name]), 4),
                             floor_ms=round(floor_ms, 4), vs_floor=round(times[name] / floor_ms, 4)))
            print(f"b{bs:<4d} {name:24s} {times[name]:7.3f} ms  prefetched {pf_mb:6.1f} MB/layer  "
                  f"x{times[name] / floor_ms:.3f} floor  x{times[name] / times.get('none', times[name]):.3f} none",
                  flush=True)
    print("written", bg.write_csv(rows, os.path.dirname(args.out) or ".", os.path.basename(args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
