"""Probe: where a fused decode LoRA launch's time goes, item by item.

The fused kernel (``ops/lora_fused.py``) is a persistent launch whose programs draw items (shrink:
one K split of one module of one chunk; expand: one column block) from a ticket counter. With many
distinct adapters each item is a short chain of dependent loads, and the launch sits several times
above its byte floor. Compiled with ``trace=`` the kernel stamps each item's phases with the SM's
clock (after its metadata, its first tile, the wait for the shrink, its dots, its counter update);
this probe replays ``probe_rank_blocks.py``'s workloads in a CUDA graph of ``--layers`` layers with
and without the trace and summarises:

- ``<csv>``: per workload, kind (shrink / expand) and phase, the mean / median / p90 nanoseconds and
  the phase's share of the items' time; the launch's microseconds traced and untraced;
- ``<stem>_items.csv``: every item of the first layer's launches (for timelines).

Cycles become nanoseconds through the clock rate measured in the same trace (clock against the
global timer over each program's items). The stamps cost time themselves (a reduction and a store
each): shares are the useful output, the traced launch time says how much the trace perturbs.

    python benchmarks/probe_fused_phases.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_generate as bg  # noqa: E402  (write_csv, versions)
import probe_rank_blocks as prb  # noqa: E402  (WORKLOADS, packed_site)
from bench_kernels import SITES, Timer, capture  # noqa: E402

# phase name: (from field, to field) of an item's record; expand items wait, shrink items do not
PHASES = {
    "shrink": [("metadata", "T_START", "T_META"), ("first_tiles", "T_META", "T_FIRST"),
               ("rank_blocks", "T_FIRST", "T_COMPUTED"), ("finish", "T_COMPUTED", "T_FINISHED")],
    "expand": [("metadata", "T_START", "T_META"), ("first_tiles", "T_META", "T_FIRST"),
               ("wait", "T_FIRST", "T_WAITED"), ("rank_blocks", "T_WAITED", "T_COMPUTED"),
               ("finish", "T_COMPUTED", "T_FINISHED")],
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--csv", default="probe_fused_phases_h200.csv")
    p.add_argument("--workloads", nargs="+", default=["64_distinct_mixed", "32x8_r16"])
    p.add_argument("--variants", nargs="+", default=["library"],
                   help="library or key=value,... overrides of fused_config (none: None), e.g. max_registers=none")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--iters", type=int, default=20)
    return p.parse_args(argv)


def build(name, layers):
    """The workload's plan, backends and per-layer packed weights (as probe_rank_blocks)."""
    from peft_fastlora.backend.triton import TritonLoRABackend
    from peft_fastlora.batch import ForwardBatch, ForwardMode

    rows, n_adapters, rank_cycle, sites = prb.WORKLOADS[name]
    ranks = [rank_cycle[i % len(rank_cycle)] for i in range(n_adapters)]
    wi = [i % n_adapters for i in range(rows)]
    scal = [1.0 / (1 + i % 3) for i in range(n_adapters)]
    fb = ForwardBatch(rows, [1] * rows, ForwardMode.DECODE, torch.device("cuda"))
    tri = TritonLoRABackend(n_adapters, "cuda")
    tri.init_cuda_graph_batch_info(rows, 1, max_slots=n_adapters)
    bi = tri.prepare_lora_batch(fb, wi, ranks, scal, use_cuda_graph=True)
    tri._probe_batch = (fb, wi, ranks, scal)  # for the reference backend
    per_site = {}
    for site in sites:
        k, offsets = SITES[site]
        c = len(offsets) - 1
        rk = torch.tensor(ranks, dtype=torch.int32, device="cuda")[:, None].repeat(1, c).contiguous()
        sc = torch.tensor(scal, dtype=torch.float32, device="cuda")[:, None].repeat(1, c).contiguous()
        ws = [prb.packed_site(site, ranks) for _ in range(layers)]
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        out = torch.randn(rows, offsets[-1], device="cuda", dtype=torch.bfloat16)
        per_site[site] = (ws, x, out, rk, sc)
    return tri, bi, per_site


