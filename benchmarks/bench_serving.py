"""The OpenAI-compatible endpoint under load, measured as users measure a server.

    python benchmarks/bench_serving.py --model 8b --adapters 32 --rates 2 4 8 16 --duration 60
    python benchmarks/bench_serving.py --model 8b --adapters 32 --soak 300 --rates 8    # memory watched
    python benchmarks/bench_serving.py --smoke      # CPU: checks the script, measures nothing

The model (random weights, ``harness.build_base``) is served by ``peft_fastlora.server.create_app``
under uvicorn on the loopback interface; clients are ``openai.AsyncOpenAI`` streaming completions.
Requests arrive as a Poisson process at each ``--rates`` value for ``--duration`` seconds (one
seeded schedule, the same for every mode); their prompt and output lengths are
``bench_continuous``'s log-normal workload and their adapters are drawn from a Zipf law over
``--adapters``. Random weights never emit EOS, so each request produces exactly its output length.
The clients run in processes of their own (``--clients``, each sending every n-th arrival), as
clients on other machines would: in the server's process their Python would slow the server. Each
request is sent at its scheduled time, not a gap after the one before, and how late the clients
sent it is measured (``late_p99_s``): a rate at which they fell behind was not offered, and does
not count as met.

Modes (``--modes``), each through the same endpoint, engine and workload:

- ``fastlora``: the PeftModel with the adapters, patched, one adapter per request;
- ``base_patched``: the base model patched by fastlora with no adapters (every request ``"base"``):
  the like-for-like reference;
- ``stub``: no model, an endpoint that streams each completion's tokens at a fixed pace
  (``--stub-itl-ms``): the load generator checked alone (its inter-token latency beyond that pace
  and its late sends are the clients' own).

Per mode and rate, one CSV row: requests sent and failed, the rate offered (``offered_per_s``: the
schedule's requests over the window) and how late they were sent, output tokens/s, time to first
token and inter-token latency p50 / p99 (from the chunks' arrival times), and the server process's CPU time
over the window (``server_cpu_share``, its three busiest threads: the engine's loop, the HTTP
server's) with the engine's steps and its thread's milliseconds a step by phase. ``--soak S``: one
rate held for S seconds, the GPU memory allocated and the process's resident memory sampled every
``--sample-every`` seconds into a second CSV (flat when nothing leaks); any failed request is
reported (a well-formed request should never fail).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import threading
import time
from typing import Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness as hx  # noqa: E402
from bench_continuous import engine_counts, window_counts, workload  # noqa: E402


def id_tokenizer(vocab: int):
    """A tokenizer over token ids ``t0 .. t{vocab-1}`` (requests send ids; answers decode to text)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={f"t{i} ": i for i in range(vocab)}, unk_token="t3 "))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t3 ", pad_token="t0 ")


