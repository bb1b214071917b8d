"""examples/serve_many_adapters.py end to end on a tiny model: answers in order, equal to PEFT's."""

import json
import os
import sys

import pytest
import torch
from peft import LoraConfig, get_peft_model

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
import serve_many_adapters as serve  # noqa: E402


@pytest.fixture(scope="module")
def adapters_dir(tmp_path_factory):
    """Two adapters trained on nothing but with non-zero B, saved as PEFT saves them, for the
    same random tiny base model that ``--tiny`` builds."""
    root = tmp_path_factory.mktemp("adapters")
    configs = {"upper": LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
               "reverse": LoraConfig(r=8, lora_alpha=32, init_lora_weights=False,
                                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"])}
    for name, cfg in configs.items():
        model = get_peft_model(_tiny_base()[0], cfg, adapter_name=name)
        model.save_pretrained(str(root))  # PEFT writes a named adapter to root/<name>
    return root


def _tiny_base():
    from _chartok import build_char_tokenizer
    from _models import llama_config
    from transformers import LlamaForCausalLM

    tok = build_char_tokenizer()
    torch.manual_seed(0)
    base = LlamaForCausalLM(llama_config(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                         pad_token_id=tok.pad_token_id))
    return base, tok


def _requests(path, rows):
    with open(path, "w") as f:
        for a, p in rows:
            f.write(json.dumps({"adapter": a, "prompt": p}) + "\n")


def test_serves_in_order_and_equals_peft(adapters_dir, tmp_path):
    assert sorted(d.name for d in adapters_dir.iterdir() if d.is_dir()) == ["reverse", "upper"]
    rows = [("upper", "abc="), ("reverse", "hello="), ("__base__", "xyz"), ("reverse", "ab="), ("upper", "q")]
    _requests(tmp_path / "req.jsonl", rows)
    common = ["--tiny", "--adapters", str(adapters_dir), "--requests", str(tmp_path / "req.jsonl"),
              "--batch-size", "2", "--max-new-tokens", "6", "--device", "cpu"]
    assert serve.main(common + ["--out", str(tmp_path / "fast.jsonl")]) == 0
    assert serve.main(common + ["--out", str(tmp_path / "peft.jsonl"), "--no-fastlora"]) == 0
    fast = [json.loads(line) for line in open(tmp_path / "fast.jsonl")]
    peft = [json.loads(line) for line in open(tmp_path / "peft.jsonl")]
    assert [(r["adapter"], r["prompt"]) for r in fast] == rows
    assert fast == peft
    assert len({r["completion"] for r in fast}) > 1  # adapters change what comes out


def test_continuous_mode_gives_the_same_answers_with_latencies(adapters_dir, tmp_path):
    rows = [("upper", "abc="), ("reverse", "hello there="), ("__base__", "xyz"), ("reverse", "ab="),
            ("upper", "a much longer prompt than the others=")]
    _requests(tmp_path / "req.jsonl", rows)
    common = ["--tiny", "--adapters", str(adapters_dir), "--requests", str(tmp_path / "req.jsonl"),
              "--max-new-tokens", "6", "--device", "cpu"]
    assert serve.main(common + ["--out", str(tmp_path / "static.jsonl"), "--batch-size", "2"]) == 0
    assert serve.main(common + ["--out", str(tmp_path / "cont.jsonl"), "--continuous",
                                "--max-batch-tokens", "16"]) == 0
    static = [json.loads(line) for line in open(tmp_path / "static.jsonl")]
    cont = [json.loads(line) for line in open(tmp_path / "cont.jsonl")]
    assert [r["completion"] for r in cont] == [r["completion"] for r in static]
    assert all(r["latency_s"] > 0 for r in cont)
    with pytest.raises(SystemExit, match="--continuous needs fastlora"):
        serve.main(common + ["--out", str(tmp_path / "x.jsonl"), "--continuous", "--no-fastlora"])


def test_unknown_adapter_is_named_before_any_work(adapters_dir, tmp_path):
    _requests(tmp_path / "req.jsonl", [("upper", "a"), ("sql", "b")])
    with pytest.raises(ValueError, match="unknown adapter.*sql"):
        serve.main(["--tiny", "--adapters", str(adapters_dir), "--requests", str(tmp_path / "req.jsonl"),
                    "--out", str(tmp_path / "o.jsonl"), "--device", "cpu"])
    assert not os.path.exists(tmp_path / "o.jsonl")


def test_malformed_request_line(adapters_dir, tmp_path):
    (tmp_path / "req.jsonl").write_text('{"adapter": "upper"}\n')
    with pytest.raises(ValueError, match="needs 'adapter' and 'prompt'"):
        serve.main(["--tiny", "--adapters", str(adapters_dir), "--requests", str(tmp_path / "req.jsonl"),
                    "--out", str(tmp_path / "o.jsonl")])


def test_tiny_demo_needs_no_files(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # from any folder
    assert serve.main(["--tiny", "--device", "cpu", "--max-new-tokens", "3", "--batch-size", "5"]) == 0
    err = capsys.readouterr().err
    path = err.strip().splitlines()[-1].split(" answers written to ")[1]
    answers = [json.loads(line) for line in open(path)]
    assert len(answers) == 2 * len(serve.TINY_PROMPTS)
    assert {a["adapter"] for a in answers} == set(serve.TINY_ADAPTERS) | {"__base__"}
    assert all(isinstance(a["completion"], str) for a in answers)
    assert os.listdir(tmp_path) == []  # everything it made lives in its own temporary folder


def test_files_required_without_tiny(tmp_path, capsys):
    with pytest.raises(SystemExit):
        serve.main(["--base", str(tmp_path), "--out", str(tmp_path / "o.jsonl")])
    assert "--adapters, --requests required (or --tiny, which makes them)" in capsys.readouterr().err


def test_registered_adapters_in_gpu_slots_give_the_same_answers(adapters_dir, tmp_path):
    """--register: the folders are registered by name (CPU memory) and served from two GPU slots,
    statically and continuously; the answers equal loading them into PEFT."""
    rows = [("upper", "abc="), ("reverse", "hello="), ("__base__", "xyz"), ("reverse", "ab="), ("upper", "q")]
    _requests(tmp_path / "req.jsonl", rows)
    common = ["--tiny", "--adapters", str(adapters_dir), "--requests", str(tmp_path / "req.jsonl"),
              "--batch-size", "2", "--max-new-tokens", "6", "--device", "cpu"]
    assert serve.main(common + ["--out", str(tmp_path / "peft.jsonl")]) == 0
    assert serve.main(common + ["--out", str(tmp_path / "reg.jsonl"), "--register", "--slots", "2"]) == 0
    assert serve.main(common + ["--out", str(tmp_path / "regc.jsonl"), "--register", "--slots", "2",
                                "--continuous", "--max-batch-tokens", "16"]) == 0
    want = [json.loads(line)["completion"] for line in open(tmp_path / "peft.jsonl")]
    assert [json.loads(line)["completion"] for line in open(tmp_path / "reg.jsonl")] == want
    assert [json.loads(line)["completion"] for line in open(tmp_path / "regc.jsonl")] == want
    with pytest.raises(SystemExit, match="--register needs fastlora"):
        serve.main(common + ["--out", str(tmp_path / "x.jsonl"), "--register", "--no-fastlora"])
