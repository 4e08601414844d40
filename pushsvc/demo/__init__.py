"""``pushsvc demo``: see pushsvc for yourself, on one machine.

- ``serving``: the main demo. The same prompts through one colocated vLLM and through P/D
  (two vLLM servers with ``PushsvcConnector``, two daemons, the proxy); compares outputs
  and TTFT.
- ``transfer``: ``--transfer-only``, two daemons pushing between in-process workers, no
  vLLM; a few seconds.
- ``run``: the lifecycle both share (processes, exit codes, Ctrl-C, logs);
  ``console``: what is printed while waiting; ``report``: judging and formatting.
  The prompts and the streaming, timing client are ``pushsvc.loadgen``'s, shared with the
  benchmarks.
"""

from pushsvc.demo.run import DemoOptions, default_model_dir, run_demo

__all__ = ["DemoOptions", "default_model_dir", "run_demo"]
