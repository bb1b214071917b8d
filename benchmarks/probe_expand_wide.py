"""Probe (#13, #14): the decode expand's two launches, the library's column blocks and the wide
launch (``ops.lora_expand_wide``: rank-sized column spans), over tile sizes and warps.

The expand runs alone after a folded base GEMM (its shrink read from the GEMM's columns, packed
B). Timed per workload: 32 layers of distinct arenas in one CUDA graph, bf16, the 8B shape's
sites. Every variant's output is checked against the library launch's (bf16 rounding apart).

    python benchmarks/probe_expand_wide.py --out benchmarks/results/probe_expand_wide_h200.csv
"""

from __future__ import annotations

import argparse
import importlib
import os
import random
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench_generate as bg  # noqa: E402  (write_csv)

LAYERS = 32
ATTN = {"qkv": (0, 4096, 5120, 6144), "o": (0, 4096)}
ALL7 = dict(ATTN, gate_up=(0, 14336, 28672), down=(0, 4096))
# name: (rows, adapters, ranks to draw from, sites); rows are spread over the adapters round robin
WORKLOADS = {
    "64_distinct_mixed": (64, 64, [8, 16, 32, 64], ATTN),
    "128x32_mixed": (128, 32, [8, 16, 32, 64], ATTN),
    "32x8_r16_all7": (32, 8, [16], ALL7),
    "1x1_r16_all7": (1, 1, [16], ALL7),
    "128x8_r16_all7": (128, 8, [16], ALL7),
}
VARIANTS = [None, (2048, 2), (2048, 4), (4096, 2), (4096, 4), (4096, 8), (8192, 4)]  # None: the library's other launch


def site_arenas(offsets, ranks, device, dtype, gen):
    """One layer's packed B arena and its tables for slots of these ranks (every module targeted)."""
    from bench_kernels import packed_layout
    from peft_fastlora.backend.packed import block_align

    a_rows, b_offs, row, off = packed_layout(offsets, ranks)
    b = torch.randn(off, generator=gen, device=device, dtype=dtype) * 0.02
    return b, a_rows.to(device), b_offs.to(device), row, block_align(ranks)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/results/probe_expand_wide_h200.csv")
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS))
    p.add_argument("--iters", type=int, default=30)
    args = p.parse_args(argv)
    from bench_kernels import capture, timer_and_bandwidth
    from peft_fastlora import ForwardBatch, get_backend
    from peft_fastlora.ops import lora_expand

    wide_mod = importlib.import_module("peft_fastlora.ops.lora_expand_wide")
    default_config = wide_mod.wide_config
    device, dtype = "cuda", torch.bfloat16
    timer, bw = timer_and_bandwidth(args.iters)
    rows_out = []
    for wl in args.workloads:
        rows, adapters, choices, sites = WORKLOADS[wl]
        rng, gen = random.Random(0), torch.Generator(device=device).manual_seed(0)
        ranks = [rng.choice(choices) for _ in range(adapters)]
        backend = get_backend("triton")(adapters, device)
        slots = [i % adapters for i in range(rows)]
        bi = backend.prepare_lora_batch(ForwardBatch.from_shape(rows, 1, device), slots, ranks, [1.0] * adapters,
                                        use_cuda_graph=False)
        plan = (bi.sorted_token_ids, bi.chunk_slot, bi.chunk_start, bi.chunk_len)
        layers, b_bytes = [], 0
        for _ in range(LAYERS):
            layer = {}
            for site, offsets in sites.items():
                b, a_rows, b_offs, y_width, align = site_arenas(offsets, ranks, device, dtype, gen)
                c = len(offsets) - 1
                rt = torch.tensor([[r] * c for r in ranks], dtype=torch.int32, device=device)
                sc = torch.full((adapters, c), 0.5, dtype=torch.float32, device=device)
                y = torch.randn(rows, y_width, generator=gen, device=device, dtype=dtype)
                out = torch.randn(rows, offsets[-1], generator=gen, device=device, dtype=dtype)
                layer[site] = (y, b, offsets, rt, sc, out, b_offs, align, a_rows, max(ranks))
                b_bytes += sum(ranks[s] * offsets[-1] * 2 for s in set(slots))
            layers.append(layer)
        floor_us = b_bytes / LAYERS / bw * 1e6

        def run(variant, outs=None):
            if variant is not None:
                wide_mod.wide_config = lambda r, w, v=variant: dict(tile=v[0], num_warps=v[1])
            try:
                for li, layer in enumerate(layers):
                    for site, (y, b, offsets, rt, sc, out, b_offs, align, a_rows, r) in layer.items():
                        target = out if outs is None else outs[(li, site)]
                        lora_expand(y, b, offsets, rt, sc, target, *plan, block_m=bi.block_m, check=False,
                                    b_offs=b_offs, b_align=align, y_cols=a_rows, max_rank=r,
                                    wide=variant is not None)
            finally:
                wide_mod.wide_config = default_config

        # the timed replays add into each layer's ``out`` in place: the checks start from a copy
        pristine = {(li, site): v[5].clone() for li, layer in enumerate(layers) for site, v in layer.items()}

        def fresh():
            return {k: v.clone() for k, v in pristine.items()}

        want = fresh()
        run(None, want)
        times = {}
        for variant in VARIANTS:
            name = "library_blocks" if variant is None else "wide_t{}_w{}".format(*variant)
            got = fresh()
            run(variant, got)
            # one bf16 rounding may fall the other way (a different sum order): within 2 ulps
            worst = max(((got[k].float() - want[k].float()).abs() / (want[k].float().abs() + 1e-2)).max().item()
                        for k in want)
            if worst > 2 ** -7:
                print(f"{wl} {name}: output differs from the library launch (relative {worst:.3g})", flush=True)
                continue
            g = capture(lambda: run(variant))
            times[name] = timer(g.replay) / LAYERS
            del g
            rows_out.append(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                                 triton=__import__("triton").__version__, copy_tb_s=round(bw / 1e12, 3),
                                 workload=wl, rows=rows, adapters=adapters, sites="+".join(sites), variant=name,
                                 tile=variant[0] if variant else "", num_warps=variant[1] if variant else "",
                                 us_per_layer=round(times[name], 2), floor_us_per_layer=round(floor_us, 2),
                                 x_floor=round(times[name] / floor_us, 3),
                                 vs_library=round(times[name] / times["library_blocks"], 3),
                                 max_rel_diff=f"{worst:.2e}"))
            print(f"{wl:20s} {name:16s} {times[name]:7.2f} us a layer ({'+'.join(sites)}), x{times[name] / floor_us:.2f} "
                  f"its B floor, x{times[name] / times['library_blocks']:.3f} the library blocks", flush=True)
        layers = None
        torch.cuda.empty_cache()
    return bg.write_out(rows_out, args.out)


if __name__ == "__main__":
    sys.exit(main())
