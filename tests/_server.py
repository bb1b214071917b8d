"""A live OpenAI-compatible server for tests: ``examples/serve_openai.py --tiny`` (random tiny Llama,
character tokenizer, three saved adapters) run by uvicorn in a thread on a free loopback port, with
plain HTTP helpers (``http.client``: raw bodies, any header) and PEFT's own ``generate`` on an
unpatched copy loaded from the same files (the oracle)."""

from __future__ import annotations

import http.client
import json
import os
import sys
import threading
import time
from typing import List, Optional

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import serve_many_adapters as files  # noqa: E402
import serve_openai  # noqa: E402

import _options  # noqa: E402

ADAPTERS = ["reverse", "sum", "upper"]


class AppServer:
    """``app`` run by uvicorn in a thread on a free loopback port, with plain HTTP helpers.

    Args:
        headers: sent with every request (an API key, say).
    """

    def __init__(self, app, headers=None):
        import uvicorn

        self.app, self.headers = app, dict(headers or {})
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=0, log_level="warning",
                                                    lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.05)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}/v1"

    def stop(self, timeout: float = 60) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=timeout)

    # -- plain HTTP -------------------------------------------------------------------------------
    def request(self, method: str, path: str, body=None, raw: Optional[bytes] = None, headers=None,
                timeout: float = 30):
        """(status, headers, decoded JSON or text) of one request; ``body`` is sent as JSON."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        payload = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        hdrs = {"Content-Type": "application/json", **self.headers}
        hdrs.update(headers or {})
        try:
            conn.request(method, path, body=payload, headers=hdrs)
            resp = conn.getresponse()
            text = resp.read().decode("utf-8", "replace")
            try:
                content = json.loads(text)
            except ValueError:
                content = text
            return resp.status, dict(resp.getheaders()), content
        finally:
            conn.close()

    def post(self, path: str, body=None, **kwargs):
        return self.request("POST", path, body, **kwargs)

    def events(self, path: str, body, headers=None, timeout: float = 60) -> list:
        """The decoded events of a streamed answer (``[DONE]`` as the string)."""
        status, _, text = self.request("POST", path, body, headers=headers, timeout=timeout)
        assert status == 200, (status, text)
        out = []
        for line in str(text).splitlines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                out.append(data if data == "[DONE]" else json.loads(data))
        return out

    def open_stream(self, path: str, body, timeout: float = 60) -> "OpenStream":
        """A streamed answer read event by event (``close`` hangs up mid-answer)."""
        return OpenStream(self, path, body, timeout)

    def health(self):
        return self.request("GET", "/health")


class LiveServer(AppServer):
    """``examples/serve_openai.py --tiny`` served, with PEFT's unpatched model as the oracle.

    Args:
        folder: where the tiny adapters are written.
        argv: ``serve_openai.py`` arguments besides ``--tiny --device`` (``--server-device``, cpu by default).
        reference: also load PEFT's unpatched model from the same files.
        headers: sent with every request (an API key, say).
    """

    def __init__(self, folder: str, argv: List[str] = (), reference: bool = True, headers=None):
        args = serve_openai.parse_args(["--tiny", "--device", _options.SERVER_DEVICE] + list(argv))
        files.make_tiny_files(args, folder)
        self.args = args
        app, self.names = serve_openai.build_app(args)
        self.service = app.state.fastlora
        self.ref, self.tokenizer = None, self.service.tokenizer  # the served one (with its chat template)
        if reference:  # before the server starts: the random weights come from the seeded global RNG
            register, args.register = args.register, False
            self.ref, _, _ = files.load_model(args)
            args.register = register
        super().__init__(app, headers)

    @property
    def supervisor(self):
        return self.service.supervisor

    # -- the oracle -------------------------------------------------------------------------------
    def prompt_ids(self, prompt: str) -> List[int]:
        return list(self.tokenizer(prompt)["input_ids"])

    def peft(self, ids: List[int], adapter: str, max_tokens: int) -> List[int]:
        """PEFT's greedy tokens for ``ids`` alone with ``adapter`` (``"base"``: none)."""
        adapter = "__base__" if adapter in ("base", "__base__") else adapter
        x = torch.tensor([ids], device=self.ref.device)
        tok = self.tokenizer
        with torch.no_grad():
            out = self.ref.generate(input_ids=x, attention_mask=torch.ones_like(x), adapter_names=[adapter],
                                    max_new_tokens=max_tokens, do_sample=False, eos_token_id=tok.eos_token_id,
                                    pad_token_id=tok.pad_token_id)
        return out[0, len(ids):].tolist()

    def last_logits(self, ids: List[int], adapter: str) -> torch.Tensor:
        """PEFT's float logits of the position after ``ids`` with ``adapter``, (1, vocab) on the
        model's device (where the server samples)."""
        with torch.no_grad():
            out = self.ref(input_ids=torch.tensor([ids], device=self.ref.device), adapter_names=[adapter])
        return out.logits[0, -1:].float()

    def peft_text(self, prompt: str, adapter: str, max_tokens: int) -> str:
        return self.tokenizer.decode(self.peft(self.prompt_ids(prompt), adapter, max_tokens),
                                     skip_special_tokens=True)


class OpenStream:
    """One streamed request kept open: its events read one at a time."""

    def __init__(self, live: AppServer, path: str, body, timeout: float):
        self.conn = http.client.HTTPConnection("127.0.0.1", live.port, timeout=timeout)
        self.conn.request("POST", path, body=json.dumps(body).encode(),
                          headers={"Content-Type": "application/json", **live.headers})
        self.response = self.conn.getresponse()
        self.status = self.response.status

    def next_event(self):
        """The next event's data (decoded JSON, or ``"[DONE]"``); None at the end of the stream."""
        while True:
            line = self.response.readline()
            if not line:
                return None
            line = line.decode().strip()
            if line.startswith("data: "):
                data = line[len("data: "):]
                return data if data == "[DONE]" else json.loads(data)

    def rest(self) -> list:
        out = []
        while True:
            item = self.next_event()
            if item is None:
                return out
            out.append(item)

    def close(self) -> None:
        self.conn.close()
