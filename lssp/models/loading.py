"""Load registry entries through transformers, accelerate placement and bitsandbytes."""
from __future__ import annotations

import contextlib
import copy
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from lssp.errors import IncompatibleModelsError, UserError
from lssp.models.compact import CompactLlama, FusedDecoder
from lssp.models.draft_head import has_subset_head, load_subset_head_model
from lssp.models.modules import logit_width, model_device
from lssp.models.placement import OFF_GPU
from lssp.models.registry import (
    BITSANDBYTES_QUANTIZATIONS,
    CPU_QUANTIZATIONS,
    GPU_WEIGHT_ONLY,
    WEIGHT_ONLY_QUANTIZATIONS,
    ModelSpec,
)
from lssp.models.sources import gguf_copy_dir, random_config
from lssp.models.sources import model_source as _model_source
from lssp.models.weight_only import weight_only_quantize

log = logging.getLogger(__name__)
DynamicLinear = torch.ao.nn.quantized.dynamic.Linear
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
KERNELS = {"q4_1": "our kernel"}  # whose kernels multiply a quantization's weights, where not torch's or bnb's


def encode_prompt(tokenizer: PreTrainedTokenizerBase, text: str, chat: bool) -> list[int]:
    """Token ids of ``text``, as a user turn in the chat template when ``chat`` and the tokenizer has one."""
    return encode_conversation(tokenizer, [text], [], chat)


def interleave(turns: Sequence[str], answers: Sequence[str]) -> list[str]:
    """turn 1, answer 1, turn 2, answer 2, ...: the conversation so far."""
    return [piece for i, turn in enumerate(turns) for piece in (turn, *answers[i:i + 1])]


def conversation(turns: Sequence[str], answers: Sequence[str] = ()) -> tuple[tuple[str, str], ...]:
    """(role, text) of user ``turns`` and the ``answers`` so far: what a chat API is sent."""
    return tuple(("user" if i % 2 == 0 else "assistant", piece) for i, piece in enumerate(interleave(turns, answers)))


def encode_conversation(tokenizer: PreTrainedTokenizerBase, turns: Sequence[str], answers: Sequence[str],
                        chat: bool) -> list[int]:
    """Token ids of user ``turns`` interleaved with the ``answers`` so far (one fewer than the turns), ready for
    the next answer: in the chat template when ``chat`` and the tokenizer has one, else joined by blank lines."""
    pieces = interleave(turns, answers)
    if chat and getattr(tokenizer, "chat_template", None):
        roles = ("user", "assistant")
        messages = [{"role": roles[i % 2], "content": piece} for i, piece in enumerate(pieces)]
        templated = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer(templated, add_special_tokens=False).input_ids
    return tokenizer("\n\n".join(pieces)).input_ids


class ModelHandle:
    """A registry entry as measurements see it, whichever engine runs its weights: its name, tokenizer, end tokens,
    and what describes it in rows. ``LoadedModel`` holds the weights in this process; an engine that runs them
    elsewhere (vLLM) has a handle of its own."""

    spec: ModelSpec
    tokenizer: PreTrainedTokenizerBase | None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def device(self) -> torch.device:
        raise NotImplementedError

    @property
    def placement(self) -> str:
        raise NotImplementedError

    @property
    def precision(self) -> str:
        raise NotImplementedError

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    @property
    def draft_kind(self) -> str:
        """As a draft: "eagle" for a feature head, "draft" for a model of its own."""
        raise NotImplementedError

    def _eos_sources(self) -> list[Any]:
        """Where the end token ids are read: configs and the tokenizer."""
        return [self.tokenizer]

    @property
    def eos_ids(self) -> frozenset[int]:
        """The token ids that end an answer: the generation config's, the model config's and the tokenizer's."""
        ids: set[int] = set()
        for source in self._eos_sources():
            value = getattr(source, "eos_token_id", None) if source is not None else None
            ids.update([value] if isinstance(value, int) else value or [])
        return frozenset(ids)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def encode(self, text: str, chat: bool = False) -> torch.Tensor:
        """Token ids (1, T); ``chat`` wraps ``text`` as a user turn in the tokenizer's chat template."""
        return self.encode_turns([text], (), chat)

    def encode_turns(self, turns: Sequence[str], answers: Sequence[str] = (), chat: bool = False) -> torch.Tensor:
        """Token ids (1, T) of a conversation ready for its next answer (``encode_conversation``).

        A model without a tokenizer (random init) gets the UTF-8 bytes of the turns and answers as ids.
        """
        if self.tokenizer is None:
            if chat:
                raise UserError(f"model {self.name!r} has no tokenizer, so no chat template")
            vocab = self.vocab_size
            text = "\n\n".join(interleave(turns, answers))
            return torch.tensor([[b % vocab for b in text.encode()]], dtype=torch.long)
        if chat and not self.has_chat_template:
            raise UserError(f"model {self.name!r}: its tokenizer has no chat template")
        return torch.tensor([encode_conversation(self.tokenizer, turns, answers, chat)], dtype=torch.long)

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return " ".join(map(str, ids))
        return self.tokenizer.decode(ids, skip_special_tokens=True)


