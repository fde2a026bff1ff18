#!/usr/bin/env python3
"""Writes a tiny Llama model directory for vLLM's `--load-format dummy`.

No hub access: the architecture is a config (vocab 32000, hidden 128, two
layers, head_dim 64) whose weights vLLM fills with dummy values, and the
tokenizer is the real SentencePiece model that the PyPI package
mistral_common ships (tokenizer.model.v1), converted with transformers'
LlamaTokenizer, plus a chat template with role markers.

    python make_tiny_model.py OUT_DIR
"""
import json
import os
import sys

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['content'] is string %}{% set content = message['content'] %}"
    "{% else %}{% set content = message['content'] | map(attribute='text') | join('') %}{% endif %}"
    "[{{ message['role'] | upper }}] {{ content }}\n"
    "{% endfor %}"
    "{% if tools %}[TOOLS] {{ tools | tojson }}\n{% endif %}"
    "{% if add_generation_prompt %}[ASSISTANT] {% endif %}"
)


def main(out):
    import shutil
    import tempfile

    import mistral_common
    from transformers import LlamaTokenizer

    os.makedirs(out, exist_ok=True)
    spm = os.path.join(os.path.dirname(mistral_common.__file__), "data", "tokenizer.model.v1")
    # from_pretrained converts a directory's tokenizer.model to a fast
    # tokenizer; the vocab_file= constructor does not (transformers 5).
    with tempfile.TemporaryDirectory() as src:
        shutil.copy(spm, os.path.join(src, "tokenizer.model"))
        tokenizer = LlamaTokenizer.from_pretrained(src, legacy=False, add_bos_token=True)
    if len(tokenizer) != 32000 or tokenizer("hello").input_ids[:1] != [1]:
        sys.exit("tokenizer conversion failed: %d tokens" % len(tokenizer))
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out)

    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 32000,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "max_position_embeddings": 16384,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    }
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": 2}, f)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
