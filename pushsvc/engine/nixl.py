"""The real engine: one ``nixl_agent`` per worker rank, driven from the event loop.

NIXL's progress thread is off by default (``nixl_progress_thread = false``): measured on a
2-core host, an idle agent with the thread on burns a whole core, and with it off the
daemon drives progress itself by calling ``state``/``notifs`` while work is in flight
(see docs/architecture.md, "Progress without threads").
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import re
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from pushsvc.engine.base import XferState
from pushsvc.errors import TransferError

_STATES = {"DONE": XferState.DONE, "PROC": XferState.PROC, "ERR": XferState.ERR}

# Every NIXL call runs on the daemon's event loop: one that takes this long held up every
# worker, peer and timer of the daemon meanwhile, and is reported (``on_slow``).
SLOW_CALL_S = 0.25

# (agent name, call, seconds): told of every NIXL call of at least SLOW_CALL_S.
SlowCall = Callable[[str, str, float], None]


def _timed(call: str):
    """Time the method; tell the agent's ``on_slow`` if it took SLOW_CALL_S or more."""
    def wrap(method):
        @functools.wraps(method)
        def timed(self: "NixlAgent", *args, **kwargs):
            start = time.perf_counter()
            try:
                return method(self, *args, **kwargs)
            finally:
                spent = time.perf_counter() - start
                if spent >= SLOW_CALL_S and self._on_slow is not None:
                    self._on_slow(self.name, call, spent)
        return timed
    return wrap


# The backends the ``nixl`` meta package chooses from, in its order when torch has no CUDA.
_BACKENDS = ("nixl_cu13", "nixl_cu12", "nixl_rocm")


def torch_without_cuda() -> bool:
    """Whether torch is missing or a build without CUDA, read off disk (no torch import)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.origin:
        return True
    try:
        text = (Path(spec.origin).parent / "version.py").read_text()
    except OSError:
        return False  # unknown: let nixl decide
    return says_no_cuda(text)


def says_no_cuda(torch_version_py: str) -> bool:
    """Whether torch's ``version.py`` sets ``cuda`` to None (a build without CUDA)."""
    return re.search(r"^cuda\b[^=]*=\s*None\s*$", torch_version_py, re.MULTILINE) is not None


def _nixl_api_module() -> str:
    # ``import nixl`` picks its backend by torch's CUDA version; with a CPU-only torch it
    # finds none on disk and imports all of torch to ask (2 s of CPU; 15 s on a 2-core host
    # busy with vLLM, all of it before a restarted daemon is ready), then takes the first
    # backend installed. The daemon never uses torch: take that backend directly.
    if torch_without_cuda():
        for name in _BACKENDS:
            if importlib.util.find_spec(name) is not None:
                return f"{name}._api"
    return "nixl._api"


def _import_nixl():
    api = importlib.import_module(_nixl_api_module())
    nixl_agent, nixl_agent_config = api.nixl_agent, api.nixl_agent_config

    # NIXL configures its own logger at import and logs every agent and backend it
    # creates at INFO; our own events already say that.
    logging.getLogger("nixl").setLevel(logging.WARNING)
    return nixl_agent, nixl_agent_config


