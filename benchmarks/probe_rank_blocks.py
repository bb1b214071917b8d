"""Probe: the fused decode LoRA kernel stepping through each adapter's rank in blocks of
``rank_block`` rows (the default, 16), against one tile of the site's padded rank (``rank_block``
= the padded rank: the kernel before rank blocks), on packed weights as the registry holds them.

Each workload is a CUDA graph of ``--layers`` layers' sites, every layer with its own weights (so
nothing stays in L2 between layers, as in a model), timed as graph replays after a 256 MiB memset.
Per workload and rank block: microseconds per launch, the byte floor of a launch (A and B at each
used adapter's own rank, x read, the output read and written, over the copy bandwidth measured in
the same run), and the output compared with the torch backend on the first layer.

    python benchmarks/probe_rank_blocks.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_generate as bg  # noqa: E402  (write_csv, versions)
from bench_kernels import SITES, Timer, capture, copy_bandwidth, packed_layout  # noqa: E402

# name: (rows, distinct adapters, ranks cycled over the adapters, sites)
WORKLOADS = {
    "64_distinct_mixed": (64, 64, (8, 16, 32, 64), ("qkv", "o")),  # bench_many_adapters' batches
    "128x32_mixed": (128, 32, (8, 16, 32, 64), ("qkv", "o", "gate_up", "down")),
    "32x8_r64": (32, 8, (64,), ("qkv", "o", "gate_up", "down")),
    "32x8_r16": (32, 8, (16,), ("qkv", "o", "gate_up", "down")),
}
DTYPE = torch.bfloat16
DEVICE = "cuda"
SMOKE_SITES = {"qkv": (40, (0, 48, 56, 64)), "o": (40, (0, 40)), "gate_up": (40, (0, 72, 144)), "down": (72, (0, 40))}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/results", help="folder of the CSV")
    p.add_argument("--csv", default="probe_rank_blocks_h200.csv")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--rank-blocks", type=int, nargs="+", default=[0, 16, 32, 64],
                   help="0: the library's choice (by whether the ranks differ)")
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS))
    p.add_argument("--programs-per-sm", type=int, nargs="+", default=[None],
                   help="sweep the fused kernel's persistent programs per SM (default: the library's)")
    p.add_argument("--num-warps", type=int, nargs="+", default=[None], help="sweep its warps per program")
    p.add_argument("--prefetch", type=int, nargs="+", default=[None], help="sweep: 1 on, 0 off")
    p.add_argument("--max-registers", type=int, nargs="+", default=[None], help="sweep: 0 none, else a cap")
    p.add_argument("--paths", nargs="+", default=["fused"], choices=["fused", "two_kernel"],
                   help="two_kernel: the shrink and expand kernels, the path of batches the fused one does not take")
    p.add_argument("--block-k", type=int, nargs="+", default=[None], help="sweep: K columns per shrink item")
    p.add_argument("--block-n", type=int, nargs="+", default=[None], help="sweep: output columns per expand item")
    p.add_argument("--smoke", action="store_true", help="CPU (TRITON_INTERPRET=1), tiny shapes, eager")
    args = p.parse_args(argv)
    if args.smoke:
        global DEVICE, DTYPE
        DEVICE, DTYPE = "cpu", torch.float32
        bg.DEVICE = "cpu"
        SITES.update(SMOKE_SITES)
        args.layers, args.iters = 2, 1
        for name, (rows, adapters, ranks, sites) in WORKLOADS.items():  # the interpreter: few rows and slots
            WORKLOADS[name] = (min(rows, 4), min(adapters, 2), ranks, sites)
    return args


def packed_site(site, ranks):
    """One site's packed arenas for slots of these ranks (every module at the slot's rank), blocks
    back to back at multiples of 8 elements, as the pool places them."""
    from peft_fastlora.backend.packed import PackedWeights, block_align

    k, offsets = SITES[site]
    a_rows, b_offs, row, off = packed_layout(offsets, ranks)
    a = torch.randn(row, k, device=DEVICE, dtype=DTYPE) / k ** 0.5
    b = torch.randn(off, device=DEVICE, dtype=DTYPE) / 8
    return PackedWeights(a, b, a_rows.to(DEVICE), b_offs.to(DEVICE), max(ranks), tuple(offsets),
                         align=block_align(ranks), mixed_ranks=len(set(ranks)) > 1)


def byte_floor_us(site, rows, used_ranks, bandwidth):
    k, offsets = SITES[site]
    n = offsets[-1]
    weights = sum(r * (k + n) for r in used_ranks) * 2
    return 1e6 * (weights + rows * (k + 2 * n) * 2) / bandwidth


def run_workload(name, rank_blocks, layers, timer, bandwidth, versions, launch_sweep=((None,) * 6,), path="fused"):
    lf = importlib.import_module("peft_fastlora.ops.lora_fused")  # (the package exports a function of that name)
    from peft_fastlora.backend.torch_native import TorchNativeLoRABackend
    from peft_fastlora.backend.triton import TritonLoRABackend
    from peft_fastlora.batch import ForwardBatch, ForwardMode

    rows, n_adapters, rank_cycle, sites = WORKLOADS[name]
    ranks = [rank_cycle[i % len(rank_cycle)] for i in range(n_adapters)]
    wi = [i % n_adapters for i in range(rows)]
    scal = [1.0 / (1 + i % 3) for i in range(n_adapters)]
    fb = ForwardBatch(rows, [1] * rows, ForwardMode.DECODE, torch.device(DEVICE))
    tri = TritonLoRABackend(n_adapters, DEVICE, fused_decode=path == "fused")
    ref = TorchNativeLoRABackend(n_adapters, DEVICE)
    tri.init_cuda_graph_batch_info(rows, 1, max_slots=n_adapters)  # the decode graphs' static plan
    bi = tri.prepare_lora_batch(fb, wi, ranks, scal, use_cuda_graph=True)
    ref.prepare_lora_batch(fb, wi, ranks, scal, use_cuda_graph=False)
    per_site = {}
    for site in sites:
        k, offsets = SITES[site]
        c = len(offsets) - 1
        rk = torch.tensor(ranks, dtype=torch.int32, device=DEVICE)[:, None].repeat(1, c).contiguous()
        sc = torch.tensor(scal, dtype=torch.float32, device=DEVICE)[:, None].repeat(1, c).contiguous()
        ws = [packed_site(site, ranks) for _ in range(layers)]
        x = torch.randn(rows, k, device=DEVICE, dtype=DTYPE)
        out = torch.randn(rows, offsets[-1], device=DEVICE, dtype=DTYPE)
        per_site[site] = (ws, x, out, rk, sc)
    floor = sum(byte_floor_us(s, rows, [ranks[w] for w in sorted(set(wi))], bandwidth) for s in sites)
    results = []
    library_config, library_blocks = lf.fused_config, (lf.RANK_BLOCK, lf.MIXED_RANK_BLOCK)
    for rb, (pps, warps, prefetch, max_regs, bk, bn) in [(rb, lw) for rb in rank_blocks for lw in launch_sweep]:
        if rb:  # 0: the library's own choice
            lf.RANK_BLOCK = lf.MIXED_RANK_BLOCK = rb

        def config(*args, _pps=pps, _warps=warps, _prefetch=prefetch, _regs=max_regs, _bk=bk, _bn=bn, **kwargs):
            cfg = library_config(*args, **kwargs)
            return dict(cfg, programs_per_sm=_pps or cfg["programs_per_sm"], num_warps=_warps or cfg["num_warps"],
                        block_k=_bk or cfg["block_k"], block_n=_bn or cfg["block_n"],
                        prefetch=cfg["prefetch"] if _prefetch is None else bool(_prefetch),
                        max_registers=cfg["max_registers"] if _regs is None else (_regs or None))

        lf.fused_config = config
        used = config(max(ranks), 4096, [4096], DTYPE, mixed_ranks=len(set(ranks)) > 1)  # what the launches take
        # the first layer of each site against the torch backend, from the same base output
        err = 0.0
        for site, (ws, x, out, rk, sc) in per_site.items():
            base = out.clone()
            got = tri.run_packed_lora(x, ws[0], base_output=base.clone(), layer_ranks=rk, layer_scalings=sc,
                                      batch_info=bi)
            want = ref.run_packed_lora(x, ws[0], base_output=base.clone(), layer_ranks=rk, layer_scalings=sc)
            err = max(err, float((got.float() - want.float()).abs().max() / want.float().abs().max()))

        def step():
            for layer in range(layers):
                for ws, x, out, rk, sc in per_site.values():
                    tri.run_packed_lora(x, ws[layer], base_output=out, layer_ranks=rk, layer_scalings=sc,
                                        batch_info=bi)

        if DEVICE == "cuda":
            graph = capture(step)
            us = timer(graph.replay) / layers
            del graph
        else:  # smoke: eager, once
            t0 = time.perf_counter()
            step()
            us = 1e6 * (time.perf_counter() - t0) / layers
        row = dict(versions, workload=name, path=path, rows=rows, adapters=n_adapters, ranks="/".join(map(str, rank_cycle)),
                   sites="+".join(sites), rank_block=rb,
                   **{key: used[key] for key in ("programs_per_sm", "num_warps", "prefetch", "max_registers", "r_sub",
                                      "block_k", "block_n")}, us_per_layer=round(us, 2),
                   us_per_launch=round(us / len(sites), 2), floor_us_per_layer=round(floor, 2),
                   x_floor=round(us / floor, 3), max_rel_err=f"{err:.2e}", timeouts=tri.fused_timeouts())
        print(row, flush=True)
        results.append(row)
    (lf.RANK_BLOCK, lf.MIXED_RANK_BLOCK), lf.fused_config = library_blocks, library_config
    return results


def kernel_registers():
    """(registers, spills, warps) of each compiled variant of the fused kernel: what bounds its
    programs per SM (Triton's cache layout; best effort)."""
    lf = importlib.import_module("peft_fastlora.ops.lora_fused")
    try:
        return sorted({(k.n_regs, k.n_spills, k.metadata.num_warps)
                       for cache in lf._lora_fused_decode_kernel.device_caches.values()
                       for k in cache[0].values()})
    except Exception as e:  # noqa: BLE001 (a probe's extra: never fail the run for it)
        return f"unavailable ({type(e).__name__})"


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.manual_seed(0)
    timer = Timer(args.iters) if DEVICE == "cuda" else None
    bandwidth = copy_bandwidth(timer) if timer else 1e12
    versions = dict(bg.versions(), copy_tb_s=round(bandwidth / 1e12, 3))
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    rows = []
    for name in args.workloads:
        sweep = [(p, w, f, r, k, n) for p in args.programs_per_sm for w in args.num_warps for f in args.prefetch
                 for r in args.max_registers for k in args.block_k for n in args.block_n]
        for path in args.paths:
            rows += run_workload(name, args.rank_blocks, args.layers, timer, bandwidth, versions, sweep, path)
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    print("fused kernel variants compiled (registers, spills, warps):", kernel_registers(), flush=True)
    path = bg.write_csv(rows, args.out, args.csv)
    print(f"written {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
