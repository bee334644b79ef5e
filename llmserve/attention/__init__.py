"""Paged attention: metadata, KV-cache layout, torch reference paths and the CPU kernel."""
from llmserve.attention.backend import (AttentionMetadata, PagedAttention, build_attn_metadata,
                                        get_kv_cache_shape, write_to_kv_cache)

__all__ = ["AttentionMetadata", "PagedAttention", "build_attn_metadata", "get_kv_cache_shape",
           "write_to_kv_cache"]
