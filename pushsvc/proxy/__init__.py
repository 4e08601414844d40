"""The P/D proxy (``pushsvc proxy``): an OpenAI-compatible front for disaggregated vLLM.

Each generation request becomes two concurrent legs: a prefill leg to a P instance and a
decode leg to a D instance that names P's daemon, so D's daemon registers its blocks while P
computes and P's daemon pushes the KV straight into them. P's daemon is named by
``--prefill-daemon`` or learned from P's answers (the first exchange with a P runs P's leg
first). Modules: ``config`` (ProxyConfig),
``legs`` (the two request bodies, pure), ``backends`` (selection, daemon coordinates),
``upstream`` (backend calls and their errors), ``metrics``, ``affinity`` (prefix affinity,
pure), ``app`` (the handlers and the exchange), ``server`` (routes, middleware, lifecycle).
"""

from pushsvc.proxy.server import ProxyServer, build_app, run_proxy
from pushsvc.proxy.config import ProxyConfig, load_proxy_config

__all__ = ["ProxyConfig", "ProxyServer", "build_app", "load_proxy_config", "run_proxy"]
