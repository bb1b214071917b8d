"""An OpenAI-compatible HTTP server for a folder of LoRA adapters: ``"model"`` picks the adapter.

    python examples/serve_openai.py --base BASE_DIR --adapters ADAPTERS_DIR [--port 8000]
    python examples/serve_openai.py --tiny          # a random tiny Llama and three random adapters

Then, with the ``openai`` client (or curl):

    client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
    client.completions.create(model="upper", prompt="abc=", max_tokens=8)              # greedy
    client.completions.create(model="sum", prompt="12+7=", max_tokens=8, temperature=0.8, top_p=0.9, seed=1)
    client.chat.completions.create(model="base", messages=[{"role": "user", "content": "hi"}], stream=True)

Every request goes through transformers' continuous batching with its own adapter and its own
sampling (``peft_fastlora.server.create_app``); ``GET /v1/models`` lists the adapters and the base
model, ``GET /health`` the engine's state, ``GET /metrics`` Prometheus' counters. With
``--adapter-root DIR``, adapters saved under DIR are loaded and unloaded while serving:

    curl -X POST localhost:8000/v1/load_lora_adapter -H 'Content-Type: application/json' \
         -d '{"lora_name": "mine", "lora_path": "mine"}'          # DIR/mine, saved by PEFT
    curl -X POST localhost:8000/v1/unload_lora_adapter -H 'Content-Type: application/json' \
         -d '{"lora_name": "mine"}'

``--api-key`` (or the ``FASTLORA_API_KEY`` environment variable) makes ``/v1`` ask for
``Authorization: Bearer <key>``. ``--demo`` runs the server on a free port, sends a greedy, a
sampled, a streamed request and a load / unload through the ``openai`` client, prints the answers
and stops.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_many_adapters as files  # noqa: E402  (the same model loading, patching and --tiny files)


# the character tokenizer of --tiny has no chat template: "role: content " per message, then the
# assistant's turn
TINY_CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}assistant: "


def build_app(args):
    """The patched model and its app (no server started)."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    from peft_fastlora.server import ServerConfig, create_app

    if args.tiny and args.adapters is None:
        files.make_tiny_files(args, tempfile.mkdtemp(prefix="fastlora_serve_"))
    if args.adapters is None:
        raise SystemExit("--adapters (a folder of saved adapters) or --tiny is required")
    model, tokenizer, names = files.load_model(args)
    if args.tiny and tokenizer.chat_template is None:
        tokenizer.chat_template = TINY_CHAT_TEMPLATE
    print(files.patch_and_register(model, args, names), file=sys.stderr)
    gen = GenerationConfig(do_sample=False, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    cb = ContinuousBatchingConfig(num_blocks=max(1, args.cache_tokens // 256), max_batch_tokens=args.max_batch_tokens,
                                  use_async_batching=args.async_batching or None)
    config = ServerConfig(base_name=args.base_name, api_key=args.api_key or os.environ.get("FASTLORA_API_KEY"),
                          adapter_root=args.adapter_root, max_model_len=args.max_model_len,
                          max_pending=args.max_pending)
    app = create_app(model, tokenizer, config, generation_config=gen, continuous_batching_config=cb,
                     adapters=names)  # the folders (not --register's scaffold)
    return app, names


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=files._Help)
    p.add_argument("--base", help="base model folder (save_pretrained)")
    p.add_argument("--tokenizer", help="tokenizer folder (default: --base)")
    p.add_argument("--adapters", help="folder with one PEFT adapter per sub-folder")
    p.add_argument("--tiny", action="store_true", help="a random tiny Llama with a character tokenizer")
    p.add_argument("--register", action="store_true",
                   help="register the adapters by name (CPU memory, slots filled on demand) instead of loading them into PEFT")
    p.add_argument("--slots", type=int, default=None, help="--register: GPU slots (default: one per adapter)")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--base-name", default="base", help="the 'model' that means no adapter")
    p.add_argument("--max-batch-tokens", type=int, default=256, help="tokens per forward")
    p.add_argument("--cache-tokens", type=int, default=16384, help="KV-cache size in tokens")
    p.add_argument("--async-batching", action="store_true",
                   help="force the engine's async batching on (it prepares each step while the GPU runs the "
                        "one before; CUDA); default: the engine's choice")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="most tokens of one request, prompt and completion (default: the model's and the cache's limit)")
    p.add_argument("--max-pending", type=int, default=512, help="completions in flight before 429")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (or set FASTLORA_API_KEY)")
    p.add_argument("--adapter-root", default=None,
                   help="folder that /v1/load_lora_adapter may load adapters from (default: loading off)")
    p.add_argument("--demo", action="store_true",
                   help="serve on a free port, send a few requests with the openai client, print the answers, stop")
    args = p.parse_args(argv)
    args.requests = args.out = "-"  # --tiny makes adapters only (the loading helpers are shared)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.demo and args.tiny and args.adapter_root is None:
        args.adapter_root = tempfile.mkdtemp(prefix="fastlora_adapter_root_")
    app, names = build_app(args)
    import uvicorn

    if args.demo:
        return demo(app, args)
    print(f"serving {args.base_name!r} and adapters {', '.join(names)} on http://{args.host}:{args.port}/v1",
          file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0


def demo(app, args) -> int:
    """Serve in a thread on a free port; a few requests through the openai client; stop."""
    import shutil
    import threading
    import time

    import openai
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise SystemExit("the server did not start")
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=args.api_key or "unused", max_retries=0)
    try:
        greedy = client.completions.create(model="upper", prompt="abc=", max_tokens=8)
        print("greedy  upper:", repr(greedy.choices[0].text))
        sampled = client.completions.create(model="sum", prompt="12+7=", max_tokens=8, temperature=0.8,
                                            top_p=0.9, seed=1, n=2)
        print("sampled sum (n=2, seed=1):", [c.text for c in sampled.choices])
        stream = client.chat.completions.create(model=args.base_name, messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=8, stream=True)
        print("streamed base:", repr("".join(c.choices[0].delta.content or "" for c in stream if c.choices)))
        if args.adapter_root is not None:
            shutil.copytree(os.path.join(args.adapters, "upper"), os.path.join(args.adapter_root, "upper-copy"))
            client.post("/load_lora_adapter", cast_to=object, body={"lora_name": "upper2", "lora_path": "upper-copy"})
            again = client.completions.create(model="upper2", prompt="abc=", max_tokens=8)
            print("loaded  upper2 (a copy of upper):", repr(again.choices[0].text))
            client.post("/unload_lora_adapter", cast_to=object, body={"lora_name": "upper2"})
            print("after unloading, models:", sorted(m.id for m in client.models.list().data))
    finally:
        server.should_exit = True
        thread.join(timeout=60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