@dataclass
class LoadedModel(ModelHandle):
    """A registry entry with its weights loaded in this process."""

    spec: ModelSpec
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase | None

    @property
    def device(self) -> torch.device:
        return model_device(self.model)

    @property
    def placement(self) -> str:
        """The devices its weights are on: "cpu", "cuda:3", "cuda:0-3"."""
        from lssp.models.placement import device_names

        return device_names(self.model)

    @property
    def huge_pages(self) -> float | None:
        """The share of its weights arena (our kernel's q4_1 weights) in huge pages; None where it has none."""
        from lssp.models.weight_only import arena_huge_pages

        getattr(self.model, "one_call", None)  # a compact forward moves its weights into the arena on first use
        return arena_huge_pages(self.model)

    @property
    def hf_model(self) -> PreTrainedModel:
        """The transformers model itself (under a compact forward, the one it wraps)."""
        return getattr(self.model, "hf", self.model)

    @property
    def dtype(self) -> str:
        return str(self.model.get_input_embeddings().weight.dtype).removeprefix("torch.")

    @property
    def precision(self) -> str:
        """dtype, or the quantization where there is one; and a compact forward if used."""
        quantization = self.spec.quantization
        if quantization == "none" or (quantization in CPU_QUANTIZATIONS and self.device.type != "cpu"):
            weights = self.dtype  # a torch CPU quantization applies on the CPU only (cpu_quantize)
        else:
            kernel = KERNELS.get(quantization, "torch" if quantization in CPU_QUANTIZATIONS else "bnb")
            if quantization in KERNELS:  # which vectors ours was built with on this CPU
                from lssp.kernels import kernel_isa

                kernel = f"{kernel}, {kernel_isa()}"
            weights = f"{quantization} ({kernel})"
        if self.hf_model is self.model:
            return weights
        mode = getattr(self.model, "compile_mode", None)
        if getattr(self.model, "one_call", False):
            cache = getattr(self.model, "cache_dtype", None)
            return f"{weights}, compact forward, one-call decoder" + (f", {str(cache).removeprefix('torch.')} KV cache" if cache else "")
        return f"{weights}, compact forward" + (f", compiled ({mode})" if mode else "")

    @property
    def weight_bytes(self) -> int:
        """Bytes of every weight, the prepacked ones of dynamically quantized layers included."""
        model = self.hf_model
        total = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
        for module in model.modules():
            if isinstance(module, DynamicLinear):
                packed = module._packed_params.dtype  # float16 or qint8; weight() unpacks it
                total += module.in_features * module.out_features * (2 if packed == torch.float16 else 1)
        return total

    @property
    def vocab_size(self) -> int:
        """Rows of the input embedding."""
        return self.model.get_input_embeddings().weight.shape[0]

    @property
    def draft_kind(self) -> str:
        from lssp.models.eagle import FeatureDrafting

        return "eagle" if isinstance(self.model, FeatureDrafting) else "draft"

    def _eos_sources(self) -> list[Any]:
        return [getattr(self.hf_model, "generation_config", None), self.hf_model.config, self.tokenizer]


