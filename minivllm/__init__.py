"""minivllm: a readable, step-by-step vLLM-style inference engine, written as a book.

from minivllm import LLM, SamplingParams
"""

from minivllm.entrypoints.llm import LLM
from minivllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from minivllm.sample.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = [
    "LLM",
    "SamplingParams",
    "StructuredOutputsParams",
    "RequestOutput",
    "CompletionOutput",
    "RequestMetrics",
    "Logprob",
]
__version__ = "0.1.0"
