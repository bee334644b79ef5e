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

    @classmethod
    def import_plugin(cls, plugin_path: str) -> None:
        """Run the Python file ``plugin_path`` as a module named after the file (vLLM's
        ``import_from_path``), so that its ``register_module`` calls register parsers here.
        Raises ValueError (with the cause) for a missing file or one that fails to import;
        vLLM only logs that, and the server then fails later on an unknown parser name."""
        import importlib.util
        import os
        import sys

        if not os.path.isfile(plugin_path):
            raise ValueError(f"{cls.kind} plugin {plugin_path!r} is not a file")
        name = os.path.splitext(os.path.basename(plugin_path))[0]
        spec = importlib.util.spec_from_file_location(name, plugin_path)
        if spec is None or spec.loader is None:
            raise ValueError(f"{cls.kind} plugin {plugin_path!r} cannot be imported (not a Python file)")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as e:  # noqa: BLE001 - any error of the user's file is reported as such
            sys.modules.pop(name, None)
            raise ValueError(f"{cls.kind} plugin {plugin_path!r} failed to import: "
                             f"{type(e).__name__}: {e}") from e