def _placement(spec: ModelSpec, device: str | None, draft: bool = False) -> dict[str, Any]:
    """device_map/max_memory arguments for from_pretrained. A ``draft`` whose entry says nothing
    about placement goes whole onto the GPU with the most free memory (after the target)."""
    n_gpus = torch.cuda.device_count()
    if device is not None:
        if device.startswith("cuda") and n_gpus == 0:
            raise UserError(f"--device {device} asked for, but no CUDA GPU is visible")
        return {"device_map": device}
    if spec.needs_gpu and n_gpus == 0:
        raise UserError(
            f"model {spec.name!r} needs {spec.gpus or 1} GPU(s) and none is visible; use --device cpu to run it on the CPU anyway"
        )
    if spec.gpus and spec.gpus > n_gpus:
        raise UserError(f"model {spec.name!r} asks for {spec.gpus} GPUs, only {n_gpus} visible")
    if draft and n_gpus and not (spec.device_map or spec.gpus or spec.max_memory):
        return {"device_map": f"cuda:{_gpu_for_whole(spec, n_gpus)}"}
    device_map = spec.device_map or ("auto" if n_gpus else "cpu")
    kwargs: dict[str, Any] = {"device_map": device_map}
    max_memory: dict[Any, str] | None = None
    if spec.max_memory:
        max_memory = {int(k) if k.isdigit() else k: v for k, v in spec.max_memory.items()}
    elif spec.gpus:
        max_memory = {i: f"{torch.cuda.mem_get_info(i)[0] // 2**20}MiB" for i in range(spec.gpus)}
    if max_memory:
        kwargs["max_memory"] = max_memory
    return kwargs


def _gpu_for_whole(spec: ModelSpec, n_gpus: int) -> int:
    """The GPU with the most free memory, after checking (where the model's shape is known) that it fits there."""
    from lssp.models.placement import GiB, emptiest, empty_model, model_config, precision_of, weight_bytes

    free = {i: torch.cuda.mem_get_info(i)[0] for i in range(n_gpus)}
    gpu = emptiest(free)
    try:
        size = weight_bytes(empty_model(model_config(spec), DTYPES.get(spec.dtype, torch.bfloat16)), precision_of(spec))
    except UserError:
        return gpu  # shape unknown offline: from_pretrained will say if it does not fit
    if size > 0.95 * free[gpu]:
        raise UserError(f"model {spec.name!r} ({size / GiB:.1f} GiB) does not fit whole on one GPU (cuda:{gpu} has "
                        f"the most free, {free[gpu] / GiB:.1f} GiB); give its entry 'device_map: auto' to split it")
    return gpu


def _lands_on_gpu(placement: dict[str, Any]) -> bool:
    """Whether the weights ``placement`` describes go (at least partly) onto a GPU."""
    device_map = placement["device_map"]
    places = device_map.values() if isinstance(device_map, dict) else [device_map]
    return torch.cuda.device_count() > 0 and any(str(where) not in OFF_GPU for where in places)


def on_gpu_weight_only(spec: ModelSpec) -> ModelSpec:
    """A weight-only entry (int8, int4, q4_1: CPU kernels) as it loads on a GPU: bitsandbytes' 8-bit or 4-bit
    weights under transformers' forward (the compact forward fuses plain Linear layers), uncompiled."""
    quantization = GPU_WEIGHT_ONLY[spec.quantization]
    log.warning("%s: %s on a GPU loads as bitsandbytes %s (transformers' forward, uncompiled)", spec.name,
                spec.quantization, quantization)
    return replace(spec, quantization=quantization, forward="transformers", compile=False)


