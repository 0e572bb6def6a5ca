"""TensorFold's Nemotron-H family: Mamba2 + attention (no RoPE) + relu² MLP or routed MoE, one mixer a layer (HF
nemotron_h: Nemotron-H, Nemotron-Nano v2, Nemotron-3).

    config.py     the config record, the layer schedule, the dt policy, what is refused
    shapes.py     real shapes as config.json dicts (Nemotron-3-Nano-30B-A3B, Nemotron-H-8B, HF's class default)
    norms.py      the block RMSNorm and Mamba2's grouped gated RMSNorm
    mamba.py      Mamba2: conv tail, the SSD scan (chunked on the absolute grid, recurrent decode), gated norm
    attention.py  GQA over the KvStore's rows, no RoPE
    mlp.py        the relu² MLP and the grouped-routing MoE with a shared expert and optional latent
    model.py      the forward (StepPlan + KvStore -> logits)
    load.py       HF checkpoint names -> the model's weights
    plugin.py     the hook implementations the core calls (entry point `nemotron` in group `tensorfold`)
"""
