"""A model sharded by transformers' tensor parallelism (2 processes, gloo, CPU): fastlora serves
its LoRA layers from each rank's shards and results equal PEFT on the unsharded model. The ranks
run ``_tp_worker.py`` under torchrun."""

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def test_tensor_parallel_lora_equals_peft_unsharded(tmp_path):
    pytest.importorskip("torch.distributed.tensor")
    env = dict(os.environ, PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""),
               # PEFT's mixed batch walks a set of adapter names; its order must be the same on
               # every rank (each adapter's rowwise LoRA does a collective)
               PYTHONHASHSEED="0", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.join(HERE, "_tp_worker.py"), str(tmp_path / "tiny")]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    assert "rank 0: ok" in run.stdout and "rank 1: ok" in run.stdout
