"""Decode-attention benchmark: one-token attention over a static KV cache at Llama-3-8B shapes.

Implementations, each captured in a CUDA graph of ``--layers`` calls (one per layer, each over its
own cache, so no call finds its K/V in L2) and timed as graph replays, L2 flushed before each:
- ``fastlora``: ``peft_fastlora.ops.decode_attention`` (the launcher's own config);
- ``hf_sdpa``: the installed transformers' ``sdpa_attention_forward`` (what a model runs today);
- ``sdpa_repeat_kv``: K/V repeated to every query head, then sdpa with the full-length bool mask
  (transformers 5.17's path for a masked GQA decode step);
- ``sdpa_pack_gqa``: the query heads of a kv head packed as query rows, sdpa with the mask
  (transformers >= 5.2x's path).
Then a short coordinate sweep of the kernel's launch parameters (splits, block_n, warps, stages),
reported as ``fastlora[...]`` rows, so one GPU run also says how to tune the defaults.

Shapes: H 32, KVH 8, D 128, bf16, cache of ``--cache-len`` slots filled to ``--filled`` (every row to
the same index, left padding of 0..47 slots expressed by the mask, as fastlora's static caches
hold them). The byte floor of one call is the K/V of the attended positions + q + output + mask over
the measured copy bandwidth; the launch floor is a graph of as many empty kernels.

    python benchmarks/bench_attention.py                      # attention_h200.csv
    python benchmarks/bench_attention.py --batches 16 48 64 96 192 256 --no-sweep --tag batches
    python benchmarks/bench_attention.py --grid "num_warps=1,2,4 block_n=16,32,64" --batches 128
    python benchmarks/bench_attention.py --smoke            # CPU (Triton's interpreter): checks the script
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness as hx  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
MODEL_LAYERS = 32  # Llama-3-8B: the "per step" column is the per-call time times this
DTYPE = torch.bfloat16
MAX_PAD = 48


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=hx.RESULTS, help="folder for attention[_<tag>]_<gpu>.csv")
    p.add_argument("--tag", default="", help="added to the CSV's name")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU under Triton's interpreter")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    p.add_argument("--cache-len", type=int, default=512)
    p.add_argument("--filled", type=int, default=200, help="cache index every row is filled to")
    p.add_argument("--layers", type=int, default=32, help="calls (distinct caches) per graph")
    p.add_argument("--iters", type=int, default=30, help="timed replays per measurement")
    p.add_argument("--no-sweep", action="store_true", help="skip the launch-parameter sweep")
    p.add_argument("--sweep-budget-s", type=float, default=90.0, help="stop sweeping after this")
    p.add_argument("--grid", default=None,
                   help='instead of the coordinate sweep, every combination of the given values, e.g. '
                        '"num_warps=1,2,4 block_n=32,64 num_splits=1,2 num_stages=1,2"')
    return p.parse_args(argv)


# ---- inputs and implementations --------------------------------------------------------------
def smoke_settings(args):
    """Heads, widths and lengths a few interpreted launches cover (fp32: the interpreter's bf16
    rounds differently from the GPU's), a two-point grid."""
    global HEADS, KV_HEADS, HEAD_DIM, DTYPE, MAX_PAD
    HEADS, KV_HEADS, HEAD_DIM, DTYPE, MAX_PAD = 4, 2, 16, torch.float32, 4
    args.batches, args.cache_len, args.filled, args.layers, args.iters = [2], 32, 20, 2, 1
    args.grid = args.grid or "num_warps=1 block_n=16,32"


def make_inputs(bsz, layers, cache_len, filled, seed=0):
    dev = hx.DEVICE
    g = torch.Generator(device=dev).manual_seed(seed)
    qs, ks, vs = [], [], []
    for _ in range(layers):
        qs.append(torch.randn(bsz, HEADS, 1, HEAD_DIM, device=dev, dtype=DTYPE, generator=g))
        ks.append(torch.randn(bsz, KV_HEADS, cache_len, HEAD_DIM, device=dev, dtype=DTYPE, generator=g))
        vs.append(torch.randn(bsz, KV_HEADS, cache_len, HEAD_DIM, device=dev, dtype=DTYPE, generator=g))
    pad = torch.randint(0, MAX_PAD, (bsz,), device=dev, generator=g)
    pad[0] = 0
    pos = torch.arange(cache_len, device=dev)
    mask = ((pos[None] >= pad[:, None]) & (pos[None] < filled))[:, None, None, :]
    return qs, ks, vs, mask


class _AttnStub(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.num_key_value_groups = HEADS // KV_HEADS
        self.is_causal = True


def impls(scale):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from peft_fastlora.ops import decode_attention

    sdpa = torch.nn.functional.scaled_dot_product_attention
    stub = _AttnStub().eval()
    groups = HEADS // KV_HEADS

    def repeat(x):
        b, h, n, d = x.shape
        return x[:, :, None].expand(b, h, groups, n, d).reshape(b, h * groups, n, d)

    def repeat_kv(q, k, v, m):
        return sdpa(q, repeat(k), repeat(v), attn_mask=m, scale=scale).transpose(1, 2)

    def pack_gqa(q, k, v, m):
        b = q.shape[0]
        o = sdpa(q.reshape(b, KV_HEADS, groups, HEAD_DIM), k, v, attn_mask=m, scale=scale)
        return o.reshape(b, HEADS, 1, HEAD_DIM).transpose(1, 2)

    return {
        "fastlora": lambda q, k, v, m: decode_attention(q, k, v, m, scaling=scale),
        "hf_sdpa": lambda q, k, v, m: sdpa_attention_forward(stub, q, k, v, m, scaling=scale)[0],
        "sdpa_repeat_kv": repeat_kv,
        "sdpa_pack_gqa": pack_gqa,
    }


def max_err(out, q, k, v, mask, scale):
    from peft_fastlora.ops import decode_attention_reference

    ref = decode_attention_reference(q, k, v, mask, scaling=scale)
    return (out.float() - ref.float()).abs().max().item()


# ---- measurement --------------------------------------------------------------------------------
def time_graph(timer, capture, fn, layers, inputs):
    qs, ks, vs, mask = inputs
    graph = capture(lambda: [fn(qs[i], ks[i], vs[i], mask) for i in range(layers)])
    us = timer(graph.replay) / layers
    del graph
    return us


def sweep_configs():
    """Coordinate sweep: each axis varied around the best point found so far (None: the default)."""
    return [("num_splits", [1, 2, 4, 8, 16]), ("block_n", [32, 64, 128, 256]), ("num_warps", [2, 4, 8]),
            ("num_stages", [1, 2, 3, 4])]


def grid_configs(spec: str) -> list:
    """Every combination of the values in ``spec`` ("axis=v1,v2 axis=v1 ...")."""
    import itertools

    axes = []
    for item in spec.split():
        axis, _, values = item.partition("=")
        if axis not in dict(sweep_configs()) or not values:
            raise ValueError(f"--grid: {item!r} is not axis=v1,v2 with an axis of {[a for a, _ in sweep_configs()]}")
        axes.append((axis, [int(v) for v in values.split(",")]))
    return [dict(zip([a for a, _ in axes], combo)) for combo in itertools.product(*[v for _, v in axes])]


def bench_batch(args, bsz, timer, capture, launch_floor, bandwidth, meta, deadline):
    from peft_fastlora.ops import decode_attention, decode_attention_config

    scale = HEAD_DIM ** -0.5
    inputs = make_inputs(bsz, args.layers, args.cache_len, args.filled)
    qs, ks, vs, mask = inputs
    attended = int(mask.sum().item())  # (row, position) pairs
    elt = torch.tensor([], dtype=DTYPE).element_size()
    floor_bytes = (2 * attended * KV_HEADS * HEAD_DIM * elt  # K and V of attended positions
                   + 2 * bsz * HEADS * HEAD_DIM * elt + mask.numel())  # q, output, mask
    full_cache_bytes = 2 * bsz * KV_HEADS * args.cache_len * HEAD_DIM * elt
    byte_floor = floor_bytes / bandwidth * 1e6
    cfg = decode_attention_config(bsz, KV_HEADS, HEADS // KV_HEADS, args.cache_len, HEAD_DIM, qs[0].device)
    launches = 1 if cfg["num_splits"] == 1 else 2
    lf = launch_floor(timer, launches * args.layers) / args.layers
    base = dict(meta, batch=bsz, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                cache_len=args.cache_len, filled=args.filled, floor_bytes=floor_bytes,
                full_cache_bytes=full_cache_bytes, byte_floor_us=round(byte_floor, 2),
                launch_floor_us=round(lf, 2))
    rows = []

    def add(impl, config, us, err):
        rows.append(dict(base, impl=impl, config=config, time_us=round(us, 2),
                         step_ms=round(us * MODEL_LAYERS / 1e3, 3),
                         x_floor=round(us / max(byte_floor, lf), 2), max_abs_err=f"{err:.3g}"))

    for name, fn in impls(scale).items():
        try:
            err = max_err(fn(qs[0], ks[0], vs[0], mask), qs[0], ks[0], vs[0], mask, scale)
            us = time_graph(timer, capture, fn, args.layers, inputs)
        except torch.cuda.OutOfMemoryError as e:
            print(f"  {name} batch {bsz}: out of memory ({e})", file=sys.stderr)
            empty_cache()
            continue
        config = (f"splits={cfg['num_splits']} block_n={cfg['block_n']} warps={cfg['num_warps']} "
                  f"stages={cfg['num_stages']}") if name == "fastlora" else ""
        add(name, config, us, err)
        empty_cache()

    if not args.no_sweep:
        best = {"num_splits": cfg["num_splits"], "block_n": cfg["block_n"], "num_warps": cfg["num_warps"],
                "num_stages": cfg["num_stages"]}
        best_us = next(r["time_us"] for r in rows if r["impl"] == "fastlora")
        seen = {tuple(sorted(best.items()))}
        if args.grid:  # each trial from the launcher's config, not from the best so far
            trials = [(None, dict(best, **combo)) for combo in grid_configs(args.grid)]
        else:
            trials = [(axis, value) for axis, values in sweep_configs() for value in values]
        label = "fastlora[grid]" if args.grid else "fastlora[sweep]"
        for axis, value in trials:
            if time.perf_counter() > deadline:
                break
            trial = value if axis is None else dict(best, **{axis: value})
            key = tuple(sorted(trial.items()))
            if key in seen:
                continue
            seen.add(key)

            def fn(q, k, v, m, trial=trial):
                return decode_attention(q, k, v, m, scaling=scale, **trial)

            try:
                err = max_err(fn(qs[0], ks[0], vs[0], mask), qs[0], ks[0], vs[0], mask, scale)
                us = time_graph(timer, capture, fn, args.layers, inputs)
            except Exception as e:  # a config that does not compile (registers, shared memory)
                print(f"  sweep {trial}: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
                continue
            add(label, " ".join(f"{k}={v}" for k, v in trial.items()), us, err)
            if us < best_us:
                best, best_us = trial, us
        add("fastlora[best]", " ".join(f"{k}={v}" for k, v in best.items()), best_us, float("nan"))
    hf = next((r["time_us"] for r in rows if r["impl"] == "hf_sdpa"), None)
    for r in rows:
        r["speedup_vs_hf_sdpa"] = round(hf / r["time_us"], 2) if hf else ""
    del inputs, qs, ks, vs
    empty_cache()
    return rows


def empty_cache():
    if hx.DEVICE == "cuda":
        torch.cuda.empty_cache()


def print_table(results):
    print(f"\n{'batch':>5} {'impl':16} {'us/call':>9} {'ms/step':>8} {'floor us':>9} {'x floor':>8} "
          f"{'vs hf':>6} {'max err':>8}  config")
    for r in results:
        floor = max(r["byte_floor_us"], r["launch_floor_us"])
        print(f"{r['batch']:5d} {r['impl']:16} {r['time_us']:9.2f} {r['step_ms']:8.3f} {floor:9.2f} "
              f"{r['x_floor']:8.2f} {r['speedup_vs_hf_sdpa']:>5}x {r['max_abs_err']:>8}  {r['config']}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.smoke:
        hx.use_cpu()
        smoke_settings(args)
        args.out = None if args.out == hx.RESULTS else args.out
    elif hx.needs_gpu("bench_attention"):
        return 0
    torch.manual_seed(0)
    timer = hx.GpuTimer(args.iters)
    bandwidth = hx.copy_bandwidth()
    meta = dict(hx.versions(), copy_bw_gbs=round(bandwidth / 1e9, 1), layers_per_graph=args.layers)
    print(f"{meta['gpu']}  torch {meta['torch']}  triton {meta['triton']}  transformers "
          f"{meta['transformers']}  copy bandwidth {meta['copy_bw_gbs']} GB/s (read + written)")
    results = []
    per_batch = args.sweep_budget_s / max(1, len(args.batches))
    for bsz in args.batches:
        deadline = time.perf_counter() + per_batch
        results += bench_batch(args, bsz, timer, hx.capture, hx.launch_floor, bandwidth, meta, deadline)
        print(f"  batch {bsz}: done", file=sys.stderr)
    if args.out:
        hx.write_csv(results, hx.out_path(args.out, "_".join(x for x in ("attention", args.tag) if x), meta["gpu"]))
    print_table(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