def _quantization(spec: ModelSpec, dtype: torch.dtype | str) -> dict[str, Any]:
    if spec.quantization == "none" or spec.quantization in CPU_QUANTIZATIONS:
        return {}
    from transformers import BitsAndBytesConfig

    if spec.quantization == "8bit":
        return {"quantization_config": BitsAndBytesConfig(load_in_8bit=True)}
    compute = dtype if isinstance(dtype, torch.dtype) else torch.bfloat16
    return {"quantization_config": BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=compute)}


def save_gguf_copy(model: PreTrainedModel, spec: ModelSpec, where: str, extra: dict[str, Any]) -> None:
    """Write the converted copy of a model just loaded from a GGUF file (a failure only logs)."""
    from safetensors.torch import save_file

    target = gguf_copy_dir(spec.local_path(), spec.dtype)
    tmp = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".partial-"))
        config = copy.deepcopy(model.config)
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # the weights are dequantized: a plain checkpoint
        config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        state = model.state_dict()
        if config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file({k: v.detach().cpu().contiguous() for k, v in state.items()}, tmp / "model.safetensors",
                  metadata={"format": "pt"})
        AutoTokenizer.from_pretrained(where, **extra).save_pretrained(tmp)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
    except (OSError, RuntimeError, ValueError) as exc:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        log.warning("could not keep a converted copy of %s in %s: %s", spec.path, target, _first_line(exc))
        return
    log.info("kept a converted copy of %s in %s", spec.path, target)


def model_source(spec: ModelSpec) -> tuple[str, dict[str, Any]]:
    """``sources.model_source``, its "not cached and no hub" line saying how much memory the weights would need."""
    from lssp.models.catalog import memory_note

    try:
        return _model_source(spec)
    except UserError as exc:
        if "Hugging Face cache" not in str(exc):
            raise
        raise UserError(f"{exc}{memory_note(spec)}") from None


def load_tokenizer(spec: ModelSpec) -> PreTrainedTokenizerBase | None:
    if spec.tokenizer:
        sub = ModelSpec(name=spec.name, path=spec.tokenizer, base_dir=spec.base_dir)
        where, extra = model_source(sub)
    elif spec.is_random:
        return None
    else:
        where, extra = model_source(spec)
    try:
        return AutoTokenizer.from_pretrained(where, **extra)
    except OSError as exc:
        raise UserError(f"model {spec.name!r}: cannot load tokenizer from {where}: {_first_line(exc)}") from None


def load_model(spec: ModelSpec, device: str | None = None, draft: bool = False,
               compile_fallback: bool = False, target: LoadedModel | None = None) -> LoadedModel:
    """Load one registry entry, placed and quantized as it says (``device`` overrides placement;
    a ``draft`` is kept whole on one GPU unless its entry says otherwise). Where ``compile`` is
    asked and cannot be done, ``compile_fallback`` runs it uncompiled instead of refusing. A feature
    head (EAGLE) is bound to ``target``, whose embeddings and output layer it reads."""
    head_folder = feature_head_folder(spec)
    if spec.quantization == "auto" and head_folder is None:
        from lssp.models.calibration import resolve_auto

        on_cpu = device == "cpu" if device is not None else torch.cuda.device_count() == 0
        spec = resolve_auto(spec, on_cpu, lambda candidate: load_model(candidate, device="cpu").model)
    dtype: torch.dtype | str = DTYPES.get(spec.dtype, "auto")
    if head_folder is not None:
        return load_feature_draft(spec, head_folder, dtype, target)
    placement = _placement(spec, device, draft)
    if spec.quantization in GPU_WEIGHT_ONLY and not spec.is_random and _lands_on_gpu(placement) \
            and not has_subset_head(model_source(spec)[0]):  # such a draft keeps its dtype on a GPU
        spec = on_gpu_weight_only(spec)
    if spec.is_random and spec.quantization in BITSANDBYTES_QUANTIZATIONS:
        raise UserError(f"model {spec.name!r}: random weights are built without bitsandbytes "
                        f"(quantization: {spec.quantization}); use quantization: none")
    kwargs: dict[str, Any] = {"dtype": dtype, **placement, **_quantization(spec, dtype)}
    if spec.attn_implementation:
        kwargs["attn_implementation"] = spec.attn_implementation
    if spec.is_random:
        model = _random_model(spec, dtype, placement)
    else:
        where, extra = model_source(spec)
        log.info("loading %s from %s %s", spec.name, where, extra)
        try:
            if has_subset_head(where):
                if spec.quantization in BITSANDBYTES_QUANTIZATIONS:
                    raise UserError(f"model {spec.name!r}: a draft with a frequent-token head loads without bitsandbytes")
                torch_dtype = dtype if isinstance(dtype, torch.dtype) else torch.float32
                model = load_subset_head_model(where, torch_dtype, _single_device(placement["device_map"]))
            else:
                with _no_conversion_bar("gguf_file" in extra):
                    model = AutoModelForCausalLM.from_pretrained(where, **kwargs, **extra)
                if "gguf_file" in extra:
                    save_gguf_copy(model, spec, where, extra)
        except OSError as exc:
            raise UserError(f"model {spec.name!r}: cannot load {where}: {_first_line(exc)}") from None
    if spec.forward == "compact":
        model = compact(model, spec)  # first, so that a CPU quantization also covers its fused layers
    if spec.quantization in CPU_QUANTIZATIONS:
        model = cpu_quantize(model, spec)
    model.eval()
    if spec.compile:
        compile_decode(model, spec, compile_fallback)
    return LoadedModel(spec, model, load_tokenizer(spec))


