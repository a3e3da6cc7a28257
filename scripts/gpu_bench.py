"""The book's measurements on one CUDA GPU: `make gpu-bench` runs this file.

The measurements live in the package minivllm.bench.gpu, one module per chapter; its
docstring describes what each chapter measures and the files it writes under figures/gpu/.
This file is the entry point that `make gpu-bench` and the notebooks name, the same as
`python -m minivllm.bench.gpu`:

    python scripts/gpu_bench.py                   # every chapter, the CUDA smoke first
    python scripts/gpu_bench.py --quick           # tiny sizes, any device: checks that it runs
    python scripts/gpu_bench.py --chapters smoke,06,11
"""

from minivllm.bench.gpu.main import main

if __name__ == "__main__":
    main()
