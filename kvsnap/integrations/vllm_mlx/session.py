"""One ``kvsnap vllm-mlx serve --kv-snapshots`` run inside vllm-mlx: warm start, re-warm, routes.

``Session.load`` replaces vllm-mlx's ``_load_prefix_cache_from_disk`` (called after the
engine starts, before the port opens, and after each model reload). With
``--warm-prompts`` it runs a ``VllmMlxWarmPlan`` (snapshots from the store, the rest prefilled and
written back); without, it inserts every snapshot of the model. Either way the entries
are pinned in vllm-mlx's prefix cache (``vllm_mlx.pin``).

``DELETE /v1/cache/prefix`` keeps vllm-mlx's own clearing and answers
``{"status": "cleared", "rewarm_scheduled": true}``; the same warm pass then runs in the
background on the model's thread. At most one re-warm runs at a time: a DELETE that
arrives while one runs is coalesced into a single further pass (the clear it made may have
removed entries the running pass had already put back).

``GET /v1/kvsnap/status`` returns the last warm-up's report and the re-warm count as JSON,
and with ``--persist-requests`` a ``persist`` object (``vllm_mlx.persist``): the entries
vllm-mlx keeps are written behind into the store, read back on a hit after a restart, and
removed by ``DELETE /v1/cache/prefix`` (its answer's ``persisted_removed``).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from kvsnap.errors import KvsnapError
from kvsnap.integrations.common.warm_plan import WarmReport, upstream_model
from kvsnap.integrations.vllm_mlx.warm_plan import VllmMlxWarmPlan
from kvsnap.profiles import VLLM_MLX, EngineTokenization, vllm_mlx_enable_thinking
from kvsnap.prompts import WarmPromptSet

if TYPE_CHECKING:
    from kvsnap.integrations.vllm_mlx.insert import InsertReport
    from kvsnap.integrations.vllm_mlx.persist import PersistHooks
    from kvsnap.integrations.vllm_mlx.pin import Pins
    from kvsnap.key import DigestCache
    from kvsnap.runtime.persist.options import PersistOptions
    from kvsnap.store.local import Store

# A warm pass (model thread): a WarmPlan's report, or insert_snapshots'.
WarmPass = Callable[[], "WarmReport | InsertReport"]

log = logging.getLogger("kvsnap.vllm_mlx")

CLEAR_PATH = "/v1/cache/prefix"
STATUS_PATH = "/v1/kvsnap/status"


def scheduler_of(engine: Any) -> Any:
    """BatchedEngine -> AsyncEngineCore -> EngineCore -> Scheduler, or None."""
    core = getattr(getattr(engine, "_engine", None), "engine", None)
    return getattr(core, "scheduler", None)


def engine_tokenization(server: Any, engine: Any, scheduler: Any) -> EngineTokenization:
    """vllm-mlx's request path up to the token ids, through its own functions."""
    from vllm_mlx.api.tool_calling import convert_tools_for_template

    defaults = {
        "enable_thinking": vllm_mlx_enable_thinking(getattr(engine, "_model_name", "") or ""),
        **(getattr(server, "_default_chat_template_kwargs", None) or {}),
    }

    def render_chat(messages: list, tools: list | None, kwargs: dict) -> str:
        prepared = server._prepare_chat_messages(engine, messages)[0]
        ctk = server._resolve_chat_template_kwargs(kwargs or None)
        # The server converts request tools once, engine.stream_chat once more.
        template_tools = (
            convert_tools_for_template(convert_tools_for_template(tools)) if tools else None
        )
        return engine._apply_chat_template(prepared, template_tools, chat_template_kwargs=ctk)

    return EngineTokenization(
        server=VLLM_MLX,
        add_special_tokens=True,
        template_defaults=tuple(sorted(defaults.items())),
        render_chat=render_chat,
        encode_text=scheduler.tokenizer.encode,
    )


