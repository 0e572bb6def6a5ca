"""TensorFold's template family: dense Qwen3-style GQA attention (HF `qwen3`), small enough to copy.

    model.py   the config record and the forward (StepPlan + KvStore -> logits)
    load.py    HF checkpoint names -> the model's weights
    plugin.py  the hook implementations the core calls (entry point `example` in group `tensorfold`)
"""

from tensorfold_example.model import ExampleConfig, ExampleModel

__all__ = ["ExampleConfig", "ExampleModel"]
