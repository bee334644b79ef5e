"""Tensor parallelism for the Llama-family model (vLLM's column/row-parallel linears and
vocab-parallel LM head), applied to a loaded model: ``shard_llama(model, tp)``.

Each of the T workers keeps:
- attention: its share of the KV heads and the query heads of their GQA groups
  (``qkv_proj`` rows, column-parallel), and the matching input columns of ``o_proj``
  (row-parallel: partial sums, then an all-reduce, then the bias once);
- MLP: its share of the intermediate columns of ``gate_proj``/``up_proj`` (column-parallel)
  and the matching rows of ``down_proj``'s input (row-parallel, all-reduce);
- LM head: its share of the vocabulary rows (vocab-parallel); logits are all-gathered.
The embedding, norms and rotary tables are replicated. Two all-reduces per layer, as vLLM.

Heads are split as evenly as the KV heads allow (vLLM requires T to divide both head
counts; here SmolLM2-135M's 3 KV heads split 2+1 over T=2, so its 9 query heads go 6+3).
T must not exceed the number of KV heads (vLLM would replicate them; not done here).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from llmserve.distributed.parallel_state import TPGroup
from llmserve.ops import batch_invariant


def split_evenly(n: int, parts: int) -> list[tuple[int, int]]:
    """``(start, count)`` of each of ``parts`` near-equal contiguous shares of ``n``."""
    base, extra = divmod(n, parts)
    out, start = [], 0
    for r in range(parts):
        count = base + (1 if r < extra else 0)
        out.append((start, count))
        start += count
    return out


def check_tp_size(hf_config: Any, tp_size: int) -> None:
    """Raise ValueError (naming ``tensor_parallel_size``) when the model cannot be split T ways."""
    if tp_size == 1:
        return
    arch = (getattr(hf_config, "architectures", None) or ["?"])[0]
    if getattr(hf_config, "model_type", None) not in ("llama", "mistral", "qwen2", "qwen3"):
        raise ValueError(f"tensor_parallel_size={tp_size}: tensor parallelism covers the Llama family "
                         f"(Llama, Mistral, Qwen2, Qwen3), not {arch}")
    heads = hf_config.num_attention_heads
    kv = getattr(hf_config, "num_key_value_heads", None) or heads
    if tp_size > kv:
        raise ValueError(f"tensor_parallel_size={tp_size} exceeds the model's {kv} KV heads; use at most {kv}")


class RowParallelLinear(nn.Module):
    """``all_reduce(x @ W_r.T) + b``: this rank's input columns ``W_r [out, in/T]`` (vLLM's
    ``RowParallelLinear`` with ``reduce_results=True``); the bias is added once, after the sum."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], tp: TPGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.clone(), requires_grad=False)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(batch_invariant.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelLMHead:
    """This rank's vocabulary rows ``[vocab_r, hidden]`` of the LM head; ``logits(h)``
    computes the local logits and all-gathers them to ``[N, vocab]`` float32."""

    def __init__(self, weight: torch.Tensor, tp: TPGroup) -> None:
        shares = split_evenly(weight.shape[0], tp.world_size)
        start, count = shares[tp.rank]
        self.weight = weight[start:start + count].contiguous()
        self.sizes = [c for _, c in shares]
        self.tp = tp

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        local = batch_invariant.linear(hidden, self.weight).float()
        return self.tp.all_gather(local, self.sizes, dim=-1)


def _shard_attention(attn: nn.Module, tp: TPGroup) -> None:
    from llmserve.attention.backend import PagedAttention

    group = attn.num_heads // attn.num_kv_heads
    kv_start, kv_count = split_evenly(attn.num_kv_heads, tp.world_size)[tp.rank]
    hd = attn.head_dim
    q_rows = slice(kv_start * group * hd, (kv_start + kv_count) * group * hd)
    k_rows = slice(attn.q_size + kv_start * hd, attn.q_size + (kv_start + kv_count) * hd)
    v_rows = slice(attn.q_size + attn.kv_size + kv_start * hd,
                   attn.q_size + attn.kv_size + (kv_start + kv_count) * hd)
    qkv = attn.qkv_proj
    qkv.weight = nn.Parameter(torch.cat([qkv.weight[r] for r in (q_rows, k_rows, v_rows)]), requires_grad=False)
    qkv.set_packed(None, 0)  # GGUF blocks (rows interleaved by 16): shards run dense
    if qkv.bias is not None:
        qkv.bias = nn.Parameter(torch.cat([qkv.bias[r] for r in (q_rows, k_rows, v_rows)]), requires_grad=False)
    o = attn.o_proj
    attn.o_proj = RowParallelLinear(o.weight[:, q_rows], o.bias, tp)
    # The rows / input columns kept, for LoRA adapters' B / A (llmserve/lora/layers.py).
    qkv.lora_out_index = torch.cat([torch.arange(r.start, r.stop) for r in (q_rows, k_rows, v_rows)])
    attn.o_proj.lora_in_index = torch.arange(q_rows.start, q_rows.stop)
    old = attn.attn
    attn.num_heads, attn.num_kv_heads = kv_count * group, kv_count
    attn.q_size, attn.kv_size = attn.num_heads * hd, kv_count * hd
    attn.attn = PagedAttention(attn.num_heads, hd, kv_count, old.scale, old.sliding_window, old.use_kernel,
                               old.logits_soft_cap)


def _shard_mlp(mlp: nn.Module, tp: TPGroup) -> None:
    i = mlp.intermediate_size
    start, count = split_evenly(i, tp.world_size)[tp.rank]
    gu = mlp.gate_up_proj
    rows = torch.cat([torch.arange(start, start + count), torch.arange(i + start, i + start + count)])
    gu.weight = nn.Parameter(gu.weight[rows].contiguous(), requires_grad=False)
    gu.set_packed(None, 0)
    if gu.bias is not None:
        gu.bias = nn.Parameter(gu.bias[rows].contiguous(), requires_grad=False)
    d = mlp.down_proj
    mlp.down_proj = RowParallelLinear(d.weight[:, start:start + count], d.bias, tp)
    gu.lora_out_index, mlp.down_proj.lora_in_index = rows, torch.arange(start, start + count)
    mlp.intermediate_size = count


@torch.no_grad()
def shard_llama(model: nn.Module, tp: TPGroup) -> nn.Module:
    """Keep this rank's share of a loaded ``LlamaForCausalLM`` (in place; returns it).
    Sets ``model.tp_num_kv_heads`` (this rank's KV heads: the KV cache's shape) and
    ``model.tp_lm_head`` (the vocab-parallel head that ``compute_logits`` uses).
    Raises ValueError as ``check_tp_size``."""
    check_tp_size(model.config, tp.world_size)
    for layer in model.model.layers:
        _shard_attention(layer.self_attn, tp)
        _shard_mlp(layer.mlp, tp)
    weight = model.model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    model.tp_lm_head = VocabParallelLMHead(weight, tp)
    model.lm_head = None  # the full head is no longer used: free it (the tied one is the embedding)
    model.packed_head = None  # nor its GGUF blocks (row-parallel layers run dense: their blocks went with them)
    model.tp_num_kv_heads = model.model.layers[0].self_attn.num_kv_heads if len(model.model.layers) else 0
    return model
