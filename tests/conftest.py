"""Tiny random Llama models built in-process: no downloads."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lssp.models.eagle import FeatureHead, head_config

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# One intra-op thread: these models are too small to gain from a second, and on a busy 2-core machine
# every op that opens a parallel region (softmax does, even over 8 logits) waits for a core, ~1 ms
# a call: the sampling law tests ran ~10x slower with 2 threads while other processes ran.
torch.set_num_threads(1)


def tiny_llama(seed: int, vocab_size: int = 64, hidden: int = 32, layers: int = 2, scale: float = 1.0,
               eos: int | None = 1, heads: int = 4, kv_heads: int = 2) -> LlamaForCausalLM:
    """A random Llama small enough to run thousands of forwards in seconds, in float32."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=eos,
        pad_token_id=None,
    )
    model = LlamaForCausalLM(config).eval()
    if scale != 1.0:  # sharpen the output layer so distributions are far from uniform
        with torch.no_grad():
            model.lm_head.weight.mul_(scale)
    return model


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under pytest-xdist, the tests that start real engines (vLLM, llama-server) run on one worker, one after
    another: their module fixtures start once, and two engines never compete for the memory and the cores."""
    for item in items:
        if item.get_closest_marker("vllm") or item.get_closest_marker("llamacpp") or "vllm" in item.nodeid \
                or "llamacpp" in item.nodeid:
            item.add_marker(pytest.mark.xdist_group("engines"))


@pytest.fixture(scope="session", autouse=True)
def _temporary_files_inside_pytests_own(tmp_path_factory):
    """Fallback copies of results (``llamassp-RUNID`` in the temporary folder) go under pytest's basetemp, which
    pytest prunes, rather than into /tmp for good."""
    import tempfile

    base = str(tmp_path_factory.mktemp("tmp"))
    before, tempfile.tempdir = tempfile.tempdir, base
    yield
    tempfile.tempdir = before


@pytest.fixture(scope="session")
def target() -> LlamaForCausalLM:
    return tiny_llama(0, scale=30.0)


@pytest.fixture(scope="session")
def draft() -> LlamaForCausalLM:
    return tiny_llama(1, hidden=16, layers=1, scale=30.0)


@pytest.fixture(scope="session")
def soft_target() -> LlamaForCausalLM:
    """Less peaked than ``target``: sampling and drafts disagree often."""
    return tiny_llama(10, scale=4.0)


@pytest.fixture(scope="session")
def soft_draft() -> LlamaForCausalLM:
    return tiny_llama(11, hidden=16, layers=1, scale=4.0)


CHARS = list("0123456789abcdefghijklmnopqrstuvwxyz \n*=?.,!'")


def char_tokenizer(chars: list[str] = CHARS):
    """A character-level fast tokenizer: 3 special tokens, then one id per character."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def save_tiny(path, seed: int, vocab_size: int = 64, chars: list[str] = CHARS, **kwargs) -> None:
    tiny_llama(seed, vocab_size=vocab_size, **kwargs).save_pretrained(path)
    char_tokenizer(chars).save_pretrained(path)


def save_tiny_head(path, target: LlamaForCausalLM, seed: int) -> None:
    """A random feature head (EAGLE layout) for ``target``, in float32."""
    from lssp.models.eagle import FeatureHead, head_config, save_feature_head

    torch.manual_seed(seed)
    head = FeatureHead(head_config(target.config))
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    save_feature_head(head, path, dtype=torch.float32)


