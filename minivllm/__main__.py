"""`python -m minivllm ...` is the same as the `minivllm` command."""

from minivllm.entrypoints.cli import main

main()
