"""Which layers and which GEMMs ``base_ops.stream_linears`` sends to the weight-streaming kernel,
on CPU (Triton's interpreter runs the kernel; ``test_stream_linears_gpu.py`` runs a model)."""

import importlib
import threading

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model

import peft_fastlora.base_ops.stream_linears as sl
from peft_fastlora import Tuning
import peft_fastlora.ops.tma_gemm as tma_ops
from peft_fastlora.ops.tma_gemm import TmaConfig
from peft_fastlora.instance_methods import InstancePatches

from _helpers import count_calls
from _models import tiny_llama


def _tuning(narrow: bool = False, tma_tiles=None, fp32: bool = False, **fields) -> Tuning:
    """Every tiny layer takes the kernel, under the wide layers' tiles (``narrow``: the narrow ones').
    Past ``stream_max_rows``, the TMA kernel's ``tma_tiles`` (none: the committed table stays out of
    it). ``fp32``: float32 too (ieee dots under the interpreter: tokens compare with PEFT's exactly)."""
    tuning = Tuning(stream_min_n=16, stream_min_k=16,
                    tma_tiles={cls: config._asdict() for cls, config in (tma_tiles or {}).items()})
    if not narrow:
        tuning = tuning.replace(stream_narrow_n=16)
    if fp32:
        tuning = tuning.replace(stream_dtypes=(torch.float32, torch.bfloat16, torch.float16))
    return tuning.replace(**fields)


DEFAULT = Tuning()


def _spy_configs(monkeypatch, module, name):
    """The ``config`` of every call of ``module.<name>`` (a GEMM launcher), in order."""
    configs, original = [], getattr(module, name)

    def spy(*args, **kwargs):
        configs.append(kwargs["config"])
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return configs


# tiny tiles for every class (split K for the deep ones, so their residual rides in a split launch)
TINY_TMA = {"deep": TmaConfig(16, 32, 2, 4, 2), "square": TmaConfig(32, 32, 1, 4, 2),
            "tall": TmaConfig(32, 16, 1, 4, 2), "wide": TmaConfig(64, 32, 1, 4, 2), "glu": TmaConfig(32, 32, 1, 4, 2)}