TINY_REGISTRY = """\
default_target: tiny-target
default_draft: tiny-draft
models:
  tiny-target:
    path: ./tiny-target
    dtype: float32
  tiny-draft:
    path: ./tiny-draft
    dtype: float32
  tiny-draft-copy:
    path: ./tiny-draft
    dtype: float32
    prompt_lookup: 2
  tiny-draft-sure:
    path: ./tiny-draft
    dtype: float32
    confidence: 0.5
  tiny-target-8bit:
    path: ./tiny-target
    quantization: 8bit
  tiny-target-fp16dyn:
    path: ./tiny-target
    dtype: bfloat16
    quantization: dynamic-fp16
  tiny-draft-int8dyn:
    path: ./tiny-draft
    quantization: dynamic-int8
  tiny-draft-compact:
    path: ./tiny-draft
    dtype: float32
    forward: compact
  tiny-target-compact:
    path: ./tiny-target
    dtype: float32
    forward: compact
  tiny-target-int4:
    path: ./tiny-target
    dtype: float32
    quantization: int4
    forward: compact
  tiny-target-int8:
    path: ./tiny-target
    dtype: float32
    quantization: int8
  tiny-target-q4:
    path: ./tiny-target
    dtype: float32
    quantization: q4_1
    forward: compact
  tiny-target-q4-compiled:
    path: ./tiny-target
    dtype: float32
    quantization: q4_1
    forward: compact
    compile: true
  tiny-wide-q4:
    path: ./tiny-wide
    dtype: float32
    quantization: q4_1
    forward: compact
  tiny-wide-q4-f16:
    path: ./tiny-wide
    dtype: float32
    quantization: q4_1
    forward: compact
    kv_cache: float16
  tiny-target-q4-f16:  # heads of 8: the one-call decoder keeps its cache in float32
    path: ./tiny-target
    dtype: float32
    quantization: q4_1
    forward: compact
    kv_cache: float16
  tiny-other-vocab:
    path: ./tiny-other
    dtype: float32
  tiny-eagle:
    path: ./tiny-eagle
    dtype: float32
  tiny-target-auto:
    path: ./tiny-target
    dtype: float32
    quantization: auto
    forward: compact
  tiny-eagle-q4:
    path: ./tiny-eagle
    dtype: float32
    quantization: q4_1
  tiny-eagle-auto:
    path: ./tiny-eagle
    dtype: float32
    quantization: auto
  tiny-random:
    init: random
    tokenizer: ./tiny-target
    dtype: float32
    config: {model_type: llama, vocab_size: 64, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2,
             num_attention_heads: 4, num_key_value_heads: 2}
"""


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A folder with tiny saved models and a models.yaml that points at them."""
    root = tmp_path_factory.mktemp("tiny")
    save_tiny(root / "tiny-target", 0, scale=4.0)
    save_tiny(root / "tiny-draft", 1, hidden=16, layers=1, scale=4.0)
    save_tiny(root / "tiny-other", 2, chars=list(reversed(CHARS)))
    save_tiny_head(root / "tiny-eagle", tiny_llama(0, scale=4.0), seed=3)
    save_tiny(root / "tiny-wide", 4, hidden=256, scale=4.0)  # heads of 64, as a float16 KV cache takes
    (root / "models.yaml").write_text(TINY_REGISTRY)
    return root


def cli(capsys, config: Path, results: Path):
    """The CLI as a user calls it (output not a terminal, so 80 columns), on registry ``config`` with results in
    ``results`` unless a call names others; each call returns (exit code, stdout, stderr)."""
    from lssp.cli import main

    def _run(*args: str, config: Path | None = None, results: Path | None = None) -> tuple[int, str, str]:
        code = main(["--config", str(config or default_config), "--results-dir", str(results or default_results), *args])
        out = capsys.readouterr()
        return code, out.out, out.err

    default_config, default_results = config, results
    return _run


@pytest.fixture()
def run(tiny_dir, tmp_path, capsys):
    """``cli`` on the tiny registry."""
    return cli(capsys, tiny_dir / "models.yaml", tmp_path / "results")


def random_head(target, seed: int, token_ids: list[int] | None = None, bias: bool = False, scale: float = 1.0) -> FeatureHead:
    torch.manual_seed(seed)
    head = FeatureHead(head_config(target.config, token_ids=token_ids), bias=bias).eval()
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2 * scale)
    return head
