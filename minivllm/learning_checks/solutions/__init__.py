"""Solutions to the exercises, kept apart from the notebooks: look only after trying.

Each notebook's exercise cell holds a stub that raises NotImplementedError; you replace its
body and run the cell, whose learning check then tests your function. One correct answer per
check lives here: the check named "chXX.name" has its solution at
`minivllm.learning_checks.solutions.chXX.name`, a plain function with the check's signature,
written as a learner would write it (it uses torch and the standard library, not minivllm's
own implementation). Yours may look different and be just as right: the check decides.

The test suite runs every check on its solution, and so do the notebooks in CI: with
MINIVLLM_CHECK_SOLUTIONS=1 or MINIVLLM_QUICK=1, `check` tests the solution wherever the
exercise is still a stub.
"""
