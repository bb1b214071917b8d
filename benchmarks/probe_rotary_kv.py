"""Probe (#13): rotary and the KV-cache write as one kernel (``ops.rotary_kv``), against the two.

A decode step runs, per layer, the q/k/v GEMM, ``ops.rotary`` (q and k rotated into new tensors),
``ops.kv_cache_write`` (the rotated k and v copied into the static cache at its fill length, which
the last program advances) and the attention. The second of the two small kernels reads what the
first has just written; ``ops.rotary_kv.rotary_kv_write`` does both (q and the cache bit-equal to
the two kernels', checked before timing).

Timed in CUDA graphs of 32 layers at Llama-3-8B's attention shapes, each layer the chain of a step:
q/k/v GEMM (fastlora's streaming GEMM up to 64 rows, cuBLAS past), then the two kernels or the one,
then the decode attention over the cache, with each of its ``prewait`` settings (what a split
program does before its PDL wait: nothing, or the mask scan; session 20's results also have a
third, the scan and an L2 hint for the program's K/V rows, since removed: no faster at batch 1,
slower at 32 and 128).
Reported: microseconds per layer of each chain.

    python benchmarks/probe_rotary_kv.py --out benchmarks/results/probe_rotary_kv_h200.csv
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench_generate as bg  # noqa: E402
from peft_fastlora.ops.kv_cache import kv_cache_write  # noqa: E402
from peft_fastlora.ops.rotary import apply_rotary  # noqa: E402
from peft_fastlora.ops.rotary_kv import rotary_kv_write  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 4096, 32, 8, 128, 32


def _layer_inputs(bsz, heads, kv_heads, dim, cache_len, filled, device, dtype, hidden=None):
    """One layer's step: a fused q/k/v output and its views, cos / sin, caches, length, ticket."""
    qkv = torch.randn(bsz, 1, (heads + 2 * kv_heads) * dim, device=device, dtype=dtype)
    shape = (bsz, 1, -1, dim)
    q = qkv[..., : heads * dim].view(shape).transpose(1, 2)
    k = qkv[..., heads * dim: (heads + kv_heads) * dim].view(shape).transpose(1, 2)
    v = qkv[..., (heads + kv_heads) * dim:].view(shape).transpose(1, 2)
    ang = torch.rand(bsz, 1, dim, device=device) * 6.28
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    caches = [torch.randn(bsz, kv_heads, cache_len, dim, device=device, dtype=dtype) for _ in range(2)]
    length = torch.full((1,), filled, dtype=torch.int64, device=device)
    ticket = torch.zeros(1, dtype=torch.int32, device=device)
    return dict(qkv=qkv, q=q, k=k, v=v, cos=cos, sin=sin, k_cache=caches[0], v_cache=caches[1], length=length,
                ticket=ticket)


