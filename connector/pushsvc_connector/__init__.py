"""vLLM KV connector for pushsvc: a thin client of the co-located transfer daemon.

Load it with::

    --kv-transfer-config '{"kv_connector": "PushsvcConnector",
                           "kv_connector_module_path": "pushsvc_connector",
                           "kv_role": "kv_producer",
                           "kv_connector_extra_config": {"daemon_socket": "/run/pushsvc/pushsvc.sock"}}'
"""

from pushsvc_connector.connector import PushsvcConnector

__all__ = ["PushsvcConnector"]
