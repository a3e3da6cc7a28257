"""Execute notebooks top to bottom and save them with their outputs (full mode by default).

python scripts/run_notebooks.py notebooks/02-kv-cache.ipynb
MINIVLLM_QUICK=1 python scripts/run_notebooks.py --no-save notebooks/*.ipynb
python scripts/run_notebooks.py --resume notebooks/*.ipynb

The book's full run takes hours on two cores, so a run is resumable: `--resume` skips every
notebook whose saved outputs already come from the code it would run now (its first output names
the same code commit and machine, see `code_version` and `machine_label`) and whose code cells all
ran. A notebook that fails is reported and the others still run.
"""

import argparse
import re
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

# A cell may run for more than an hour: chapter 04's side-by-side runs transformers one request
# at a time on 64 requests in two rounds. The limit only catches a cell that hangs.
CELL_TIMEOUT_SECONDS = 4 * 3600


def run_notebook(path: Path, save: bool, timeout: int = CELL_TIMEOUT_SECONDS) -> float:
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


def ran_on(path: Path) -> str | None:
    """The "commit ... · machine" line a notebook's saved run printed first, if every code cell
    ran; None for a notebook never run whole."""
    cells = [cell for cell in nbformat.read(path, as_version=4).cells if cell.cell_type == "code"]
    if not cells or any(cell.execution_count is None for cell in cells):
        return None
    printed = "".join(output.get("text", "") for output in cells[0].outputs)
    found = re.search(r"ran on (.+)", printed)
    return found.group(1).strip() if found else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="+", type=Path)
    parser.add_argument("--no-save", action="store_true", help="do not write outputs back")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="skip notebooks whose saved run is already this code on this machine",
    )
    args = parser.parse_args()
    current = None
    if args.resume:
        from minivllm.bench.benchmark import code_version, machine_label

        current = f"{code_version()} · {machine_label()}"
    failed = []
    for path in args.notebooks:
        if current is not None and ran_on(path) == current:
            print(f"{path}: skipped, already ran on {current}", flush=True)
            continue
        try:
            seconds = run_notebook(path, save=not args.no_save)
        except Exception as error:  # one failing notebook must not stop the book's run
            failed.append(path)
            print(f"{path}: FAILED: {type(error).__name__}: {str(error)[:2000]}", flush=True)
            continue
        print(f"{path}: {seconds:.0f} s", flush=True)
    if failed:
        print(f"{len(failed)} notebook(s) failed: {', '.join(map(str, failed))}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