def test_install_skips_fusible_siblings_and_their_base_layers():
    patches = InstancePatches()
    model = get_peft_model(tiny_llama(0), LoraConfig(r=4, target_modules=["q_proj", "o_proj", "down_proj"]))
    streams = sl.StreamLinears(torch.device("cpu"), DEFAULT)
    names = {n.split("layers.0.")[-1] for n, _ in streams.install(model, patches) if "layers.1" not in n}
    assert {"self_attn.o_proj.base_layer", "mlp.down_proj.base_layer"} <= names
    assert not any(part in n for n in names for part in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"))
    assert any(n.endswith("lm_head") for n, _ in streams.modules)
    # the LoRA layers themselves are not plain nn.Linear: PEFT's forward stays theirs
    assert "forward" not in model.base_model.model.model.layers[0].self_attn.o_proj.__dict__


def test_decode_sized_bf16_gemms_take_the_kernel_others_keep_f_linear(monkeypatch):
    tuning = _tuning()
    streams = sl.StreamLinears(torch.device("cpu"), tuning)
    calls = count_calls(monkeypatch,
            importlib.import_module("peft_fastlora.base_ops.stream_linears"), ["stream_gemm"])
    w = (torch.randn(48, 64) / 8).bfloat16()
    b = torch.randn(48).bfloat16()
    x = torch.randn(2, 3, 64).bfloat16()
    out = streams.linear(x, w, b)
    assert calls["stream_gemm"] == 1 and out.shape == (2, 3, 48)
    ref = (x.float() @ w.float().T + b.float()).bfloat16()
    torch.testing.assert_close(out.float(), ref.float(), atol=1.6e-2, rtol=1.6e-2)
    for other in (torch.randn(65, 64).bfloat16(),           # past MAX_ROWS: a prefill
                  torch.randn(3, 64),                        # float32 (w bf16: F.linear's own error)
                  torch.randn(3, 64).bfloat16().requires_grad_()):
        try:
            streams.linear(other, w)
        except RuntimeError:
            assert other.dtype == torch.float32  # F.linear refused the mixed dtypes, as it would anyway
    with torch.no_grad():
        streams.linear(torch.randn(3, 64).bfloat16().requires_grad_(), w)  # no gradient: the kernel
    assert calls["stream_gemm"] == 2
    torch.testing.assert_close(streams.linear(torch.randn(3, 64), w.float()).shape, torch.Size([3, 48]))
    assert calls["stream_gemm"] == 2  # float32: F.linear
    streams.skip = lambda: True  # the owner's test (the state's: a continuous-batching forward)
    streams.linear(x, w)
    assert calls["stream_gemm"] == 2
    streams.skip = None
    sl.StreamLinears(torch.device("cpu"), tuning.replace(stream_min_n=4096)).linear(x, w)
    assert calls["stream_gemm"] == 2  # too narrow a layer: cuBLAS
    sl.StreamLinears(torch.device("cpu"), tuning.replace(stream_min_k=2048)).linear(x, w)
    assert calls["stream_gemm"] == 2  # too shallow a reduction: cuBLAS


def test_a_wide_layer_gets_the_rows_of_a_strided_slice_packed(monkeypatch):
    """The LM head past the kernel's widths reads each sequence's last token, a strided slice of
    the hidden states: F.linear gets the rows packed, the same values; a large input, or one
    already packed, goes as it is."""
    streams = sl.StreamLinears(torch.device("cpu"), _tuning(stream_max_n=32))
    seen, original = [], F.linear
    monkeypatch.setattr(sl.F, "linear", lambda x, w, b=None: seen.append(x) or original(x, w, b))
    w, hidden = torch.randn(48, 64).bfloat16(), torch.randn(2, 5, 64).bfloat16()
    last = hidden[:, -1:, :]
    assert not last.is_contiguous()
    out = streams.linear(last, w)
    assert seen[-1].is_contiguous() and seen[-1].shape == last.shape
    torch.testing.assert_close(out, original(last, w), atol=0, rtol=0)
    wide = torch.randn(4, 64).bfloat16()  # as many input elements as the weight's: left strided
    streams.linear(torch.randn(2, 6, 64).bfloat16()[:, ::2], wide)
    assert not seen[-1].is_contiguous()
    streams.linear(hidden, w)
    assert seen[-1] is hidden


@pytest.mark.parametrize("m,n,k,split", [(1, 4096, 14336, 1), (32, 4096, 14336, 2), (16, 4096, 4096, 2),
                                         (64, 4096, 4096, 1), (32, 6144, 4096, 1), (64, 28672, 4096, 1)])
def test_tile_choice(m, n, k, split):
    assert sl._config(m, n, k, DEFAULT.stream_narrow_n).split_k == split


# a 1B Llama's q/k/v (3,072 x 2,048), o (2,048 x 2,048) and down (2,048 x 8,192)
@pytest.mark.parametrize("m,n,k,split", [(1, 3072, 2048, 1), (16, 3072, 2048, 1), (32, 3072, 2048, 2),
                                         (1, 2048, 2048, 4), (32, 2048, 2048, 4), (8, 2048, 8192, 4)])
def test_narrow_tile_choice(m, n, k, split):
    assert sl._config(m, n, k, DEFAULT.stream_narrow_n).split_k == split


def test_narrow_layers_stream_fewer_rows_in_k_ranges(monkeypatch):
    """Below ``NARROW_N`` outputs a layer streams up to ``NARROW_MAX_ROWS`` rows, in four K ranges
    where it is not wider than deep, and past that keeps ``F.linear``; its result is the GEMM's."""
    tuning = _tuning(narrow=True, stream_narrow_n=64)
    streams = sl.StreamLinears(torch.device("cpu"), tuning)
    configs = _spy_configs(monkeypatch, sl, "stream_gemm")
    w = (torch.randn(48, 512) / 16).bfloat16()  # narrow, deep: four ranges of one 128-wide tile
    for rows in (1, tuning.stream_narrow_max_rows):
        x = torch.randn(rows, 512).bfloat16()
        torch.testing.assert_close(streams.linear(x, w).float(), F.linear(x.float(), w.float()).bfloat16().float(),
                                   atol=3e-2, rtol=1.6e-2)
    assert [c.split_k for c in configs] == [4, 4]
    streams.linear(torch.randn(tuning.stream_narrow_max_rows + 1, 512).bfloat16(), w)
    assert len(configs) == 2  # past the narrow rows: F.linear
    streams.linear(torch.randn(tuning.stream_narrow_max_rows + 1, 512).bfloat16(), torch.randn(64, 512).bfloat16())
    assert len(configs) == 3  # as wide as NARROW_N: the wide layers' rows and tiles (two ranges, preload)
    assert (configs[-1].split_k, configs[-1].preload) == (2, True)


def test_workspace_covers_every_split_launch(monkeypatch):
    """A split launch of the widest splitting layer and the most rows fits the model's workspace."""
    tuning = _tuning()
    streams = sl.StreamLinears(torch.device("cpu"), tuning)
    n, k = 64, 64  # square: splits past 8 rows
    assert sl._config(24, n, k, tuning.stream_narrow_n).split_k == 2
    w = torch.randn(n, k).bfloat16()
    x = torch.randn(24, k).bfloat16()
    torch.testing.assert_close(streams.linear(x, w).float(), F.linear(x.float(), w.float()).bfloat16().float(),
                               atol=3e-2, rtol=1.6e-2)
    assert streams.workspace.part.numel() >= 2 * tuning.stream_max_rows * tuning.stream_split_max_n
    # the narrow layers' four ranges of their most rows, and a ticket per 64-column tile of them
    assert streams.workspace.part.numel() >= 4 * tuning.stream_narrow_max_rows * tuning.stream_narrow_n
    assert streams.workspace.tickets.numel() >= tuning.stream_narrow_n // 64


@pytest.mark.parametrize("narrow", [False, True], ids=["wide_tiles", "narrow_tiles"])
def test_patched_model_streams_its_decode_gemms_through_calls_and_an_adapter_change(monkeypatch, narrow):
    """``patch(stream_gemm=True)`` on a bf16 model (the interpreter runs the kernel; every layer
    made wide enough): the fused groups and the other linear layers stream through emulated graphs
    over calls of changing batch sizes, and again after an adapter is added (the rebuilt groups
    take the GEMM too); each step's logits stay within bf16 rounding (about 1% here, as between
    fastlora and PEFT) of the same step with the kernel off, and ``unpatch`` leaves no forward
    behind. ``narrow``: every layer under the narrow layers' rules (their tiles, though these
    reductions are too shallow to split; a prefill past 32 rows keeps F.linear)."""
    import peft_fastlora as fastlora
    from _models import LLAMA_LIKE_ALL, left_padded_batch, tiny_peft_llama

    tuning = _tuning(narrow=narrow)
    model = tiny_peft_llama().to(torch.bfloat16)
    calls_rows = [[5, 9, 3], [7], [4, 6, 2, 8, 5]]
    names = {3: ["a", "__base__", "b"], 1: ["b"], 5: ["a", "b", "a", "__base__", "b"]}

    def run(on, add_adapter=False):
        report = fastlora.patch(model, stream_gemm=on, cuda_graphs="emulate", tuning=tuning)
        counter = count_calls(monkeypatch,
                importlib.import_module("peft_fastlora.base_ops.stream_linears"), ["stream_gemm"])
        logits = []
        try:
            with torch.no_grad():
                if add_adapter:
                    model.add_adapter("c", LoraConfig(r=2, lora_alpha=2, target_modules=LLAMA_LIKE_ALL,
                                                      init_lora_weights=False))
                for rows in calls_rows:
                    out = model.generate(**left_padded_batch(rows, seed=len(rows)), max_new_tokens=4,
                                         do_sample=False, pad_token_id=0, adapter_names=names[len(rows)],
                                         output_logits=True, return_dict_in_generate=True)
                    logits.append((out.sequences[:, -4:], torch.stack(out.logits)))
        finally:
            fastlora.unpatch(model)
            if add_adapter:
                model.delete_adapter("c")
        return report, counter["stream_gemm"], logits

    off_report, off_calls, off = run(False)
    on_report, on_calls, on = run(True)
    assert "decode GEMMs streamed: off (stream_gemm=False)" in str(off_report) and off_calls == 0
    assert "decode GEMMs streamed: fused groups and" in str(on_report), on_report
    assert on_calls > 0
    compared = 0
    for (tok_a, a), (tok_b, b) in zip(on, off):
        for step in range(4):  # while the tokens agree (bf16: a near tie may round the other way)
            if not torch.equal(tok_a[:, :step], tok_b[:, :step]):
                break
            assert ((a[step].float() - b[step].float()).norm() / b[step].float().norm()).item() < 2e-2
            compared += 1
    assert compared >= 8
    _, after_calls, _ = run(True, add_adapter=True)
    assert after_calls >= on_calls  # the groups rebuilt for the new adapter still stream
    for m in model.modules():
        assert "forward" not in m.__dict__ or not isinstance(m, torch.nn.Linear), m


def test_residual_rides_in_the_gemm_of_its_weight_only(monkeypatch):
    """``expect_add``: the next kernel GEMM over that weight on this thread adds the residual (and
    ``took_add`` says so, once); a GEMM over another weight, one that keeps F.linear, or one on
    another thread leaves it to the caller."""
    tuning = _tuning()
    streams = sl.StreamLinears(torch.device("cpu"), tuning)
    w, other = (torch.randn(48, 64) / 8).bfloat16(), (torch.randn(48, 64) / 8).bfloat16()
    x, residual = torch.randn(1, 3, 64).bfloat16(), torch.randn(1, 3, 48).bfloat16()
    streams.expect_add(w, residual)
    plain = streams.linear(x, other)  # another weight: no add
    torch.testing.assert_close(plain.float(), F.linear(x.float(), other.float()), atol=3e-2, rtol=1.6e-2)
    added = streams.linear(x, w)
    want = F.linear(x.float(), w.float()) + residual.float()
    torch.testing.assert_close(added.float(), want, atol=3e-2, rtol=1.6e-2)
    assert streams.took_add() and not streams.took_add()
    streams.expect_add(w, residual)
    streams.linear(torch.randn(70, 64).bfloat16(), w)  # past MAX_ROWS: F.linear, nothing added
    assert not streams.took_add()
    streams.expect_add(w, residual)
    torch.testing.assert_close(streams.linear(x, w).float(), want, atol=3e-2, rtol=1.6e-2)
    streams.took_add()
    torch.testing.assert_close(streams.linear(x, w).float(), F.linear(x.float(), w.float()), atol=3e-2,
                               rtol=1.6e-2)  # forgotten after took_add
    streams.expect_add(w, residual)  # another thread's GEMM over the same weight does not take it
    other_thread = []
    worker = threading.Thread(target=lambda: other_thread.append((streams.linear(x, w), streams.took_add())))
    worker.start()
    worker.join()
    torch.testing.assert_close(other_thread[0][0].float(), F.linear(x.float(), w.float()), atol=3e-2, rtol=1.6e-2)
    assert not other_thread[0][1]
    torch.testing.assert_close(streams.linear(x, w).float(), want, atol=3e-2, rtol=1.6e-2)
    assert streams.took_add()




def _same_decode(got, want):
    """PEFT's tokens, and its logits to float32 rounding (tokens alone would miss a wrong MLP term:
    a tiny random model's MLP moves its logits too little to change every argmax)."""
    assert torch.equal(got.sequences, want.sequences)
    a, b = torch.stack(got.logits).float(), torch.stack(want.logits).float()
    assert (a - b).abs().max() <= 1e-4 * b.abs().max(), (a - b).abs().max()


def test_patched_model_folds_each_mlp_residual_add_into_down(monkeypatch):
    """Through emulated graphs, every decode step's layers take the residual in down_proj's GEMM
    (folded LoRA and not, rows on no adapter included), and the tokens equal PEFT's mixed batch
    (PEFT's own path as the reference)."""
    import peft_fastlora as fastlora
    from _models import left_padded_batch, tiny_peft_llama

    tuning = _tuning(fp32=True)
    model = tiny_peft_llama()
    batch, names = left_padded_batch([5, 9, 3], seed=3), ["a", "__base__", "b"]
    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        want = model.generate(**batch, adapter_names=names, **kwargs)
    took = []
    original = sl.StreamLinears.took_add

    def counting(self):
        took.append(original(self))
        return took[-1]

    monkeypatch.setattr(sl.StreamLinears, "took_add", counting)
    fastlora.patch(model, stream_gemm=True, fuse_norms=True, fuse_silu_mul=True, cuda_graphs="emulate",
                            tuning=tuning)
    try:
        with torch.no_grad():
            got = model.generate(**batch, adapter_names=names, **kwargs)
    finally:
        fastlora.unpatch(model)
    _same_decode(got, want)
    # the prefill's 3 x 9 rows and more fit MAX_ROWS too: every forward's layers folded
    assert len(took) >= model.config.num_hidden_layers * 5 and all(took), took
    assert not any("_fastlora_stream" in m.__dict__ for m in model.modules())


def test_dora_down_keeps_the_separate_add(monkeypatch):
    """A DoRA adapter on down_proj rescales the base output: the residual is not folded into it."""
    import peft_fastlora as fastlora

    tuning = _tuning(fp32=True)
    model = get_peft_model(tiny_llama(0), LoraConfig(r=4, target_modules=["down_proj"], use_dora=True))
    report = fastlora.patch(model, stream_gemm=True, fuse_norms=True, fuse_silu_mul=True, cuda_graphs="emulate",
                            tuning=tuning)
    try:
        state = fastlora.get_state(model)
        layer = model.base_model.model.model.layers[0]
        if state.base_ops.stream is None:
            pytest.skip(f"stream_gemm not installed: {report}")
        assert layer.__dict__.get("_fastlora_stream") is state.base_ops.stream
        assert state.base_ops.stream.residual_target(layer) is None
    finally:
        fastlora.unpatch(model)


def test_plain_gate_up_gives_the_activation_from_one_gemm_until_an_adapter_wraps_it(monkeypatch):
    """Adapters on q/v/o/down only: each MLP's gate/up is a plain fused group, and decode steps take
    ``act(gate) * up`` from one GEMM (no act-mul kernel); tokens equal PEFT's. An adapter added on
    gate/up wraps them in LoRA layers: the MLP calls them again (their deltas count), still PEFT's
    tokens."""
    import peft_fastlora as fastlora
    from _models import LLAMA_LIKE_ALL, left_padded_batch

    tuning = _tuning(fp32=True)
    base = tiny_llama(0, vocab_size=128)
    base.generation_config.eos_token_id = None
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj",
                                                                              "down_proj"],
                                            init_lora_weights=False), adapter_name="a").eval()
    batch, names = left_padded_batch([4, 7], seed=5), ["a", "__base__"]
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    glu_calls = count_calls(monkeypatch,
            importlib.import_module("peft_fastlora.base_ops.stream_linears"), ["stream_gemm"])
    act_calls = count_calls(monkeypatch, importlib.import_module("peft_fastlora.base_ops.mlp_forwards"), ["act_mul"])
    with torch.no_grad():
        want = model.generate(**batch, adapter_names=names, **kwargs)
    seen = []
    original = sl.StreamLinears.gated

    def gated(self, *args):
        out = original(self, *args)
        seen.append(out is not None)
        return out

    monkeypatch.setattr(sl.StreamLinears, "gated", gated)
    report = fastlora.patch(model, stream_gemm=True, fuse_norms=True, fuse_silu_mul=True, fuse=True,
                            cuda_graphs="emulate", tuning=tuning)
    layers = model.config.num_hidden_layers
    assert f"(residual add in down's GEMM x{layers}, act-mul in gate/up's GEMM x{layers})" in str(report), report
    try:
        with torch.no_grad():
            got = model.generate(**batch, adapter_names=names, **kwargs)
            _same_decode(got, want)
            assert seen and all(seen), seen
            assert act_calls["act_mul"] == 0 and glu_calls["stream_gemm"] > 0
            model.add_adapter("g", LoraConfig(r=2, lora_alpha=2, target_modules=LLAMA_LIKE_ALL,
                                              init_lora_weights=False))
            seen.clear()
            names = ["g", "a"]
            got = model.generate(**batch, adapter_names=names, **kwargs)
    finally:
        fastlora.unpatch(model)
    with torch.no_grad():
        want = model.generate(**batch, adapter_names=names, **kwargs)
    _same_decode(got, want)
    assert not any(seen)  # (the wrapped members: the MLP's own path)
    assert not any("_fastlora_gated" in m.__dict__ for m in model.modules())


