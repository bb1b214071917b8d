"""The greedy token selection alone: ``ops.greedy_select`` at its own launch shape and others against
what transformers' loop runs for it (the float32 copy of the logits, ``argmax``, the padding of
finished rows, the EOS ``isin``), at an 8B vocabulary (128,256) in bf16.

Each variant is captured in a CUDA graph of ``--chain`` launches on distinct logits (so the time is
the GPU's, not the host's launch rate) and timed as replays; "per launch" is the replay over the
chain. The byte floor is the logits' bytes over the copy bandwidth.

``two_pass`` (probe only; session 35's lead): the library kernel's keys without its atomics. Each
program stores its chunk's best key to a (rows, chunks) buffer, and a second launch takes each
row's largest. It leaves out the stop ids and the pad (a few scalar ops of the second launch);
every variant's tokens are first checked against ``argmax``. ``--smoke`` runs that check alone
on the CPU (Triton's interpreter), with ties, NaN, infinities and signed zeros.

``looped`` and ``looped_keys`` (probe only; session 36): whether the library kernel was latency-bound (a program
loads, computes, reduces and exits, so few bytes are in flight an SM) and its per-element int64 key
work heavy. A few programs a row (``seg`` columns each) loop over their segment in ``tile``-wide
loads that ``tl.range(num_stages=stages)`` pipelines (``stages=1``: not, the control). ``looped``
keeps a float32 running maximum and its first column a lane and packs one key a lane at the end;
``looped_keys`` packs every element's key (the library's work, looped). Each stores its segment's
key and ``two_pass``'s second launch picks the row's. ``looped`` won (session 36) and is now the
library kernel's form (with its atomic finish); both stay here as the experiment.

    python benchmarks/probe_greedy_select.py --out benchmarks/results/probe_greedy_select_h200.csv
"""

from __future__ import annotations

import argparse
import csv
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from peft_fastlora.ops.greedy_select import EMPTY_KEY, segment_of  # noqa: E402

VOCAB = 128256


@triton.jit
def _chunk_keys_kernel(logits_ptr, keys_ptr, vocab, stride_lr, n_chunks, EMPTY: tl.constexpr, BLOCK: tl.constexpr):
    """Pass 1: a program's best key (``ops.greedy_select``'s packing), stored, no atomics."""
    chunk = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    ok = cols < vocab
    x = tl.load(logits_ptr + row * stride_lr + cols, mask=ok, other=float("-inf")).to(tl.float32) + 0.0
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    key = tl.where(x != x, 0x7FFFFFFF, key)
    low32 = tl.full([], 0xFFFFFFFF, tl.int64)
    packed = tl.where(ok, (key.to(tl.int64) << 32) + (low32 - cols.to(tl.int64)), EMPTY)
    tl.store(keys_ptr + row * n_chunks + chunk, tl.max(packed, axis=0))


@triton.jit
def _pick_kernel(keys_ptr, token_ptr, rows, n_chunks, EMPTY: tl.constexpr, ROWS: tl.constexpr,
                 CHUNKS: tl.constexpr):
    """Pass 2: ``ROWS`` rows a program, each row's largest chunk key turned back into its column."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    c = tl.arange(0, CHUNKS)
    mask = (r < rows)[:, None] & (c < n_chunks)[None, :]
    keys = tl.load(keys_ptr + r.to(tl.int64)[:, None] * n_chunks + c[None, :], mask=mask, other=EMPTY)
    best = tl.max(keys, axis=1)
    low32 = tl.full([], 0xFFFFFFFF, tl.int64)
    tl.store(token_ptr + r, low32 - (best & low32), mask=r < rows)


@triton.jit
def _key(x, cols):
    """``ops.greedy_select``'s packing: the value's order-preserving key above the column's complement."""
    x = x + 0.0  # -0.0 + 0.0 is +0.0: the two zeros get one key
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    key = tl.where(x != x, 0x7FFFFFFF, key)
    low32 = tl.full([], 0xFFFFFFFF, tl.int64)
    return (key.to(tl.int64) << 32) + (low32 - cols.to(tl.int64))


