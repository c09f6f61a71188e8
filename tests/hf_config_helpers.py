"""What tests/test_hf_config.py and tests/test_hf_config_rope.py share: the config.json
of two real checkpoints, Llama 3.1 8B (llama3 RoPE scaling) and Qwen2.5 7B (yarn)."""

LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"],
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}


QWEN25_7B = {  # Qwen/Qwen2.5-7B-Instruct config.json, with the model card's yarn added
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "max_position_embeddings": 32768,
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "vocab_size": 152064,
    "rope_scaling": {"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"},
}