@contextlib.contextmanager
def _no_conversion_bar(gguf: bool) -> Iterator[None]:
    """transformers' GGUF conversion draws a tqdm bar of its own, which its progress-bar switch does not reach (in a
    piped log, ~30 lines of 90 columns): off unless the logs are at INFO (-v)."""
    if not gguf or log.isEnabledFor(logging.INFO):
        yield
        return
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    bar = gguf_utils.tqdm
    gguf_utils.tqdm = lambda iterable, **_: iterable
    try:
        yield
    finally:
        gguf_utils.tqdm = bar


def feature_head_folder(spec: ModelSpec) -> Path | None:
    """The folder of an EAGLE head entry (a local folder in that layout, or ``speculative_method: eagle`` or
    ``eagle3`` on a hub id, downloaded now), None for any other entry."""
    from lssp.models.eagle import is_feature_head

    if spec.is_random or spec.is_gguf:
        return None
    local = spec.local_path()
    if local is not None:
        return local if local.is_dir() and is_feature_head(local) else None
    if spec.speculative_method not in ("eagle", "eagle3"):
        return None
    from huggingface_hub import snapshot_download

    from lssp.models.hub import require_cached_or_online

    require_cached_or_online(spec.path, spec.revision, f"model {spec.name!r}")
    try:
        return Path(snapshot_download(spec.path, revision=spec.revision,
                                      allow_patterns=["*.json", "*.safetensors", "pytorch_model*.bin"]))
    except Exception as exc:  # noqa: BLE001 - offline, gated, missing: one line
        raise UserError(f"model {spec.name!r}: cannot fetch the EAGLE head {spec.path}: {_first_line(exc)}") from None