@triton.jit
def _segment_keys_kernel(logits_ptr, keys_ptr, vocab, stride_lr, n_segs, EMPTY: tl.constexpr, SEG: tl.constexpr,
                         TILE: tl.constexpr, STAGES: tl.constexpr, PACK_EACH: tl.constexpr):
    """Pass 1, looped: a program's segment in ``TILE``-wide loads, its best key stored."""
    seg = tl.program_id(0)
    row, start, n, base, lanes = segment_of(logits_ptr, vocab, stride_lr, SEG, TILE)
    if PACK_EACH:
        best = tl.full([TILE], EMPTY, tl.int64)
    else:
        best = tl.full([TILE], float("-inf"), tl.float32)
        # a lane that never takes (its values all -inf) keeps its first column, which ranks it right
        col = lanes
    for t in tl.range(0, n, TILE, num_stages=STAGES):
        ok = t + lanes < n
        x = tl.load(base + t + lanes, mask=ok, other=float("-inf")).to(tl.float32)
        if PACK_EACH:
            best = tl.maximum(best, tl.where(ok, _key(x, start + t + lanes), EMPTY))
        else:
            # strictly larger (a later equal value loses), or the lane's first NaN (argmax's maximum)
            take = (x > best) | ((x != x) & (best == best))
            best = tl.where(take, x, best)
            col = tl.where(take, t + lanes, col)
    if not PACK_EACH:
        best = _key(best, start + col)
    tl.store(keys_ptr + row * n_segs + seg, tl.max(best, axis=0))


def _pick(keys, tokens, n_chunks: int, rows_per_program: int = 8):
    rows = tokens.shape[0]
    _pick_kernel[(triton.cdiv(rows, rows_per_program),)](keys, tokens, rows, n_chunks, EMPTY=EMPTY_KEY,
                                                         ROWS=rows_per_program,
                                                         CHUNKS=max(2, triton.next_power_of_2(n_chunks)), num_warps=1)
    return tokens


def two_pass(logits, tokens, keys, block: int, warps: int, rows_per_program: int = 8):
    rows, vocab = logits.shape
    n_chunks = triton.cdiv(vocab, block)
    _chunk_keys_kernel[(n_chunks, rows)](logits, keys, vocab, logits.stride(0), n_chunks, EMPTY=EMPTY_KEY,
                                         BLOCK=block, num_warps=warps)
    return _pick(keys, tokens, n_chunks, rows_per_program)


def looped(logits, tokens, keys, seg: int, tile: int, warps: int, stages: int, pack_each: bool = False,
           rows_per_program: int = 8):
    rows, vocab = logits.shape
    n_segs = triton.cdiv(vocab, seg)
    _segment_keys_kernel[(n_segs, rows)](logits, keys, vocab, logits.stride(0), n_segs, EMPTY=EMPTY_KEY, SEG=seg,
                                         TILE=tile, STAGES=stages, PACK_EACH=pack_each, num_warps=warps)
    return _pick(keys, tokens, n_segs, rows_per_program)