def fastlora_app(model, tokenizer, args):
    """fastlora's endpoint over ``model`` with the benchmark's engine settings."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    from peft_fastlora.server import ServerConfig, create_app

    choice = {"auto": None, "on": True, "off": False}
    cb = ContinuousBatchingConfig(max_batch_tokens=args.max_batch_tokens, use_cuda_graph=choice[args.engine_graphs],
                                  use_async_batching=choice[args.async_batching],
                                  **({"num_blocks": max(1, args.cache_tokens // 256)} if args.cache_tokens else {}))
    gen = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0)
    return create_app(model, tokenizer, ServerConfig(max_pending=args.max_pending, max_tokens_default=16),
                      generation_config=gen, continuous_batching_config=cb)


def stub_app(itl_s: float):
    """An endpoint with no model (mode ``stub``): each streamed completion sends its ``max_tokens``
    chunks one every ``itl_s`` seconds, on a fixed schedule from its start. What the clients
    measure against it beyond that pace is their own doing: the load generator checked alone."""
    from starlette.applications import Starlette
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    async def completions(request):
        body = await request.json()
        n, began = int(body.get("max_tokens") or 16), time.perf_counter()

        async def events():
            for i in range(n):
                chunk = dict(id="stub", object="text_completion", created=0, model=body.get("model", ""),
                             choices=[dict(index=0, text="t ", logprobs=None, finish_reason=None)])
                yield f"data: {json.dumps(chunk)}\n\n"
                await asyncio.sleep(max(0.0, began + (i + 1) * itl_s - time.perf_counter()))
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])


def serve(app, args):
    """(uvicorn server, its thread, base URL) with ``app`` started."""
    import uvicorn

    stack = dict(loop="asyncio", http="h11") if args.http == "pure-python" else dict(loop="auto", http="auto")
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", **stack))
    thread = threading.Thread(target=server.run, daemon=True, name="http")
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the server did not start")
        time.sleep(0.05)
    return server, thread, f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}/v1"


async def one_request(client, model_name, prompt, max_tokens, temperature, record, scheduled):
    began = time.perf_counter()
    arrivals = []
    try:
        stream = await client.completions.create(model=model_name, prompt=prompt, max_tokens=max_tokens,
                                                 temperature=temperature, stream=True)
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                arrivals.append(time.perf_counter())
        record.append(dict(ok=True, began=began, late=began - scheduled, arrivals=arrivals, tokens=max_tokens))
    except Exception as e:  # noqa: BLE001  (counted: a failed request is a result)
        record.append(dict(ok=False, began=began, late=began - scheduled, arrivals=arrivals, tokens=0,
                           error=repr(e)[:200]))


def schedule(reqs, rate: float, duration: float, seed: int) -> list:
    """The arrivals of a Poisson process of ``rate`` a second over ``duration`` seconds, from time
    0: (seconds from the start, index into ``reqs``), the workload's requests taken in turn. Every
    mode (and every split among client processes) sends the same requests at the same times."""
    rng, t, out = random.Random(seed), 0.0, []
    while t < duration:
        out.append((t, len(out) % len(reqs)))
        t += rng.expovariate(rate)
    return out


async def drive(url, reqs, arrivals, with_adapters: bool, temperature: float, start_at: Optional[float] = None,
                record=None, drain=None):
    """Send ``reqs[i]`` at ``start_at`` (``time.time()``; None: once the client is made) + t for
    each (t, i) in ``arrivals``: each at its own time, not a gap after the one before, so a client
    loop busy reading the streams in flight sends late (counted: ``late``) but not fewer. Finished
    requests are appended to ``record``; once every request is sent, at most ``drain`` seconds
    (None: no limit) for those in flight, the rest cancelled and counted. Returns (record, seconds from the start, requests
    cut by the drain limit)."""
    import openai

    client = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
    tasks, record = [], [] if record is None else record
    start = time.perf_counter() + (0.0 if start_at is None else start_at - time.time())
    for t, i in arrivals:
        wait = start + t - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        prompt, adapter, out = reqs[i]
        name = adapter if with_adapters else "base"
        tasks.append(asyncio.create_task(one_request(client, name, prompt, out, temperature, record, start + t)))
    _, pending = await asyncio.wait(tasks, timeout=drain) if tasks else (set(), set())
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    await client.close()
    return record, time.perf_counter() - start, len(pending)  # (a cancelled request records nothing)


SLO_TTFT_S, SLO_ITL_MS = 2.0, 50.0  # the service levels a rate is held to
MAX_LATE_S = 0.1  # the clients kept to the schedule: their 99th percentile request sent at most this late


def meets_slo(row: dict) -> bool:
    return (not row["failed"] and row["ttft_p99_s"] < SLO_TTFT_S and row["itl_p99_ms"] < SLO_ITL_MS
            and not row.get("cut_by_drain") and row["late_p99_s"] <= MAX_LATE_S)


def _drive_sync(*args):
    *args, drain = args
    return asyncio.run(drive(*args, drain=drain))


class ClientProcesses:
    """``drive`` split over processes of their own, each sending every n-th arrival of the same
    schedule. Clients on other machines take no time from the server; in the server's process the
    load generator's Python (the openai client parses every chunk) would share the interpreter
    with the endpoint's event loop and the engine's thread and slow both. One client process
    reading every stream becomes the limit itself at high rates: it then sends late, and its
    measured latencies include its own queueing."""

    def __init__(self, n: int, url, reqs, with_adapters: bool):
        import multiprocessing

        self.n = n
        self._pool = multiprocessing.get_context("spawn").Pool(n)
        # a request from each process first: the openai client's first call builds its types and
        # would send the requests scheduled meanwhile late
        self._pool.starmap(_drive_sync, [(url, reqs, [(0.0, k % len(reqs))], with_adapters, 0.0, None, None, None)
                                         for k in range(n)])

    def drive(self, url, reqs, arrivals, with_adapters, temperature, drain=None):
        start_at = time.time() + 0.5  # (a shared start: every process has its task by then)
        parts = self._pool.starmap(_drive_sync, [(url, reqs, arrivals[k::self.n], with_adapters, temperature,
                                                  start_at, None, drain) for k in range(self.n)])
        record = [r for part in parts for r in part[0]]
        return record, max(part[1] for part in parts), sum(part[2] for part in parts)

    def close(self):
        self._pool.close()
        self._pool.join()


def pct(values, q):
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def summarize(record, elapsed: float, scheduled: int, duration: float) -> dict:
    """One window's numbers: ``scheduled`` requests over ``duration`` seconds were asked for (the
    offered rate: ``offered_per_s``), ``late_p99_s`` says how late the clients sent them."""
    ok = [r for r in record if r["ok"]]
    ttft = [r["arrivals"][0] - r["began"] for r in ok if r["arrivals"]]
    itl = [b - a for r in ok for a, b in zip(r["arrivals"], r["arrivals"][1:])]
    late = [r["late"] for r in record]
    return dict(requests=len(record), failed=len(record) - len(ok), elapsed_s=round(elapsed, 2),
                offered_per_s=round(scheduled / duration, 2), late_p50_s=round(pct(late, 0.5), 4),
                late_p99_s=round(pct(late, 0.99), 4),
                output_tokens_per_s=round(sum(r["tokens"] for r in ok) / elapsed, 1),
                ttft_p50_s=round(pct(ttft, 0.5), 4), ttft_p99_s=round(pct(ttft, 0.99), 4),
                itl_p50_ms=round(1000 * pct(itl, 0.5), 3), itl_p99_ms=round(1000 * pct(itl, 0.99), 3),
                first_error=next((r["error"] for r in record if not r["ok"]), ""))


def thread_cpu_seconds() -> dict:
    """CPU seconds (user + system) each live thread of this process has used, by thread name
    (the engine's loop, the HTTP server's, the workers of ``asyncio.to_thread`` together)."""
    ticks = os.sysconf("SC_CLK_TCK")
    names = {t.native_id: t.name for t in threading.enumerate()}
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        name = names.get(int(tid), "native")
        name = "to_thread" if name.startswith("asyncio_") else name.split("(")[-1].rstrip(")")
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / ticks
    return out


def cpu_shares(before: dict, after: dict, elapsed: float) -> dict:
    """The process's CPU time over ``elapsed`` seconds, in all and for its three busiest threads:
    near 1.0 in one Python thread, or in all of them together, the interpreter is the limit."""
    used = {k: v - before.get(k, 0.0) for k, v in after.items()}
    busiest = sorted(used.items(), key=lambda kv: -kv[1])[:3]
    return dict(server_cpu_share=round(sum(used.values()) / elapsed, 3),
                busiest_threads=" ".join(f"{k}={v / elapsed:.2f}" for k, v in busiest))


def resident_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def build(mode: str, args):
    import peft_fastlora as fastlora

    began = time.perf_counter()
    base = hx.build_base(args.model, args.layers)
    model = hx.add_adapters(base, args.adapters, args.rank) if mode == "fastlora" else base
    fastlora.patch(model, engine_attention=args.engine_attention, **({"cuda_graphs": "emulate"} if args.smoke else {}))
    print(f"{mode}: model built and patched in {time.perf_counter() - began:.0f} s", flush=True)
    return model


def run_mode(mode, args, reqs, versions):
    if mode == "stub":
        server, thread, url = serve(stub_app(args.stub_itl_ms / 1e3), args)
        engine = lambda: {}  # noqa: E731  (no engine: no engine columns)
    else:
        app = fastlora_app(build(mode, args), id_tokenizer(hx.SHAPES[args.model]["vocab_size"]), args)
        server, thread, url = serve(app, args)
        engine = lambda: engine_counts(app.state.fastlora.supervisor.manager)  # noqa: E731
    rows, samples = [], []
    try:
        began = time.perf_counter()
        warm = [(0.5 * k, k) for k in range(min(4, len(reqs)))]
        asyncio.run(drive(url, reqs, warm, mode == "fastlora", 0.0))
        print(f"{mode}: served, warm-up requests done in {time.perf_counter() - began:.0f} s", flush=True)
        if args.soak:  # in this process: the sampler reads the requests finished so far
            rows.append(soak(url, reqs, mode, args, samples, versions))
        else:
            clients = ClientProcesses(args.clients, url, reqs, mode == "fastlora") if args.clients else None
            try:
                for rate in args.rates:
                    arrivals = schedule(reqs, rate, args.duration, args.seed)
                    cpu_before, engine_before = thread_cpu_seconds(), engine()
                    drive_args = (url, reqs, arrivals, mode == "fastlora", args.temperature)
                    record, elapsed, cut = (clients.drive(*drive_args, drain=args.drain) if clients is not None else
                                            asyncio.run(drive(*drive_args, drain=args.drain)))
                    row = dict(mode=mode, rate=rate, **summarize(record, elapsed, len(arrivals), args.duration),
                               cut_by_drain=cut, client_processes=args.clients, http=args.http,
                               **cpu_shares(cpu_before, thread_cpu_seconds(), elapsed),
                               **window_counts(engine_before, engine(), elapsed), **versions)
                    print(" | ".join(f"{k}={v}" for k, v in row.items() if k not in versions), flush=True)
                    if row["late_p99_s"] > MAX_LATE_S:
                        print(f"{mode}: at {rate} a second the clients sent their requests up to "
                              f"{row['late_p99_s']:.2f} s late (p99): this rate was not offered as scheduled; "
                              "more --clients", flush=True)
                    rows.append(row)
            finally:
                if clients is not None:
                    clients.close()
    finally:
        server.should_exit = True
        thread.join(timeout=120)
    return rows, samples


def soak(url, reqs, mode, args, samples, versions):
    """One rate for ``--soak`` seconds, memory and the requests finished so far sampled while it runs
    (each sample printed: a soak stopped from outside still leaves its curve and counts)."""
    done = threading.Event()
    began = time.perf_counter()
    record = []

    def sample():
        while not done.is_set():
            gpu = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
            finished = list(record)
            samples.append(dict(mode=mode, t_s=round(time.perf_counter() - began, 1), gpu_allocated_bytes=gpu,
                                resident_bytes=resident_bytes(), finished=len(finished),
                                failed=sum(not r["ok"] for r in finished)))
            print("soak sample " + " ".join(f"{k}={v}" for k, v in samples[-1].items()), flush=True)
            done.wait(args.sample_every)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        arrivals = schedule(reqs, args.rates[0], args.soak, args.seed)
        record, elapsed, cut = asyncio.run(drive(url, reqs, arrivals, mode == "fastlora", args.temperature,
                                                 record=record, drain=args.drain))
    finally:
        done.set()
        sampler.join()
    row = dict(mode=mode, rate=args.rates[0], soak_s=args.soak,
               **summarize(record, elapsed, len(arrivals), args.soak), cut_by_drain=cut)
    half = samples[len(samples) // 2:] or samples
    row["gpu_allocated_growth_bytes"] = half[-1]["gpu_allocated_bytes"] - half[0]["gpu_allocated_bytes"] if half else 0
    row["resident_growth_bytes"] = half[-1]["resident_bytes"] - half[0]["resident_bytes"] if half else 0
    row.update(versions)
    print(" | ".join(f"{k}={v}" for k, v in row.items() if k not in versions), flush=True)
    return row


def fit_context(reqs, context: int):
    """The workload's requests cut to fit the model's context (prompt and output together), as a
    client that knows the model would send them: the endpoint refuses the others with a 400."""
    fitted = []
    for prompt, name, new in reqs:
        prompt = prompt[:context - 1]
        fitted.append((prompt, name, max(1, min(new, context - len(prompt)))))
    return fitted


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    hx.add_model_args(p, adapters=32)
    hx.add_run_args(p)
    p.add_argument("--layers", type=int, default=None, help="fewer layers than the shape has")
    p.add_argument("--modes", nargs="+", default=["base_patched", "fastlora"],
                   choices=["base_patched", "fastlora", "stub"])
    p.add_argument("--stub-itl-ms", type=float, default=10.0, help="mode stub: milliseconds between its tokens")
    p.add_argument("--rates", nargs="+", type=float, default=[2, 4, 8, 16], help="requests a second")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per rate")
    p.add_argument("--soak", type=float, default=0.0, help="seconds of one rate (the first) with memory sampled")
    p.add_argument("--sample-every", type=float, default=5.0)
    p.add_argument("--drain", type=float, default=None,
                   help="seconds to wait for the requests in flight once arrivals stop (the rest cancelled, counted)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max-pending", type=int, default=4096)
    p.add_argument("--max-batch-tokens", type=int, default=2048)
    p.add_argument("--cache-tokens", type=int, default=None, help="default: the engine sizes its cache")
    p.add_argument("--engine-graphs", choices=["auto", "on", "off"], default="auto",
                   help="the engine's CUDA graphs (auto: the engine's choice, as a server started plainly gets)")
    p.add_argument("--async-batching", choices=["auto", "on", "off"], default="auto",
                   help="the engine's async batching (auto: the engine's choice)")
    p.add_argument("--engine-attention", default="auto", choices=["auto", "varlen", "paged", "engine"],
                   help="fastlora.patch's engine_attention for both modes")
    p.add_argument("--requests", type=int, default=2000, help="distinct requests in the workload pool")
    p.add_argument("--prompt-mean", type=int, default=289)
    p.add_argument("--prompt-cap", type=int, default=2048)
    p.add_argument("--output-mean", type=int, default=201)
    p.add_argument("--output-cap", type=int, default=1024)
    p.add_argument("--zipf", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--isolate", choices=["auto", "on", "off"], default="auto",
                   help="each mode in its own process (auto: on CUDA with several modes), so that each "
                        "engine sizes its cache from the same free memory")
    p.add_argument("--clients", type=int, default=min(8, max(4, (os.cpu_count() or 4) // 2)),
                   help="client processes sharing each rate's arrivals (default: half the cores, 4 to 8; 0: the "
                        "clients in the server's process, where their Python slows the server); one process "
                        "reading every stream falls behind the schedule at high rates, and the clients' own share "
                        "of the inter-token latency grows with the rate (the stub mode measures it)")
    p.add_argument("--http", choices=["auto", "pure-python"], default="auto",
                   help="uvicorn's event loop and HTTP parser: auto (uvloop and httptools, which the serve extra "
                        "installs) or pure-python (asyncio's loop and h11: what uvicorn falls back to without them)")
    p.add_argument("--child-result", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    stub_only = args.modes == ["stub"] and not args.smoke  # the load generator checked alone: any machine
    if not stub_only and not hx.start(args, "bench_serving"):
        return 0
    if args.smoke:
        args.model, args.adapters, args.requests, args.rates = "tiny", 3, 12, [4.0]
        args.duration, args.prompt_mean, args.prompt_cap, args.output_mean, args.output_cap = 1.5, 8, 20, 4, 6
        args.max_batch_tokens, args.cache_tokens = 64, 4096
        args.soak = min(args.soak, 2.0)
        args.clients = min(args.clients, 2)
        args.sample_every = min(args.sample_every, 0.5)
    reqs = fit_context(workload(args), hx.context_length(args.model))
    versions = hx.versions()
    if stub_only and versions["gpu"].startswith("cpu"):
        versions["gpu"] = "cpu (stub endpoint, no model)"
    if args.child_result:  # one mode for a parent process (--isolate)
        r, s = run_mode(args.modes[0], args, reqs, versions)
        with open(args.child_result, "w") as f:
            json.dump(dict(rows=r, samples=s), f)
        return 0
    isolate = args.isolate == "on" or (args.isolate == "auto" and hx.DEVICE == "cuda" and len(args.modes) > 1)
    rows, samples = [], []
    for mode in args.modes:
        if isolate:
            child = hx.run_in_child(__file__, argv, ["--modes", mode, "--isolate", "off", "--out", ""])
            r, s = child["rows"], child["samples"]
        else:
            r, s = run_mode(mode, args, reqs, versions)
        rows += r
        samples += s
    for r in rows:
        r.update(engine_attention=args.engine_attention, engine_graphs=args.engine_graphs,
                 async_batching=args.async_batching)
    for mode in args.modes:
        measured = [r["rate"] for r in rows if r["mode"] == mode]
        met = [r["rate"] for r in rows if r["mode"] == mode and meets_slo(r)]
        best = "none of those measured" if not met else (
            f"{max(met)} (the highest measured: the limit is above it)" if max(met) == max(measured) else max(met))
        print(f"{mode}: highest rate with TTFT p99 < {SLO_TTFT_S} s and ITL p99 < {SLO_ITL_MS} ms: {best}", flush=True)
    stem = (f"serving_{'stub' if args.modes == ['stub'] else args.model}" + ("_soak" if args.soak else "")
            + ("" if args.engine_attention == "auto" else f"_{args.engine_attention}"))
    path = hx.out_path(args.out, stem, versions["gpu"])
    if path:
        hx.write_csv(rows, path)
        if samples:
            hx.write_csv(samples, path.replace(".csv", "_memory.csv"))
    failed = sum(r["failed"] for r in rows)
    if failed:
        print(f"{failed} well-formed requests failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