def load_feature_draft(spec: ModelSpec, folder: Path, dtype: torch.dtype | str, target: LoadedModel | None) -> LoadedModel:
    """An EAGLE head bound to ``target``, in the entry's dtype (and dynamic quantization on a CPU)."""
    from lssp.models.eagle import FeatureDraft, check_head_fits, load_feature_head
    from lssp.models.eagle3 import Eagle3Draft, is_eagle3_head, load_eagle3_head

    if target is None:
        raise UserError(f"model {spec.name!r} is a feature head (EAGLE): it drafts for a target and cannot run alone")
    if spec.quantization == "auto":  # the target's format, where it has a CPU one
        quantization = target.spec.quantization if target.spec.quantization in CPU_QUANTIZATIONS else "none"
        spec = replace(spec, quantization=quantization, dtype=target.spec.dtype)
        dtype = DTYPES.get(spec.dtype, "auto")
    if spec.quantization in BITSANDBYTES_QUANTIZATIONS or spec.compile:
        raise UserError(f"model {spec.name!r}: a feature head runs without bitsandbytes and uncompiled")
    weights = target.model.get_input_embeddings().weight
    torch_dtype = dtype if isinstance(dtype, torch.dtype) else weights.dtype
    if is_eagle3_head(folder):
        model: PreTrainedModel = Eagle3Draft(load_eagle3_head(folder, target.model, spec.name), target.model,
                                             torch_dtype)
        if spec.quantization in WEIGHT_ONLY_QUANTIZATIONS and model_device(model).type == "cpu":
            model = weight_only_quantize(model, spec.quantization, torch.float32)[0]  # its Linear layers only
        elif spec.quantization in CPU_QUANTIZATIONS:
            log.info("%s: an EAGLE-3 head runs in %s (%s is for EAGLE-1/2 heads and models)", spec.name,
                     str(torch_dtype).removeprefix("torch."), spec.quantization)
    else:
        head = load_feature_head(folder, spec.name)
        check_head_fits(head, target.model, spec.name)
        model = FeatureDraft(head, target.model, torch_dtype)
        if spec.quantization in CPU_QUANTIZATIONS:
            model = cpu_quantize(model, spec)
    has_tokenizer = any((folder / name).exists() for name in ("tokenizer.json", "tokenizer_config.json"))
    return LoadedModel(spec, model.eval(), load_tokenizer(spec) if has_tokenizer or spec.tokenizer else target.tokenizer)


def compile_decode(model: PreTrainedModel, spec: ModelSpec, fallback: bool = False) -> None:
    """Put the compact forward's decode steps under torch.compile (CUDA graphs on a GPU unless the entry
    names another mode), or say in one line why not (with ``fallback``, a warning, and it runs uncompiled)."""
    if getattr(model, "one_call", False):
        log.info("%s: its decoder layers run in one call of our kernel (q4_1): nothing to compile", spec.name)
        return
    reason = _why_not_compilable(model)
    if reason:
        if fallback:
            log.warning("%s runs uncompiled: %s", spec.name, reason)
            return
        raise UserError(f"model {spec.name!r} cannot be compiled: {reason} (--compile-fallback runs it uncompiled)")
    on_gpu = model_device(model).type == "cuda"
    mode = spec.compile if isinstance(spec.compile, str) else "reduce-overhead" if on_gpu else "default"
    model.compile_decode(mode)


def _why_not_compilable(model: PreTrainedModel) -> str | None:
    if not isinstance(model, CompactLlama):
        return "torch.compile runs the compact forward only ('forward: compact' or --compile on a Llama model)"
    if any(isinstance(m, DynamicLinear) for m in model.modules()):
        return "dynamically quantized layers (quantization: dynamic-*) are opaque to torch.compile; use quantization: none"
    try:
        torch.compile(lambda x: x * 2 + 1, fullgraph=True)(torch.ones(2, device=model_device(model)))
    except Exception as exc:  # noqa: BLE001 - whatever stops inductor (no compiler, unsupported platform) is the reason
        return f"torch.compile fails here: {_first_line(exc)}"
    return None


def compact(model: PreTrainedModel, spec: ModelSpec) -> CompactLlama:
    """``model`` behind the compact forward, or a one-line error saying why it cannot be."""
    try:
        return CompactLlama(model).eval()
    except ValueError as exc:
        raise UserError(f"model {spec.name!r}: {exc}") from None


def weight_only_dtype(spec: ModelSpec) -> torch.dtype:
    """The dtype a weight-only entry computes the rest of the model in: for int4/int8 bfloat16 (the kernels' own
    activations, no conversion at each layer) where the entry asks for it and the CPU computes bf16 natively, else
    float32 (q4_1's kernel takes float32)."""
    from lssp.report.results import native_bf16

    bf16 = spec.quantization != "q4_1" and spec.dtype in ("bfloat16", "auto") and native_bf16()
    return torch.bfloat16 if bf16 else torch.float32