def check(bsz, heads, kv_heads, dim, cache_len, filled, device, dtype):
    """The one kernel's q, caches and length equal the two kernels' exactly."""
    a = _layer_inputs(bsz, heads, kv_heads, dim, cache_len, filled, device, dtype)
    b = {n: (t.clone() if isinstance(t, torch.Tensor) and n in ("k_cache", "v_cache", "length", "ticket") else t)
         for n, t in a.items()}
    q_two, k_two = apply_rotary(a["q"], a["k"], a["cos"], a["sin"])
    kv_cache_write(k_two, a["v"], a["k_cache"], a["v_cache"], a["length"], ticket=a["ticket"])
    q_one = rotary_kv_write(b["q"], b["k"], b["v"], b["cos"], b["sin"], b["k_cache"], b["v_cache"], b["length"],
                            b["ticket"])
    for name, x, y in (("q", q_two, q_one), ("k cache", a["k_cache"], b["k_cache"]),
                       ("v cache", a["v_cache"], b["v_cache"]), ("length", a["length"], b["length"]),
                       ("ticket", a["ticket"], b["ticket"])):
        if not torch.equal(x, y):
            raise AssertionError(f"{name}: the one kernel differs from the two")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/results/probe_rotary_kv_h200.csv")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    p.add_argument("--iters", type=int, default=20)
    # the cache must hold every timed replay's write (each replay advances the fill length)
    p.add_argument("--cache-len", type=int, default=2048)
    p.add_argument("--filled", type=int, default=200, help="positions attended (the fill at capture)")
    p.add_argument("--prewaits", nargs="+", default=["off", "span"], choices=["auto", "off", "span"])
    p.add_argument("--smoke", action="store_true", help="CPU (TRITON_INTERPRET=1): the equality check, tiny shapes")
    args = p.parse_args(argv)
    if args.smoke:
        for dtype in (torch.float32, torch.bfloat16):
            check(3, 4, 2, 16, 12, 5, "cpu", dtype)
            check(2, 4, 1, 8, 6, 6, "cpu", dtype)  # a full cache: nothing written, the length still advances
        print("smoke: the one kernel's q, caches and length equal the two kernels'")
        return 0
    from bench_kernels import capture, timer_and_bandwidth
    from peft_fastlora.ops.decode_attention import decode_attention
    from peft_fastlora.ops.stream_gemm import StreamConfig, StreamWorkspace, stream_gemm

    timer, _ = timer_and_bandwidth(args.iters)
    dtype, dev = torch.bfloat16, "cuda"
    n_qkv = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    weights = [torch.randn(n_qkv, HIDDEN, device=dev, dtype=dtype) / HIDDEN ** 0.5 for _ in range(LAYERS)]
    rows = []
    CACHE_LEN, FILLED = args.cache_len, args.filled
    for bsz in args.batches:
        check(bsz, HEADS, KV_HEADS, HEAD_DIM, CACHE_LEN, FILLED, dev, dtype)
        x = torch.randn(bsz, 1, HIDDEN, device=dev, dtype=dtype)
        layers = [_layer_inputs(bsz, HEADS, KV_HEADS, HEAD_DIM, CACHE_LEN, FILLED, dev, dtype) for _ in range(LAYERS)]
        pos = torch.arange(CACHE_LEN, device=dev)
        mask = (pos < FILLED + 1)[None, None, None, :].expand(bsz, 1, 1, CACHE_LEN).contiguous()
        work = StreamWorkspace(dev, 4 * bsz * n_qkv, n_qkv)
        cfg = StreamConfig(block_n=64, block_k=128, num_warps=4, num_stages=6)

        def gemm(w, out):
            if bsz <= 64:
                stream_gemm(x.view(bsz, HIDDEN), w, out=out.view(bsz, -1), config=cfg, workspace=work, check=False)
            else:
                torch.matmul(x.view(bsz, HIDDEN), w.T, out=out.view(bsz, -1))

        def step(fused, prewait):
            for w, L in zip(weights, layers):
                gemm(w, L["qkv"])
                if fused:
                    q = rotary_kv_write(L["q"], L["k"], L["v"], L["cos"], L["sin"], L["k_cache"], L["v_cache"],
                                        L["length"], L["ticket"])
                else:
                    q, k = apply_rotary(L["q"], L["k"], L["cos"], L["sin"])
                    kv_cache_write(k, L["v"], L["k_cache"], L["v_cache"], L["length"], ticket=L["ticket"])
                decode_attention(q, L["k_cache"], L["v_cache"], mask, prewait=prewait)

        times = {}
        for prewait in args.prewaits:
            for name, fused in (("two_kernels", False), ("one_kernel", True)):
                for L in layers:  # each capture and replay advances the fill: start every chain alike
                    L["length"].fill_(FILLED)
                graph = capture(lambda: step(fused, prewait))
                times[name, prewait] = timer(graph.replay) / LAYERS
                del graph
        first = times["two_kernels", args.prewaits[0]]
        for (name, prewait), us in times.items():
            rows.append(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                             batch=bsz, cache_len=CACHE_LEN, filled=FILLED,
                             chain=f"qkv gemm + {name.replace('_', ' ')} + attention", impl=name,
                             attention_prewait=prewait, us_per_layer=round(us, 2),
                             vs_first=round(us / first, 3)))
        print(f"b{bsz:<4d} " + "; ".join(f"{n} {w} {us:7.2f}" for (n, w), us in times.items()) + " us a layer",
              flush=True)
    return bg.write_out(rows, args.out)


if __name__ == "__main__":
    sys.exit(main())
