"""``Daemon`` owns the lifecycle: startup, main loop, bounded graceful shutdown.

Start and stop are idempotent. Shutdown first stops accepting workers, then waits up
to ``drain_timeout_s`` for WRITEs in flight to settle (a WRITE may still be reading
our memory), then closes the side channel, cancels what is left and releases NIXL
and shared memory.
Signal handlers only set flags: SIGTERM/SIGINT ask for a drain, a second SIGINT forces
the exit without draining.
"""

from __future__ import annotations

import asyncio
import os
import resource
import signal
import time
import uuid
from typing import Any

import structlog

from pushsvc import __version__
from pushsvc.config import Config, read_secret_file
from pushsvc.devmem.base import DeviceMemory
from pushsvc.devmem.load import load_device_memory
from pushsvc.engine.base import Engine
from pushsvc.metrics import Metrics
from pushsvc.peer_hosts import is_loopback_host
from pushsvc.sdnotify import Notifier
from pushsvc.server.health import HealthServer
from pushsvc.server.progress import Pace, ProgressLoop, keep_cpu
from pushsvc.server.rundir import prepare_runtime_dir, prepare_socket_dir
from pushsvc.server.service import PushService
from pushsvc.server.workers import WorkerServer

log = structlog.get_logger("pushsvc.daemon")


def slow_call_reporter(metrics: Metrics):
    """What the engine calls when a NIXL call held the event loop (``SLOW_CALL_S``): an
    ``engine_call_slow`` event naming the call and the agent, and a count per call."""
    def report(agent: str, call: str, seconds: float) -> None:
        metrics.engine_slow_calls.labels(call).inc()
        log.warning("engine_call_slow", agent=agent, call=call, seconds=round(seconds, 3))
    return report


def _pass_timer(metrics: Metrics):
    """What the progress loop calls after each pass: its seconds, by the pace it chose
    (each pace's histogram child found once, not per pass)."""
    children = {pace: metrics.progress_pass_seconds.labels(pace.name.lower()).observe for pace in Pace}

    def observe(pace: Pace, seconds: float) -> None:
        children[pace](seconds)
    return observe


_FD_LIMIT_CAP = 1 << 20


