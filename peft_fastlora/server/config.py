"""The settings of the HTTP endpoint: one frozen dataclass, validated when it is built."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class ServerConfig:
    """How ``create_app`` serves.

    Args:
        base_name: the ``"model"`` that means no adapter.
        max_tokens_default: ``max_tokens`` of a request that sets none (OpenAI's default is 16),
            lowered to what the context leaves.
        max_model_len: the most tokens (prompt and completion) of one request; None: the model's
            position limit or the engine's cache, whichever is smaller. Larger values are lowered
            to those.
        max_body_bytes: requests with a larger body are refused (413).
        max_pending: the most completions accepted and not finished (one request with ``n=4``
            counts 4); more are refused with 429 and ``Retry-After``.
        max_choices: the most completions one request may ask for (``n`` times its prompts).
        max_stop: the most stop strings and stop token ids of one request.
        api_key: when set, ``/v1`` routes need ``Authorization: Bearer <api_key>`` (401 without),
            and FastAPI's ``/docs``, ``/redoc`` and ``/openapi.json`` are not served.
        adapter_root: the folder that ``POST /v1/load_lora_adapter`` may load adapters from (and
            under it only); None: loading and unloading through the API are off.
        restart_attempts: how often the engine is restarted after it dies, in a row, before the
            server reports itself down (a restart counts as a success once it served a request).
        restart_wait_s: how long a request waits for a restarting engine before a 503.
        shutdown_grace_s: at shutdown, how long requests in flight may finish before they are
            cancelled.
        warmup: capture the engine's CUDA graphs for every step size before each manager serves
            (``fastlora.warmup_engine``), so that no request waits for a capture.
    """

    base_name: str = "base"
    max_tokens_default: int = 16
    max_model_len: Optional[int] = None
    max_body_bytes: int = 2 * 2**20
    max_pending: int = 512
    max_choices: int = 16
    max_stop: int = 16
    api_key: Optional[str] = None
    adapter_root: Optional[str] = None
    restart_attempts: int = 3
    restart_wait_s: float = 30.0
    shutdown_grace_s: float = 30.0
    warmup: bool = True

    def __post_init__(self):
        if not isinstance(self.base_name, str) or not self.base_name:
            raise ValueError(f"base_name must be a non-empty string, got {self.base_name!r}")
        for name in ("max_tokens_default", "max_body_bytes", "max_pending", "max_choices", "max_stop"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_model_len is not None and (isinstance(self.max_model_len, bool)
                                               or not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ValueError(f"max_model_len must be an integer of at least 2 or None, got {self.max_model_len!r}")
        if isinstance(self.restart_attempts, bool) or not isinstance(self.restart_attempts, int) \
                or self.restart_attempts < 0:
            raise ValueError(f"restart_attempts must be a non-negative integer, got {self.restart_attempts!r}")
        for name in ("restart_wait_s", "shutdown_grace_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{name} must be a non-negative number of seconds, got {value!r}")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise ValueError("api_key must be a non-empty string or None")
        if not isinstance(self.warmup, bool):
            raise ValueError(f"warmup must be True or False, got {self.warmup!r}")
        if self.adapter_root is not None and not isinstance(self.adapter_root, str):
            raise ValueError(f"adapter_root must be a folder path or None, got {self.adapter_root!r}")

    def replace(self, **changes) -> "ServerConfig":
        return dataclasses.replace(self, **changes)
