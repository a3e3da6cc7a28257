"""The C++ CPU kernels of chapters 06 and 12, built at first use into one library.

Chapter 06's paged attention (`attention/csrc/`) and chapter 12's int4/int8 products
(`models/csrc/`) are C++ sources compiled on the user's machine with the compiler that inductor
needs anyway on a CPU, by `torch.utils.cpp_extension` and ninja: about a minute on two cores the
first time, then loaded from the disk cache in well under a second. Their operators register as
`torch.ops.minivllm_cpu.*` (and chapter 12's two the model calls as `torch.ops.minivllm.*`).
Without a compiler, minivllm says so once and runs the PyTorch reference paths instead.
"""

from __future__ import annotations

import functools
import hashlib
import shutil
import sys
import time
import warnings
from pathlib import Path

import torch

PACKAGE = Path(__file__).parent
SOURCES = [  # compiled, in this order
    PACKAGE / "attention" / "csrc" / "paged_attention.cpp",
    PACKAGE / "models" / "csrc" / "quantized_linear.cpp",
    PACKAGE / "models" / "csrc" / "quantized_linear_int8_activations.cpp",
]
HEADERS = [  # included by the sources; part of the build's hash
    PACKAGE / "attention" / "csrc" / "attention_tiles.h",
    PACKAGE / "attention" / "csrc" / "work_item.h",
    PACKAGE / "models" / "csrc" / "quantized_blocks.h",
]

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
        "-mf16c",  # float16 scales widened by one instruction (not implied by -mavx512f)
    ],
    "AVX2": ["-DCPU_CAPABILITY_AVX2", "-mavx2", "-mfma", "-mf16c"],
}
# Instructions some AVX512 CPUs add, used where torch reports them (chapter 12): VNNI's byte dot
# product (int8 activations) and AVX512-BF16's bfloat16 pair dot product (int4 weights times
# bfloat16 activations). Each one present is part of the build's name.
AVX512_EXTENSIONS = {
    "avx512_vnni": ["-DMINIVLLM_VNNI", "-mavx512vnni"],
    "avx512_bf16": ["-DMINIVLLM_AVX512_BF16", "-mavx512bf16"],
}

# torch's builder takes a lock file in the build directory, and a process that finds it waits
# until it is gone. A build that was interrupted (Ctrl-C, a killed process) leaves it behind, and
# every later process would then wait for ever. A build takes about a minute, so a lock older
# than this belongs to no running build.
STALE_LOCK_SECONDS = 600


def compiler_flags() -> tuple[str, list[str]]:
    """The build's name for this CPU's instructions, and the flags that target them."""
    capability = torch.backends.cpu.get_cpu_capability()
    flags = ["-O3", "-fopenmp", *ISA_FLAGS.get(capability, [])]
    if capability == "AVX512":
        present = torch.cpu.get_capabilities()
        for extension, extension_flags in AVX512_EXTENSIONS.items():
            if present.get(extension, False):
                capability, flags = (
                    f"{capability}_{extension[len('avx512_') :]}",
                    flags + extension_flags,
                )
    return capability.lower(), flags


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
    capability, flags = compiler_flags()
    # The name says what was built: a changed source or flags build anew, next to the old one.
    code = b"".join(path.read_bytes() for path in SOURCES + HEADERS) + " ".join(flags).encode()
    digest = hashlib.sha256(code).hexdigest()[:12]
    name = f"minivllm_cpu_kernels_{capability}_{digest}"
    build_directory = Path(cpp_extension._get_build_directory(name, verbose=False))
    library = build_directory / f"{name}.so"
    remove_stale_lock(build_directory)
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


def remove_stale_lock(build_directory: Path, now: float | None = None) -> bool:
    """Remove the build lock an interrupted build left behind (older than STALE_LOCK_SECONDS),
    saying so; a younger lock is another process's build in progress and stays."""
    lock = build_directory / "lock"
    try:
        age = (time.time() if now is None else now) - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age < STALE_LOCK_SECONDS:
        return False
    lock.unlink(missing_ok=True)
    warnings.warn(
        f"minivllm: removed {lock}, left {age / 60:.0f} minutes ago by a build that was"
        " interrupted; building again",
        stacklevel=3,
    )
    return True


def _cannot_build(reason: str) -> None:
    warnings.warn(
        f"minivllm: the C++ CPU kernels (the cpu attention backend, the int4/int8 products) "
        f"are unavailable, {reason}; running the PyTorch reference instead",
        stacklevel=3,
    )
    return None