def set_cache_dtype(model: FusedDecoder, spec: ModelSpec) -> None:
    """The entry's ``kv_cache`` where our one-call decoder runs a model with a cache of its own (a feature head's
    follows its features) over heads of 64 or 128 (it reads float16 keys and values of those); elsewhere one log
    line says it is not applied."""
    if spec.kv_cache in (None, "float32"):
        return
    if isinstance(model, CompactLlama) and model.one_call and model.head_dim in (64, 128):
        model.cache_dtype = torch.float16
    else:
        log.info("%s: kv_cache %s applies to a model's own one-call decoder over heads of 64 or 128; keeping float32",
                 spec.name, spec.kv_cache)


def cpu_quantize(model: PreTrainedModel, spec: ModelSpec) -> PreTrainedModel:
    """Every Linear layer as a dynamically quantized one (dynamic-*: fp16 or int8 weights, fp32 compute) or a
    weight-only one (int4, int8: ``lssp.models.weight_only``).

    The rest of the model (embeddings, norms) runs in float32 (weight-only: ``weight_only_dtype``). This is a CPU
    technique: on a GPU the model is left in the entry's dtype.
    """
    if model_device(model).type != "cpu":
        log.info("%s: %s applies on the CPU only; keeping %s on %s", spec.name, spec.quantization, spec.dtype,
                 model_device(model))
        return model
    if spec.quantization in WEIGHT_ONLY_QUANTIZATIONS:
        model, kept = weight_only_quantize(model, spec.quantization, weight_only_dtype(spec))
        if spec.quantization == "q4_1" and isinstance(model, FusedDecoder):
            model.row_attention = True  # each position of a verification computed as in a one-token forward
            model._block_stack()  # its weights laid out for the one-call decoder now, not at the first forward
            set_cache_dtype(model, spec)
        if kept:
            log.info("%s: %d Linear layers stay float (shapes the %s kernel does not take)", spec.name, kept,
                     spec.quantization)
        return model
    import warnings

    from torch.ao.quantization import quantize_dynamic

    weights = torch.float16 if spec.quantization == "dynamic-fp16" else torch.qint8
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization announces its move to torchao
        model = model.to(torch.float32)
        return quantize_dynamic(model, {torch.nn.Linear}, dtype=weights, inplace=True)


def _random_model(spec: ModelSpec, dtype: torch.dtype | str, placement: dict[str, Any]) -> PreTrainedModel:
    """Random weights built directly where they go (no download, no CPU copy first): on one device,
    or, with ``max_memory`` (from ``gpus`` or the entry's own), over the devices the balanced placement picks."""
    config = random_config(spec)
    torch_dtype = dtype if isinstance(dtype, torch.dtype) else torch.float32
    if "max_memory" not in placement:
        with torch.device(_single_device(placement["device_map"])):
            return AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    from accelerate import dispatch_model
    from accelerate.utils import set_module_tensor_to_device

    from lssp.models.placement import empty_model, place_target

    model = empty_model(config, torch_dtype)
    device_map = place_target(model, spec.name, "16-bit", placement["max_memory"]).device_map
    if "disk" in device_map.values() or ("cpu" in device_map.values() and "cpu" not in placement["max_memory"]):
        raise UserError(f"model {spec.name!r} does not fit on the memory its entry allows; "
                        "`llamassp.py plan` shows where it would go")
    std = getattr(config, "initializer_range", 0.02)
    for name, param in list(model.named_parameters()):
        where = _module_device(name, device_map)
        value = torch.empty(param.shape, dtype=param.dtype, device=where)
        if name.endswith(".bias"):
            value.zero_()
        elif value.dim() == 1:  # norm weights
            value.fill_(1.0)
        else:
            value.normal_(0.0, std)
        set_module_tensor_to_device(model, name, where, value=value)
    model.tie_weights()
    return dispatch_model(model, device_map)


def _module_device(name: str, device_map: dict[str, int | str]) -> int | str:
    """The device accelerate's map gives the module holding parameter ``name`` (its longest matching prefix)."""
    owner = max((m for m in device_map if m == "" or name == m or name.startswith(m + ".")), key=len)
    return device_map[owner]


