"""Probe (#13): what programmatic dependent launch (``ops/pdl.py``) does to a graphed decode step.

One model, the same calls, in turn with fastlora's decode kernels launched with PDL (``pdl.FULL``),
with PDL but no early launch of the next kernel (``pdl.WAIT_ONLY``), with PDL on the kernels that
have a preamble only (``pdl.PREAMBLE_ONLY``: the expand and the norms) and without (``pdl.OFF``); each
mode patched afresh, so its graphs are captured in that mode; several rounds, so that drift
between the runs shows. For each: the ``generate`` step and the GPU time of
its graph replay, and the greedy tokens, which must be equal in both modes (the kernels compute
the same; only their launch overlaps).

    python benchmarks/probe_pdl.py --model 8b --out benchmarks/results/probe_pdl_h200.csv
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_generate as bg  # noqa: E402
import peft_fastlora as fastlora  # noqa: E402
from peft_fastlora.ops import pdl  # noqa: E402

MODES = {"pdl": pdl.FULL, "pdl_wait_only": pdl.WAIT_ONLY, "pdl_preamble_only": pdl.PREAMBLE_ONLY, "no_pdl": pdl.OFF}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bg.add_model_args(p, adapters=8)
    bg.add_decode_args(p, new_tokens=64, reps=3)
    p.add_argument("--rounds", type=int, default=2, help="rounds over the modes")
    p.add_argument("--modes", nargs="+", default=["pdl", "no_pdl"], choices=sorted(MODES))
    p.add_argument("--base", action="store_true", help="also time the base model (no adapters)")
    args = p.parse_args(argv)
    if args.smoke:
        bg.DEVICE, args.model, args.batches, args.new_tokens, args.reps, args.rounds = "cpu", "tiny", [2], 4, 1, 1
    model = bg.build_base(args.model)
    graphs = "auto" if bg.DEVICE == "cuda" else "emulate"
    rows, info, tokens = [], bg.versions(), {}
    ids = {b: torch.randint(3, 1000, (b, args.prompt), device=bg.DEVICE) for b in args.batches}
    for what in (("base", "mixed") if args.base else ("mixed",)):
        if what == "mixed":  # PEFT wraps the model in place: the base model is timed first
            model = bg.add_adapters(model, args.adapters, args.rank)
        for rnd in range(args.rounds):
            for mode in args.modes:
                pdl.SETTING = MODES[mode]
                fastlora.patch(model, cuda_graphs=graphs)
                try:
                    for b in args.batches:
                        kw = dict(input_ids=ids[b], attention_mask=torch.ones_like(ids[b]), do_sample=False,
                                  pad_token_id=0)
                        if what == "mixed":
                            kw["adapter_names"] = [f"a{i % args.adapters}" for i in range(b)]
                        _, step, out = bg.measure(
                            lambda n: model.generate(**kw, max_new_tokens=n, min_new_tokens=n),
                            args.new_tokens, args.reps)
                        replay = bg.measure.replay_ms
                        ref = tokens.setdefault((what, b), out)
                        rows.append(dict(**info, model=args.model, what=what, batch=b, round=rnd, mode=mode,
                                         decode_ms_per_step=round(step, 3),
                                         graph_replay_ms=round(replay, 3) if replay else "",
                                         tokens_equal_first_run=bool(torch.equal(out, ref))))
                        print(rows[-1], flush=True)
                finally:
                    fastlora.unpatch(model)
    pdl.SETTING = pdl.FULL
    if args.out and not args.smoke:
        bg.write_out(rows, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