def test_shape_classes_and_the_tile_table(tmp_path):
    """The 8B layer's GEMMs, plain and with 8 adapters' A folded under them, fall in one class each;
    the table file gives a tile per class it lists, and no file gives none."""
    for (n, k), cls in {(6144, 4096): "tall", (6528, 4096): "tall", (4096, 4096): "square", (4224, 4096): "square",
                        (28672, 4096): "wide", (28928, 4096): "wide", (4096, 14336): "deep",
                        (4224, 14336): "deep"}.items():
        assert sl.shape_class(n, k) == cls, (n, k)
    path = tmp_path / "tiles.json"
    path.write_text('{"gpu": "x", "classes": {"wide": {"block_n": 256, "block_k": 64, "split_k": 1, '
                    '"num_warps": 8, "num_stages": 3}}}')
    assert sl.tma_tiles(str(path)) == {"wide": sl.TmaTile(TmaConfig(256, 64, 1, 8, 3), 0)}
    path.write_text('{"classes": {"glu": {"block_n": 128, "block_k": 64, "split_k": 1, "num_warps": 8, '
                    '"num_stages": 4, "min_k": 4096}}}')
    assert sl.tma_tiles(str(path)) == {"glu": sl.TmaTile(TmaConfig(128, 64, 1, 8, 4), 4096)}
    assert sl.tma_tiles(str(tmp_path / "none.json")) == {}
    committed = sl.tma_tiles()  # the probe's table reads, each tile with the reduction it was measured on
    assert all(isinstance(t.config, TmaConfig) and t.min_k >= 2048 for t in committed.values()), committed