class Daemon:
    def __init__(self, config: Config, engine: Engine | None = None, devmem: DeviceMemory | None = None,
                 notifier: Notifier | None = None) -> None:
        self.config = config
        # systemd's notify socket (pushsvc/sdnotify.py); inert unless the command line found one.
        self.notifier = notifier if notifier is not None else Notifier()
        self.metrics = Metrics()
        if engine is None:
            from pushsvc.engine.nixl import NixlEngine

            engine = NixlEngine(config.nixl_backends, config.nixl_progress_thread, config.ucx_error_handling_mode,
                                on_slow=slow_call_reporter(self.metrics), sgl=config.ucx_sgl == "on")
            # The real engine comes with the real device memory; tests pass their fakes.
            devmem = load_device_memory(config.gpu)
        self.engine = engine
        self.devmem = devmem
        self.daemon_id = uuid.uuid4().hex
        self.service = PushService(config, engine, self.metrics, self.daemon_id, devmem=devmem)
        self.progress = ProgressLoop(self.service.progress, config.poll_busy_interval_s, config.poll_idle_interval_s,
                                     os.sched_yield if config.poll_hot_yield else keep_cpu, _pass_timer(self.metrics),
                                     spin_s=config.poll_spin_s, tracking=self.service.tracking,
                                     spun=self.metrics.progress_spin_seconds.inc)
        self.service.wake = self.progress.wake
        self.workers = WorkerServer(
            path=config.socket_path,
            service=self.service,
            metrics=self.metrics,
            max_frame=config.max_worker_frame,
            allowed_uids=config.allowed_uids,
            allowed_gids=config.allowed_gids,
            group=config.socket_group,
            max_connections=config.max_worker_connections,
            hello_timeout_s=config.worker_hello_timeout_s,
            max_pending=config.max_pending_workers,
        )
        token = read_secret_file(config.health_token_file, "health_token_file") if config.health_token_file else None
        self.health = HealthServer(self, config.health_host, config.health_port, self.metrics, token=token)
        self.should_exit = False
        self.force_exit = False
        self.started = False
        self.stopped = False
        self._started_at = time.time()
        self._progress_task: asyncio.Task | None = None
        self._notify_task: asyncio.Task | None = None
        self._exit = asyncio.Event()

    # ------------------------------------------------------------------ lifecycle

    async def startup(self) -> None:
        if self.started:
            return
        self.started = True
        _raise_fd_limit()
        prepare_runtime_dir(self.config.runtime_dir, self.workers.gid)
        prepare_socket_dir(self.config.socket_path, self.config.runtime_dir, self.workers.gid)
        self.workers.start()
        await self.service.peers.start(self.config.side_channel_host, self.config.side_channel_port)
        if self.config.insecure_side_channel and not self.config.side_channel_secret_file:
            log.warning("side_channel_unauthenticated", host=self.config.side_channel_host, port=self.service.peers.port)
        await self.health.start()
        if not self.config.health_token_file and not is_loopback_host(self.config.health_host):
            log.warning("health_unauthenticated", host=self.config.health_host, port=self.health.port)
        self._progress_task = asyncio.get_running_loop().create_task(self.progress.run(), name="pushsvc-progress")
        log.info("daemon_started", engine_id=self.config.engine_id, daemon_id=self.daemon_id[:8],
                 socket=self.config.socket_path, side_channel=f"{self.config.advertised_host}:{self.service.peers.port}",
                 health=f"{self.config.health_host}:{self.health.port}", version=__version__,
                 ucx_sgl=getattr(self.engine, "sgl", False))
        # READY=1 now if /readyz answers 200 now; else the notifier's next update sends it.
        self.notifier.update(*self.service_status())
        self._notify_task = asyncio.get_running_loop().create_task(
            self.notifier.run(self.service_status), name="pushsvc-sdnotify")

    async def main_loop(self) -> None:
        await self._exit.wait()

    def request_exit(self, force: bool = False) -> None:
        if force:
            self.force_exit = True
        self.should_exit = True
        self._exit.set()

    async def shutdown(self) -> None:
        if self.stopped or not self.started:
            return
        self.stopped = True
        log.info("daemon_stopping", force=self.force_exit)
        self.notifier.stopping(self.service_status()[1])
        self.workers.stop_listening()
        self.service.draining = True  # new registrations and sends are refused from here
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.drain_timeout_s
        while not self.force_exit and loop.time() < deadline and not self.service.drained():
            await asyncio.sleep(0.01)
        if not self.service.drained():
            log.warning("drain_incomplete", tables=self.service.table_sizes())
        if self._progress_task is not None:
            self._progress_task.cancel()
            await asyncio.gather(self._progress_task, return_exceptions=True)
        # Agents first, workers last: once the agents are closed nothing can land in the
        # workers' memory, and only then do the workers hear how their requests ended.
        await self.service.close()
        if self.devmem is not None:
            self.devmem.close()
        self.workers.close()
        await self.health.close()
        # Watchdog pings last until here: a drain that hangs the loop is a hang too.
        if self._notify_task is not None:
            self._notify_task.cancel()
            await asyncio.gather(self._notify_task, return_exceptions=True)
        self.notifier.close()
        log.info("daemon_stopped")

    async def serve(self, install_signals: bool = True) -> None:
        if install_signals:
            self._install_signal_handlers()
        try:
            await self.startup()
            await self.main_loop()
        finally:
            await self.shutdown()

    async def __aenter__(self) -> Daemon:
        await self.startup()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.shutdown()

    def _install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self._on_signal, signal.SIGTERM)
        loop.add_signal_handler(signal.SIGINT, self._on_signal, signal.SIGINT)

    def _on_signal(self, sig: int) -> None:
        # A second SIGINT while draining skips the rest of the drain.
        self.request_exit(force=self.should_exit and sig == signal.SIGINT)

    # ------------------------------------------------------------------ health source

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        ranks = self.service.ranks.current.values()
        checks = {
            "socket_listening": self.workers.listening,
            "side_channel": self.service.peers.port > 0,
            "agents": len(self.service.ranks.current),
            "agents_registered": sum(1 for r in ranks if r.ready),
        }
        ready = (self.started and not self.should_exit and checks["socket_listening"] and checks["side_channel"]
                 and checks["agents_registered"] == checks["agents"])
        return ready, checks

    def service_status(self) -> tuple[bool, str]:
        """Readiness and the one line ``systemctl status`` shows for it."""
        ready, checks = self.readiness()
        state = "draining" if self.should_exit or self.stopped else "ready" if ready else "not ready"
        workers = sum(1 for r in self.service.ranks.current.values() if r.conn is not None)
        return ready, (f"{state}: {checks['agents_registered']}/{checks['agents']} ranks registered, "
                       f"{workers} workers connected, {len(self.service.peers.peers)} peers, "
                       f"{self.service.writes_in_flight()} WRITEs in flight")

    def info(self) -> dict[str, Any]:
        tp_size = next((r.tp_size for r in self.service.ranks.current.values()), None)
        return {
            "version": __version__,
            # The engine's TP size once a worker said hello (a proxy passes it to D as
            # ``remote_tp_size``); absent before.
            **({"tp_size": tp_size} if tp_size is not None else {}),
            "engine_id": self.config.engine_id,
            "daemon_id": self.daemon_id,
            "side_channel_host": self.config.advertised_host,
            "side_channel_port": self.service.peers.port,
            "socket_path": self.config.socket_path,
            "health_port": self.health.port,
            "uptime_s": round(time.time() - self._started_at, 3),
            "agents": [
                {"rank": r.number, "tp_size": r.tp_size, "stage": r.stage, "stages": r.stages, "role": r.role,
                 "agent": r.agent.name,
                 "registered": r.ready, "worker_connected": r.conn is not None,
                 "mem_type": r.memory.mem_type if r.memory else None,
                 "regions": len(r.memory.layout.regions) if r.memory else 0,
                 "kv_groups": r.memory.layout.groups if r.memory else 0,
                 "landing_slots": r.memory.landing.geometry.slots if r.memory and r.memory.landing else 0,
                 "landing_bytes": r.memory.landing.buffer.size + r.memory.landing.copier.nbytes
                 if r.memory and r.memory.landing else 0,
                 "staging_bytes": r.memory.staging.buffer.size + r.memory.staging.copier.nbytes
                 if r.memory and r.memory.staging else 0}
                for r in self.service.ranks.current.values()
            ],
            # D TP above P's: one joint agent per P rank of each lower P TP (server/joints.py).
            "joints": [
                {"rank": j.number, "tp_size": j.tp_size, "agent": j.agent.name,
                 "members": [m.number for m in j.members], "gathering": len(j.gathering)}
                for j in self.service.joints.current.values()
            ],
            "retiring_agents": [r.agent.name for r in [*self.service.ranks.retiring, *self.service.joints.retiring]],
            "peers": [
                {"engine_id": p.engine_id, "daemon_id": p.daemon_id, "host": p.host, "port": p.port,
                 "minor": p.minor, "authenticated": p.authenticated, "agents": sorted(p.agents),
                 "ipc_ready": sorted(p.ipc_ready)}
                for p in self.service.peers.peers.values()
            ],
            "tables": self.service.table_sizes(),
            "open_timelines": self.service.timelines.open_count,
            "nixl_handles": self.service.nixl_handles(),
            "gpu": None if self.devmem is None else {
                "memory": self.devmem.name, **self.devmem.usage(),
                "landing_slots": self.service.receiver.landing.slot_counts(),
                "staging_slots": self.service.sender.staging.slot_counts()},
            "open_fds": _open_fds(),
        }

    def metrics_text(self) -> bytes:
        return self.metrics.render()

    def requests(self, limit: int, request_id: str) -> list[dict[str, Any]]:
        return self.service.timelines.recent(limit, request_id)

    def __repr__(self) -> str:
        return f"<Daemon {self.config.engine_id} started={self.started} exit={self.should_exit}>"


def _open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # less the one listdir holds
    except OSError:
        return -1


def _raise_fd_limit() -> None:
    """Lift the soft RLIMIT_NOFILE to the hard one: systemd and most shells start services
    with a soft limit of 1024, which a few hundred idle or hostile connections on the health
    port and the worker socket would exhaust, starving everything that needs an fd."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # An unlimited hard limit still stops at fs.nr_open; 2^20 is its usual value.
    target = _FD_LIMIT_CAP if hard == resource.RLIM_INFINITY else min(hard, _FD_LIMIT_CAP)
    if soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            log.warning("fd_limit_not_raised", soft=soft, hard=hard, error=str(exc))
            return
        log.info("fd_limit_raised", soft=soft, now=target, hard=hard)
