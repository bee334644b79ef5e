"""Connector registry (vLLM's ``KVConnectorFactory``): a name in
``kv_transfer_config.kv_connector`` -> a class, imported only when used.

Third-party connectors register with ``KVConnectorFactory.register_connector(name,
module_path, class_name)``, or name their module in ``kv_connector_module_path`` (vLLM's
field), and subclass ``llmserve.kv_transfer.base.KVConnectorBase_V1``.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable

from llmserve.kv_transfer.base import KVConnectorBase_V1, KVConnectorRole


class KVConnectorFactory:
    """Class-level registry of connector loaders (name -> a callable returning the class)."""

    _registry: dict[str, Callable[[], type]] = {}

    @classmethod
    def register_connector(cls, name: str, module_path: str, class_name: str) -> None:
        """Register ``module_path.class_name`` under ``name``. Raises ValueError when
        ``name`` is taken."""
        if name in cls._registry:
            raise ValueError(f"Connector '{name}' is already registered.")
        cls._registry[name] = lambda: getattr(importlib.import_module(module_path), class_name)

    @classmethod
    def known_connectors(cls) -> list[str]:
        return sorted(cls._registry)

    @classmethod
    def get_connector_class(cls, kv_transfer_config: Any) -> type:
        """The class for ``kv_transfer_config.kv_connector``: a registered name, else the
        class of that name in ``kv_connector_module_path``. Raises ValueError naming the
        known connectors."""
        name = kv_transfer_config.kv_connector
        if name in cls._registry:
            return cls._registry[name]()
        module_path = kv_transfer_config.kv_connector_module_path
        if module_path:
            try:
                connector_cls = getattr(importlib.import_module(module_path), name)
            except (ImportError, AttributeError) as e:
                raise ValueError(f"kv_transfer_config: cannot load connector {name!r} from "
                                 f"kv_connector_module_path={module_path!r}: {e}") from e
            if not (isinstance(connector_cls, type) and issubclass(connector_cls, KVConnectorBase_V1)):
                raise ValueError(f"kv_transfer_config: {module_path}.{name} is not a KVConnectorBase_V1")
            return connector_cls
        raise ValueError(f"kv_transfer_config: unknown kv_connector {name!r}; known connectors: "
                         f"{cls.known_connectors()} (or set kv_connector_module_path)")

    @classmethod
    def create_connector(cls, vllm_config: Any, role: KVConnectorRole) -> KVConnectorBase_V1:
        """Build the ``role`` half of the configured connector."""
        return cls.get_connector_class(vllm_config.kv_transfer_config)(vllm_config, role)


KVConnectorFactory.register_connector("SharedStorageConnector", "llmserve.kv_transfer.shared_storage",
                                      "SharedStorageConnector")
KVConnectorFactory.register_connector("OffloadingConnector", "llmserve.kv_transfer.shared_storage",
                                      "OffloadingConnector")
