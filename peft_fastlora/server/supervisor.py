"""The continuous-batching manager behind the endpoint: started with the app, watched, restarted
when its thread dies, stopped with the app.

transformers' engine runs in one background thread; an error it does not confine ends that thread,
fails every request it held and leaves the manager refusing new ones. The supervisor notices
within a tenth of a second, reports ``degraded``, makes a new manager from the same model and
configs and serves again; requests that arrive meanwhile wait for it (``restart_wait_s``). After
``restart_attempts`` deaths in a row with no request served in between it reports ``down``.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import Callable, Optional

from ..compat.engine import cb_cache_tokens, cb_fatal_error
from ..patch import warmup_engine
from .config import ServerConfig
from .errors import APIError
from .metrics import Metrics

logger = logging.getLogger("peft_fastlora")
_WATCH_INTERVAL_S = 0.1
_START_TIMEOUT_S = 300.0


class EngineSupervisor:
    """Args:
        model: the patched model (its ``init_continuous_batching`` makes the managers).
        generation_config / continuous_batching_config: what every manager is made with.
        config: the server's settings.
        metrics: where restarts are counted, and the engine's loop shown.
    """

    def __init__(self, model, generation_config, continuous_batching_config, config: ServerConfig,
                 metrics: Metrics):
        self.model, self.generation_config, self.cb_config = model, generation_config, continuous_batching_config
        self.config, self.metrics = config, metrics
        self.manager = None
        self.status = "starting"  # ok, degraded (restarting), down, stopping
        self.restarts = 0
        self.last_error: Optional[str] = None
        self.cache_tokens: Optional[int] = None  # the most tokens one request can hold
        self._deaths_in_a_row = 0
        self._ready: Optional[asyncio.Event] = None
        self._watcher: Optional[asyncio.Task] = None
        self._retired = collections.Counter()  # the loop clocks of the managers stopped or replaced
        metrics.watch_engine(self.engine_clock)

    def engine_clock(self) -> collections.Counter:
        """The engine's steps and its thread's seconds by phase, over every manager so far."""
        total = collections.Counter(self._retired)
        clock = getattr(self.manager, "fastlora_step_seconds", None)
        if clock is not None:
            total.update(dict(clock))
        return total

    def _retire(self, manager) -> None:
        """``manager`` stops being the current one: its clock joins the totals (one step of the
        event loop, so a scrape counts it once)."""
        if self.manager is manager:
            self.manager = None
        clock = getattr(manager, "fastlora_step_seconds", None)
        if clock is not None:
            self._retired.update(dict(clock))

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        self._ready = asyncio.Event()
        self.manager = await asyncio.to_thread(self._new_manager)
        self.status = "ok"
        self._ready.set()
        self._watcher = asyncio.create_task(self._watch())

    async def stop(self, in_flight: Callable[[], int]) -> None:
        """Refuse new requests, let those in flight (``in_flight()`` completions) finish for
        ``shutdown_grace_s``, then cancel the rest and stop the engine."""
        self.status = "stopping"
        if self._watcher is not None:
            self._watcher.cancel()
        deadline = time.monotonic() + self.config.shutdown_grace_s
        while in_flight() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        manager = self.manager
        if manager is not None:
            self._retire(manager)
            await asyncio.to_thread(manager.stop, block=True, timeout=30, hard_stop=bool(in_flight()))

    def _new_manager(self):
        manager = self.model.init_continuous_batching(generation_config=self.generation_config,
                                                      continuous_batching_config=self.cb_config)
        if self.config.warmup:
            warm = warmup_engine(manager)
            if warm.captures:
                logger.info("fastlora: the engine captured %d graphs in %.1f s before serving",
                            warm.captures, warm.seconds)
        manager.start()
        deadline = time.monotonic() + _START_TIMEOUT_S
        while manager.batch_processor is None:  # the engine's thread makes it, and its cache
            if not manager.is_running():
                raise RuntimeError(f"the engine stopped while starting: {cb_fatal_error(manager)}")
            if time.monotonic() > deadline:
                manager.stop(block=False)
                raise RuntimeError("the engine did not start in time")
            time.sleep(0.01)
        self.cache_tokens = cb_cache_tokens(manager.batch_processor)
        return manager

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(_WATCH_INTERVAL_S)
            manager = self.manager
            if manager is not None and not manager.is_running() and self.status == "ok":
                try:
                    await self._restart(manager)
                except Exception as e:  # noqa: BLE001  (the watcher must outlive any one restart)
                    self.status, self.last_error = "down", str(e)
                    self._ready.set()
                    logger.exception("fastlora server: the engine could not be restarted")

    async def _restart(self, dead) -> None:
        self.status = "degraded"
        self._ready.clear()
        self.last_error = str(cb_fatal_error(dead))
        logger.error("fastlora server: the engine stopped (%s); restarting it", self.last_error)
        self._retire(dead)
        try:
            await asyncio.to_thread(dead.stop, block=True, timeout=10)
        except Exception as e:  # noqa: BLE001  (a dead manager's clean-up must not stop the restart)
            logger.warning("fastlora server: stopping the dead engine raised %r", e)
        while self.status == "degraded":
            if self._deaths_in_a_row >= self.config.restart_attempts:
                self.status = "down"
                logger.error("fastlora server: the engine died %d times in a row; the server is down",
                             self._deaths_in_a_row)
                self._ready.set()  # waiting requests get their 503 now
                return
            self._deaths_in_a_row += 1
            self.restarts += 1
            self.metrics.restarts.inc()
            try:
                self.manager = await asyncio.to_thread(self._new_manager)
            except Exception as e:  # noqa: BLE001  (counted as one more death)
                self.last_error = str(e)
                logger.error("fastlora server: restarting the engine failed: %s", e)
                continue
            self.status = "ok"
            self._ready.set()

    # -- requests -------------------------------------------------------------------------------
    def served_one(self) -> None:
        """A request finished well: the engine works again."""
        self._deaths_in_a_row = 0

    async def manager_for_request(self):
        """The running manager; waits for a restart in progress; 503 when none can be had."""
        if self.status == "degraded":
            try:
                await asyncio.wait_for(self._ready.wait(), timeout=self.config.restart_wait_s)
            except asyncio.TimeoutError:
                raise APIError("the engine is restarting; try again shortly", 503,
                               headers={"Retry-After": "5"}) from None
        if self.status == "stopping":
            raise APIError("the server is shutting down", 503)
        if self.status != "ok" or self.manager is None:
            raise APIError(f"the engine is down: {self.last_error or 'it could not be started'}", 503)
        return self.manager

    def health(self) -> dict:
        out = {"status": self.status, "engine_restarts": self.restarts}
        if self.status != "ok" and self.last_error:
            out["last_error"] = self.last_error
        return out
