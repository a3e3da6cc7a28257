"""Chapter 11 — the model compiled: one graph per shape family, fused by inductor.

Eager PyTorch runs the model one operator at a time: for each of the ~1,600 operators of a step
Python dispatches a call, and each elementwise one (a norm, the rotary rotation, SiLU times up,
a residual add) reads and writes its whole tensor. `torch.compile` traces the forward once into
a graph (dynamo), and inductor turns the graph into fused loops (C++ on a CPU, Triton on a
GPU): a norm and the residual add before it become one kernel whose passes over a row find it
in the cache, and the step's Python work shrinks to one call into generated code.

Four decisions make one compilation serve every step, cheaply:

1. **Attention is opaque** (`compilation/forward_context.py`): the step's backend and its
   metadata stay outside the graph.
2. **The token count is symbolic.** The batch's first dimension is marked dynamic, so one graph
   serves 2..max_num_batched_tokens tokens (dynamo specializes a count of 1, the batch-1
   decode, into a graph of its own). `compile` traces both at engine start, under a progress
   bar, so no request waits for it (and a third count for int8 layers, which branch on the
   number of rows; see `CompiledModel.compile`).
3. **Only the inputs are guarded.** Before each call dynamo checks that what the graph was traced
   on still holds (its guards); by default that includes every attribute of every module of the
   model, about a millisecond a step here, 4% of a batch-1 decode. A CompiledModel's model is
   fixed once it is built (weights packed or quantized before the first trace, never changed
   after), so the module guards are dropped (`skip_guard_on_all_nn_modules_unsafe`: "unsafe" for
   a model that changes under its graph, which this one does not); the guards on the inputs'
   shapes, which pick the graph, stay. For the same reason the generated code does not check
   the size and strides of every argument on every call (`size_asserts=False`): it had 426
   arguments (the weights included) and checked each one, about a quarter of the generated
   code's own time in a batch-1 int4 step, to learn what the guards already knew.
4. **The packed weights stay** (`models/linear.py`): products call oneDNN on the same packed
   weights as eager, so compiled and eager differ only in how the fused elementwise loops
   round (a few float32 ulps), and greedy tokens agree with transformers.

Inductor keeps what it generates on disk (`TORCHINDUCTOR_CACHE_DIR`, by default
`/tmp/torchinductor_<user>`): a second engine start, even in a new process, reads compiled code
back instead of generating it again. `enforce_eager` (vLLM's setting) chooses: True skips all
this; False, the default as in vLLM, compiles at start (and on a GPU records CUDA graphs too,
`compilation/cuda_graphs.py`).
"""

from __future__ import annotations

import time
import types

import torch
from tqdm.auto import tqdm

from minivllm.attention.backend import PagedAttentionBackend
from minivllm.compilation.forward_context import OPAQUE_ATTENTION, forward_context
from minivllm.models.llama import LlamaForCausalLM
from minivllm.models.quantization import INT8_FUSED_MAX_ROWS

# Dynamo keeps one compiled graph per shape family it meets (batch-1, any other count, the
# layer-skip draft's shorter model, ...), at most this many per model (each CompiledModel
# compiles a function of its own, see `own_function`). Past it, with fullgraph=True, the call
# raises rather than running eagerly.
MAX_COMPILED_GRAPHS = 16


def compilable(model: LlamaForCausalLM) -> bool:
    """Whether this model's forward compiles: not when split across tensor-parallel ranks
    (their all-reduces are not traced here; those ranks run eagerly)."""
    return model.tp.size == 1


class CompiledModel:
    """`model`'s forward (token ids, positions, attention -> hidden states) compiled; called
    like the model itself."""

    def __init__(self, model: LlamaForCausalLM):
        self.model = model
        self.config = model.config
        self._forward = torch.compile(
            own_function(self._eager_forward),
            dynamic=None,
            fullgraph=True,
            options={
                "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe,
                "size_asserts": False,  # see the module docstring, 3.
            },
        )
        self.compile_seconds = 0.0

    def _eager_forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, num_layers: int | None
    ) -> torch.Tensor:
        return self.model(input_ids, positions, OPAQUE_ATTENTION, num_layers)

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: PagedAttentionBackend,
        num_layers: int | None = None,
    ) -> torch.Tensor:
        if len(input_ids) > 1:  # one graph for every count of two or more tokens
            torch._dynamo.mark_dynamic(input_ids, 0)
            torch._dynamo.mark_dynamic(positions, 0)
        with (
            forward_context(attention),
            torch._dynamo.config.patch(recompile_limit=MAX_COMPILED_GRAPHS),
        ):
            return self._forward(input_ids, positions, num_layers)

    def compile(self, make_attention, num_layers: int | None = None) -> float:
        """Trace and compile the graphs a step can need (one token; two or more), running
        each once on dummy tokens through `make_attention(num_tokens)`, a backend over a
        scratch pool. Returns the seconds it took.

        Two or more tokens are one graph unless the model's code branches on the count: chapter
        12's int8 layers choose their kernel by the number of rows (`INT8_FUSED_MAX_ROWS`), so
        dynamo guards the two-token graph on it. A third, prompt-sized count traces the other
        side now, instead of at the first prompt (elsewhere it reuses the graph: no compile)."""
        start = time.perf_counter()
        device = self.model.device
        counts = (1, 2, INT8_FUSED_MAX_ROWS + 1)
        for num_tokens in tqdm(counts, desc="compiling the model (torch.compile)", unit="graph"):
            # Made in inference mode, as every step's inputs are: a graph is guarded on how
            # its inputs were made, and one traced on ordinary tensors would not serve a step.
            with torch.inference_mode():
                input_ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
                positions = torch.arange(num_tokens, device=device)
                self(input_ids, positions, make_attention(num_tokens), num_layers)
        self.compile_seconds += time.perf_counter() - start
        return self.compile_seconds


def own_function(method: types.MethodType) -> types.MethodType:
    """`method` bound to a copy of its function with a code object of its own. Dynamo keeps
    its compiled graphs, and counts them against the recompile limit, on the code object: with
    the class's one `_eager_forward`, every CompiledModel of the process would share one count,
    and a process that built a few engines (or models of different shapes) would reach
    MAX_COMPILED_GRAPHS. A copy's graphs are its model's alone, and go when it goes."""
    function = method.__func__
    copy = types.FunctionType(
        function.__code__.replace(),  # an equal code object, but another one
        function.__globals__,
        function.__name__,
        function.__defaults__,
        function.__closure__,
    )
    return types.MethodType(copy, method.__self__)
