"""pushsvc: push-mode KV-cache transfer daemon for disaggregated vLLM serving."""

__version__ = "0.1.0"
