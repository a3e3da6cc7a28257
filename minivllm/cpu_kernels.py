"""The C++ CPU kernels of chapters 06 and 12, built at first use into one library.

Chapter 06's paged attention (`attention/csrc/`) and chapter 12's int4/int8 products
(`models/csrc/`) are C++ sources compiled on the user's machine with the compiler that inductor
needs anyway on a CPU, by `torch.utils.cpp_extension` and ninja: about a minute on two cores the
first time, then loaded from the disk cache in well under a second. Their operators register as
`torch.ops.minivllm_cpu.*`. Without a compiler, minivllm says so once and runs the PyTorch
reference paths instead.
"""

from __future__ import annotations

import functools
import hashlib
import shutil
import sys
import warnings
from pathlib import Path

import torch

PACKAGE = Path(__file__).parent
SOURCES = [  # compiled, in this order
    PACKAGE / "attention" / "csrc" / "paged_attention.cpp",
    PACKAGE / "models" / "csrc" / "quantized_linear.cpp",
]
HEADERS = [PACKAGE / "attention" / "csrc" / "attention_tiles.h"]  # included; part of the hash

# The vector instructions at::vec (and the kernels' own intrinsics) are compiled for: the widest
# that torch itself uses here. The capability is part of the build's name, so a cached build
# never runs on a machine that lacks its instructions.
ISA_FLAGS = {
    "AVX512": [
        "-DCPU_CAPABILITY_AVX512",
        "-mavx512f",
        "-mavx512bw",
        "-mavx512vl",
        "-mavx512dq",
        "-mfma",
    ],
    "AVX2": ["-DCPU_CAPABILITY_AVX2", "-mavx2", "-mfma", "-mf16c"],
}


@functools.cache
def load_kernels() -> str | None:
    """Build (first use) or load (cached) the kernels; returns the library's path, or None after
    warning once why they cannot be built."""
    from torch.utils import cpp_extension

    compiler = cpp_extension.get_cxx_compiler()
    if shutil.which(compiler) is None:
        return _cannot_build(f"no C++ compiler found ({compiler!r})")
    if not cpp_extension.is_ninja_available():
        return _cannot_build("ninja is not installed")
    capability = torch.backends.cpu.get_cpu_capability()
    flags = ["-O3", "-fopenmp", *ISA_FLAGS.get(capability, [])]
    # The name says what was built: a changed source or flags build anew, next to the old one.
    code = b"".join(path.read_bytes() for path in SOURCES + HEADERS) + " ".join(flags).encode()
    digest = hashlib.sha256(code).hexdigest()[:12]
    name = f"minivllm_cpu_kernels_{capability.lower()}_{digest}"
    build_directory = Path(cpp_extension._get_build_directory(name, verbose=False))
    library = build_directory / f"{name}.so"
    if not library.exists():
        print("minivllm: building the C++ CPU kernels (once)...", file=sys.stderr, flush=True)
    try:
        cpp_extension.load(
            name=name,
            sources=[str(path) for path in SOURCES],
            extra_cflags=flags,
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
    except (RuntimeError, OSError) as error:
        return _cannot_build(f"building them failed: {error}")
    return str(library)


def _cannot_build(reason: str) -> None:
    warnings.warn(
        f"minivllm: the C++ CPU kernels (the cpu attention backend, the int4/int8 products) "
        f"are unavailable, {reason}; running the PyTorch reference instead",
        stacklevel=3,
    )
    return None