class NixlAgent:
    """One NIXL agent. Every handle it hands out is tracked until released, so
    ``handles()`` can prove nothing leaks and ``close()`` can release what is left."""

    __slots__ = ("name", "_agent", "_reg", "_dlists", "_xfers", "_remotes", "_on_slow")

    def __init__(self, name: str, backends: list[str], progress_thread: bool,
                 backend_params: dict[str, dict[str, str]] | None = None, on_slow: SlowCall | None = None) -> None:
        nixl_agent, nixl_agent_config = _import_nixl()
        params = backend_params or {}
        # Backends with parameters of ours are created after the agent, with them.
        conf = nixl_agent_config(enable_prog_thread=progress_thread,
                                 backends=[b for b in backends if b not in params])
        try:
            self._agent = nixl_agent(name, conf)
            for backend in backends:
                if backend in params:
                    self._agent.create_backend(backend, dict(params[backend]))
        except Exception as exc:
            raise TransferError(f"cannot create NIXL agent {name}: {exc}") from exc
        if not self._agent.backends:
            raise TransferError(f"NIXL agent {name}: none of the backends {backends} is available")
        self.name = name
        self._on_slow = on_slow
        self._reg: list[Any] = []
        self._dlists: dict[int, Any] = {}  # id(handle) -> handle
        self._xfers: dict[int, Any] = {}
        self._remotes: set[str] = set()

    @_timed("register_memory")
    def register(self, buffers: list[tuple[int, int]], mem_type: str, device: int = 0) -> None:
        descs = [(addr, length, device, "") for addr, length in buffers]
        try:
            self._reg.append(self._agent.register_memory(descs, mem_type))
        except Exception as exc:
            raise TransferError(f"memory registration failed: {exc}") from exc

    @_timed("get_agent_metadata")
    def metadata(self) -> bytes:
        return self._agent.get_agent_metadata()

    @_timed("add_remote_agent")
    def add_remote(self, metadata: bytes) -> str:
        try:
            name = self._agent.add_remote_agent(metadata)
        except Exception as exc:
            raise TransferError(f"cannot load remote agent metadata: {exc}") from exc
        name = name.decode() if isinstance(name, bytes) else name
        self._remotes.add(name)
        return name

    @_timed("remove_remote_agent")
    def remove_remote(self, name: str) -> None:
        try:
            self._agent.remove_remote_agent(name)
        except Exception as exc:
            raise TransferError(f"cannot remove remote agent {name}: {exc}") from exc
        finally:
            self._remotes.discard(name)

    @_timed("prep_xfer_dlist")
    def prep_local(self, descs: np.ndarray, mem_type: str) -> Any:
        try:
            handle = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", descs, mem_type)
        except Exception as exc:
            raise TransferError(f"cannot prepare local descriptors: {exc}") from exc
        self._dlists[id(handle)] = handle
        return handle

    @_timed("prep_xfer_dlist")
    def prep_remote(self, remote: str, descs: np.ndarray, mem_type: str) -> Any:
        try:
            handle = self._agent.prep_xfer_dlist(remote, descs, mem_type)
        except Exception as exc:
            raise TransferError(f"cannot prepare descriptors of {remote}: {exc}") from exc
        self._dlists[id(handle)] = handle
        return handle

    @_timed("release_dlist_handle")
    def release_dlist(self, handle: Any) -> None:
        self._dlists.pop(id(handle), None)
        try:
            self._agent.release_dlist_handle(handle)
        except Exception as exc:
            raise TransferError(f"cannot release descriptor list: {exc}") from exc

    @_timed("transfer")
    def write(self, local: Any, local_idx: np.ndarray, remote: Any, remote_idx: np.ndarray, notif: bytes):
        try:
            handle = self._agent.make_prepped_xfer("WRITE", local, local_idx, remote, remote_idx, notif)
        except Exception as exc:
            raise TransferError(f"cannot create WRITE: {exc}") from exc
        self._xfers[id(handle)] = handle
        try:
            state = _STATES[self._agent.transfer(handle)]
        except Exception as exc:
            self._safe_release(handle)
            raise TransferError(f"cannot post WRITE: {exc}") from exc
        return handle, state

    @_timed("check_xfer_state")
    def state(self, xfer: Any) -> XferState:
        try:
            return _STATES[self._agent.check_xfer_state(xfer)]
        except Exception:
            return XferState.ERR

    @_timed("release_xfer_handle")
    def release(self, xfer: Any) -> None:
        try:
            self._agent.release_xfer_handle(xfer)
        except Exception as exc:
            raise TransferError(f"cannot release WRITE handle: {exc}") from exc
        self._xfers.pop(id(xfer), None)

    @_timed("send_notif")
    def send_notif(self, remote: str, payload: bytes) -> None:
        try:
            self._agent.send_notif(remote, payload)
        except Exception as exc:
            raise TransferError(f"cannot notify {remote}: {exc}") from exc

    @_timed("get_new_notifs")
    def notifs(self) -> dict[str, list[bytes]]:
        try:
            got = self._agent.get_new_notifs()
        except Exception as exc:
            raise TransferError(f"notification poll failed: {exc}") from exc
        return {(k.decode() if isinstance(k, bytes) else k): v for k, v in got.items()} if got else {}

    def handles(self) -> dict[str, int]:
        return {"registrations": len(self._reg), "dlists": len(self._dlists), "xfers": len(self._xfers),
                "remote_agents": len(self._remotes)}

    def close(self) -> None:
        """Release everything still held, in dependency order: WRITEs, descriptor
        lists, remote agents, then the memory they referenced."""
        for handle in list(self._xfers.values()):
            self._safe_release(handle)
        for handle in list(self._dlists.values()):
            try:
                self._agent.release_dlist_handle(handle)
            except Exception:
                pass
        self._dlists.clear()
        for name in list(self._remotes):
            try:
                self._agent.remove_remote_agent(name)
            except Exception:
                pass
        self._remotes.clear()
        for reg in self._reg:
            try:
                self._agent.deregister_memory(reg)
            except Exception:
                pass
        self._reg.clear()

    def _safe_release(self, handle: Any) -> None:
        self._xfers.pop(id(handle), None)
        try:
            self._agent.release_xfer_handle(handle)
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"<NixlAgent {self.name} {self.handles()}>"


# NIXL's UCX backend posts each descriptor pair of a WRITE as a UCX put of its own, unless
# this is set when the backend is made: then it hands UCX the WRITE as one scatter-gather
# list (over cuda_ipc, one cuMemcpyBatchAsync and one CUDA event for all pairs).
SGL_ENV = "NIXL_UCX_SGL_ENABLE"


class NixlEngine:
    name = "nixl"

    def __init__(self, backends: list[str], progress_thread: bool = False,
                 ucx_error_handling_mode: str = "peer", on_slow: SlowCall | None = None,
                 sgl: bool = False) -> None:
        self.backends = list(backends)
        self.progress_thread = progress_thread
        self.on_slow = on_slow
        self.sgl = sgl
        # UCX's "peer" mode (NIXL's default) reports a dead peer (NIXL_ERR_REMOTE_DISCONNECT)
        # but keeps only transports that can: on one host, puts by cma and active messages
        # (notifications) over tcp/lo. "none" brings back the shared-memory transports
        # (docs/architecture.md, "UCX transports").
        self.backend_params = ({} if ucx_error_handling_mode == "peer" else
                               {"UCX": {"ucx_error_handling_mode": ucx_error_handling_mode}})
        # Import NIXL (seconds on a loaded host) now, before the daemon reports ready,
        # not inside the first worker's hello while the event loop waits.
        _import_nixl()

    def create_agent(self, name: str) -> NixlAgent:
        # Read by NIXL's UCX backend as the agent is made (an engine of another setting in
        # the same process, as in tests and benchmarks, changes it for its own agents only).
        os.environ[SGL_ENV] = "1" if self.sgl else "0"
        return NixlAgent(name, self.backends, self.progress_thread, self.backend_params, self.on_slow)
