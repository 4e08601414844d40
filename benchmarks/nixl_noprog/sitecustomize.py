"""Turn NIXL's progress thread off in every Python process that has this folder on
PYTHONPATH (the vLLM API server, its EngineCore and its workers).

vLLM 0.32 builds its agent as ``nixl_agent_config(num_threads=..., capture_telemetry=True)``
(``nixl/base_worker.py``) and offers no knob for ``enable_prog_thread``; this is the
benchmark's way to give vLLM's connectors the same setting the pushsvc daemon uses.
Without the thread, transfers advance when vLLM calls into the agent (``check_xfer_state``,
``get_new_notifs``), which its workers do on every engine step.
"""

import os

if os.environ.get("BENCH_NIXL_PROG_THREAD", "") == "0":
    # vLLM sets this only when it imports NIXL first; we import it first, so set it here.
    os.environ.setdefault("UCX_RCACHE_MAX_UNRELEASED", "1024")
    try:
        import nixl._api as _api
    except Exception:  # noqa: BLE001 - no NIXL: nothing to patch
        _api = None
    if _api is not None:
        _init = _api.nixl_agent_config.__init__

        def __init__(self, *args, **kwargs):  # noqa: N807
            _init(self, *args, **kwargs)
            self.enable_pthread = False

        _api.nixl_agent_config.__init__ = __init__
