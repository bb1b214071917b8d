"""An OpenAI-compatible HTTP server for a folder of LoRA adapters: ``"model"`` picks the adapter.

    python examples/serve_openai.py --base BASE_DIR --adapters ADAPTERS_DIR [--port 8000]
    python examples/serve_openai.py --tiny          # a random tiny Llama and three random adapters

Then, with the ``openai`` client (or curl):

    client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
    client.completions.create(model="upper", prompt="abc=", max_tokens=8)
    client.chat.completions.create(model="base", messages=[{"role": "user", "content": "hi"}], stream=True)

Every request goes through transformers' continuous batching with its own adapter
(``peft_fastlora.server.create_app``); ``GET /v1/models`` lists the adapters and the base model.
Decoding is greedy; a request asking for other sampling settings is refused.
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

    from peft_fastlora.server import create_app

    if args.tiny and args.adapters is None:
        files.make_tiny_files(args, tempfile.mkdtemp(prefix="fastlora_serve_"))
    if args.adapters is None:
        raise SystemExit("--adapters (a folder of saved adapters) or --tiny is required")
    model, tokenizer, names = files.load_model(args)
    if args.tiny and tokenizer.chat_template is None:
        tokenizer.chat_template = TINY_CHAT_TEMPLATE
    print(files.patch_and_register(model, args, names), file=sys.stderr)
    gen = GenerationConfig(do_sample=False, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    cb = ContinuousBatchingConfig(num_blocks=max(1, args.cache_tokens // 256), max_batch_tokens=args.max_batch_tokens)
    app = create_app(model, tokenizer, generation_config=gen, continuous_batching_config=cb,
                     base_name=args.base_name, adapters=names)  # the folders (not --register's scaffold)
    return app, names


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=files._Help)
    p.add_argument("--base", help="base model folder (save_pretrained)")
    p.add_argument("--tokenizer", help="tokenizer folder (default: --base)")
    p.add_argument("--adapters", help="folder with one PEFT adapter per sub-folder")
    p.add_argument("--tiny", action="store_true", help="a random tiny Llama with a character tokenizer")
    p.add_argument("--register", action="store_true",
                   help="register the adapters by name (CPU memory, GPU slots on demand) instead of loading them into PEFT")
    p.add_argument("--slots", type=int, default=None, help="--register: GPU slots (default: one per adapter)")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--base-name", default="base", help="the 'model' that means no adapter")
    p.add_argument("--max-batch-tokens", type=int, default=256, help="tokens per forward")
    p.add_argument("--cache-tokens", type=int, default=16384, help="KV-cache size in tokens")
    args = p.parse_args(argv)
    args.requests = args.out = "-"  # --tiny makes adapters only (the loading helpers are shared)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    app, names = build_app(args)
    import uvicorn

    print(f"serving {args.base_name!r} and adapters {', '.join(names)} on http://{args.host}:{args.port}/v1",
          file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0


if __name__ == "__main__":
    sys.exit(main())
