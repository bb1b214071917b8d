"""The greedy token selection alone: ``ops.greedy_select`` at its block sizes and warps against
what transformers' loop runs for it (the float32 copy of the logits, ``argmax``, the padding of
finished rows, the EOS ``isin``), at an 8B vocabulary (128,256) in bf16.

Each variant is captured in a CUDA graph of ``--chain`` launches on distinct logits (so the time is
the GPU's, not the host's launch rate) and timed as replays; "per launch" is the replay over the
chain. The byte floor is the logits' bytes over the copy bandwidth.

    python benchmarks/probe_greedy_select.py --out benchmarks/results/probe_greedy_select_h200.csv
"""

from __future__ import annotations

import argparse
import csv
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

VOCAB = 128256


def _graph_time_us(fn, chain: int, iters: int = 50) -> float:
    fn(0)  # compile
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(chain):
            fn(i)
    for _ in range(3):
        g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / iters / chain


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 32, 128])
    p.add_argument("--chain", type=int, default=16)
    p.add_argument("--out", default="benchmarks/results/probe_greedy_select_h200.csv")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_greedy_select needs a CUDA GPU; nothing measured")
        return 0
    import peft
    import transformers
    import triton

    from bench_generate import copy_bandwidth
    from peft_fastlora.ops import greedy_select as gs

    bw = copy_bandwidth()
    vers = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                transformers=transformers.__version__, peft=peft.__version__, copy_bw_tbs=round(bw / 1e12, 3))
    rows_out, defaults = [], (gs.BLOCK, gs.NUM_WARPS)
    for rows in args.rows:
        xs = [torch.randn(rows, VOCAB, device="cuda", dtype=torch.bfloat16) for _ in range(args.chain)]
        tokens = torch.empty(rows, dtype=torch.long, device="cuda")
        unfinished = torch.ones(rows, dtype=torch.long, device="cuda")
        pad = torch.tensor(0, device="cuda")
        eos = torch.tensor([2], device="cuda")
        floor_us = 1e6 * rows * VOCAB * 2 / bw

        def hf(i):
            scores = xs[i].to(copy=True, dtype=torch.float32)
            nxt = torch.argmax(scores, dim=-1)
            nxt = nxt * unfinished + pad * (1 - unfinished)
            return unfinished & ~torch.isin(nxt, eos)

        variants = [("transformers", "copy+argmax+pad+isin", hf)]
        for block in (1024, 2048, 4096, 8192):
            for warps in (4, 8):
                def fused(i, block=block, warps=warps):
                    gs.BLOCK, gs.NUM_WARPS = block, warps
                    return gs.greedy_select(xs[i], tokens, unfinished, pad, eos)
                variants.append(("greedy_select", f"block={block} warps={warps}", fused))
        for impl, config, fn in variants:
            try:
                us = _graph_time_us(fn, args.chain)
            except Exception as e:  # noqa: BLE001 - a variant that fails is reported, not fatal
                print(f"rows {rows} {impl} {config}: {type(e).__name__}: {e}", flush=True)
                continue
            row = dict(vers, rows=rows, vocab=VOCAB, impl=impl, config=config, us_per_launch=round(us, 2),
                       byte_floor_us=round(floor_us, 2))
            print(row, flush=True)
            rows_out.append(row)
        gs.BLOCK, gs.NUM_WARPS = defaults
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows_out[0]))
        w.writeheader()
        w.writerows(rows_out)
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
