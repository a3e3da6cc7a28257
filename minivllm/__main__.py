"""`python -m minivllm ...` is the same as the `minivllm` command."""

from minivllm.entrypoints.cli import main

if __name__ == "__main__":
    main()