def test_a_tile_keeps_to_the_reductions_it_was_measured_on(monkeypatch):
    """A tile measured on reductions of at least ``min_k`` is not taken for a shallower one (a smaller
    model's layer): F.linear there, and ``gated`` declines."""
    tile = dict(TmaConfig(32, 32, 1, 4, 2)._asdict(), min_k=64)
    tuning = _tuning().replace(tma_tiles={"tall": tile, "glu": tile})
    streams = sl.StreamLinears(torch.device("cpu"), tuning)
    calls = count_calls(monkeypatch, importlib.import_module("peft_fastlora.base_ops.stream_linears"), ["tma_gemm"])
    for k, taken in ((48, 0), (64, 1)):
        streams.linear(torch.randn(80, k).bfloat16(), (torch.randn(2 * k, k) / 8).bfloat16())
        assert calls["tma_gemm"] == taken, (k, calls)
    assert streams.gated(torch.randn(80, 48).bfloat16(), torch.randn(192, 48).bfloat16(), None, "silu") is None
    assert streams.gated(torch.randn(80, 64).bfloat16(), torch.randn(192, 64).bfloat16(), None, "silu") is not None


def test_rows_past_max_rows_take_the_tma_tile_of_their_class(monkeypatch):
    """65-128 rows take the TMA kernel where the table has the weight's class (its tile, split K
    clamped past ``SPLIT_MAX_N``), else F.linear; past 128 rows or with an unaligned input, F.linear;
    the results are the GEMM's either way."""
    tuning = _tuning(tma_tiles={"tall": TmaConfig(32, 32, 2, 4, 2)})
    streams = sl.StreamLinears(torch.device("cpu"), tuning)
    assert streams.workspace.part.numel() >= 2 * tma_ops.MAX_ROWS * tuning.stream_split_max_n
    configs = _spy_configs(monkeypatch, sl, "tma_gemm")
    stream_calls = count_calls(monkeypatch,
            importlib.import_module("peft_fastlora.base_ops.stream_linears"), ["stream_gemm"])
    tall, square = (torch.randn(96, 48) / 7).bfloat16(), (torch.randn(48, 48) / 7).bfloat16()
    for rows in (tuning.stream_max_rows + 1, 128):
        x = torch.randn(rows, 48).bfloat16()
        torch.testing.assert_close(streams.linear(x, tall).float(), F.linear(x.float(), tall.float()).bfloat16().float(),
                                   atol=3e-2, rtol=1.6e-2)
    assert configs == [TmaConfig(32, 32, 2, 4, 2)] * 2 and stream_calls["stream_gemm"] == 0
    streams.linear(torch.randn(80, 48).bfloat16(), square)  # no tile for its class
    streams.linear(torch.randn(129, 48).bfloat16(), tall)  # past the TMA kernel's rows
    unaligned = torch.randn(80 * 48 + 1).bfloat16()[1:].view(80, 48)
    torch.testing.assert_close(streams.linear(unaligned, tall).float(),
                               F.linear(unaligned.float(), tall.float()).bfloat16().float(), atol=3e-2, rtol=1.6e-2)
    assert len(configs) == 2 and stream_calls["stream_gemm"] == 0
    streams.linear(torch.randn(tuning.stream_max_rows, 48).bfloat16(), tall)  # the streaming kernel's rows
    assert stream_calls["stream_gemm"] == 1 and len(configs) == 2
    streams = sl.StreamLinears(torch.device("cpu"), tuning.replace(stream_split_max_n=64))  # too wide to split
    streams.linear(torch.randn(80, 48).bfloat16(), tall)
    assert configs[-1].split_k == 1


