"""Load generation against an OpenAI-compatible server: the demo's and the benchmarks' one client.

- ``prompts``: deterministic prompt sets (mixed lengths; long prompts of a token count).
- ``client``: the streaming completions client that times each request (TTFT, TPOT,
  latency) and runs a batch of prompts at a bounded concurrency.
- ``stats``: percentiles and the per-batch summary.
"""
