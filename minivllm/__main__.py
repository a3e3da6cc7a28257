"""`python -m minivllm ...` is the same as the `minivllm` command."""

from minivllm.cli import main

main()