def _single_device(device_map: str) -> str:
    """The one device a model built outside from_pretrained goes to: the first GPU if any, else the CPU."""
    if device_map in ("auto", "balanced", "sequential"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device_map


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


PROBE_TEXT = "Speculative sampling: 12 * 34 = 408, naïve café, 日本語, def f(x):\n    return x ** 2"


def check_compatible(target: ModelHandle, draft: ModelHandle) -> int:
    """Refuse a draft whose tokenizer differs from the target's; return the target's logit width.

    Tokenizers must agree on every string -> id mapping and on special tokens. The embedding matrices may be padded
    to different sizes (Qwen2.5's 0.5B and 7B, say): SSp verifies against the target's whole law, as RSp samples it,
    the draft proposing within its own width (the residual draws the rest); a loaded draft with fewer input rows
    than the target has logits reads every id the target may emit (``read_any_token``).
    """
    t_tok, d_tok = target.tokenizer, draft.tokenizer
    if t_tok is not None and d_tok is not None:
        t_vocab, d_vocab = t_tok.get_vocab(), d_tok.get_vocab()
        if t_vocab != d_vocab:
            raise IncompatibleModelsError(
                f"draft {draft.name!r} does not share target {target.name!r}'s tokenizer "
                f"({len(t_vocab)} vs {len(d_vocab)} tokens); first differences: {_first_differences(t_vocab, d_vocab)}"
            )
        for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
            if getattr(t_tok, attr) != getattr(d_tok, attr):
                raise IncompatibleModelsError(
                    f"draft {draft.name!r} and target {target.name!r} disagree on {attr}: "
                    f"{getattr(d_tok, attr)} vs {getattr(t_tok, attr)}"
                )
        t_ids, d_ids = t_tok(PROBE_TEXT).input_ids, d_tok(PROBE_TEXT).input_ids
        if t_ids != d_ids:
            at = next(i for i, (a, b) in enumerate(zip(t_ids + [None], d_ids + [None])) if a != b)
            raise IncompatibleModelsError(
                f"draft {draft.name!r} and target {target.name!r} tokenize the same text differently from token {at}: "
                f"{t_ids[at:at + 5]} vs {d_ids[at:at + 5]}"
            )
    widths = [logit_width(m.model) if isinstance(m, LoadedModel) else m.vocab_size for m in (target, draft)]
    if t_tok is None and d_tok is None and widths[0] != widths[1]:
        raise IncompatibleModelsError(
            f"draft {draft.name!r} ({widths[1]} logits) and target {target.name!r} ({widths[0]}) have no tokenizer to compare "
            "and different vocabulary sizes"
        )
    if isinstance(draft, LoadedModel):
        read_any_token(draft.model, widths[0])
    return widths[0]


def read_any_token(model: torch.nn.Module, width: int) -> bool:
    """Let ``model`` read any id below ``width`` where its input embeddings have fewer rows (ids the target may emit
    in its padded rows): such an id reads the last row. Only what the draft proposes changes, and SSp stays exact
    (each draft is checked against the law it was drawn from). True where it was needed."""
    embeddings = model.get_input_embeddings()
    rows = getattr(embeddings, "num_embeddings", width)
    if rows >= width or getattr(embeddings, "_reads_any_token", False):
        return False
    embeddings.register_forward_pre_hook(lambda module, args: (args[0].clamp(max=rows - 1), *args[1:]))
    embeddings._reads_any_token = True
    return True


def _first_differences(a: dict[str, int], b: dict[str, int], limit: int = 3) -> str:
    a_by_id = {i: s for s, i in a.items()}
    b_by_id = {i: s for s, i in b.items()}
    ids = sorted(i for i in set(a_by_id) | set(b_by_id) if a_by_id.get(i) != b_by_id.get(i))[:limit]
    return "; ".join(f"id {i}: {a_by_id.get(i)!r} (target) vs {b_by_id.get(i)!r} (draft)" for i in ids)
