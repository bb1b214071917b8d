"""Whether cuBLAS's GEMMs wait on a programmatic dependency (``griddepcontrol.wait``), and what a
programmatic edge into them would save.

In a captured decode step, the edge from one of our PDL kernels (a norm, the attention) into the
cuBLAS GEMM after it is a full edge: cuBLAS launches without PDL. Were it programmatic, the GEMM
could launch while the kernel before it finishes; that is sound only if the GEMM's kernel waits
(``griddepcontrol.wait``) before it reads its input. Their SASS is not found by name in
libcublasLt, so this asks the GPU:

- ``race``: a graph of a writer kernel (it lets dependents launch at its start, spins
  ``--spin-us``, then writes x) and ``x @ w.T`` by cuBLAS. The writer -> GEMM edge is made
  programmatic before instantiation and x is zeroed before each replay. A GEMM that waits gives
  ``x @ w.T`` in every replay; one that does not reads the zeros. Two Triton controls behind the
  same writer check the check: a copy kernel that waits (must match) and one that does not (must not).
- ``timing``: 32 (RMSNorm -> GEMM) pairs in one graph, replayed with the norm -> GEMM edges full or
  programmatic (only meaningful where ``race`` says the GEMM waits).

    python benchmarks/probe_cublas_wait.py --out benchmarks/results/probe_cublas_wait_h200.csv
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import os
import statistics
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@triton.jit
def _now():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                     pack=1)


@triton.jit
def _late_write_kernel(src_ptr, dst_ptr, n, spin_ns, BLOCK: tl.constexpr):
    """Lets dependents launch, spins ``spin_ns``, then copies ``src`` to ``dst``."""
    tl.extra.cuda.gdc_launch_dependents()
    start = _now()
    now = start
    while now - start < spin_ns:
        now = _now()
    for off in range(tl.program_id(0) * BLOCK, n, tl.num_programs(0) * BLOCK):
        cols = off + tl.arange(0, BLOCK)
        tl.store(dst_ptr + cols, tl.load(src_ptr + cols, mask=cols < n), mask=cols < n)


@triton.jit
def _copy_kernel(src_ptr, dst_ptr, n, WAIT: tl.constexpr, BLOCK: tl.constexpr):
    if WAIT:
        tl.extra.cuda.gdc_wait()
    for off in range(tl.program_id(0) * BLOCK, n, tl.num_programs(0) * BLOCK):
        cols = off + tl.arange(0, BLOCK)
        tl.store(dst_ptr + cols, tl.load(src_ptr + cols, mask=cols < n), mask=cols < n)


def _edge_data(from_port, type_):
    from peft_fastlora.decode import early_launch as el

    data = (el._EdgeData * 1)()
    data[0].from_port, data[0].to_port, data[0].type = from_port, 0, type_
    return data


def make_programmatic(graph_handle, want_src, want_dst):
    """Full edges from nodes whose kernel name passes ``want_src`` into ones passing ``want_dst``
    become programmatic edges from the source's programmatic port; returns (edges, dst names)."""
    from peft_fastlora.decode import early_launch as el

    drv = el._get_driver()
    graph = ctypes.c_void_p(graph_handle)
    names = el.names(graph_handle)
    moved, dst_names = 0, set()
    for e in drv.edges(graph):
        if e.type != el.TYPE_DEFAULT or not want_src(names.get(e.src)) or not want_dst(names.get(e.dst)):
            continue
        src, dst = (ctypes.c_void_p * 1)(e.src), (ctypes.c_void_p * 1)(e.dst)
        drv.call("cuGraphRemoveDependencies_v2", graph, src, dst, _edge_data(e.from_port, e.type), 1)
        new = _edge_data(el.PORT_PROGRAMMATIC, el.TYPE_PROGRAMMATIC)
        drv.call("cuGraphAddDependencies_v2", graph, src, dst, new, 1)
        moved += 1
        dst_names.add(names.get(e.dst))
    return moved, dst_names


def _capture(fn, edit=None):
    from peft_fastlora import _compat

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # warm: cuBLAS picks and loads its kernel, Triton compiles
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = _compat.new_cuda_graph(True)
    with torch.cuda.graph(graph):
        fn()
    info = edit(graph.raw_cuda_graph()) if edit is not None else (0, set())
    graph.instantiate()
    return graph, info


