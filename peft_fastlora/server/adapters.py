"""The adapters an endpoint serves, by the ``"model"`` names requests use; loading and unloading
them while serving (``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter``).

Loading registers a saved adapter folder by name (``fastlora.register_adapter``): the folder must
lie under the configured root (links resolved), and the error a client sees names the folder as
the client gave it, never the server's paths. Unloading stops serving it at once; requests still
using it in the engine fail with a 409 naming the adapter.
"""

from __future__ import annotations

import asyncio
import os
import re
from typing import List, Optional, Sequence

from ..patch import get_state
from ..registration import LAYERS_ADAPTER, register_adapter, unregister_adapter
from .errors import APIError

BASE = "__base__"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-]{0,199}$")


class AdapterCatalog:
    """Args:
        model: the patched model.
        served: the adapter names served (None: every adapter of the model, PEFT's and registered).
        base_name: the ``"model"`` that means no adapter.
        root: the folder adapters may be loaded from (None: loading is off).
    """

    def __init__(self, model, served: Optional[Sequence[str]], base_name: str, root: Optional[str]):
        self.model, self.base_name = model, base_name
        self._served = None if served is None else set(served)
        self._root = None if root is None else os.path.realpath(root)
        self._unloaded: set = set()
        self._lock = asyncio.Lock()  # one load or unload at a time

    def names(self) -> List[str]:
        if self._served is not None:
            return sorted(self._served)
        state = get_state(self.model)
        registered = state.stored if state is not None else ()
        return sorted((set(getattr(self.model, "peft_config", None) or ()) | set(registered)) - {LAYERS_ADAPTER})

    def adapter_of(self, name: str) -> str:
        """The adapter a request's ``"model"`` names; 404 for one not served."""
        if name == self.base_name:
            return BASE
        if name not in self.names():
            served = ", ".join(self.names()) or "(none)"
            raise APIError(f"The model {name!r} does not exist: this server has {self.base_name!r} and the "
                           f"adapters {served}", 404, code="model_not_found", param="model")
        return name

    def was_unloaded(self, name: str) -> bool:
        return name in self._unloaded

    async def load(self, name: str, path: str) -> None:
        if self._root is None:
            raise APIError("loading adapters is off: start the server with an adapter root", 403,
                           param="lora_path")
        if not _NAME.match(name) or name in (self.base_name, BASE):
            raise APIError(f"invalid adapter name {name!r}: letters, digits, '.', '_' and '-', not the base "
                           "model's name", param="lora_name")
        if "\x00" in path:  # (the file system's calls raise ValueError for it, not OSError)
            raise APIError("lora_path must not contain a NUL character", param="lora_path")
        folder = os.path.realpath(os.path.join(self._root, path))
        if os.path.commonpath([folder, self._root]) != self._root:
            raise APIError(f"{path!r} is outside the folder adapters may be loaded from", 403, param="lora_path")
        async with self._lock:
            if name in self.names():
                raise APIError(f"an adapter named {name!r} is already served", 400, param="lora_name")
            try:
                await asyncio.to_thread(register_adapter, self.model, name, folder)
            except (ValueError, FileNotFoundError, OSError) as e:
                message = str(e).replace(repr(folder), repr(path)).replace(folder, repr(path))
                message = message.replace(self._root + os.sep, "")
                raise APIError(f"adapter {name!r} could not be loaded: {message}", 400, param="lora_path") from None
            if self._served is not None:
                self._served.add(name)
            self._unloaded.discard(name)

    async def unload(self, name: str) -> None:
        if self._root is None:
            raise APIError("unloading adapters is off: start the server with an adapter root", 403,
                           param="lora_name")
        async with self._lock:
            if name not in self.names():
                raise APIError(f"no adapter named {name!r} is served", 404, code="model_not_found",
                               param="lora_name")
            state = get_state(self.model)
            if state is None or name not in state.stored:
                raise APIError(f"adapter {name!r} was loaded into the model before it was served; only "
                               "adapters loaded by name can be unloaded", 400, param="lora_name")
            # marked first: the removal fails the adapter's requests in the engine's thread, and their
            # handlers may read the reason before this coroutine resumes
            self._unloaded.add(name)
            try:
                await asyncio.to_thread(unregister_adapter, self.model, name)
            except BaseException:
                self._unloaded.discard(name)
                raise
            if self._served is not None:
                self._served.discard(name)

