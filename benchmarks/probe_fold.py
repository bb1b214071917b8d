"""Probe (#13): is the LoRA shrink cheaper folded into the base GEMM than in the fused kernel?

A stand-in decode step of an 8B Llama shape (32 layers x the four LoRA sites, bf16, 8 adapters of
rank 16 in 8 slots, rows spread over them), captured in one CUDA graph and timed as replays:

- ``base``: the base GEMMs alone;
- ``fused``: base GEMM + the fused shrink-and-expand kernel per site (today's decode path);
- ``fold_gemm``: one GEMM per site over the base weight with every slot's A appended as more
  output rows (x @ [W; A].T gives the base output and every slot's x @ A.T at once);
- ``fold``: that GEMM + the expand kernel alone, reading its shrink output from those columns;
  ``fold_n<N>_w<W>``: the same with the expand's column tile and warps set (``--expand-block-n``).

Attention, norms and the rest of the layer are left out: the differences between rows are the
LoRA's cost. The expand reads slot 0's columns for every row: the same bytes and launches as the
slot's own columns (this is a timing probe; correctness is the tests' job).

    python benchmarks/probe_fold.py --out benchmarks/results/probe_fold_h200.csv
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_generate as bg  # noqa: E402  (write_csv)
from bench_kernels import Timer, capture  # noqa: E402  (L2 evicted before each timed replay)

HIDDEN, Q, KV, INTER, LAYERS = 4096, 4096, 1024, 14336, 32
SITES = {"qkv": (HIDDEN, (0, Q, Q + KV, Q + 2 * KV)), "o": (HIDDEN, (0, HIDDEN)),
         "gate_up": (HIDDEN, (0, INTER, 2 * INTER)), "down": (INTER, (0, HIDDEN))}
SLOTS, RANK, DTYPE, DEVICE = 8, 16, torch.bfloat16, "cuda"


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="benchmarks/results/probe_fold_h200.csv")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--expand-block-n", type=int, nargs="*", default=[],
                   help="also time the expand with these column tiles (4 and 8 warps each)")
    p.add_argument("--smoke", action="store_true", help="CPU (TRITON_INTERPRET=1), tiny shapes, eager")
    args = p.parse_args(argv)
    global LAYERS, SITES, DEVICE, DTYPE
    if args.smoke:
        LAYERS, DEVICE, DTYPE = 2, "cpu", torch.float32
        SITES = {"qkv": (64, (0, 64, 80, 96)), "o": (64, (0, 64)), "gate_up": (64, (0, 96, 192)),
                 "down": (96, (0, 64))}
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from peft_fastlora import ForwardBatch, get_backend
    from peft_fastlora.ops import lora_expand

    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layer = {}
        for site, (k, offs) in SITES.items():
            c, n = len(offs) - 1, offs[-1]
            w = torch.randn(n, k, device=DEVICE, dtype=DTYPE) / k ** 0.5
            a = torch.randn(SLOTS, c * RANK, k, device=DEVICE, dtype=DTYPE) / k ** 0.5
            b = torch.randn(SLOTS, n, RANK, device=DEVICE, dtype=DTYPE) / RANK ** 0.5
            w_ext = torch.cat([w, a.reshape(-1, k)])
            layer[site] = (w, a, b, w_ext)
        layers.append(layer)
    tables = {site: (torch.full((SLOTS, len(o) - 1), RANK, dtype=torch.int32, device=DEVICE),
                     torch.full((SLOTS, len(o) - 1), 2.0, dtype=torch.float32, device=DEVICE))
              for site, (_, o) in SITES.items()}
    backend = get_backend("triton")(SLOTS, DEVICE)
    rows_out = []
    for bs in args.batches:
        fb = ForwardBatch.from_shape(bs, 1, DEVICE)
        bi = backend.prepare_lora_batch(fb, [i % SLOTS for i in range(bs)], [RANK] * SLOTS, [2.0] * SLOTS,
                                        use_cuda_graph=False)
        xs = {site: torch.randn(bs, k, device=DEVICE, dtype=DTYPE) for site, (k, _) in SITES.items()}

        def step(mode):
            for layer in layers:
                for site, (k, offs) in SITES.items():
                    w, a, b, w_ext = layer[site]
                    ranks, scal = tables[site]
                    x, n, c = xs[site], offs[-1], len(offs) - 1
                    kw = dict(base_output=None, layer_ranks=ranks, layer_scalings=scal, batch_info=bi)
                    if mode == "base":
                        F.linear(x, w)
                    elif mode == "fused":
                        kw["base_output"] = F.linear(x, w)
                        if site == "qkv":
                            backend.run_qkv_lora(x, a, b, output_offset=offs, **kw)
                        elif site == "gate_up":
                            backend.run_gate_up_lora(x, a, b, **kw)
                        else:
                            backend.run_lora(x, a, b, **kw)
                    else:
                        res = F.linear(x, w_ext)
                        if mode.startswith("fold") and mode != "fold_gemm":
                            tile = dict(expand_tiles).get(mode, {})
                            lora_expand(res[:, n:n + c * RANK], b, offs, ranks, scal, res[:, :n],
                                        bi.sorted_token_ids, bi.chunk_slot, bi.chunk_start, bi.chunk_len,
                                        block_m=bi.block_m, check=False, **tile)

        # the expand's launch settings to compare ("fold": expand_config's, the library's choice)
        expand_tiles = [(f"fold_n{bn}_w{nw}", dict(block_n=bn, num_warps=nw))
                        for bn in args.expand_block_n for nw in (4, 8)]
        modes = ("base", "fused", "fold_gemm", "fold") + tuple(m for m, _ in expand_tiles)
        times = {}
        if args.smoke:
            for mode in modes:
                step(mode)
            print("smoke: every mode ran at batch", bs)
            continue
        timer = Timer(args.iters)
        for mode in modes:
            g = capture(lambda: step(mode))
            times[mode] = timer(g.replay) / 1e3  # ms
            del g
        torch.cuda.synchronize()
        for mode, ms in times.items():
            row = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, batch=bs, slots=SLOTS,
                       rank=RANK, mode=mode, step_ms=round(ms, 4),
                       lora_ms=round(ms - times["base"], 4),
                       per_site_us=round(1e3 * (ms - times["base"]) / (4 * LAYERS), 2))
            rows_out.append(row)
            print(row, flush=True)
    if args.smoke:
        return 0
    return bg.write_out(rows_out, args.out)


if __name__ == "__main__":
    sys.exit(main())