def test_residual_and_gated_activation_ride_in_the_tma_kernel(monkeypatch):
    """At 65-128 rows the residual add rides in a (split) TMA launch over its weight, and a [gate; up]
    weight gives ``act(gate) * up`` from the ``glu`` tile; without a ``glu`` tile ``gated`` declines."""
    from peft_fastlora.ops.silu_mul import act_mul

    tuning = _tuning(tma_tiles=TINY_TMA)
    streams = sl.StreamLinears(torch.device("cpu"), tuning)
    calls = count_calls(monkeypatch, importlib.import_module("peft_fastlora.base_ops.stream_linears"), ["tma_gemm"])
    w = (torch.randn(48, 112) / 10).bfloat16()  # deep: two K ranges
    x, residual = torch.randn(2, 40, 112).bfloat16(), torch.randn(2, 40, 48).bfloat16()
    streams.expect_add(w, residual)
    added = streams.linear(x, w)
    assert streams.took_add() and calls["tma_gemm"] == 1
    torch.testing.assert_close(added.float(), F.linear(x.float(), w.float()) + residual.float(), atol=3e-2, rtol=1.6e-2)
    gate_up = (torch.randn(2 * 96, 48) / 7).bfloat16()
    h = torch.randn(90, 48).bfloat16()
    out = streams.gated(h, gate_up, None, "silu")
    assert calls["tma_gemm"] == 2 and out.shape == (90, 96)
    both = F.linear(h.float(), gate_up.float()).bfloat16()
    torch.testing.assert_close(out.float(), act_mul(both[:, :96], both[:, 96:], "silu").float(), atol=3e-2, rtol=2e-2)
    tuning = _tuning(tma_tiles={k: v for k, v in TINY_TMA.items() if k != "glu"})
    assert sl.StreamLinears(torch.device("cpu"), tuning).gated(h, gate_up, None, "silu") is None


