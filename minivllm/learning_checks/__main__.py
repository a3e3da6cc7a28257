"""`python -m minivllm.learning_checks NAME module:function` runs one check on your function;
with no arguments it lists the checks."""

import importlib
import sys

from minivllm.learning_checks import all_checks, check


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        for name, learning_check in all_checks().items():
            print(f"{name:32} {learning_check.signature}")
        return 0
    name, target = argv
    module_name, _, function_name = target.partition(":")
    implementation = getattr(importlib.import_module(module_name), function_name)
    return 0 if check(name, implementation) else 1


sys.exit(main(sys.argv[1:]))
