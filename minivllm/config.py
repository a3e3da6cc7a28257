"""Configuration shared by every chapter.

`ModelConfig` is the handful of numbers our transformer needs, read from a Hugging Face
`config.json`. Keeping it small and explicit shows what a Llama-family model *is*: a stack of
identical layers whose shapes follow from a dozen integers. The families we support differ
only in a few switches (bias on q/k/v for Qwen2, a norm on q and k for Qwen3, a sliding window
for early Mistral), which appear here as plain fields.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch

from minivllm import cpu_kernels
from minivllm.utils import as_int, float_in, int_at_least, reject

# model_type in config.json -> the switches that family turns on.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
SCHEDULING_POLICIES = ("fcfs", "priority")
# vLLM's logprobs_mode values: what reported logprobs are computed from (sample/sampler.py).
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
# "auto" and the names registered in attention/backend.py (a test keeps the two in step).
ATTENTION_BACKEND_NAMES = ("auto", "torch", "triton", "flex", "cpu")
# `quantization=` values (vLLM's setting, chapter 12: models/quantization.py): int8 and int4
# quantize the float checkpoint at load; gguf reads the model's 4-bit blocks from its GGUF file.
QUANTIZATION_METHODS = ("int8", "int4", "gguf")
# The activation dtypes each scheme has a fast kernel for, by device type (vLLM's
# `get_supported_act_dtypes`); the first is the one dtype="auto" picks. Read from PyTorch's
# kernels: on an x86 CPU `_weight_int8pack_mm` and `_weight_int4pack_mm_for_cpu` have vectorized
# (AVX2, AVX-512) loops for bfloat16 only, and float32 and float16 take a scalar loop, 5 to 20
# times slower than the float model's product (aten/src/ATen/native/cpu/int8mm_kernel.cpp,
# int4mm_kernel.cpp); tinygemm's CUDA int4 kernel takes bfloat16 only; CUDA's int8 kernel
# computes in float32 whatever the activations' dtype (native/cuda/int8mm.cu). An engine refuses
# any other pair (resolve_dtype); the layers (models/quantization.py) multiply any dtype, by
# the reference product where no kernel fits, which the tests use as their oracle.
KERNEL_ACTIVATION_DTYPES = {
    "cpu": {"int8": (torch.bfloat16,), "int4": (torch.bfloat16,)},
    "cuda": {"int8": (torch.bfloat16, torch.float16, torch.float32), "int4": (torch.bfloat16,)},
}


# minivllm's own CPU products (models/cpu_quantized.py, C++ built at first use) widen the
# weights to float32 and accumulate there whatever the activations' dtype, so they are fast for
# both; bfloat16 first, as above. Where they cannot be built, the table above holds.
OWN_CPU_KERNEL_DTYPES = (torch.bfloat16, torch.float32)


def uses_own_cpu_kernels(device: torch.device | str) -> bool:
    """Whether int8/int4 weights on `device` run minivllm's own C++ products (chapter 12):
    on a CPU, once they are built (at the first call)."""
    return torch.device(device).type == "cpu" and cpu_kernels.load_kernels() is not None


def supported_activation_dtypes(method: str, device: torch.device | str) -> tuple[torch.dtype, ...]:
    """The activation dtypes `method` ("int8", "int4" or "gguf", which runs int4's kernels)
    has a kernel for on `device`; () where it has none."""
    scheme = "int4" if method == "gguf" else method
    if scheme in ("int8", "int4") and uses_own_cpu_kernels(device):
        return OWN_CPU_KERNEL_DTYPES
    return KERNEL_ACTIVATION_DTYPES.get(torch.device(device).type, {}).get(scheme, ())


# RoPE variants whose frequencies do not depend on the sequence length, so they can be computed
# once when the model is built (dynamic NTK scaling would need recomputing per step).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass
class ModelConfig:
    """The shapes and switches of a Llama-family decoder."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # Qwen2: q/k/v projections have a bias
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before RoPE
    sliding_window: int | None = None  # early Mistral: attend to the last W tokens only
    rope_type: str = "default"
    rope_theta: float = 10000.0
    # The Hugging Face config object, kept so RoPE variants can reuse transformers' frequency
    # formulas instead of copying them.
    hf_config: Any = field(default=None, repr=False, compare=False)

    @property
    def max_model_len(self) -> int:
        """Longest sequence (prompt + output) the model can attend over correctly.

        With a sliding window and full attention being the same for sequences no longer than
        the window, we cap the length there instead of implementing the window.
        """
        if self.sliding_window is not None:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K and V one token occupies across all layers (chapter 02's memory math)."""
        element_size = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_size

    def check_tensor_parallel_size(self, size: int) -> None:
        """vLLM's rule for splitting attention over `size` ranks: the query heads divide by it,
        and the KV heads either divide by it (each rank holds its own) or divide it (each KV
        head is copied onto size / num_kv_heads ranks). The MLP's width must divide too."""
        problems = []
        if self.num_heads % size:
            problems.append(f"{self.num_heads} query heads do not divide by it")
        if self.num_kv_heads % size and size % self.num_kv_heads:
            problems.append(f"{self.num_kv_heads} KV heads neither divide by it nor divide it")
        if self.intermediate_size % size:
            problems.append(f"the MLP width {self.intermediate_size} does not divide by it")
        if problems:
            raise ValueError(
                f"tensor_parallel_size={size} does not fit this model: {'; '.join(problems)}"
            )

    def per_rank(self, tensor_parallel_size: int) -> ModelConfig:
        """The shapes one rank of a `tensor_parallel_size`-way split holds: its share of the
        query heads and of the KV heads (at least one: KV heads are copied when they are
        fewer than the ranks). Its KV-cache pool is sized from this."""
        return replace(
            self,
            num_heads=self.num_heads // tensor_parallel_size,
            num_kv_heads=max(1, self.num_kv_heads // tensor_parallel_size),
        )

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> ModelConfig:
        """Read the fields we need from a transformers `PretrainedConfig`."""
        model_type = hf_config.model_type
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported architecture model_type={model_type!r}; minivllm runs the "
                f"Llama family: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        rope_parameters = getattr(hf_config, "rope_parameters", None) or {}
        rope_type = rope_parameters.get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported RoPE variant rope_type={rope_type!r}; supported: "
                f"{', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        sliding_window = getattr(hf_config, "sliding_window", None)
        if model_type in ("qwen2", "qwen3") and not getattr(hf_config, "use_sliding_window", False):
            sliding_window = None  # Qwen configs carry a window value but switch it off
        return cls(
            model_type=model_type,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf_config.rms_norm_eps,
            max_position_embeddings=hf_config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            attention_bias=model_type == "qwen2"
            or bool(getattr(hf_config, "attention_bias", False)),
            qk_norm=model_type == "qwen3",
            sliding_window=sliding_window,
            rope_type=rope_type,
            rope_theta=float(rope_parameters.get("rope_theta", 10000.0)),
            hf_config=hf_config,
        )


def resolve_device(device: str | torch.device) -> torch.device:
    """ "auto" means CUDA when a GPU is present, else the CPU. A CUDA device always comes back
    with its index ("cuda" is the current device, cuda:0 unless set otherwise; cuda:0 on a
    machine without CUDA, where asking for the current one would fail): binding a process to a
    device (`torch.cuda.set_device`) refuses one without."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(device)
    except RuntimeError as error:
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {device!r}") from error
    if device.type == "cuda" and device.index is None:
        current = torch.cuda.current_device() if torch.cuda.is_available() else 0
        device = torch.device("cuda", current)
    return device


_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


def resolve_dtype(
    dtype: str | torch.dtype, device: torch.device, quantization: str | None = None
) -> torch.dtype:
    """ "auto" means float32 on the CPU (exact, and what transformers compares against) and
    bfloat16 on CUDA (half the memory traffic, no overflow risk). With `quantization` (chapter
    12) the dtype must be one the method has a kernel for on the device, and "auto" picks one:
    bfloat16 on the CPU, where PyTorch's int8 and int4 kernels are fast for bfloat16 only."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype must be one of float32, bfloat16, float16, got {dtype}")
        resolved = dtype
    elif dtype == "auto":
        resolved = torch.bfloat16 if device.type == "cuda" else torch.float32
    elif dtype in _DTYPES:
        resolved = _DTYPES[dtype]
    else:
        raise ValueError(f"dtype must be 'auto', 'float32', 'bfloat16' or 'float16', got {dtype!r}")
    if quantization is None:
        return resolved
    supported = supported_activation_dtypes(quantization, device)
    if dtype == "auto" and supported:  # the fastest, listed first
        return supported[0]
    if resolved not in supported:
        names = ", ".join(str(d).removeprefix("torch.") for d in supported) or "none"
        raise ValueError(
            f"dtype {str(resolved).removeprefix('torch.')} has no quantization={quantization!r} "
            f"kernel on {device.type}; supported there: {names}"
        )
    return resolved


# The KV-cache budget on the CPU when none is given: enough for 64 sequences of ~700 tokens of
# the embedded model in float32, small next to a laptop's memory.
DEFAULT_CPU_KV_CACHE_BYTES = 2 * 1024**3


# ngram: copy from earlier in the sequence; draft_model: a smaller model with the same
# vocabulary; layer_skip: the target's own first layers and LM head (self-speculation).
SPECULATIVE_METHODS = ("ngram", "draft_model", "layer_skip")

# vLLM's n-gram lookup length when neither prompt_lookup_min nor prompt_lookup_max is given.
DEFAULT_PROMPT_LOOKUP = 5


@dataclass
class SpeculativeConfig:
    """Chapter 08's speculative decoding, with vLLM's `speculative_config` keys."""

    method: str = "ngram"
    num_speculative_tokens: int = 3  # draft tokens proposed per step
    # n-gram: the shortest suffix worth matching and the longest tried first. As in vLLM, both
    # default to 5 and a single given value sets the other too.
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None  # draft_model: the draft's Hugging Face directory
    num_draft_layers: int | None = None  # layer_skip: how many of the target's layers draft

    def __post_init__(self) -> None:
        if self.prompt_lookup_min is None and self.prompt_lookup_max is None:
            self.prompt_lookup_min = self.prompt_lookup_max = DEFAULT_PROMPT_LOOKUP
        elif self.prompt_lookup_min is None:
            self.prompt_lookup_min = self.prompt_lookup_max
        elif self.prompt_lookup_max is None:
            self.prompt_lookup_max = self.prompt_lookup_min

    @property
    def uses_draft_model(self) -> bool:
        """A draft that runs a model, with K/V of its own (n-gram lookups have none)."""
        return self.method != "ngram"

    @property
    def num_lookahead_tokens(self) -> int:
        """Slots the scheduler reserves past a grant, where a draft model writes the K/V of
        its guesses (vLLM's name)."""
        return self.num_speculative_tokens if self.uses_draft_model else 0

    @classmethod
    def from_value(cls, value: dict | str) -> SpeculativeConfig:
        """From `LLM(speculative_config={...})` or the CLI's JSON string; clear errors for
        unknown keys and bad values."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise ValueError(f"speculative_config is not valid JSON: {error}") from None
        if not isinstance(value, dict):
            reject("speculative_config", value, "a dict (or a JSON object string)")
        names = [item.name for item in fields(cls)]
        unknown = [key for key in value if key not in names]
        if unknown:
            raise ValueError(
                f"unknown speculative_config key(s) {', '.join(unknown)}; valid: {', '.join(names)}"
            )
        config = cls(**value)
        if config.method not in SPECULATIVE_METHODS:
            reject("speculative_config.method", config.method, f"one of {SPECULATIVE_METHODS}")
        int_at_least("speculative_config.num_speculative_tokens", config.num_speculative_tokens, 1)
        int_at_least("speculative_config.prompt_lookup_min", config.prompt_lookup_min, 1)
        int_at_least(
            "speculative_config.prompt_lookup_max",
            config.prompt_lookup_max,
            config.prompt_lookup_min,
        )
        config._check_method_keys()
        return config

    def _check_method_keys(self) -> None:
        """`model` belongs to draft_model and `num_draft_layers` to layer_skip, each required
        there and refused elsewhere (a key that would be silently ignored is a mistake)."""
        if self.method == "draft_model":
            if not isinstance(self.model, str) or not self.model:
                reject("speculative_config.model", self.model, "the draft model's directory")
        elif self.model is not None:
            raise ValueError(
                f"speculative_config.model is only used with method 'draft_model', "
                f"not {self.method!r}"
            )
        if self.method == "layer_skip":
            int_at_least("speculative_config.num_draft_layers", self.num_draft_layers, 1)
        elif self.num_draft_layers is not None:
            raise ValueError(
                f"speculative_config.num_draft_layers is only used with method 'layer_skip', "
                f"not {self.method!r}"
            )


def setting(default: Any, help: str, choices: tuple[str, ...] | None = None) -> Any:
    """One engine setting: its default, the help text the CLI shows, and (for a string) the
    values it may take. `LLM(...)`, the CLI flags and validation are all derived from these."""
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass
class EngineConfig:
    """Every setting of the engine, declared once, with vLLM's names.

    `LLM(**settings)` builds this; `minivllm generate/chat/bench` get one flag per field
    (`--max-num-seqs`, `--no-enable-prefix-caching`, ...); a new setting is one line here.
    """

    model: str | None = setting(
        None, "a local Hugging Face model directory (default: the embedded SmolLM2-135M-Instruct)"
    )
    dtype: str | torch.dtype = setting(
        "auto",
        "weights and KV cache: auto is float32 on CPU (bfloat16 with quantization), bfloat16 on "
        "CUDA",
        ("auto", "float32", "float", "bfloat16", "float16", "half"),
    )
    device: str | torch.device = setting("auto", "auto (CUDA when present), cpu, cuda or cuda:N")
    seed: int = setting(0, "seed of the random draws of requests that bring no seed")
    block_size: int = setting(16, "tokens per KV-cache block")
    max_num_seqs: int = setting(64, "most requests running at once")
    max_num_batched_tokens: int = setting(2048, "token budget of one step, prefills and decodes")
    max_model_len: int | None = setting(
        None, "longest prompt + output (default: the model's context, or what the pool holds)"
    )
    kv_cache_memory_bytes: int | None = setting(
        None, f"KV-cache size in bytes (CPU default: {DEFAULT_CPU_KV_CACHE_BYTES})"
    )
    gpu_memory_utilization: float = setting(
        0.9, "share of GPU memory for weights, activations and KV cache"
    )
    scheduling_policy: str = setting(
        "fcfs",
        "fcfs: first come first served; priority: lowest priority value first",
        SCHEDULING_POLICIES,
    )
    enable_chunked_prefill: bool = setting(True, "split long prompts across steps")
    enable_prefix_caching: bool = setting(True, "share the KV blocks of equal prompt prefixes")
    attention_backend: str = setting(
        "auto", "attention kernel: auto picks the best for the device", ATTENTION_BACKEND_NAMES
    )
    tensor_parallel_size: int = setting(
        1, "processes (devices) each layer is split across, one KV-head share each"
    )
    data_parallel_size: int = setting(1, "engine replicas, each in its own process(es)")
    logprobs_mode: str = setting(
        "raw_logprobs",
        "what logprobs report: the model's own logits (raw) or those a token was chosen from "
        "(processed: after logit_bias, penalties, the min_tokens ban, temperature, top-k/p), "
        "as logprobs or as logits",
        LOGPROBS_MODES,
    )
    quantization: str | None = setting(
        None,
        "weights in fewer bits (chapter 12): int8 per output channel or int4 in groups of 32, "
        "quantized at load; gguf: the embedded model's own 4-bit blocks from its GGUF file",
        QUANTIZATION_METHODS,
    )
    enforce_eager: bool = setting(
        os.environ.get("MINIVLLM_ENFORCE_EAGER") == "1",
        "run the model one PyTorch operator at a time: no torch.compile (chapter 11) and no "
        "CUDA graphs; False (vLLM's default) compiles the model at start and on a GPU replays "
        "decode steps from CUDA graphs; MINIVLLM_ENFORCE_EAGER=1 makes the default True",
    )
    speculative_config: dict | str | None = setting(
        None,
        'speculative decoding, vLLM\'s keys as JSON: {"method": "ngram", '
        '"num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}; '
        'or {"method": "draft_model", "model": DIR} or {"method": "layer_skip", '
        '"num_draft_layers": 8}',
    )

    def __post_init__(self):
        for name in (
            "block_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "tensor_parallel_size",
            "data_parallel_size",
        ):
            int_at_least(name, getattr(self, name), 1)
        as_int("seed", self.seed)
        if self.max_model_len is not None:
            int_at_least("max_model_len", self.max_model_len, 2)
        if self.kv_cache_memory_bytes is not None:
            int_at_least("kv_cache_memory_bytes", self.kv_cache_memory_bytes, 1)
        float_in("gpu_memory_utilization", self.gpu_memory_utilization, 0.0, 1.0, False)
        for name in ("enable_chunked_prefill", "enable_prefix_caching"):
            if not isinstance(getattr(self, name), bool):
                reject(name, getattr(self, name), "a bool")
        if not isinstance(self.enforce_eager, bool):
            reject("enforce_eager", self.enforce_eager, "a bool")
        if self.speculative_config is not None:
            speculative = SpeculativeConfig.from_value(self.speculative_config)  # raises if bad
            if speculative.uses_draft_model and self.tensor_parallel_size > 1:
                raise ValueError(
                    f"speculative_config.method {speculative.method!r} needs "
                    "tensor_parallel_size=1 (the draft model is not split across ranks)"
                )
        for item in fields(self):
            choices, value = item.metadata["choices"], getattr(self, item.name)
            if choices is not None and isinstance(value, str) and value not in choices:
                reject(item.name, value, f"one of {', '.join(choices)}")
        if self.quantization is not None:  # refused here, before any weight is loaded
            resolve_dtype(self.dtype, resolve_device(self.device), self.quantization)

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """The parsed speculative_config, or None without speculation."""
        if self.speculative_config is None:
            return None
        return SpeculativeConfig.from_value(self.speculative_config)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build from keyword arguments; an unknown one is a TypeError that names it and lists
        the valid ones (a typo must not be silently ignored)."""
        names = [item.name for item in fields(cls)]
        unknown = [name for name in kwargs if name not in names]
        if unknown:
            raise TypeError(
                f"unknown engine argument(s) {', '.join(unknown)}; valid: {', '.join(names)}"
            )
        return cls(**kwargs)