def test_patched_model_decodes_through_the_tma_kernel_with_peft_tokens(monkeypatch):
    """Every GEMM of more than two rows through the TMA kernel (``MAX_ROWS`` lowered; tiny tiles for
    every class): the prefill and the decode steps of a mixed batch through emulated graphs (folded
    LoRA sites, the residual fold, plain gate/up's activation) give PEFT's tokens and logits."""
    import peft_fastlora as fastlora
    from _models import left_padded_batch

    tuning = _tuning(tma_tiles=TINY_TMA, fp32=True)
    tuning = tuning.replace(stream_max_rows=2)
    base = tiny_llama(0, vocab_size=128)
    base.generation_config.eos_token_id = None
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj",
                                                                              "down_proj"],
                                            init_lora_weights=False), adapter_name="a").eval()
    model.add_adapter("b", LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "down_proj"],
                                      init_lora_weights=False))
    batch, names = left_padded_batch([5, 7, 3], seed=4), ["a", "__base__", "b"]
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        want = model.generate(**batch, adapter_names=names, **kwargs)
    calls = count_calls(monkeypatch, importlib.import_module("peft_fastlora.base_ops.stream_linears"), ["tma_gemm"])
    stream_calls = count_calls(monkeypatch,
            importlib.import_module("peft_fastlora.base_ops.stream_linears"), ["stream_gemm"])
    with fastlora.patched(model, stream_gemm=True, fuse_norms=True, fuse_silu_mul=True, fuse=True,
                          cuda_graphs="emulate", tuning=tuning), torch.no_grad():
        got = model.generate(**batch, adapter_names=names, **kwargs)
    _same_decode(got, want)
    layers = model.config.num_hidden_layers
    assert calls["tma_gemm"] >= 4 * layers * 4, calls  # q/k/v, o, gate/up, down a layer, each step
    assert stream_calls["stream_gemm"] == 0