@dataclass
class Session:
    # The vllm_mlx.server module.
    server: Any
    store: Store
    writable: bool
    prompts: WarmPromptSet | None = None
    agents_file: str = ""
    digests: DigestCache | None = None
    last_report: WarmReport | InsertReport | None = None
    warmups: int = 0
    rewarms: int = 0
    # The warm pass of the current engine, run on its model thread.
    _work: WarmPass | None = None
    # The engine's "run on the model thread".
    _run: Callable[[Callable[[], Any]], Awaitable[Any]] | None = None
    _task: asyncio.Task[None] | None = None
    _again: bool = False
    pins: Pins | None = field(default=None, repr=False)
    # With --persist-requests, else None.
    persist: PersistOptions | None = None
    persist_hooks: PersistHooks | None = field(default=None, repr=False)
    # Why nothing is persisted although it was asked for.
    persist_note: str = ""

    # --- start-up --------------------------------------------------------------------

    async def load(self, engine: Any = None) -> None:
        """vllm-mlx's ``_load_prefix_cache_from_disk``, replaced: warm the prefix cache from the
        store."""
        target = engine or self.server._engine
        if target is None:
            return
        scheduler = scheduler_of(target)
        prefix_cache = getattr(scheduler, "memory_aware_cache", None)
        if prefix_cache is None:
            log.warning(
                "[kvsnap] no snapshots loaded: this vllm-mlx engine (%s) has no memory-aware "
                "prefix cache; it starts cold",
                type(target).__name__,
            )
            return
        try:
            self._work = self._make_work(target, scheduler, prefix_cache)
            self._run = getattr(target, "_run_on_generation_worker", None)
            await self._warm("start")
        except KvsnapError as exc:
            log.warning("[kvsnap] no snapshots loaded (%s); vllm-mlx starts cold", exc)
        except Exception as exc:  # a broken store must not stop vllm-mlx from serving
            log.error(
                "[kvsnap] no snapshots loaded (%s: %s); vllm-mlx starts cold",
                type(exc).__name__,
                exc,
                exc_info=True,
            )

    def _make_work(self, engine: Any, scheduler: Any, prefix_cache: Any) -> WarmPass:
        from kvsnap.integrations.vllm_mlx.agents import place_system_messages
        from kvsnap.integrations.vllm_mlx.exact import reuse_exact_hits
        from kvsnap.integrations.vllm_mlx.insert import insert_snapshots
        from kvsnap.integrations.vllm_mlx.pin import pin

        try:
            self.pins = pin(prefix_cache)
        except AttributeError as exc:
            self.pins = None
            log.warning("[kvsnap] %s; snapshots are ordinary LRU entries in this run", exc)
        reuse_exact_hits(prefix_cache)  # a hit covering the whole prompt: all but its last token
        place_system_messages(engine)  # agents' later system messages stay after the warm prefix
        model_path = getattr(engine, "_model_path", None) or getattr(
            self.server, "_model_path", None
        )
        if not model_path:
            raise KvsnapError(
                f"this vllm-mlx engine ({type(engine).__name__}) names no model path, so its "
                f"snapshots cannot be matched"
            )
        prompts = self.prompts
        if prompts is None:
            thinking = vllm_mlx_enable_thinking(getattr(engine, "_model_name", "") or "")
            return self._persisting(
                prefix_cache,
                scheduler,
                model_path,
                lambda: insert_snapshots(
                    prefix_cache,
                    scheduler.model,
                    scheduler.tokenizer,
                    model_path,
                    self.store,
                    self.digests,
                    pins=self.pins,
                    enable_thinking=thinking,
                ),
            )
        tokenization = engine_tokenization(self.server, engine, scheduler)
        plan_box: dict[str, VllmMlxWarmPlan] = {}

        def work() -> WarmReport:
            # Identity hashing runs on the model thread, once per engine.
            if "plan" not in plan_box:
                plan_box["plan"] = self._make_plan(
                    prefix_cache, scheduler, model_path, tokenization, prompts, engine
                )
            return plan_box["plan"].run()

        return self._persisting(prefix_cache, scheduler, model_path, work)

    def _persisting(
        self, prefix_cache: Any, scheduler: Any, model_path: str, warm: WarmPass
    ) -> WarmPass:
        """``warm`` (a warm pass, model thread), after the persist hooks are installed (first
        pass of an engine); what it inserts is the store's own, never persisted again."""

        def work() -> WarmReport | InsertReport:
            if self.persist is not None and self.persist_hooks is None and not self.persist_note:
                self._start_persisting(prefix_cache, scheduler, model_path, self.persist)
            hooks = self.persist_hooks
            if hooks is not None:
                hooks.paused += 1
            try:
                return warm()
            finally:
                if hooks is not None:
                    hooks.paused -= 1

        return work

    def _start_persisting(
        self, prefix_cache: Any, scheduler: Any, model_path: str, options: PersistOptions
    ) -> None:
        from kvsnap.integrations.vllm_mlx.persist import start_hooks

        try:
            lm = upstream_model(model_path, scheduler.model, scheduler.tokenizer)
            identity = lm.identity(self.digests)
        except KvsnapError as exc:
            self.persist_note = f"request prefixes are not persisted: {exc}"
            log.warning("[kvsnap] %s", self.persist_note)
            return
        self.persist_hooks, self.persist_note = start_hooks(
            prefix_cache, lm, identity, self.store, options
        )

    def _make_plan(
        self,
        prefix_cache: Any,
        scheduler: Any,
        model_path: str,
        tokenization: EngineTokenization,
        prompts: WarmPromptSet,
        engine: Any = None,
    ) -> VllmMlxWarmPlan:
        from kvsnap.integrations.vllm_mlx.agents import agent_tokenization

        lm = upstream_model(model_path, scheduler.model, scheduler.tokenizer)
        server = self.server
        return VllmMlxWarmPlan(
            prefix_cache=prefix_cache,
            pins=self.pins,
            lm=lm,
            identity=lm.identity(self.digests),
            store=self.store,
            writable=self.writable,
            prompts=prompts,
            agents_file=self.agents_file,
            tokenization=tokenization,
            agent_tokenization=lambda prompt: agent_tokenization(
                tokenization, server, engine, prompt
            ),
        )

    async def _warm(self, why: str) -> WarmReport | InsertReport:
        work = self._work
        if work is None:
            raise KvsnapError("no vllm-mlx engine to warm (it was stopped or unloaded)")
        report = await self._run(work) if self._run is not None else work()
        self.last_report = report
        if why == "start":
            self.warmups += 1
        else:
            self.rewarms += 1
        line = report.summary()
        log.info(
            "%s",
            line
            if why == "start"
            else line.replace("[lifespan] Warm-up done", "[clear_prefix_cache] re-warm done", 1),
        )
        return report

    async def flush_persisted(self) -> None:
        """Shutdown or unload: write what is queued within ``--persist-flush-timeout`` (the
        writer's log line says what was left); nothing is captured after."""
        hooks, self.persist_hooks = self.persist_hooks, None
        self.persist_note = ""  # a reloaded engine persists again
        if hooks is None:
            return
        hooks.paused += 1
        persister = hooks.persister  # its writer only: no mlx off the model's thread
        left = await asyncio.to_thread(persister.writer.close, persister.options.flush_timeout_s)
        log.info(
            "[kvsnap] persisted conversations: %d written this run, %d restored, %d left unwritten",
            persister.writer.as_dict()["written"],
            hooks.restored,
            left,
        )

    async def purge_persisted(self) -> int | None:
        """Remove every persisted conversation, on the model's thread; None when off (or the
        writer did not finish in time)."""
        hooks = self.persist_hooks
        if hooks is None:
            return None
        return await self._run(hooks.purge) if self._run is not None else hooks.purge()

    def release(self) -> None:
        """Drop every reference to the engine's model and cache (vllm-mlx is about to stop or
        unload it).

        Holding them past the engine's stop keeps mlx arrays alive until interpreter
        teardown, where freeing them can abort the process. A later ``load`` (a model
        reload) builds everything again.
        """
        if self._task is not None and not self._task.done():
            self._task.cancel()
        self._work = self._run = self._task = self.pins = None
        self._again = False

    # --- re-warm ---------------------------------------------------------------------

    def schedule_rewarm(self) -> bool:
        """Start a background re-warm, or coalesce into the one running. True when one will run."""
        if self._work is None:
            return False
        if self._task is not None and not self._task.done():
            self._again = True
            return True
        self._again = False
        self._task = asyncio.get_running_loop().create_task(self._rewarm_loop())
        return True

    async def _rewarm_loop(self) -> None:
        while True:
            self._again = False
            try:
                await self._warm("rewarm")
            except Exception as exc:  # the server keeps serving, cold, and says why
                log.error(
                    "[kvsnap] re-warm failed (%s: %s); the prefix cache stays cold until the next "
                    "DELETE or start",
                    type(exc).__name__,
                    exc,
                    exc_info=True,
                )
            if not self._again:
                return

    def status(self) -> dict:
        report, pins = self.last_report, self.pins
        return {
            "store": str(self.store.root),
            "write_back": self.writable,
            "warm_prompts": self.agents_file or None,
            "warmups": self.warmups,
            "rewarms": self.rewarms,
            "rewarm_running": bool(self._task is not None and not self._task.done()),
            "pinned": pins.present() if pins is not None else 0,
            "pinned_mib": round(pins.nbytes() / 2**20, 3) if pins is not None else 0.0,
            "last": report.as_dict() if report is not None else None,
            "persist": self.persist_status(),
        }

    def persist_status(self) -> dict:
        hooks = self.persist_hooks
        if hooks is not None:
            return hooks.as_dict()
        note = self.persist_note if self.persist is not None else ""
        return {"enabled": False, "note": note or ("" if self.persist is None else "starting")}