def race(m, n, k, spin_us, replays, consumer):
    torch.manual_seed(m * 7 + n)
    x_src = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    x = torch.zeros_like(x_src)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16) if consumer == "gemm" else torch.empty_like(x)
    spin_ns = int(spin_us * 1000)

    def step():
        _late_write_kernel[(1,)](x_src, x, x.numel(), spin_ns, BLOCK=1024)
        if consumer == "gemm":
            torch.mm(x, w.t(), out=out)
        else:
            _copy_kernel[(4,)](x, out, x.numel(), WAIT=consumer == "copy_wait", BLOCK=1024)

    ref = x_src @ w.t() if consumer == "gemm" else x_src.clone()
    graph, (moved, dst_names) = _capture(step, lambda h: make_programmatic(
        h, lambda s: s == "_late_write_kernel", lambda d: d is not None and d != "_late_write_kernel"))
    equal = 0
    for _ in range(replays):
        x.zero_()
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        equal += bool(torch.equal(out, ref))
    return dict(check="race", consumer=consumer, m=m, n=n, k=k, spin_us=spin_us, edges_made_programmatic=moved,
                kernel=";".join(sorted(str(d) for d in dst_names)), replays=replays, replays_equal=equal)


def timing(m, n, k, pairs, replays):
    from peft_fastlora.ops.rms_norm import rms_norm

    xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(pairs)]
    nw = torch.ones(k, device="cuda", dtype=torch.bfloat16)
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(2)]
    outs = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(pairs)]

    def step():
        for i in range(pairs):
            torch.mm(rms_norm(xs[i], nw, 1e-5), ws[i % 2].t(), out=outs[i])

    res = {}
    ref = None
    for mode in ("full", "programmatic", "full2", "programmatic2"):
        edit = None
        if mode.startswith("programmatic"):
            edit = lambda h: make_programmatic(h, lambda s: s == "_rms_norm_kernel",  # noqa: E731
                                               lambda d: d is not None and not d.startswith("_"))
        graph, (moved, _) = _capture(step, edit)
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        got = torch.stack(outs).clone()
        if ref is None:
            ref = got
        times = []
        for _ in range(replays):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graph.replay()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        res[mode] = (statistics.median(times), moved, bool(torch.equal(got, ref)))
        del graph
    full = statistics.mean([res["full"][0], res["full2"][0]])
    prog = statistics.mean([res["programmatic"][0], res["programmatic2"][0]])
    return dict(check="timing", consumer="gemm", m=m, n=n, k=k, pairs=pairs,
                full_ms=round(full, 4), programmatic_ms=round(prog, 4),
                saved_us_per_pair=round(1e3 * (full - prog) / pairs, 3),
                edges_made_programmatic=res["programmatic"][1],
                outputs_equal=all(r[2] for r in res.values()))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spin-us", type=float, default=200.0)
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--out", default="benchmarks/results/probe_cublas_wait_h200.csv")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_cublas_wait needs a CUDA GPU; nothing measured")
        return 0
    import bench_generate as bg

    vers = bg.versions()
    rows = []
    # the 8B shapes cuBLAS runs in the decode step: q/k/v and o at 65-128 rows, the LM head at all
    shapes = [(128, 6144, 4096), (128, 4096, 4096), (96, 6144, 4096), (128, 128256, 4096), (32, 128256, 4096),
              (1, 128256, 4096)]
    for consumer in ("copy_wait", "copy_nowait"):
        rows.append(race(128, 4096, 4096, args.spin_us, args.replays, consumer))
        print(rows[-1], flush=True)
    for m, n, k in shapes:
        rows.append(race(m, n, k, args.spin_us, args.replays, "gemm"))
        print(rows[-1], flush=True)
    for m, n, k in ((128, 6144, 4096), (128, 4096, 4096)):
        rows.append(timing(m, n, k, 32, 50))
        print(rows[-1], flush=True)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    fields = []
    for r in rows:
        fields += [f for f in r if f not in fields]
    with open(args.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields + list(vers))
        w.writeheader()
        for r in rows:
            w.writerow(dict(r, **vers))
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
