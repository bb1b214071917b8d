"""Two GPUs of one host: transformers' tensor parallelism under torchrun, and
accelerate's device_map across both GPUs. fp32 tiny models; PEFT on one GPU is the oracle.

- TP=2 (NCCL): ``_tp_worker.py`` with real CUDA graphs (the all-reduces captured inside), Llama
  and Qwen2 (q/k/v biases: the colwise shards carry them), fused within each rank, with and
  without the base-model kernels, with and without the shrink folded into the base GEMMs, then
  random traffic with an adapter deleted half-way;
- device_map: a tiny Llama split layer by layer over cuda:0 and cuda:1: each LoRA layer's pool
  and kernels on its own GPU, graphs off with the reason, tokens equal to PEFT's;
- a model on cuda:1 while cuda:0 is current: the kernels launch on the model's GPU.
"""

import warnings

import pytest
import torch

import peft_fastlora as fastlora
from peft_fastlora.kernel_support import kernel_runs_on

from _helpers import run_tp_worker
from _models import PAD_ID, build_peft_lm, left_padded_batch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs two CUDA GPUs")]

NAMES = ["a0", "__base__", "a2", "a1", "a0"]


@pytest.mark.parametrize("arch,ops,heads,fold", [("llama", "kernels", "", False), ("qwen2", "kernels", "", False),
                                                 ("qwen2", "torch", "", False), ("llama", "kernels", "heads", False),
                                                 ("qwen2", "kernels", "", True), ("llama", "kernels", "heads", True)])
def test_tensor_parallel_two_gpus_graphs_equal_peft(tmp_path, arch, ops, heads, fold):
    """heads: an adapter on the vocabulary-sharded embedding and the gathered LM head too (their
    collectives captured in the decode graphs). fold: every Linear site's shrink in its base GEMM."""
    out = run_tp_worker(tmp_path, arch, "cuda", "auto", ops=ops, heads=heads, fold=fold)
    assert "graphs=auto" in out and f"ops={ops}" in out and f"fold={fold}" in out


def _generate(model, batch, names, new=8):
    with torch.no_grad():
        return model.generate(**batch, adapter_names=names, max_new_tokens=new, min_new_tokens=new,
                              do_sample=False, pad_token_id=PAD_ID)


@pytest.mark.parametrize("order", ["dispatch_then_peft", "peft_then_dispatch"])
def test_device_map_across_two_gpus_equals_peft(order):
    from accelerate import dispatch_model

    batch = left_padded_batch([7, 4, 9, 2, 6])
    ref = build_peft_lm("llama").to("cuda:0")
    want = _generate(ref, {k: v.to("cuda:0") for k, v in batch.items()}, NAMES)
    device_map = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0,
                  "model.layers.1": 1, "model.norm": 1, "lm_head": 1}

    def dispatch(base):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dispatch_model(base, device_map=device_map)

    # the same seeds: the same weights and adapters
    if order == "dispatch_then_peft":  # from_pretrained(..., device_map=...), then PEFT
        model = build_peft_lm("llama", prepare_base=dispatch)
    else:
        model = build_peft_lm("llama")
        dispatch(model.get_base_model())
    inner = model.get_base_model()
    devices = {str(p.device) for p in inner.parameters()}
    assert devices == {"cuda:0", "cuda:1"}, devices
    report = fastlora.patch(model)
    assert not report.left_on_peft, report
    assert report.cuda_graphs.startswith("off (the model spans cuda:0, cuda:1"), report.cuda_graphs
    if order == "dispatch_then_peft":  # accelerate's hooks on the base layers only move inputs: siblings fuse
        assert report.fusion_blocked == [] and {"qkv", "gate_up"} <= set(report.counts()), report
    else:  # dispatched after PEFT, the LoRA layers carry accelerate's forwards too: they stay apart
        assert report.fusion_blocked and all(why == "a member already has its own forward"
                                             for _, why in report.fusion_blocked), report.fusion_blocked
    state = fastlora.get_state(model)
    site_devices = {str(s.device) for s in state.sites}
    assert site_devices == {"cuda:0", "cuda:1"}, site_devices
    for s in state.sites:
        assert s.pool.lora_a.device == s.device, (s.name, s.pool.lora_a.device, s.device)
    launched = []
    run_lora = state.backend.run_packed_lora

    def counting(x, *a, **k):
        launched.append((str(x.device), torch.cuda.current_device()))
        return run_lora(x, *a, **k)

    state.backend.run_packed_lora = counting
    got = _generate(model, {k: v.to("cuda:0") for k, v in batch.items()}, NAMES)
    assert torch.equal(got.cpu(), want.cpu()), (got, want)
    # layers on both GPUs took fastlora's path, each with its own GPU current
    assert {d for d, _ in launched} >= {"cuda:0", "cuda:1"}, set(launched)
    assert all(d == f"cuda:{i}" for d, i in launched), set(launched)
    fastlora.unpatch(model)


def test_model_on_second_gpu_while_first_is_current():
    batch = left_padded_batch([5, 8, 3, 6, 4])
    ref = build_peft_lm("llama").to("cuda:1")
    dev = {k: v.to("cuda:1") for k, v in batch.items()}
    want = _generate(ref, dev, NAMES)
    model = build_peft_lm("llama").to("cuda:1")
    torch.cuda.set_device(0)
    report = fastlora.patch(model)
    assert report.cuda_graphs == "on" and report.device == "cuda:1", report
    for _ in range(2):  # the second call replays the graphs captured by the first
        got = _generate(model, dev, NAMES)
        assert torch.equal(got, want), (got, want)
    # a plain forward outside generate: the kernels launch on cuda:1 too
    with torch.no_grad():
        logits = model(**dev, adapter_names=NAMES).logits
        ref_logits = ref(**dev, adapter_names=NAMES).logits
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    stats = fastlora.get_state(model).graph_runner.stats
    assert stats["replays"] > 0 and stats["capture_failures"] == 0, stats
    assert torch.cuda.current_device() == 0
    fastlora.unpatch(model)


def test_kernels_run_only_on_the_current_device():
    torch.cuda.set_device(0)
    assert kernel_runs_on(torch.zeros(2, device="cuda:0"))
    assert not kernel_runs_on(torch.zeros(2, device="cuda:1"))
    with torch.cuda.device(1):
        assert kernel_runs_on(torch.zeros(2, device="cuda:1"))