def install_routes(server: Any, session: Session) -> None:
    """Replace vllm-mlx's ``DELETE /v1/cache/prefix`` (keeping its clearing) and add ``GET
    /v1/kvsnap/status``."""
    from fastapi import Depends
    from fastapi.routing import APIRoute

    app = server.app
    routes = app.router.routes
    index = next(
        (
            i
            for i, r in enumerate(routes)
            if getattr(r, "path", None) == CLEAR_PATH
            and "DELETE" in (getattr(r, "methods", None) or ())
        ),
        None,
    )
    if index is None:
        raise KvsnapError(
            f"vllm-mlx has no DELETE {CLEAR_PATH} route to extend; kvsnap's integration is tested "
            f"with vllm-mlx 0.6.0"
        )
    original = routes[index]
    clear = original.endpoint

    async def clear_prefix_cache_and_rewarm() -> Any:
        """vllm-mlx's clear, then a re-warm from the kvsnap store in the background."""
        result = await clear()
        if isinstance(result, dict) and result.get("status") == "cleared":
            answer: dict = {"status": "cleared"}
            if session.persist is not None:  # memory first, then the store (kvsnap serve's order)
                answer["persisted_removed"] = await session.purge_persisted()
            answer["rewarm_scheduled"] = session.schedule_rewarm()
            return answer
        return result

    async def kvsnap_status() -> dict:
        return session.status()

    routes[index] = APIRoute(
        CLEAR_PATH,
        clear_prefix_cache_and_rewarm,
        methods=["DELETE"],
        dependencies=list(original.dependencies),
    )
    auth = [Depends(server.verify_api_key)] if hasattr(server, "verify_api_key") else []
    routes.insert(index, APIRoute(STATUS_PATH, kvsnap_status, methods=["GET"], dependencies=auth))