def smoke() -> int:
    """Every probe variant's tokens against ``argmax`` under the interpreter (a small vocabulary)."""
    vocab, block = 1000, 128
    # (seg, tile, stages, pack_each): several tiles a segment and a lane; segments not a tile multiple;
    # a last segment (104 columns) shorter than one tile
    loops = [(256, 64, 2, pack) for pack in (False, True)] + [(448, 128, 1, False)]
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        x = torch.randn(9, vocab).to(dtype)
        x[0, vocab - 1] = 50.0  # the last column, in the last, partial chunk
        x[1, 3], x[1, 700] = 50.0, 50.0  # a tie across chunks: the first wins
        x[2, 5], x[2, 9] = 50.0, 50.0  # a tie in one chunk
        x[3] = float("-inf")
        x[4, 600], x[4, 200] = float("nan"), float("nan")  # the first NaN wins
        x[5] = -0.0
        x[5, 1], x[5, 400] = 0.0, 0.0  # -0.0 equals 0.0: column 0
        x[6, 10], x[6, 999] = float("inf"), float("inf")
        x[7, 20], x[7, 84], x[7, 148] = 50.0, 50.0, 50.0  # a tie in one lane of later tiles
        x[8, 44], x[8, 172], x[8, 300] = float("nan"), float("nan"), float("nan")  # NaNs in one lane
        want = torch.argmax(x.float(), dim=-1)
        keys = torch.empty(9, triton.cdiv(vocab, 64), dtype=torch.long)
        got = two_pass(x, torch.empty(9, dtype=torch.long), keys, block, 4, rows_per_program=4)
        assert torch.equal(got, want), ("two_pass", dtype, got, want)
        for seg, tile, stages, pack in loops:
            got = looped(x, torch.empty(9, dtype=torch.long), keys, seg, tile, 4, stages, pack, rows_per_program=4)
            assert torch.equal(got, want), ("looped", seg, tile, pack, dtype, got, want)
    print("smoke: every variant ran and matched argmax")
    return 0


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
    p.add_argument("--smoke", action="store_true", help="the probe variants' check on the CPU (interpreter)")
    args = p.parse_args(argv)
    if args.smoke:
        return smoke()
    if not torch.cuda.is_available():
        print("probe_greedy_select needs a CUDA GPU; nothing measured")
        return 0
    import peft
    import transformers

    from bench_generate import copy_bandwidth
    from peft_fastlora.ops import greedy_select as gs

    bw = copy_bandwidth()
    vers = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                transformers=transformers.__version__, peft=peft.__version__, copy_bw_tbs=round(bw / 1e12, 3))
    rows_out, default = [], gs.CONFIG
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
        # the library's kernel: its own choice for these rows, then the loops' other shapes
        for config in [None, (1024, 1024, 8, 1), (2048, 2048, 8, 1), (8192, 4096, 8, 3), (8192, 1024, 4, 3),
                       (8192, 2048, 8, 1), (16384, 1024, 4, 1), (32768, 2048, 8, 1)]:
            def fused(i, config=config):
                gs.CONFIG = config
                return gs.greedy_select(xs[i], tokens, unfinished, pad, eos)
            shape = config or gs.config_for(rows)
            label = "seg={} tile={} warps={} stages={}".format(*shape) + (" (default)" if config is None else "")
            variants.append(("greedy_select", label, fused))
        keys = torch.empty(rows, triton.cdiv(VOCAB, 1024), dtype=torch.long, device="cuda")
        for block in (2048, 4096, 8192):
            for warps in (4, 8):
                def two(i, block=block, warps=warps):
                    return two_pass(xs[i], tokens, keys, block, warps)
                variants.append(("two_pass", f"block={block} warps={warps}", two))
        # (tile, warps): 8 or 16 logits a thread a load (16 or 32 bytes)
        for seg in (8192, 16384, 32768):
            for tile, warps in ((1024, 4), (2048, 4), (2048, 8), (4096, 8)):
                for stages in (1, 3):
                    def loop(i, seg=seg, tile=tile, warps=warps, stages=stages):
                        return looped(xs[i], tokens, keys, seg, tile, warps, stages)
                    variants.append(("looped", f"seg={seg} tile={tile} warps={warps} stages={stages}", loop))
        for seg in (8192, 16384):
            for tile, warps in ((1024, 4), (2048, 8)):
                def loop_keys(i, seg=seg, tile=tile, warps=warps):
                    return looped(xs[i], tokens, keys, seg, tile, warps, 3, pack_each=True)
                variants.append(("looped_keys", f"seg={seg} tile={tile} warps={warps} stages=3", loop_keys))
        for impl, config, fn in variants:
            if impl != "transformers":  # the tokens first
                unfinished.fill_(1)
                fn(0)
                want = torch.argmax(xs[0].float(), dim=-1)
                if not torch.equal(tokens, want):
                    print(f"rows {rows} {impl} {config}: tokens differ from argmax; not timed", flush=True)
                    continue
            try:
                us = _graph_time_us(fn, args.chain)
            except Exception as e:  # noqa: BLE001 - a variant that fails is reported, not fatal
                print(f"rows {rows} {impl} {config}: {type(e).__name__}: {e}", flush=True)
                continue
            row = dict(vers, rows=rows, vocab=VOCAB, impl=impl, config=config, us_per_launch=round(us, 2),
                       byte_floor_us=round(floor_us, 2))
            print(row, flush=True)
            rows_out.append(row)
        gs.CONFIG = default
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows_out[0]))
        w.writeheader()
        w.writerows(rows_out)
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
