"""When the worker role tells its daemon what a step decided, driven by vLLM's own model
runner code (``KVConnectorModelRunnerMixin.maybe_get_kv_connector_output``, the context
that wraps each forward pass) with ``PushsvcConnector`` installed as vLLM's transfer group
and a real daemon on a Unix socket.

vLLM calls ``start_load_kv`` only after the forward pass has been launched (on a CPU:
after it ran). P's finished requests and D's registrations would then wait for a forward
pass that is not theirs, under load a whole prefill step; they go when vLLM binds the
step's metadata instead, before the pass."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from types import SimpleNamespace

import pytest
from daemon_fixtures import BLOCK_LEN, P_ENGINE, REGIONS, daemon_config, kv_regions, metric, wait_until
from vllm.config import KVTransferConfig, ParallelConfig
from vllm.distributed import parallel_state
from vllm.distributed.kv_transfer import kv_transfer_state
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.worker import kv_connector_model_runner_mixin as runner_kv
from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

from pushsvc.engine.fake import FakeEngine
from pushsvc.protocol import worker as wp
from pushsvc.server.daemon import Daemon
from pushsvc.shm import SharedBuffer
from pushsvc_connector import PushsvcConnector
from pushsvc_connector.kvshare import KVShare
from pushsvc_connector.metadata import PushsvcMetadata


@pytest.fixture
def base():
    path = tempfile.mkdtemp(prefix="pso")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _messages(daemon: Daemon, kind: str) -> float:
    return metric(daemon, "pushsvc_worker_messages_total", type=kind) or 0.0


@pytest.mark.asyncio
async def test_a_steps_messages_reach_the_daemon_before_its_forward_pass(base, monkeypatch) -> None:
    daemon = Daemon(daemon_config(f"{base}/rt", P_ENGINE), engine=FakeEngine())
    await daemon.startup()
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: 0)
    kv = KVTransferConfig(kv_connector="PushsvcConnector", kv_connector_module_path="pushsvc_connector",
                          kv_role="kv_producer", kv_connector_extra_config={"daemon_socket": daemon.config.socket_path})
    connector = PushsvcConnector(SimpleNamespace(kv_transfer_config=kv, parallel_config=ParallelConfig()),  # type: ignore[arg-type]
                                 KVConnectorRole.WORKER, None)
    buf = SharedBuffer.create(REGIONS * 8 * BLOCK_LEN)
    monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", connector)
    monkeypatch.setattr(runner_kv, "get_forward_context", lambda: None)  # the pass itself is not run here
    try:
        assert connector._worker is not None
        await asyncio.to_thread(connector._worker.register, KVShare(kv_regions(8), buffers=[buf]))
        meta = PushsvcMetadata(sends={"p1": wp.SendReady(request_id="p1", block_ids=[[1, 2]], match_key="k1")})
        step = SimpleNamespace(kv_connector_metadata=meta, has_sync_kv_loads=False, finished_req_ids=set())
        with KVConnectorModelRunnerMixin.maybe_get_kv_connector_output(step):  # type: ignore[arg-type]
            # The forward pass would run here: the daemon already has the step's messages.
            await wait_until(lambda: _messages(daemon, "SendReady") == 1, "SendReady before the forward pass")
        # After the pass (vLLM's start_load_kv, get_finished): nothing is sent twice.
        await asyncio.sleep(0.05)
        assert _messages(daemon, "SendReady") == 1
    finally:
        connector.shutdown()
        buf.close()
        await daemon.shutdown()
