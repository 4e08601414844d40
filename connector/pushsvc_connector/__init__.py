"""vLLM KV connector for pushsvc: a thin client of the co-located transfer daemon.

Load it with::

    --kv-transfer-config '{"kv_connector": "PushsvcConnector",
                           "kv_connector_module_path": "pushsvc_connector",
                           "kv_role": "kv_producer",
                           "kv_connector_extra_config": {"daemon_socket": "/run/pushsvc/pushsvc.sock"}}'
"""

from typing import Any

__all__ = ["PushsvcConnector"]


def __getattr__(name: str) -> Any:
    # Imported on first use, so the worker role (``pushsvc_connector.worker``) and the
    # share helpers import without vLLM.
    if name == "PushsvcConnector":
        from pushsvc_connector.connector import PushsvcConnector

        return PushsvcConnector
    raise AttributeError(name)
