"""Typed LoRA errors. Each is a ValueError (the serving layer's 400) that names the field
at fault (``.param``); ``LoRANotFoundError`` is the 404 of an unknown adapter.

Across the process boundary a utility call's exception arrives as the text
``"<ClassName>: <message>"``; :func:`reraise_lora_error` turns it back into the type."""
from __future__ import annotations

from typing import Optional


class LoRAAdapterError(ValueError):
    """An adapter that cannot be loaded or used; ``param``: the field named (e.g.
    ``lora_path``, ``r``, ``target_modules``, ``modules_to_save``, ``max_cpu_loras``)."""

    def __init__(self, message: str, param: Optional[str] = None) -> None:
        super().__init__(message)
        self.param = param


class LoRANotFoundError(LoRAAdapterError):
    """No adapter is loaded under this id or name (vLLM answers 404)."""


_TYPES = {cls.__name__: cls for cls in (LoRAAdapterError, LoRANotFoundError)}


def reraise_lora_error(error: BaseException) -> None:
    """Raise the typed error an engine-side failure message carries (``"LoRAAdapterError:
    msg [param=...]"``); returns when it is not one of ours."""
    text = str(error)
    name, sep, rest = text.partition(": ")
    cls = _TYPES.get(name)
    if cls is None or not sep:
        return
    message, _, param = rest.rpartition(" [param=")
    if not _ or not param.endswith("]"):
        raise cls(rest) from None
    raise cls(message, param[:-1]) from None


def error_from_text(text: str) -> ValueError:
    """The error a refused request's message carries: the typed one (its ``param`` kept,
    so the server's 400 names the field) when ``text`` is :func:`failure_text`'s form,
    else a plain ValueError(text)."""
    try:
        reraise_lora_error(ValueError(text))
    except LoRAAdapterError as e:
        return e
    return ValueError(text)


def failure_text(error: LoRAAdapterError) -> str:
    """The wire form :func:`reraise_lora_error` reads."""
    suffix = f" [param={error.param}]" if error.param else ""
    return f"{type(error).__name__}: {error}{suffix}"


def lora_ids(result: object) -> set[int]:
    """``list_loras``' answer as a set: a set, the list msgpack made of it, or one list per
    data-parallel rank (the ids every rank has)."""
    if isinstance(result, (set, frozenset)):
        return set(result)
    items = list(result or [])
    if items and all(isinstance(r, (list, tuple, set)) for r in items):
        return set.intersection(*(set(r) for r in items))
    return set(items)
