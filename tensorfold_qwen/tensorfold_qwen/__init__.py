"""TensorFold's Qwen3.5 family: Gated DeltaNet + gated attention, dense and MoE (HF qwen3_5, qwen3_5_moe and their
text-only types).

    config.py     the config record, the layer schedule, what is refused
    layers.py     zero-centred and gated RMSNorm, partial RoPE
    gdn.py        Gated DeltaNet: conv tail, chunked prefill on the absolute grid, recurrent decode
    attention.py  gated attention (q | gate per head), GQA over the KvStore's rows
    mlp.py        SwiGLU MLP and the routed MoE with a shared expert
    model.py      the forward (StepPlan + KvStore -> logits)
    load.py       HF checkpoint names -> the model's weights
    plugin.py     the hook implementations the core calls (entry point `qwen` in group `tensorfold`)
"""

from tensorfold_qwen.config import QwenConfig
from tensorfold_qwen.model import QwenModel

__all__ = ["QwenConfig", "QwenModel"]
