"""Probe (#13): the host's part of a graphed decode step, three ways, in one process.

- ``per_step``: transformers' loop reads "all rows finished" back at every step
  (``patch(defer_stop_check=False)``), and builds each step's mask with its own function;
- ``deferred``: the flag read one step late (fastlora's default), transformers' mask function;
- ``deferred_step_mask``: and the one-token step's mask built by ``decode/step_mask.py``
  (fastlora's default since session 9).

For each: the ``generate`` step and the GPU time of its graph replay, and the tokens, which must
be equal in all three, for calls stopped by length and by an end-of-sequence token. (Session 9's
first run of this probe, before the library did either, turned transformers' deferred check on by
a monkeypatch; its CSV has modes ``sync`` and ``deferred``.)

    python benchmarks/probe_deferred_stop.py --model 1b --out benchmarks/results/probe_host_1b_h200.csv
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_generate as bg  # noqa: E402
import peft_fastlora as fastlora  # noqa: E402
from peft_fastlora.decode import step_mask  # noqa: E402

MODES = ("per_step", "deferred", "deferred_step_mask")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bg.add_model_args(p, adapters=8)
    bg.add_decode_args(p, new_tokens=64, reps=3)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    args = p.parse_args(argv)
    if args.smoke:
        bg.DEVICE, args.model, args.batches, args.new_tokens, args.reps = "cpu", "tiny", [2], 4, 1
    model = bg.add_adapters(bg.build_base(args.model), args.adapters, args.rank)
    graphs = "auto" if bg.DEVICE == "cuda" else "emulate"
    rows, info = [], bg.versions()
    fast_mask = step_mask.decode_mask
    for b in args.batches:
        ids = torch.randint(3, 1000, (b, args.prompt), device=bg.DEVICE)
        mask = torch.ones_like(ids)
        mask[1::4, :5] = 0  # some left-padded rows: the masks are not all ones
        kw = dict(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=0,
                  adapter_names=[f"a{i % args.adapters}" for i in range(b)])
        tokens = {}
        for mode in args.modes:
            step_mask.decode_mask = fast_mask if mode == "deferred_step_mask" else (lambda store, kwargs: None)
            report = fastlora.patch(model, cuda_graphs=graphs, defer_stop_check=mode != "per_step")
            try:
                _, step, out = bg.measure(lambda n: model.generate(**kw, max_new_tokens=n, min_new_tokens=n),
                                          args.new_tokens, args.reps)
                replay = bg.measure.replay_ms
                # stopped by an end-of-sequence token: the first row's token at step 5 of the first call
                eos = int(out[0, args.prompt + min(4, args.new_tokens - 1)])
                eos_out = model.generate(**kw, max_new_tokens=args.new_tokens, eos_token_id=eos)
                stats = fastlora.get_state(model).graph_runner.stats
            finally:
                fastlora.unpatch(model)
                step_mask.decode_mask = fast_mask
            tokens[mode] = (out, eos_out)
            first = tokens[args.modes[0]]
            rows.append(dict(**info, model=args.model, batch=b, mode=mode, stop_check=report.stop_check,
                             decode_ms_per_step=round(step, 3),
                             graph_replay_ms=round(replay, 3) if replay else "",
                             deferred_stop_calls=stats["deferred_stop_calls"], steps_undone=stats["steps_undone"],
                             tokens_equal_length_stop=bool(torch.equal(out, first[0])),
                             tokens_equal_eos_stop=bool(torch.equal(eos_out, first[1]))))
            print(rows[-1], flush=True)
    if args.out and not args.smoke:
        bg.write_out(rows, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
