"""A pretrained model and instruction data made locally for the fine-tuning tests and
benchmarks: a tiny Llama saved with `save_pretrained` (sharded safetensors with an index, or
one file), a byte-level BPE tokenizer with a ChatML chat template, and JSONL chat rows.
Nothing is downloaded."""

from __future__ import annotations

import json
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def make_tokenizer(out: Path, corpus: list[str], vocab_size: int = 320) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", bos_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))


def chat_rows(n: int) -> list[dict]:
    """Arithmetic questions and their answers: learnable by a tiny model in a few steps."""
    rows = []
    for i in range(n):
        a, b = i % 17, (i * 7) % 13
        rows.append({"messages": [
            {"role": "system", "content": "You add numbers."},
            {"role": "user", "content": f"What is {a} + {b}?"},
            {"role": "assistant", "content": f"{a} + {b} = {a + b}."}]})
    return rows


def make_model_dir(out: Path, *, tie: bool = True, max_shard: str | None = None,
                   layers: int = 2, hidden: int = 64, seed: int = 0) -> Path:
    """A tiny LlamaForCausalLM and its tokenizer in Hugging Face layout under `out`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    corpus = [json.dumps(r) for r in chat_rows(64)] + [CHAT_TEMPLATE]
    make_tokenizer(out, corpus)
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=320, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=tie, bos_token_id=0, eos_token_id=2,
                         pad_token_id=0)
    model = LlamaForCausalLM(config)
    kwargs = {"max_shard_size": max_shard} if max_shard else {}
    model.save_pretrained(str(out), **kwargs)
    return out


def make_chat_data(out: Path, n: int = 200) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in chat_rows(n)))
    return out
