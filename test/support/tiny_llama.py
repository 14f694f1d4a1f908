"""Build a tiny Llama checkpoint offline: random weights and a byte-level BPE trained on real text.

Used by the serving tests of plain SGLang on the CPU; it needs no network and takes seconds.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from sglang_tree_v4.testing import prompts

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", chat_template=CHAT_TEMPLATE)


def build(out: Path, seed: int = 0) -> Path:
    """Write config, safetensors and tokenizer of a 2-layer Llama to ``out``; return it."""
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer([r["question"] for r in prompts.gsm8k("train")[:400]], vocab_size=600)
    tokenizer.save_pretrained(out)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False, torch_dtype="float32")
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)
    # Greedy decoding of random weights loops on a few tokens; that is fine for equality tests.
    (out / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    return out
