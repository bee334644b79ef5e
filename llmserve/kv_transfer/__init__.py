"""KV connectors (vLLM's ``vllm.distributed.kv_transfer``): the connector seam
(``base.py``), the registry (``factory.py``) and the disk tier (``shared_storage.py``,
``disk_store.py``). Imports no torch (the scheduler side uses it)."""
from llmserve.kv_transfer.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole
from llmserve.kv_transfer.factory import KVConnectorFactory

__all__ = ["KVConnectorBase_V1", "KVConnectorMetadata", "KVConnectorRole", "KVConnectorFactory"]