def launch(lf, tri, bi, w, x, out, rk, sc, trace=None):
    return lf.lora_fused(x, w.a, w.b, w.offsets, rk, sc, out, bi.sorted_token_ids, bi.chunk_slot,
                         bi.chunk_start, bi.chunk_len, tri._workspace(x.device), block_m=bi.block_m,
                         check=False, a_rows=w.a_rows, b_offs=w.b_offs, max_rank=w.max_rank, b_align=w.align,
                         mixed_ranks=w.mixed_ranks, trace=trace)


def clock_ghz(records, f):
    """SM cycles per nanosecond: the programs' clock spans over their global-timer spans, pooled
    (a short launch gives each program only a few items)."""
    by_prog = {}
    for rec in records:  # (launch, program): each launch places its programs anew
        by_prog.setdefault((rec[-1], rec[f["T_SM"]]), []).append(rec)
    cycles = ns = 0
    for recs in by_prog.values():
        recs.sort(key=lambda r: r[f["T_START"]])
        cycles += recs[-1][f["T_START"]] - recs[0][f["T_START"]]
        ns += recs[-1][f["T_GLOBAL_NS"]] - recs[0][f["T_GLOBAL_NS"]]
    return cycles / ns if ns > 0 else float("nan")


def summarise(name, site, records, f, ghz):
    rows = []
    for kind_id, kind in ((0, "shrink"), (1, "expand")):
        recs = [r for r in records if r[f["T_KIND"]] == kind_id]
        if not recs:
            continue
        total = [(r[f["T_FINISHED"]] - r[f["T_START"]]) / ghz for r in recs]
        for phase, a, b in PHASES[kind] + [("item", "T_START", "T_FINISHED")]:
            ns = sorted((r[f[b]] - r[f[a]]) / ghz for r in recs)
            rows.append(dict(workload=name, site=site, kind=kind, phase=phase, items=len(recs),
                             mean_ns=round(statistics.mean(ns), 1), p50_ns=round(ns[len(ns) // 2], 1),
                             p90_ns=round(ns[int(len(ns) * 0.9)], 1),
                             share=round(sum(ns) / sum(total), 3)))
        if kind == "expand":
            spins = sorted(r[f["T_SPINS"]] for r in recs)
            rows.append(dict(workload=name, site=site, kind=kind, phase="spins", items=len(recs),
                             mean_ns=round(statistics.mean(spins), 2), p50_ns=spins[len(spins) // 2],
                             p90_ns=spins[int(len(spins) * 0.9)], share=""))
    # between items: a program's next item starts after its previous one finished
    by_prog, gaps = {}, []
    for r in records:  # (launch, program): the last field appended by main
        by_prog.setdefault((r[-1], r[f["T_SM"]]), []).append(r)
    for recs in by_prog.values():
        recs.sort(key=lambda r: r[f["T_START"]])
        gaps += [(b[f["T_START"]] - a[f["T_FINISHED"]]) / ghz for a, b in zip(recs, recs[1:])]
    if gaps:
        gaps.sort()
        rows.append(dict(workload=name, site=site, kind="all", phase="between_items", items=len(gaps),
                         mean_ns=round(statistics.mean(gaps), 1), p50_ns=round(gaps[len(gaps) // 2], 1),
                         p90_ns=round(gaps[int(len(gaps) * 0.9)], 1), share=""))
        per_prog = sorted(len(v) for v in by_prog.values())
        launches = {}
        for r in records:
            lo, hi = launches.get(r[-1], (r[f["T_GLOBAL_NS"]],) * 2)
            launches[r[-1]] = (min(lo, r[f["T_GLOBAL_NS"]]), max(hi, r[f["T_GLOBAL_NS"]]))
        span = statistics.mean(hi - lo for lo, hi in launches.values()) / 1e3
        rows.append(dict(workload=name, site=site, kind="all", phase="items_per_program", items=len(per_prog),
                         mean_ns=round(statistics.mean(per_prog), 2), p50_ns=per_prog[len(per_prog) // 2],
                         p90_ns=per_prog[int(len(per_prog) * 0.9)], share=f"item starts span {span:.1f} us a launch"))
    return rows


def set_variant(lf, text, original):
    """The library's fused_config, with this variant's overrides."""
    lf.fused_config = original
    if text != "library":
        overrides = {}
        for kv in text.split(","):
            key, _, value = kv.partition("=")
            overrides[key] = None if value == "none" else int(value)
        lf.fused_config = lambda *a, **k: dict(original(*a, **k), **overrides)


def max_error(lf, tri, bi, per_site):
    """The first layer of each site against the torch backend, from the same base output."""
    from peft_fastlora.backend.torch_native import TorchNativeLoRABackend

    ref = TorchNativeLoRABackend(tri.max_loras_per_batch, "cuda")
    ref.prepare_lora_batch(*tri._probe_batch, use_cuda_graph=False)
    err = 0.0
    for ws, x, out, rk, sc in per_site.values():
        base = out.clone()
        got = launch(lf, tri, bi, ws[0], x, base.clone(), rk, sc)
        want = ref.run_packed_lora(x, ws[0], base_output=base.clone(), layer_ranks=rk, layer_scalings=sc)
        err = max(err, float((got.float() - want.float()).abs().max() / want.float().abs().max()))
    return err


def main(argv=None) -> int:
    args = parse_args(argv)
    lf = importlib.import_module("peft_fastlora.ops.lora_fused")
    names = [n for n in dir(lf) if n.startswith("T_")]
    f = {n: getattr(lf, n) for n in names}
    torch.manual_seed(0)
    timer = Timer(args.iters)
    versions = bg.versions()
    out_rows, item_rows = [], []
    original = lf.fused_config
    for name in args.workloads:
        tri, bi, per_site = build(name, args.layers)
        cap = 1 << 16
        traces = {site: [torch.zeros(cap, lf.TRACE_FIELDS, dtype=torch.int64, device="cuda")
                         for _ in range(args.layers)] for site in per_site}

        def step(traced):
            for layer in range(args.layers):
                for site, (ws, x, out, rk, sc) in per_site.items():
                    launch(lf, tri, bi, ws[layer], x, out, rk, sc, traces[site][layer] if traced else None)

        for variant in args.variants:
            set_variant(lf, variant, original)
            err = max_error(lf, tri, bi, per_site)
            us = {}
            for traced in (False, True):
                for t in (t for ts in traces.values() for t in ts):
                    t.zero_()
                graph = capture(lambda: step(traced))
                us[traced] = timer(graph.replay) / args.layers
                del graph
            print(f"{name} {variant}: {us[False]:.1f} us a layer untraced, {us[True]:.1f} traced, "
                  f"max rel err {err:.2e}", flush=True)
            # the trace of the last replay: every drawn item wrote its kind (2 until its metadata)
            for site in per_site:
                records = []
                for layer, t in enumerate(traces[site]):
                    recs = [r + [layer] for r in t[t[:, f["T_START"]] != 0].cpu().tolist()]
                    records += recs
                    if layer == 0:
                        item_rows += [dict(workload=name, variant=variant, site=site, ticket=i,
                                           **{n.lower(): r[f[n]] for n in names}) for i, r in enumerate(recs)]
                ghz = clock_ghz(records, f)
                rows = summarise(name, site, [r for r in records if r[f["T_KIND"]] in (0, 1)], f, ghz)
                for row in rows:
                    row.update(versions, variant=variant, us_per_layer_untraced=round(us[False], 2),
                               us_per_layer_traced=round(us[True], 2), clock_ghz=round(ghz, 3),
                               max_rel_err=f"{err:.2e}", timeouts=tri.fused_timeouts())
                out_rows += rows
        set_variant(lf, "library", original)
        traces = per_site = None  # free the buffers before the next workload
        torch.cuda.empty_cache()
    print("written", bg.write_csv(out_rows, args.out, args.csv))
    stem = os.path.splitext(args.csv)[0]
    print("written", bg.write_csv(item_rows, args.out, f"{stem}_items.csv"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
