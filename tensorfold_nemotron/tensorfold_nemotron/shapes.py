"""Real Nemotron-H shapes as config.json dicts, for `tensorfold explain`, the Layout tests and the benchmarks.

Each is a complete `nemotron_h` config (no transformers needed to read it); each also builds HF's model, e.g.
`transformers.NemotronHConfig(**SHAPES["nemotron_h-30b-a3b"])`, as bench/gpu.py builds its shapes.

    nemotron_h-30b-a3b   Nemotron-3-Nano-30B-A3B: 52 layers, 23 Mamba2 / 23 MoE / 6 attention, 128 experts top-6
    nemotron_h-8b        Nemotron-H-8B: dense, 24 Mamba2 / 24 MLP / 4 attention
    nemotron_h-default   HF's NemotronHConfig() class default: 4 layers M E * -
"""

from __future__ import annotations

from typing import Any

COMMON: dict[str, Any] = {
    "model_type": "nemotron_h",
    "architectures": ["NemotronHForCausalLM"],
    "vocab_size": 131072,
    "tie_word_embeddings": False,
    "layer_norm_epsilon": 1e-5,
    "attention_bias": False,
    "mlp_bias": False,
    "use_bias": False,
    "mlp_hidden_act": "relu2",
    "mamba_hidden_act": "silu",
    "conv_kernel": 4,
    "use_conv_bias": True,
    "chunk_size": 128,
    "time_step_min": 0.001,
    "time_step_max": 0.1,
    "time_step_limit": [0.0, float("inf")],
    "mamba_ssm_cache_dtype": "float32",
    "residual_in_fp32": False,
    "head_dim": 128,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}

NANO_30B_A3B: dict[str, Any] = {
    **COMMON,
    "hidden_size": 2688,
    "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
    "num_attention_heads": 32,
    "num_key_value_heads": 2,
    "mamba_num_heads": 64,
    "mamba_head_dim": 64,
    "n_groups": 8,
    "ssm_state_size": 128,
    "intermediate_size": 1856,
    "n_routed_experts": 128,
    "num_experts_per_tok": 6,
    "moe_intermediate_size": 1856,
    "moe_shared_expert_intermediate_size": 3712,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "max_position_embeddings": 262144,
}

DENSE_8B: dict[str, Any] = {
    **COMMON,
    "hidden_size": 4096,
    "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "mamba_num_heads": 128,
    "mamba_head_dim": 64,
    "n_groups": 8,
    "ssm_state_size": 128,
    "intermediate_size": 21504,
    "max_position_embeddings": 8192,
}

CLASS_DEFAULT: dict[str, Any] = {
    **COMMON,
    "hidden_size": 4096,
    "layers_block_type": ["linear_attention", "moe", "full_attention", "mlp"],
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "mamba_num_heads": 128,
    "mamba_head_dim": 64,
    "n_groups": 8,
    "ssm_state_size": 128,
    "intermediate_size": 21504,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 7688,
    "moe_shared_expert_intermediate_size": 7688,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.0,
    "max_position_embeddings": 4096,
}

SHAPES: dict[str, dict[str, Any]] = {
    "nemotron_h-30b-a3b": NANO_30B_A3B,
    "nemotron_h-8b": DENSE_8B,
    "nemotron_h-default": CLASS_DEFAULT,
}
