"""A model sharded by transformers' tensor parallelism (2 processes, gloo, CPU): fastlora serves
its LoRA layers from each rank's shards, its decode steps go through the (emulated) graph runner,
and results equal PEFT on the unsharded model. The ranks run ``_tp_worker.py`` under torchrun."""

import os
import subprocess
import sys

import pytest

from _helpers import run_tp_worker

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# "kernels": fastlora's base-model kernels in Triton's interpreter (slow: once). Adapters left whole
# on every rank ("whole", as PEFT before 0.21.2 leaves them; fastlora slices them) run below.
@pytest.mark.parametrize("arch,layout,ops", [("llama", "peft", "kernels"), ("qwen2", "peft", "torch")])
def test_tensor_parallel_lora_equals_peft_unsharded(tmp_path, arch, layout, ops):
    pytest.importorskip("torch.distributed.tensor")
    run_tp_worker(tmp_path, arch, "cpu", "emulate", layout, ops)


@pytest.mark.parametrize("layout", ["peft", "whole"])
def test_folded_shrink_and_the_heads_under_tensor_parallelism(tmp_path, layout):
    # "whole": adapters left whole on every rank, sliced by fastlora (the heads' adapters unfolded)
    """Every Linear site's shrink folded into its base GEMM on each rank: column-sharded sites
    under this rank's output rows, row-sharded ones reducing the partial shrink with the partial
    sums in their one all-reduce. With an adapter on the vocabulary-sharded embedding and the
    gathered LM head too (neither folds): PEFT's own mixed batch fails there under TP; fastlora's
    path gives the unsharded model's results."""
    pytest.importorskip("torch.distributed.tensor")
    out = run_tp_worker(tmp_path, "llama", "cpu", "emulate", layout, "torch", heads="heads", fold=True)
    assert "fold=True" in out


def test_serve_tp_example(tmp_path):
    """examples/serve_tp.py as the README runs it: 2 ranks, adapters loaded from folders by PEFT."""
    pytest.importorskip("torch.distributed.tensor")
    env = dict(os.environ, PYTHONHASHSEED="0", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.join(ROOT, "examples", "serve_tp.py"), "--folder", str(tmp_path)]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    assert "tokens equal to PEFT on the whole model: True" in run.stdout, run.stdout[-3000:]

