"""Kernel benchmark: one fused LoRA op (shrink + expand of a projection site) at Llama-3-8B shapes.

Implementations, each timed in this one run on this GPU:
- ``triton``: the Triton backend as the layers call it, captured in a CUDA graph and timed as
  graph replays: decode-sized batches (16-row chunks) run shrink + expand as one fused launch,
  prefill the shrink and expand kernels;
- ``triton_2k``: the same backend with ``fused_decode=False``: always the shrink and expand
  kernels (two launches), the path prefill takes;
- ``torch_native``: the reference backend, eager (it syncs with the host, so no graph);
- ``peft_loop``: PEFT's mixed-batch path re-implemented (``_mixed_batch_forward`` of
  ``peft/tuners/lora/layer.py``): per projection, per distinct adapter, index the rows, run
  ``lora_B(lora_A(x)) * scaling`` and add it back by index; eager (Python lists as indices).

Every timing is a median over iterations that each start with a 256 MiB memset: it evicts the
L2 (in a model, the other layers' weights pass through between two calls of one layer) and keeps
the GPU busy while the host enqueues the call, so graph replays are timed on the GPU alone. The
same run measures the launch floor (a graph of as many empty Triton kernels as the two-kernel
path launches: ``launch_floor_us``; of one empty kernel: ``launch_floor_1k_us``) and the copy
bandwidth; the byte floor of an op is (A and B bytes of the adapters used, at their rank + x read
+ output read and written) / that bandwidth. ``x_floor`` divides by max(byte floor, launch
floor), ``x_floor_1k`` by max(byte floor, one-launch floor). ``fused_timeouts`` counts readers of
the fused kernel that gave up waiting (must be 0).

    python benchmarks/bench_kernels.py                # kernels_h200.csv (and .png)
    python benchmarks/bench_kernels.py --smoke        # CPU (Triton's interpreter): checks the script
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness as hx  # noqa: E402


def sites_of(hidden: int, q: int, kv: int, inter: int) -> dict:
    """name: (input dim, column offsets of the stacked modules in the output)."""
    return {"qkv": (hidden, (0, q, q + kv, q + 2 * kv)), "o": (hidden, (0, hidden)),
            "gate_up": (hidden, (0, inter, 2 * inter)), "down": (inter, (0, hidden))}


SITES = sites_of(4096, 4096, 1024, 14336)  # Llama-3-8B's widths
DTYPE = torch.bfloat16
MAX_LORAS = 32  # the pool size and max_loras_per_batch of every run (the graph grid depends on it)
DECODE = [(1, 1), (32, 1), (32, 8), (32, 32), (128, 1), (128, 8), (128, 32)]  # (rows, adapters)
PREFILL = [(8, 512, 1), (8, 512, 8)]  # (rows, tokens per row, adapters): 4096 tokens
RANKS = (16, 64)
IMPLS = ("triton", "triton_2k", "torch_native", "peft_loop")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=hx.RESULTS, help="folder for kernels_<gpu>.csv and its plot")
    p.add_argument("--iters", type=int, default=40, help="timed iterations per measurement")
    p.add_argument("--quick", action="store_true", help="qkv and rank 16 only")
    p.add_argument("--smoke", action="store_true", help="tiny widths on the CPU under Triton's interpreter")
    return p.parse_args(argv)


def smoke_settings():
    """Widths, rows and ranks a few interpreted launches cover (fp32: the interpreter's bf16 rounds
    differently from the GPU's)."""
    global SITES, DTYPE, MAX_LORAS, DECODE, PREFILL, RANKS
    SITES = {k: v for k, v in sites_of(64, 64, 32, 96).items() if k != "down"}  # down: o's path, deeper
    DTYPE, MAX_LORAS = torch.float32, 4
    DECODE, PREFILL, RANKS = [(2, 2)], [(2, 8, 2)], (8,)


# ---- the three implementations -----------------------------------------------------------------
def peft_loop(x3, a, b, offsets, rank, scalings, adapter_names, result3):
    """PEFT's ``_mixed_batch_forward`` for each projection of the site (its LoRA part; the base
    GEMM is common to all implementations and not timed). ``x3`` (rows, seq, K), ``result3``
    (rows, seq, N_total), adapter ``i`` is named ``str(i)``, rows with "__base__" are skipped."""
    unique_adapters = set(adapter_names)
    for j in range(len(offsets) - 1):
        result = result3[..., offsets[j] : offsets[j + 1]]  # this projection's own output
        sub_batch_indices_list = []
        for adapter in unique_adapters:
            sub_batch_indices_list.append([i for i, name in enumerate(adapter_names) if name == adapter])
        for i, active_adapter in enumerate(unique_adapters):
            if active_adapter == "__base__":
                continue
            slot = int(active_adapter)
            lora_a = a[slot, j * rank : (j + 1) * rank]  # nn.Linear weights: (r, K) and (N_j, r)
            lora_b = b[slot, offsets[j] : offsets[j + 1]]
            sub_batch = x3[sub_batch_indices_list[i]].to(lora_a.dtype)
            lora_output = torch.nn.functional.linear(
                torch.nn.functional.linear(sub_batch, lora_a), lora_b) * scalings[slot]
            result[sub_batch_indices_list[i]] += lora_output.to(result.dtype)
    return result3


def run_site(backend, site, x, a, b, offsets, out, ranks, scalings):
    kw = dict(base_output=out, layer_ranks=ranks, layer_scalings=scalings)
    if site == "qkv":
        return backend.run_qkv_lora(x, a, b, output_offset=offsets, **kw)
    if site == "gate_up":
        return backend.run_gate_up_lora(x, a, b, **kw)
    # one module: run_lora_a_sgemm + run_lora_b_sgemm, or one fused launch where it applies
    return backend.run_lora(x, a, b, **kw)


def bench_config(timer, site, rank, rows, seq, n_adapters, weights, bandwidth, floors):
    from peft_fastlora import ForwardBatch, get_backend
    from peft_fastlora.ops import fused_supported

    dev = hx.DEVICE
    TritonLoRABackend, TorchNativeLoRABackend = get_backend("triton"), get_backend("torch_native")

    k, offsets = SITES[site]
    c, n_total, s = len(offsets) - 1, offsets[-1], rows * seq
    a, b, ranks, scalings = weights
    wi = [i % n_adapters for i in range(rows)]
    fb = ForwardBatch.from_shape(rows, seq, dev)
    slot_ranks, slot_scalings = ranks[:, 0].tolist(), scalings[:, 0].tolist()
    x = torch.randn(s, k, device=dev, dtype=DTYPE)
    out = torch.randn(s, n_total, device=dev, dtype=DTYPE)

    times, timing, errs = {}, {}, {}
    tri = TritonLoRABackend(MAX_LORAS, dev)
    tri_2k = TritonLoRABackend(MAX_LORAS, dev, fused_decode=False)
    ref = TorchNativeLoRABackend(MAX_LORAS, dev)
    for be in (tri, tri_2k, ref):
        be.prepare_lora_batch(fb, wi, slot_ranks, slot_scalings, use_cuda_graph=False)
    want = run_site(ref, site, x, a, b, offsets, out.clone(), ranks, scalings).float()
    impls = (("triton", tri), ("triton_2k", tri_2k))
    for name, be in impls:  # before any timing: the timed calls add into ``out`` in place
        got = run_site(be, site, x, a, b, offsets, out.clone(), ranks, scalings).float()
        errs[name] = (got - want).abs().max().item()
    for name, be in impls:
        graph = hx.capture(lambda: run_site(be, site, x, a, b, offsets, out, ranks, scalings))
        times[name], timing[name] = timer(graph.replay), "graph"
        del graph
    fused = fused_supported(c, b.shape[2], tri.batch_info.block_m, b.dtype)
    timeouts = tri.fused_timeouts()
    times["torch_native"] = timer(lambda: run_site(ref, site, x, a, b, offsets, out, ranks, scalings))
    timing["torch_native"] = "eager (host syncs)"
    names = [str(w) for w in wi]
    x3, out3, scal_list = x.view(rows, seq, k), out.view(rows, seq, n_total), slot_scalings
    times["peft_loop"] = timer(lambda: peft_loop(x3, a, b, offsets, rank, scal_list, names, out3))
    timing["peft_loop"] = "eager (list indices)"

    n_launches = 1 + -(-c // 4)  # the two-kernel path: one shrink, one expand per 4 modules
    for n in (n_launches, 1):
        if n not in floors:
            floors[n] = hx.launch_floor(timer, n)
    launches = {"triton": 1 if fused else n_launches, "triton_2k": n_launches}
    floor_bytes = 2 * (n_adapters * rank * (c * k + n_total) + s * k + 2 * s * n_total)
    floor_us = floor_bytes / bandwidth * 1e6
    bound, bound_1k = max(floor_us, floors[n_launches]), max(floor_us, floors[1])
    rows_out = []
    for impl in IMPLS:
        rows_out.append(dict(
            site=site, mode="decode" if seq == 1 else "prefill", rows=rows, tokens=s,
            adapters=n_adapters, rank=rank, impl=impl, timing=timing[impl],
            launches=launches.get(impl, ""),
            time_us=round(times[impl], 2), byte_floor_us=round(floor_us, 2),
            launch_floor_us=round(floors[n_launches], 2),
            launch_floor_1k_us=round(floors[1], 2), floor_bytes=floor_bytes,
            x_floor=round(times[impl] / bound, 2), x_floor_1k=round(times[impl] / bound_1k, 2),
            speedup_vs_peft=round(times["peft_loop"] / times[impl], 2),
            max_abs_err_triton_vs_torch=f"{errs['triton']:.3g}",
            max_abs_err_triton_2k_vs_torch=f"{errs['triton_2k']:.3g}",
            fused_timeouts=timeouts))
    return rows_out


def make_weights(site, rank):
    """Stacked A (MAX_LORAS, c*rank, K) and B (MAX_LORAS, N, rank) and the rank/scaling tables."""
    k, offsets = SITES[site]
    c = len(offsets) - 1
    dev = hx.DEVICE
    a = torch.randn(MAX_LORAS, c * rank, k, device=dev, dtype=DTYPE) / k ** 0.5
    b = torch.randn(MAX_LORAS, offsets[-1], rank, device=dev, dtype=DTYPE) / rank ** 0.5
    ranks = torch.full((MAX_LORAS, c), rank, dtype=torch.int32, device=dev)
    scalings = torch.full((MAX_LORAS, c), 2.0, dtype=torch.float32, device=dev)
    return a, b, ranks, scalings


# ---- report ------------------------------------------------------------------------------------
def print_table(results):
    by_key = {}
    for r in results:
        by_key.setdefault((r["site"], r["mode"], r["tokens"], r["adapters"], r["rank"]), {})[r["impl"]] = r
    print(f"\n{'site':8} {'mode':8} {'tok':>5} {'ad':>3} {'r':>3} | {'triton':>9} {'tri_2k':>9} "
          f"{'torch':>9} {'peft':>9} us | {'floor':>7} {'1k':>5} us | {'x floor':>7} {'x 1k':>5} "
          f"{'2k':>5} | {'vs 2k':>6} {'vs peft':>7}")
    for (site, mode, tok, ad, rank), d in by_key.items():
        t, t2 = d["triton"], d["triton_2k"]
        floor = max(t["byte_floor_us"], t["launch_floor_us"])
        floor_1k = max(t["byte_floor_us"], t["launch_floor_1k_us"])
        print(f"{site:8} {mode:8} {tok:5d} {ad:3d} {rank:3d} | {t['time_us']:9.1f} "
              f"{t2['time_us']:9.1f} {d['torch_native']['time_us']:9.1f} "
              f"{d['peft_loop']['time_us']:9.1f}    | {floor:7.1f} {floor_1k:5.1f}    | "
              f"{t['x_floor']:7.2f} {t['x_floor_1k']:5.2f} {t2['x_floor']:5.2f} | "
              f"{t2['time_us'] / t['time_us']:5.2f}x {t['speedup_vs_peft']:6.1f}x")
    timeouts = max(r["fused_timeouts"] for r in results)
    print(f"fused-kernel timeouts: {timeouts}" + ("" if timeouts == 0 else "  <-- must be 0"))


def plot(results, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    sites = list(dict.fromkeys(r["site"] for r in results))
    fig, axes = plt.subplots(len(sites), 1, figsize=(12, 3.2 * len(sites)), squeeze=False)
    for ax, site in zip(axes[:, 0], sites):
        rows = [r for r in results if r["site"] == site]
        labels = list(dict.fromkeys(f"{r['mode'][0]}{r['tokens']}/a{r['adapters']}/r{r['rank']}"
                                    for r in rows))
        width = 0.8 / len(IMPLS)
        for i, impl in enumerate(IMPLS):
            ys = [r["time_us"] for r in rows if r["impl"] == impl]
            ax.bar([p + i * width for p in range(len(ys))], ys, width, label=impl)
        floors = [max(r["byte_floor_us"], r["launch_floor_us"]) for r in rows if r["impl"] == "triton"]
        ax.scatter([p + width for p in range(len(floors))], floors, marker="_", s=200, c="k",
                   label="floor", zorder=3)
        ax.set_yscale("log")
        ax.set_ylabel("us")
        ax.set_title(f"{site} LoRA (shrink + expand), {results[0]['gpu']}")
        ax.set_xticks([p + width for p in range(len(labels))], labels, rotation=60, fontsize=7)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.smoke:
        hx.use_cpu()
        smoke_settings()
        args.out, args.iters = None if args.out == hx.RESULTS else args.out, 1
    elif hx.needs_gpu("bench_kernels"):
        return 0
    torch.manual_seed(0)
    timer = hx.GpuTimer(args.iters)
    bandwidth = hx.copy_bandwidth()
    vers = hx.versions()
    meta = dict(vers, copy_bw_gbs=round(bandwidth / 1e9, 1))
    print(f"{meta['gpu']}  torch {meta['torch']}  triton {meta['triton']}  "
          f"copy bandwidth {meta['copy_bw_gbs']} GB/s (read + written)")
    sites = ["qkv"] if args.quick else list(SITES)
    ranks = RANKS[:1] if args.quick else RANKS
    configs = [(rows, 1, ad) for rows, ad in DECODE] + list(PREFILL)
    results, floors = [], {}
    for site in sites:
        for rank in ranks:
            weights = make_weights(site, rank)
            for rows, seq, ad in configs:
                for r in bench_config(timer, site, rank, rows, seq, ad, weights, bandwidth, floors):
                    results.append({**meta, **r})
                print(f"  {site} rank {rank} rows {rows} x {seq} tokens, {ad} adapters: done",
                      file=sys.stderr)
            del weights
            if hx.DEVICE == "cuda":
                torch.cuda.empty_cache()
    if args.out:
        path = hx.write_csv(results, hx.out_path(args.out, "kernels", vers["gpu"]))
        plot(results, os.path.splitext(path)[0] + ".png")
    print_table(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
