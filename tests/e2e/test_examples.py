"""The examples as a new user first runs them (CPU): ``serve_many_adapters.py --register --slots``
with fewer slots than a batch would hold adapters, and what it prints."""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
import serve_many_adapters as serve  # noqa: E402


def test_plan_batches_keeps_each_batch_within_its_slots():
    names = ["a", "b", "__base__", "c", "a", "c", "b", "__base__", "d", "a"]
    requests = [{"adapter": n} for n in names]
    plan = serve.plan_batches(requests, 4, max_adapters=2)
    assert sorted(i for batch in plan for i in batch) == list(range(len(names)))  # each request once
    for batch in plan:
        assert 0 < len(batch) <= 4 and batch == sorted(batch)
        assert len({names[i] for i in batch} - {"__base__"}) <= 2
    assert plan[0] == [0, 1, 2, 4]  # a request that does not fit waits; the next that fits goes
    assert serve.plan_batches(requests, 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]  # no cap: in order


def test_register_with_two_slots_serves_a_three_adapter_mix(tmp_path, capsys):
    """The demo the README suggests: three adapters and the base model mixed in one file, two slots.
    Answers come in request order and equal those of the adapters loaded into PEFT; the progress
    bar leaves no lines in a log (it prints on a terminal only)."""
    files = argparse.Namespace(adapters=None, requests=None, out=None)
    serve.make_tiny_files(files, str(tmp_path))
    common = ["--tiny", "--adapters", files.adapters, "--requests", files.requests, "--max-new-tokens", "3",
              "--device", "cpu"]
    assert serve.main(common + ["--out", str(tmp_path / "slots.jsonl"), "--register", "--slots", "2"]) == 0
    assert serve.main(common + ["--out", str(tmp_path / "peft.jsonl")]) == 0
    err = capsys.readouterr().err
    requests = [json.loads(line) for line in open(files.requests)]
    assert len({r["adapter"] for r in requests} - {"__base__"}) == 3
    slots = [json.loads(line) for line in open(tmp_path / "slots.jsonl")]
    loaded = [json.loads(line) for line in open(tmp_path / "peft.jsonl")]
    assert [(r["adapter"], r["prompt"]) for r in slots] == [(r["adapter"], r["prompt"]) for r in requests]
    assert slots == loaded
    assert " in slots (2 for 3 adapters" in err and "GPU slots" not in err
    assert "100%" not in err and err.count("answers written to") == 2
