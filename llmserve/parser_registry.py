"""A registry of parser classes by name, shared by vLLM's ``ToolParserManager`` and
``ReasoningParserManager`` (same calls: ``register_module`` as a decorator or a call,
a lookup that names the known parsers, ``list_registered``)."""
from __future__ import annotations

from typing import Any, Optional, Union


class ParserRegistry:
    """Subclasses set ``kind`` (for messages) and their own ``_registry`` dict."""

    kind: str = "parser"
    _registry: dict[str, type] = {}

    @classmethod
    def _lookup(cls, name: str) -> type:
        """The class registered as ``name``. Raises KeyError naming the known ones."""
        if name not in cls._registry:
            raise KeyError(f"{cls.kind} {name!r} is not registered (known: {sorted(cls._registry)})")
        return cls._registry[name]

    @classmethod
    def register_module(cls, name: Union[str, list[str], None] = None, force: bool = True,
                        module: Optional[type] = None) -> Any:
        """Register ``module`` under ``name`` (its class name when None; a decorator when
        ``module`` is None). Raises KeyError for a taken name unless ``force``."""
        def register(mod: type) -> type:
            names = [name] if isinstance(name, str) else (name or [mod.__name__])
            for n in names:
                if not force and n in cls._registry:
                    raise KeyError(f"{cls.kind} {n!r} is already registered")
                cls._registry[n] = mod
            return mod
        return register(module) if module is not None else register

    @classmethod
    def list_registered(cls) -> list[str]:
        return sorted(cls._registry)