def test_a_folded_deep_weight_with_its_residual_pending_takes_the_add_tile(monkeypatch):
    """With no ``deep`` tile in the table, a folded deep weight (more rows than the residual's columns)
    at 65-128 rows takes ``ADD_TILES``' tile when its residual add is pending (the add in its
    epilogue) and cuBLAS otherwise; a plain deep weight and shallower reductions than the tile was
    measured on keep cuBLAS (the layer adds the residual itself)."""
    tuning = _tuning(tma_tiles={k: v for k, v in TINY_TMA.items() if k != "deep"})
    tuning = tuning.replace(tma_add_tiles={"deep": (dict(block_n=16, block_k=32, split_k=2, num_warps=4,
                                                                num_stages=2), 112)})
    calls = count_calls(monkeypatch, importlib.import_module("peft_fastlora.base_ops.stream_linears"), ["tma_gemm"])
    folded = (torch.randn(56, 112) / 10).bfloat16()  # 48 base rows and 8 rows of A under them
    x, residual = torch.randn(80, 112).bfloat16(), torch.randn(80, 48).bfloat16()
    streams = sl.StreamLinears(torch.device("cpu"), tuning)
    plain = streams.linear(x, folded)
    assert calls["tma_gemm"] == 0
    streams.expect_add(folded, residual)
    added = streams.linear(x, folded)
    assert streams.took_add() and calls["tma_gemm"] == 1
    want = F.linear(x.float(), folded.float())
    want[:, :48] += residual.float()
    torch.testing.assert_close(added.float(), want, atol=3e-2, rtol=1.6e-2)
    torch.testing.assert_close(plain.float(), F.linear(x.float(), folded.float()), atol=3e-2, rtol=1.6e-2)
    for w, xx in (((torch.randn(48, 112) / 10).bfloat16(), x),  # plain: cuBLAS and the layer's own add
                  ((torch.randn(56, 96) / 10).bfloat16(), torch.randn(80, 96).bfloat16())):  # too shallow
        streams.expect_add(w, residual)
        streams.linear(xx, w)
        assert not streams.took_add() and calls["tma_gemm"] == 1


