"""The one rule for a name a user makes a served name: a LoRA adapter's ``lora_name``
(``POST /v1/load_lora_adapter``, ``--lora-modules`` in both forms, the offline
``LoRARequest``) and each ``--served-model-name`` (also in ``--extra-model`` JSON).

Such a name reaches log lines and Prometheus label values verbatim (``model_name``,
``vllm:lora_requests_info``'s ``running_lora_adapters``), so it must not be able to
forge a log line or split a label. The rule (:func:`check_served_name`):

- a ``str`` of 1 to :data:`MAX_SERVED_NAME_CHARS` characters;
- every character printable in Python's sense (``str.isprintable``): no control or
  format character (Unicode categories Cc, Cf: newline, tab, ESC, NUL, zero-width and
  bidi controls), no surrogate, private-use or unassigned code point (Cs, Co, Cn), no
  line or paragraph separator (Zl, Zp: U+2028 ends a line for many log viewers), and
  no space other than U+0020. These are exactly the characters ``repr()`` escapes, so a
  valid name logged as is reads the same as its ``repr``;
- no leading or trailing whitespace (``" a"`` and ``"a"`` would look the same);
- no comma: ``vllm:lora_requests_info`` joins adapter names with ``","`` (vLLM's
  format), so a comma would make one adapter read as two.

Everything model ids use stays allowed: letters of any script, digits, ``/ : . - _ @ +``
and inner spaces, e.g. ``org/model:tag``, ``ft:gpt-4o-mini:acme::abc123``,
``Qwen/Qwen2.5-0.5B-Instruct``, ``llama3.2:1b-q4_K_M``.
"""
from __future__ import annotations

from typing import Any, Iterable, Optional

from llmserve.sampling_params import SamplingParamsError

# OpenAI fine-tune ids are ~60 characters and Hugging Face repo ids at most 96
# (namespace + name); 256 leaves room for long local names without letting one name
# make every log line and scrape hundreds of KB longer.
MAX_SERVED_NAME_CHARS = 256


def served_name_problem(name: Any) -> str | None:
    """Why ``name`` breaks the served-name rule (module docstring), or None when it
    follows it. The reason quotes offending characters with ``repr``, never raw."""
    if not isinstance(name, str):
        return f"must be a string, got {type(name).__name__}"
    if not name:
        return "must not be empty"
    if len(name) > MAX_SERVED_NAME_CHARS:
        return f"must be at most {MAX_SERVED_NAME_CHARS} characters, got {len(name)}"
    bad = next((c for c in name if not c.isprintable()), None)
    if bad is not None:
        return (f"must not contain control, format, separator or unassigned characters, "
                f"found {bad!r} (U+{ord(bad):04X})")
    if name != name.strip():
        return "must not start or end with whitespace"
    if "," in name:
        return "must not contain ',' (vllm:lora_requests_info lists adapter names separated by commas)"
    return None


def check_served_name(name: Any, param: str) -> str:
    """``name`` when it follows the served-name rule; else SamplingParamsError (a
    ValueError: HTTP 400) with ``param`` set and a message naming ``param`` and quoting
    the name with ``repr`` (so the message itself is safe to log)."""
    problem = served_name_problem(name)
    if problem is not None:
        shown = repr(name) if len(repr(name)) <= 80 else repr(name)[:77] + "..."
        raise SamplingParamsError(f"{param} {shown} is not a valid name: it {problem}.", param)
    return name


# Ollama's tag of a name written without one (its types/model/name.go): ``m`` is ``m:latest``.
DEFAULT_TAG = "latest"


def has_tag(name: str) -> bool:
    """Whether ``name`` ends in a tag as Ollama reads one: a ``:`` after the last ``/``
    (``llama3:8b`` has one, ``host:5000/m`` has none)."""
    return name.rfind(":") > name.rfind("/")


def latest_match(requested: Optional[str], names: Iterable[str]) -> Optional[str]:
    """The name of ``names`` (served names, or the names a key may call) that ``requested``
    calls when the two are written alike or differ only by Ollama's default tag
    ``:latest`` (``m:latest`` calls ``m``; ``m`` calls ``m:latest``); None for none.
    Case counts (the Ollama routes add case folding: ollama/names.py). This is how every
    route reads a model name, so the ``name:latest`` an Ollama client takes from
    ``/api/tags`` (VS Code Copilot Chat sends it to ``/v1/chat/completions``) calls the
    model served as ``name``; ``m:1b`` stays another model."""
    if not requested:
        return None
    names = list(names)
    if requested in names:
        return requested
    suffix = f":{DEFAULT_TAG}"
    if requested.endswith(suffix) and has_tag(requested):
        bare = requested[:-len(suffix)]
        if bare in names and not has_tag(bare):
            return bare
    elif not has_tag(requested) and requested + suffix in names:
        return requested + suffix
    return None


def ollama_listed_name(name: str) -> str:
    """``name`` as Ollama lists it (``/api/tags``, ``/api/ps``): with ``:latest`` when it
    has no tag, so clients that compare listed names with ``NAME:latest``
    (langchain-ollama's ``validate_model_on_init``) find it; :func:`latest_match` makes
    the listed name call the model on every route."""
    return name if has_tag(name) else f"{name}:{DEFAULT_TAG}"
