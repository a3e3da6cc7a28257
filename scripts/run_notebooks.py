"""Execute notebooks top to bottom and save them with their outputs (full mode by default).

python scripts/run_notebooks.py notebooks/02-kv-cache.ipynb
MINIVLLM_QUICK=1 python scripts/run_notebooks.py --no-save notebooks/*.ipynb
"""

import argparse
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient


def run_notebook(path: Path, save: bool, timeout: int = 3600) -> float:
    notebook = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    client = NotebookClient(
        notebook,
        timeout=timeout,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
    )
    client.execute()
    if save:
        nbformat.write(notebook, path)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="+", type=Path)
    parser.add_argument("--no-save", action="store_true", help="do not write outputs back")
    args = parser.parse_args()
    for path in args.notebooks:
        seconds = run_notebook(path, save=not args.no_save)
        print(f"{path}: {seconds:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
