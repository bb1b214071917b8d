"""Every benchmark script's ``--smoke`` run (tiny models on the CPU, Triton's kernels in its
interpreter): a script broken by a change fails here, not on a GPU machine. They measure nothing.
Each script runs in a child forked by ``_script_runner.py``, which imports the heavy packages once
per test process (a fresh ``python`` spends several seconds on imports alone); torchrun's scripts
keep their own processes."""

import atexit
import json
import math
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "benchmarks")


class _Runner:
    """This test process's ``_script_runner.py`` (started at its first script): the scripts run in
    children it forks after importing the heavy packages once."""

    proc = None
    lines: "queue.Queue" = None

    @classmethod
    def get(cls, env):
        if cls.proc is None or cls.proc.poll() is not None:
            cls.proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "_script_runner.py")],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
            cls.lines = queue.Queue()
            threading.Thread(target=cls._pump, args=(cls.proc.stdout, cls.lines), daemon=True).start()
            atexit.register(cls.proc.stdin.close)
        return cls.proc

    @staticmethod
    def _pump(out, lines):
        for line in out:
            lines.put(line)

    @classmethod
    def reply(cls, timeout):
        line = cls.lines.get(timeout=timeout)
        return json.loads(line)


def _run(args, env_extra=None, torchrun=False, timeout=300):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
               NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1",
               PYTHONHASHSEED="0", **(env_extra or {}))
    if torchrun or not hasattr(os, "fork"):
        cmd = [sys.executable] + (["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
                                  if torchrun else []) + args
        run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
        return run.stdout + run.stderr
    proc = _Runner.get(env)
    with tempfile.NamedTemporaryFile("r", suffix=".log") as out:
        proc.stdin.write(json.dumps(dict(argv=args, env=env, cwd=ROOT, out=out.name)) + "\n")
        proc.stdin.flush()
        pid = _Runner.reply(60)["pid"]
        try:
            rc = _Runner.reply(timeout)["rc"]
        except queue.Empty:
            os.kill(pid, signal.SIGKILL)
            _Runner.reply(60)
            pytest.fail(f"{args[0]} ran past {timeout} s:\n" + out.read()[-6000:])
        text = out.read()
    assert rc == 0, text[-6000:]
    return text


def test_scripts_run_in_forked_children_and_their_failures_show(tmp_path):
    """``_run``'s forked children: a script's output comes back, a raised error or a non-zero exit
    fails the caller with the script's output, and each child starts from the runner's state (a
    module global one script sets is not there for the next)."""
    ok = tmp_path / "ok.py"
    ok.write_text("import peft_fastlora.ops.pdl as pdl\nprint('setting', getattr(pdl, 'MARK', 'none'))\n"
                  "pdl.MARK = 'changed'\n")
    first, second = _run([str(ok)]), _run([str(ok)])
    assert "setting" in first and first == second and "changed" not in second
    raises = tmp_path / "raises.py"
    raises.write_text("print('before')\nraise ValueError('boom')\n")
    with pytest.raises(AssertionError, match="boom"):
        _run([str(raises)])
    exits = tmp_path / "exits.py"
    exits.write_text("import sys\nprint('exit three')\nsys.exit(3)\n")
    with pytest.raises(AssertionError, match="exit three"):
        _run([str(exits)])


def _csv(path):
    import csv

    with open(path) as f:
        return list(csv.DictReader(f))


def test_bench_generate_smoke(tmp_path):
    """Every method on the tiny shape, through the table it prints and the CSV it writes."""
    out = _run([os.path.join(BENCH, "bench_generate.py"), "--smoke", "--models", "tiny", "--batches", "2",
                "--new-tokens", "3", "--short-tokens", "2", "--reps", "1", "--out", str(tmp_path)],
               env_extra={"TRITON_INTERPRET": "1"})
    for method in ("hf_eager_base", "base_graphs", "peft_native", "fastlora_eager", "fastlora_graphs"):
        assert f"llama-tiny | 2 | {method} |" in out, out[-3000:]
    graphs = [line for line in out.splitlines() if line.startswith("llama-tiny | 2 | fastlora_graphs |")][0]
    assert graphs.endswith("| 1.000"), graphs  # its greedy tokens are PEFT's
    rows = _csv(tmp_path / "generate_tiny_cpu.csv")
    assert {"ratio_to_base_graphs", "ratio_to_hf_eager_base", "ratio_to_floor", "torch"} <= set(rows[0])


def test_bench_ab_smoke(tmp_path):
    """Both sides (here the same tree) run in their own processes, into one table (a smoke run
    takes one run a side, A B; a measurement A B B A per round)."""
    _run([os.path.join(BENCH, "bench_ab.py"), "--smoke", "--old", ROOT, "--new", ROOT, "--out", str(tmp_path)])
    rows = _csv(tmp_path / "ab_tiny_cpu.csv")
    assert [(r["method"], r["runs_per_side"]) for r in rows] == [("base_patched", "1"), ("mixed", "1")]
    # one run of 4 tokens on a busy CPU: the decode difference may come out at or below zero, so a
    # number, not its sign, is what the smoke run checks
    assert all(math.isfinite(float(r[c])) for r in rows for c in ("old_ms", "new_ms"))


def test_bench_prefill_smoke(tmp_path):
    """The patched base model is the reference column, the unpatched one beside it."""
    _run([os.path.join(BENCH, "bench_prefill.py"), "--smoke", "--kernel-split", "--glu-expand", "--out", str(tmp_path)])
    rows = {r["method"]: r for r in _csv(tmp_path / "prefill_tiny_cpu.csv")}
    assert set(rows) == {"hf_base", "base_patched", "peft", "fastlora", "fastlora_glu_expand"}
    assert rows["base_patched"]["ratio_to_base_patched"] == "1.0" and rows["hf_base"]["ratio_to_hf_base"] == "1.0"
    # the two arms: the expand then the activation, and the deltas inside the activation's launch
    assert rows["fastlora"]["glu_expand_min_tokens"] == "off" and rows["fastlora_glu_expand"]["glu_expand_min_tokens"] == "32"
    assert rows["peft"]["glu_expand_min_tokens"] == ""
    split = _csv(tmp_path / "prefill_tiny_cpu_kernels.csv")  # one prefill's ops by method (CPU times here)
    methods = ("base_patched", "fastlora", "fastlora_glu_expand")
    assert {r["method"] for r in split} == set(methods)
    assert all(float(r["launches_per_step"]) > 0 for r in split)
    # on the CPU the times are differences of two noisy host timings: present, not necessarily positive
    assert all(any(float(r["us_per_step"]) != 0 for r in split if r["method"] == m) for m in methods)
    # the timeline columns: filled for the split methods (no GPU activity on the CPU: counts of 0),
    # empty for the others
    for m, r in rows.items():
        assert (r["host_syncs"] == "0" and r["kernel_launches"] == "0") if m in methods \
            else (r["host_syncs"] == "" and r["idle_share"] == ""), (m, r)


def test_bench_continuous_smoke(tmp_path):
    """Each fastlora mode is set against the patched base model through the same engine and the
    unpatched one."""
    _run([os.path.join(BENCH, "bench_continuous.py"), "--smoke", "--modes", "base", "base_patched", "fastlora",
          "static", "peft", "base_varlen", "fastlora_varlen", "fastlora_paged", "--profile", "0.01",
          "--out", str(tmp_path)])
    rows = {r["mode"]: r for r in _csv(tmp_path / "continuous_tiny_cpu.csv")}
    assert set(rows) == {"base", "base_patched", "fastlora", "static", "peft", "base_varlen", "fastlora_varlen",
                         "fastlora_paged"}
    assert float(rows["fastlora_paged"]["tokens_per_s"]) > 0 and rows["fastlora_paged"]["requests"] == "12"
    # what the engine sized, per mode: the same cache for each (the smoke run fixes it)
    assert rows["fastlora"]["cache_blocks"] == rows["base_patched"]["cache_blocks"] != "", rows["fastlora"]
    assert float(rows["fastlora"]["time_per_token_vs_base_patched"]) > 0
    assert float(rows["fastlora"]["time_per_token_vs_base"]) > 0
    assert rows["fastlora"]["fold_max_tokens"] == "256"  # the library's default
    # the shrink's launch at 32-row tiles as the tree chooses it (K tile x ranges; the tiny model's K is short)
    assert rows["fastlora"]["shrink_32_rows"] == "64x1/128x1" and rows["base_patched"]["shrink_32_rows"] == ""
    # fastlora's hook counts a patched model's steps and times its loop's phases; nothing counts the
    # unpatched model's steps, so its floor is the FLOPs one
    for mode in ("fastlora", "base_patched"):
        assert float(rows[mode]["bytes_floor_s"]) > 0 and float(rows[mode]["ratio_to_floor"]) > 0
        assert float(rows[mode]["tokens_per_step"]) > 0 and float(rows[mode]["run_host_forward_ms"]) > 0
    assert rows["base"]["bytes_floor_s"] == "" and rows["base"]["run_host_forward_ms"] == ""
    profiled = {r["mode"]: r for r in _csv(tmp_path / "continuous_profile_tiny_cpu.csv")}
    assert {"base", "base_patched", "fastlora", "base_varlen", "fastlora_varlen"} <= set(profiled)
    assert all(float(r["window_s"]) > 0 for r in profiled.values())


def test_bench_continuous_isolated_modes(tmp_path):
    """``--isolate on``: each mode measured in its own process, the rows and their ratios written by
    the parent; the host time on the step's adapters and the Triton compiles are columns. The
    adapters registered by name here (``--adapter-source registered``), as the endpoint loads them."""
    _run([os.path.join(BENCH, "bench_continuous.py"), "--smoke", "--modes", "base_patched", "fastlora",
          "--isolate", "on", "--host-profile", "20", "--adapter-source", "registered", "--fold-max-tokens", "4096",
          "--out", str(tmp_path)])
    rows = {r["mode"]: r for r in _csv(tmp_path / "continuous_tiny_cpu.csv")}
    assert set(rows) == {"base_patched", "fastlora"}
    assert rows["fastlora"]["adapter_source"] == "registered" and rows["base_patched"]["adapter_source"] == ""
    assert rows["fastlora"]["fold_max_tokens"] == "4096" and rows["base_patched"]["fold_max_tokens"] == ""
    assert float(rows["fastlora"]["time_per_token_vs_base_patched"]) > 0
    assert float(rows["fastlora"]["run_host_adapters_ms"]) > 0
    assert rows["fastlora"]["triton_compiles"] != ""
    # --host-profile: the engine thread's costliest functions per step, fastlora's own among them
    functions = _csv(tmp_path / "continuous_host_profile_tiny_cpu.csv")
    assert {r["mode"] for r in functions} == {"base_patched", "fastlora"}
    assert any(r["mode"] == "fastlora" and r["function"].startswith("peft_fastlora/continuous/engine.py")
               and float(r["calls_per_step"]) > 0 for r in functions)


def test_bench_continuous_rounds_reverse_the_order_and_keep_their_own_ratios():
    """``--rounds``: every round in the reverse order of the one before; each fastlora row's time per
    token against its own round's patched base, whichever of the two ran first."""
    sys.path.insert(0, BENCH)
    import bench_continuous as bc

    assert bc.round_orders(["base_patched_paged", "fastlora_paged"], 3) == [
        ["base_patched_paged", "fastlora_paged"], ["fastlora_paged", "base_patched_paged"],
        ["base_patched_paged", "fastlora_paged"]]
    table = [dict(round=0, mode="base_patched_paged", tokens_per_s=100.0),
             dict(round=0, mode="fastlora_paged", tokens_per_s=80.0),
             dict(round=1, mode="fastlora_paged", tokens_per_s=90.0)]
    bc.fill_ratios(table, 1)  # its base has not run yet
    assert "time_per_token_vs_base_patched" not in table[2]
    table.append(dict(round=1, mode="base_patched_paged", tokens_per_s=99.0))
    bc.fill_ratios(table, 0)
    bc.fill_ratios(table, 1)
    assert table[1]["time_per_token_vs_base_patched"] == 1.25
    assert table[2]["time_per_token_vs_base_patched"] == 1.1


@pytest.mark.parametrize("args, message", [
    (["--rounds", "0"], "--rounds must be at least 1, got 0"),
    (["--rounds", "2", "--isolate", "off"], "--rounds measures each mode in a fresh process"),
])
def test_bench_continuous_refuses_bad_rounds(capsys, args, message):
    sys.path.insert(0, BENCH)
    import bench_continuous

    with pytest.raises(SystemExit) as exit_info:
        bench_continuous.main(["--smoke", "--modes", "base_patched", "fastlora", *args])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_bench_continuous_refuses_peft_mode_with_registered_adapters(capsys):
    """PEFT's own path cannot serve adapters registered by name: refused before any model is built."""
    sys.path.insert(0, BENCH)
    import bench_continuous

    with pytest.raises(SystemExit) as exit_info:
        bench_continuous.main(["--smoke", "--modes", "fastlora", "peft", "--adapter-source", "registered"])
    assert exit_info.value.code == 2
    assert "the peft mode runs PEFT's own adapters: it needs --adapter-source peft" in capsys.readouterr().err


def test_gpu_window_reads_busy_idle_and_families_from_a_timeline():
    """``harness.GpuWindow.summary`` on a made-up timeline: overlapping kernels count once, gaps of
    100 us and more are counted, launches and syncs by name."""
    sys.path.insert(0, BENCH)
    import harness

    events = [dict(cat="kernel", name="nvjet_gemm", ts=0, dur=40), dict(cat="kernel", name="lora_shrink", ts=30, dur=20),
              dict(cat="gpu_memcpy", name="Memcpy HtoD", ts=200, dur=10), dict(cat="kernel", name="flash_fwd_kernel<cutlass::bfloat16_t>", ts=250, dur=50),
              dict(cat="cuda_runtime", name="cudaGraphLaunch", ts=0, dur=5),
              dict(cat="cuda_runtime", name="cudaStreamSynchronize", ts=60, dur=140),
              dict(cat="cuda_driver", name="cuLaunchKernelEx", ts=240, dur=3)]
    out = harness.GpuWindow.summary(events, wall=0.001)
    assert out["gpu_busy_share"] == round(110 / 300, 3) and out["idle_share"] == round(190 / 300, 3)
    assert out["outside_gpu_span_ms"] == 0.7  # 1 ms of wall, the GPU active from 0 to 300 us
    assert out["idle_gaps_over_100us"] == 1 and out["copies"] == 1 and out["host_syncs"] == 1
    assert (out["graph_launches"], out["kernel_launches"]) == (1, 1)
    assert (out["gemm_share"], out["lora_share"], out["attention_share"]) == (round(40 / 300, 3), round(20 / 300, 3),
                                                                              round(50 / 300, 3))


def test_bench_many_adapters_smoke(tmp_path):
    _run([os.path.join(BENCH, "bench_many_adapters.py"), "--smoke", "--fold-limit", "1e9", "--out", str(tmp_path)])
    rows = {r["mode"]: r for r in _csv(tmp_path / "many_adapters_tiny_cpu.csv")}
    assert set(rows) == {"base_patched", "hf_base", "slots", "resident"}
    assert float(rows["slots"]["decode_time_per_token_vs_base_patched"]) > 0
    assert float(rows["resident"]["decode_time_per_token_vs_hf_base"]) > 0


def test_bench_host_step_smoke(tmp_path):
    _run([os.path.join(BENCH, "bench_host_step.py"), "--device", "cpu", "--layers", "2", "--adapters", "4",
          "--steps", "6", "--reps", "1", "--out", str(tmp_path)])
    (row,) = _csv(tmp_path / "host_step_cpu.csv")
    assert row["rebuilds"] == "0" and float(row["step_ms"]) > 0 and float(row["fill_ms"]) > 0, row


def test_bench_device_map_smoke():
    out = _run([os.path.join(BENCH, "bench_device_map.py"), "--smoke"])
    assert "'method': 'fastlora'" in out and "'method': 'peft_native'" in out


def test_bench_tp_smoke():
    pytest.importorskip("torch.distributed.tensor")
    out = _run([os.path.join(BENCH, "bench_tp.py"), "--smoke", "--skip-tp1"], torchrun=True)
    assert "'method': 'tp2'" in out


def test_bench_kernels_smoke(tmp_path):
    """The site launches of every implementation, compared with the torch backend before timing."""
    out = _run([os.path.join(BENCH, "bench_kernels.py"), "--smoke", "--out", str(tmp_path)],
               env_extra={"TRITON_INTERPRET": "1"})
    assert "fused-kernel timeouts: 0" in out, out[-2000:]
    rows = _csv(tmp_path / "kernels_cpu.csv")
    assert {r["impl"] for r in rows} == {"triton", "triton_2k", "torch_native", "peft_loop"}
    assert max(float(r["max_abs_err_triton_vs_torch"]) for r in rows) < 1e-3


def test_sweep_expand_smoke(tmp_path):
    """Each launch of the sweep is checked against torch before it is timed, the shrink's split-K
    launches among them."""
    _run([os.path.join(BENCH, "sweep_expand.py"), "--smoke", "--split-k", "1", "3", "--out", str(tmp_path)],
         env_extra={"TRITON_INTERPRET": "1"})
    rows = _csv(tmp_path / "expand_sweep_cpu.csv")
    assert {(r["kernel"], r["site"]) for r in rows} == {
        ("expand", "qkv"), ("expand", "gate_up"), ("expand", "o"), ("shrink", "qkv"), ("shrink", "gate_up"),
        ("shrink", "down"), ("glu_expand", "gate_up"), ("expand_then_act_mul", "gate_up"), ("act_mul", "gate_up")}
    assert all(not r.get("error") and float(r["max_abs_err"]) < 1e-4 and float(r["ms"]) > 0 for r in rows)
    assert {r["split_k"] for r in rows if r["kernel"] == "shrink"} == {"1", "3"}
    assert {r["l2"] for r in rows} == {"flushed"}


def test_sweep_expand_glu_alone_smoke(tmp_path):
    """``--kernels glu``: the fused launch, the two it replaces and the activation alone, in a file of
    their own, ``--tag`` in its name."""
    _run([os.path.join(BENCH, "sweep_expand.py"), "--smoke", "--kernels", "glu", "--tag", "decode", "--out",
          str(tmp_path)], env_extra={"TRITON_INTERPRET": "1"})
    rows = _csv(tmp_path / "glu_expand_sweep_decode_cpu.csv")
    assert [r["kernel"] for r in rows] == ["expand_then_act_mul", "act_mul", "glu_expand"]
    assert all(float(r["max_abs_err"]) < 1e-4 for r in rows)


def test_sweep_expand_warm_l2_smoke(tmp_path):
    """``--warm-l2`` times the same launches back to back, and says so in each row."""
    _run([os.path.join(BENCH, "sweep_expand.py"), "--smoke", "--warm-l2", "--out", str(tmp_path)],
         env_extra={"TRITON_INTERPRET": "1"})
    rows = _csv(tmp_path / "expand_sweep_cpu.csv")
    assert rows and {r["l2"] for r in rows} == {"warm"}
    assert all(float(r["max_abs_err"]) < 1e-4 and float(r["ms"]) > 0 for r in rows)


def test_bench_attention_smoke(tmp_path):
    out = _run([os.path.join(BENCH, "bench_attention.py"), "--smoke", "--out", str(tmp_path)],
               env_extra={"TRITON_INTERPRET": "1"})
    rows = _csv(tmp_path / "attention_cpu.csv")
    assert {"fastlora", "hf_sdpa", "fastlora[grid]", "fastlora[best]"} <= {r["impl"] for r in rows}, out[-2000:]
    assert max(float(r["max_abs_err"]) for r in rows if r["max_abs_err"] != "nan") < 1e-4


def test_bench_gemm_smoke():
    out = _run([os.path.join(BENCH, "bench_gemm.py"), "--smoke"], env_extra={"TRITON_INTERPRET": "1"})
    assert "smoke: every sweep entry equals x @ w.T" in out, out[-2000:]


def test_bench_gemm_table_from_the_committed_run(tmp_path):
    """The library's tile table is what the benchmark chooses from the committed run's measurements."""
    table = tmp_path / "t.json"
    _run([os.path.join(BENCH, "bench_gemm.py"), "--table", str(table), "--from-csv",
          os.path.join(BENCH, "results", "gemm_8b_tma_h200.csv")])
    with open(os.path.join(ROOT, "peft_fastlora", "base_ops", "tma_tiles_h200.json")) as f:
        assert json.loads(table.read_text())["classes"] == json.load(f)["classes"]


def test_soak_graphs_smoke(tmp_path):
    """A short soak on the CPU (emulated graphs): PEFT's tokens on every greedy call, the adapter change
    half-way, and the warm-up after it (which once asked for the deleted adapter)."""
    import ast

    out = _run([os.path.join(BENCH, "soak_graphs.py"), "--smoke", "--model", "tiny-llama", "--calls", "6",
                "--max-rows", "3", "--max-prompt", "6", "--max-new", "3", "--compare-peft", "--out", str(tmp_path)])
    summary = ast.literal_eval(out.split("SUMMARY ", 1)[1].splitlines()[0])
    assert summary["errors"] == 0 and summary["adapter_change_at"] == 3, summary
    assert summary["greedy_calls_compared"] > 0, summary
    assert summary["greedy_calls_token_equal"] == summary["greedy_calls_compared"], summary
    assert summary["rewarm_captures"] == summary["warmup_captures"] == 3, summary
    assert (tmp_path / "soak_tiny-llama_cpu.csv").exists()


def test_kernel_resources_smoke(tmp_path):
    """The decode step's launches recorded (not run) and compiled for sm_90: rows for the step's
    kernels with registers read from their cubins."""
    out_csv = tmp_path / "r.csv"
    _run([os.path.join(BENCH, "kernel_resources.py"), "--smoke", "--batches", "2", "--adapters", "2",
          "--out", str(out_csv)])
    rows = _csv(out_csv)
    kernels = {r["kernel"] for r in rows}
    assert {"_rms_norm_kernel", "_lora_expand_wide_kernel", "_decode_attention_split_kernel"} <= kernels, kernels
    assert all(int(r["registers"]) > 0 and int(r["programs_per_sm"]) > 0 for r in rows)


# ---- profile_step.py ------------------------------------------------------------------------------------
def _profile_step():
    sys.path.insert(0, BENCH)
    import profile_step

    return profile_step


def test_profile_step_split():
    """The timeline's split of synthetic steps: graph kernels by their launch's correlation id, the
    bubbles inside a replay, the work and the idle time between replays."""
    ps = _profile_step()
    gpu, launches = [], set()
    for i in range(6):  # a replay every 100 us: two graph kernels with a 2 us bubble, one argmax outside
        t = 100.0 * i
        launches.add(i)
        gpu += [(t, t + 30, "k1", i), (t + 32, t + 60, "k2", i), (t + 65, t + 70, "argmax", 100 + i)]
    steps = ps.split_steps(sorted(gpu), launches)
    assert len(steps) == 3  # the first two replays and the last are left out
    row = ps.summarise(steps, 3)
    assert (row["period_us"], row["graph_busy_us"], row["graph_gaps_us"]) == (100.0, 58.0, 2.0)
    assert (row["outside_busy_us"], row["outside_idle_us"], row["graph_kernels"]) == (5.0, 35.0, 2)
    assert row["top_outside"] == "argmax 5.0"
    charged = {r["kernel"]: r["charged_us_per_step"] for r in ps.kernel_rows(steps)}
    assert charged == {"k1": 30.0, "k2": 30.0}  # k2's run and the bubble before it


def test_profile_step_small_graphs_count_outside():
    """A small graph between two steps' graphs (``step_advance``'s) is work outside the step, not a
    step of its own."""
    ps = _profile_step()
    gpu, launches = [], set()
    for i in range(6):  # a step graph of four kernels, then a graph of one kernel, every 100 us
        t = 100.0 * i
        launches.update({i, 50 + i})
        gpu += [(t + 10 * j, t + 10 * j + 9, f"k{j}", i) for j in range(4)]
        gpu += [(t + 45, t + 52, "select", 50 + i)]
    steps = ps.split_steps(sorted(gpu), launches)
    assert len(steps) == 3
    row = ps.summarise(steps, 3)
    assert (row["period_us"], row["graph_kernels"], row["outside_busy_us"]) == (100.0, 4, 7.0)
    assert row["top_outside"] == "select 7.0"


def test_profile_step_host_side():
    """The host's steps between graph launches: blocking calls are waits, the rest the host's work."""
    ps = _profile_step()
    runtime = []
    for i in range(6):  # a launch every 100 us, 30 us of it in an event synchronize, 5 in an async copy
        t = 100.0 * i
        runtime += [(t, 4.0, "cudaGraphLaunch"), (t + 20, 30.0, "cudaEventSynchronize"),
                    (t + 60, 5.0, "cudaMemcpyAsync")]
    host = ps.host_steps(sorted(runtime))
    assert len(host) == 3 and host[0] == dict(host_period=100.0, host_wait=30.0, host_busy=70.0)
    row = ps.summarise([dict(period=1, graph_span=1, graph_busy=1, graph_gaps=0, outside_busy=0,
                             outside_idle=0, graph_kernels=1, outside=[])], 1, host)
    assert (row["host_busy_us"], row["host_wait_us"]) == (70.0, 30.0)


def test_profile_step_charges_overlap_once():
    """Under PDL a kernel starts before the one before it ends: only its end past the frontier counts."""
    ps = _profile_step()
    kernels = [(0.0, 10.0, "void gemm<int>(float*)"), (8.0, 12.0, "norm"), (11.0, 11.5, "tiny")]
    c = ps._charges(kernels)
    assert (c["gemm"][1], c["norm"][1], c["tiny"][1]) == (10.0, 2.0, 0.0)
    assert ps.short_name("void at::native::reduce_kernel<512, 1>(at::native::ReduceOp)") == \
        "at::native::reduce_kernel"


def test_profile_step_charges_by_place_in_the_layer():
    """Two layers of gemm, norm, gemm: each gemm also charged by its place; the norm (once a
    layer) and a kernel whose count is no multiple of the layers are not split."""
    ps = _profile_step()
    kernels, t = [], 0.0
    for _ in range(2):
        for name, dur in (("gemm", 10.0), ("norm", 1.0), ("gemm", 30.0)):
            kernels.append((t, t + dur, name))
            t += dur
    kernels.append((t, t + 2.0, "head"))
    c = ps._charges(kernels, layers=2)
    assert c["gemm"] == [4, 80.0, 80.0] and c["gemm[0/2]"] == [2, 20.0, 20.0] and c["gemm[1/2]"] == [2, 60.0, 60.0]
    assert "norm[0/1]" not in c and not any(k.startswith("head[") for k in c)
    assert ps._charges(kernels) == {k: v for k, v in c.items() if "[" not in k}


def test_profile_step_smoke():
    """Each view's set-up on the tiny shape: the timeline's (no CUPTI trace on the CPU), the host
    profile's tables, and the Nsight Compute view's second call (its profiler range needs CUDA graphs)."""
    out = _run([os.path.join(BENCH, "profile_step.py"), "--smoke"])
    assert "mixed fastlora: patched" in out and "base fastlora: base model only" in out, out[-2000:]
    out = _run([os.path.join(BENCH, "profile_step.py"), "--smoke", "--view", "host", "--methods", "base"])
    assert "decode step" in out and "# by cumulative" in out, out[-2000:]
    out = _run([os.path.join(BENCH, "profile_step.py"), "--smoke", "--view", "ncu", "--methods", "mixed"])
    assert "smoke: mixed batch 2 built, patched and generated twice" in out, out[-2000:]


def test_profile_step_summarizes_the_committed_ncu_profile():
    """``--summarize``: a kernel a line from Nsight Compute's raw CSV (the mixed 8B step at 128 rows,
    4 layers: its one-launch gate/up and decode attention there)."""
    path = os.path.join(BENCH, "results", "ncu_step_mixed_b128_h200.csv")
    out = _run([os.path.join(BENCH, "profile_step.py"), "--summarize", path])
    lines = [line for line in out.splitlines() if line.startswith(("_glu_lora_kernel", "_decode_attention"))]
    assert len(lines) == 8, out[-2000:]  # two replays of a 4-layer model
    us, dram_mb = float(lines[0].split()[1]), float(lines[0].split()[2])
    assert 10 < us < 1000 and dram_mb > 1, lines[0]


def test_bench_serving_smoke(tmp_path):
    """Poisson arrivals through the endpoint with the openai client, patched base beside the
    adapters; the soak's memory samples (through the in-place paged attention)."""
    _run([os.path.join(BENCH, "bench_serving.py"), "--smoke", "--out", str(tmp_path)])
    rows = {r["mode"]: r for r in _csv(tmp_path / "serving_tiny_cpu.csv")}
    assert set(rows) == {"base_patched", "fastlora"}
    for row in rows.values():
        assert row["failed"] == "0" and int(row["requests"]) > 0 and float(row["output_tokens_per_s"]) > 0
        # the server's side of the window: its threads' CPU time and the engine's steps
        assert 0 < float(row["server_cpu_share"]) and "_run_generation_loop=" in row["busiest_threads"], row
        assert int(row["engine_steps"]) > 0 and float(row["host_prepare_ms"]) > 0, row
        # the clients' side: the rate the schedule asked for and how late the (two) client processes sent
        assert float(row["offered_per_s"]) > 0 and float(row["late_p99_s"]) >= 0 and row["client_processes"] == "2"
    # both modes were sent the same schedule
    assert rows["base_patched"]["offered_per_s"] == rows["fastlora"]["offered_per_s"]
    # the load generator alone, against an endpoint with no model
    _run([os.path.join(BENCH, "bench_serving.py"), "--smoke", "--modes", "stub", "--out", str(tmp_path)])
    stub = _csv(tmp_path / "serving_stub_cpu.csv")[0]
    assert stub["failed"] == "0" and int(stub["requests"]) > 0 and stub["offered_per_s"] == rows["fastlora"]["offered_per_s"]
    # the soak through the engine's cache read in place
    _run([os.path.join(BENCH, "bench_serving.py"), "--smoke", "--modes", "fastlora", "--soak", "2", "--drain", "30",
          "--engine-attention", "paged", "--out", str(tmp_path)])
    samples = _csv(tmp_path / "serving_tiny_soak_paged_cpu_memory.csv")
    assert samples and {"finished", "failed"} <= set(samples[0])  # a soak cut from outside still leaves counts
    soak = _csv(tmp_path / "serving_tiny_soak_paged_cpu.csv")[0]
    assert soak["failed"] == "0" and soak["cut_by_drain"] == "0" and int(soak["requests"]) > 0
    assert soak["engine_attention"] == "paged"


def test_bench_moe_smoke(tmp_path):
    """The MoE benchmark's methods on a tiny Qwen3-MoE, through the CSV it writes."""
    out = _run([os.path.join(BENCH, "bench_moe.py"), "--smoke", "--out", str(tmp_path)])
    for method in ("base_patched", "base_patched_hf", "fastlora_base_rows", "fastlora_mixed", "peft_loop"):
        assert f"method={method} |" in out, out[-3000:]
    rows = {r["method"]: r for r in _csv(tmp_path / "moe_tiny-moe_cpu.csv")}
    assert rows["fastlora_mixed"]["speedup_vs_peft"] and rows["fastlora_mixed"]["ratio_to_base_patched"]
    assert rows["fastlora_mixed"]["eager_steps"] == "0" and int(rows["fastlora_mixed"]["replays"]) > 0


def test_bench_generate_refuses_no_kind_rounds(capsys):
    sys.path.insert(0, BENCH)
    import bench_generate

    with pytest.raises(SystemExit):
        bench_generate.parse_args(["--kinds", "dora", "--kind-rounds", "0"])
    assert "--kind-rounds must be at least 1, got 0" in capsys.readouterr().err


def test_bench_generate_kinds_smoke(tmp_path):
    """--kinds: each kind beside as many plain adapters again (the like-for-like reference), in
    rounds (the adapters of a kind added and deleted again each round)."""
    out = _run([os.path.join(BENCH, "bench_generate.py"), "--smoke", "--models", "tiny", "--batches", "2",
                "--graphs-only", "--new-tokens", "3", "--reps", "1", "--kinds", "lora_bias", "--kind-rounds", "2",
                "--name", "kinds", "--out", str(tmp_path)], env_extra={"TRITON_INTERPRET": "1"})
    rows = {r["method"]: r for r in _csv(tmp_path / "kinds_tiny_cpu.csv")}
    assert {"fastlora_graphs", "fastlora_graphs_plain", "fastlora_graphs_lora_bias"} <= set(rows), out[-2000:]
    assert rows["fastlora_graphs_lora_bias"]["ratio_to_plain_twin"] and not rows["fastlora_graphs"]["ratio_to_plain_twin"]
