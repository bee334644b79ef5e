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

from typing import Any

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