def test_lora_gate_up_takes_shrink_deltas_and_activation_in_one_launch(monkeypatch):
    """Past ``MAX_ROWS`` (lowered) a folded gate/up LoRA site gives ``act(gate) * up`` with both
    deltas from one ``ops.glu_lora`` launch (B's columns kept by the site): mixed ranks, an adapter
    on gate only, "__base__" rows, through emulated graphs; then an adapter added and one deleted mid-way (the sites rebuilt, the
    MLPs' path replaced, not doubled). PEFT's tokens and logits each time."""
    import peft_fastlora as fastlora
    from _models import left_padded_batch
    from peft_fastlora.patch import get_state

    tuning = _tuning(tma_tiles=TINY_TMA, fp32=True)
    tuning = tuning.replace(stream_max_rows=2)
    base = tiny_llama(0, vocab_size=128)
    base.generation_config.eos_token_id = None
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["gate_proj", "up_proj", "q_proj"],
                                            init_lora_weights=False), adapter_name="a").eval()
    model.add_adapter("b", LoraConfig(r=4, lora_alpha=4, target_modules=["gate_proj", "down_proj"],
                                      init_lora_weights=False))
    batch, names = left_padded_batch([5, 7, 3, 6], seed=5), ["a", "__base__", "b", "a"]
    kwargs = dict(max_new_tokens=3, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        want = model.generate(**batch, adapter_names=names, **kwargs)
    taken = []
    original = sl.StreamLinears.gated_lora

    def spy(self, *args, **kw):
        out = original(self, *args, **kw)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(sl.StreamLinears, "gated_lora", spy)
    layers = model.config.num_hidden_layers
    got = []
    with fastlora.patched(model, backend="triton", stream_gemm=True, fuse_norms=True, fuse_silu_mul=True,
                          fold_shrink=True, cuda_graphs="emulate", tuning=tuning) as report, torch.no_grad():
        assert report.stream_lora_gated_mlps == layers and "LoRA gate/up, its shrink" in str(report)
        _same_decode(model.generate(**batch, adapter_names=names, **kwargs), want)
        assert sum(taken) >= layers * 3, taken  # every layer's MLP, the prefill and each decode step
        model.add_adapter("c", LoraConfig(r=8, lora_alpha=8, target_modules=["up_proj"], init_lora_weights=False))
        names = ["c", "b", "__base__", "c"]
        for change in ("added", "deleted"):
            taken.clear()
            got.append(model.generate(**batch, adapter_names=names, **kwargs))
            assert get_state(model).base_ops.gated.count("lora") == layers and sum(taken) >= layers * 3, change
            if change == "added":
                model.delete_adapter("a")
                model.set_adapter("b")  # (PEFT's model keeps the deleted name as its active adapter)
    assert not any("_fastlora_gated" in m.__dict__ for m in model.modules())
    with torch.no_grad():
        want = model.generate(**batch, adapter_names=names, **kwargs)
    for g in got:
        _same_decode(g, want)


def test_a_model_on_several_devices_gets_no_decode_gemm_kernel(monkeypatch):
    """``stream_wanted`` (which also decides whether gate/up pools keep ``ops.glu_lora``'s buffers)
    says no for a model whose parameters span two devices, whatever ``stream_gemm`` asks; the same
    model on one device gets the kernel (under the interpreter, the CPU tests' path)."""
    import peft_fastlora.base_ops as base_ops
    from peft_fastlora import PatchOptions

    monkeypatch.setattr(base_ops, "interpreting", lambda: True)
    model = tiny_llama(0, vocab_size=128)
    options = PatchOptions(stream_gemm=True)
    assert base_ops.stream_wanted(model, options, torch.device("cpu"))
    model.model.layers[1].mlp.down_proj.to("meta")  # (accelerate's device_map leaves layers elsewhere)
    assert not base_ops.stream_wanted(model, options, torch.device("cpu"))
    assert not base_ops.stream_wanted(model, PatchOptions(stream_gemm="auto"), torch.device("cpu"))
