"""`python -m minivllm.bench.gpu`: see the package's docstring."""

from minivllm.bench.gpu.main import main

main()
