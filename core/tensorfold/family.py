"""A family as the core sees it: its declarations resolved once at startup, checked, with errors naming the plugin."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import attrs
import torch

from tensorfold.chat.api import ChatFormat
from tensorfold.chat.tools import tool_parser
from tensorfold.checkpoint import Checkpoint
from tensorfold.image import ImageFormat
from tensorfold.kv import KvStore
from tensorfold.layout import Layout
from tensorfold.plan import StepPlan
from tensorfold.shard import SINGLE, Shard, TensorParallel

SWITCH_NAME = re.compile(r"^TF_[A-Z0-9_]+$")


DEFAULT_CHAT_FORMAT = ChatFormat(tool_parser=tool_parser("hermes"))   # a family without family_chat_format


class PluginError(Exception):
    """A family plugin answered a hook wrongly; the message names the family and its module."""


@runtime_checkable
class FamilyModel(Protocol):
    """What `family_load` returns: a model whose forward consumes a step plan. It may also offer
    `decode(batch: DecodeBatch, kv) -> [B, V]`, a tensor-only decode step the core captures in CUDA graphs on a
    GPU (docs/hooks.md, engine/graphs.py)."""

    vocab_size: int

    def forward(self, plan: StepPlan, kv: KvStore) -> torch.Tensor:
        """Run one step; return float32 logits [plan.logit_rows, vocab_size]: each share's last row when it samples,
        every row with `every_row` (StreamStep.logit_rows), in plan order."""
        ...


@attrs.frozen
class Declarations:
    """A family's answers for one checkpoint and dtype: what the core plans memory and keeps states from."""

    layout: Layout
    image: ImageFormat
    identity: Mapping[str, str]


@attrs.frozen
class Family:
    """One installed family: its name (the entry point's), its plugin module and its hooks, bound to it alone."""

    name: str
    module: str
    model_types: tuple[str, ...]
    request_starts_switch: str
    call: Callable[..., Any] = attrs.field(repr=False)

    def fail(self, message: str) -> PluginError:
        """An error that names this family's plugin."""
        return PluginError(f"family {self.name!r} (plugin {self.module}): {message}")

    def declare(self, config: Mapping[str, Any], dtype: torch.dtype) -> Declarations:
        """Ask the family's memory hooks once and check their answers."""
        layout = self._expect("family_kv_layout", Layout, config=config, dtype=dtype)
        image = self._expect("family_state_image", ImageFormat, config=config, layout=layout)
        problems = image.problems(layout)
        if problems:
            raise self.fail("family_state_image does not fit its Layout: " + "; ".join(problems))
        identity = self.call("family_identity", config=config, dtype=dtype)
        if not isinstance(identity, Mapping) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in identity.items()):
            raise self.fail(f"family_identity must return a mapping of str to str, got {identity!r}")
        return Declarations(layout=layout, image=image, identity=dict(identity))

    def load(self, checkpoint: Checkpoint, dtype: torch.dtype, device: torch.device,
             shard: Shard = SINGLE) -> FamilyModel:
        """Build the model (this rank's part of it with a shard of world N); the answer must be a FamilyModel."""
        model = self.call("family_load", checkpoint=checkpoint, dtype=dtype, device=device, shard=shard)
        if not isinstance(model, FamilyModel):
            raise self.fail(f"family_load returned {type(model).__name__}, which lacks forward(plan, kv) "
                            "or vocab_size")
        return model

    def tensor_parallel(self, config: Mapping[str, Any]) -> TensorParallel | None:
        """The family's cuts for tensor parallelism, None when it declares none (it serves at TP=1 alone)."""
        found = self.call("family_tensor_parallel", config=config)
        if found is not None and not isinstance(found, TensorParallel):
            raise self.fail(f"family_tensor_parallel must return a TensorParallel, got {type(found).__name__}")
        return found

    def tp_refusals(self, config: Mapping[str, Any], world: int) -> list[str]:
        """Why this family cannot run at TP=`world`: no declaration, or a count the world does not divide."""
        if world == 1:
            return []
        found = self.tensor_parallel(config)
        if found is None:
            return [f"family {self.name!r} (plugin {self.module}) declares no family_tensor_parallel: it serves at "
                    "--tensor-parallel-size 1 only"]
        return [f"family {self.name!r} (plugin {self.module}): {line}" for line in found.refusals(world)]

    def refusals(self, config: Mapping[str, Any], settings: Any) -> list[str]:
        """The family's own refusals for these settings."""
        found = self.call("family_refusals", config=config, settings=settings)
        if found is None or isinstance(found, str) or not all(isinstance(r, str) for r in found):
            raise self.fail(f"family_refusals must return a sequence of sentences, got {found!r}")
        return list(found)

    def chat_format(self, config: Mapping[str, Any]) -> ChatFormat:
        """The family's think markers and tool parser, checked; hermes without markers when it declares none."""
        found = self.call("family_chat_format", config=config)
        if found is None:
            return DEFAULT_CHAT_FORMAT
        if not isinstance(found, ChatFormat):
            raise self.fail(f"family_chat_format must return a ChatFormat, got {type(found).__name__}")
        problems = found.problems()
        if problems:
            raise self.fail("family_chat_format: " + "; ".join(problems))
        return found

    def make_tiny(self, directory: Path, seed: int = 0) -> None:
        """Write the family's tiny checkpoint into `directory`."""
        directory.mkdir(parents=True, exist_ok=True)
        self.call("family_make_tiny", directory=directory, seed=seed)
        if not (directory / "config.json").is_file():
            raise self.fail(f"family_make_tiny wrote no config.json into {directory}")

    def describe(self, config: Mapping[str, Any] | None = None, dtype: torch.dtype = torch.bfloat16) -> dict:
        """A JSON-ready record of every declaration (for `tensorfold families --json`)."""
        out: dict[str, Any] = {"name": self.name, "module": self.module, "model_types": list(self.model_types),
                               "request_starts_switch": self.request_starts_switch}
        if config is not None:
            found = self.declare(config, dtype)
            out["layout"] = found.layout.describe()
            out["image"] = attrs.asdict(found.image)
            out["identity"] = dict(found.identity)
            chat = self.chat_format(config)
            out["chat_format"] = {"tool_parser": chat.tool_parser.name, "think_start": chat.think_start,
                                  "think_end": chat.think_end}
        return out

    def _expect(self, hook: str, kind: type, **kwargs: Any) -> Any:
        answer = self.call(hook, **kwargs)
        if not isinstance(answer, kind):
            raise self.fail(f"{hook} must return a {kind.__name__}, got {type(answer).__name__}")
        return answer


def check_static(name: str, module: str, model_types: Sequence[str] | None, switch: str | None) -> None:
    """Check the declarations that need no checkpoint; raise a PluginError naming the plugin."""
    where = f"family {name!r} (plugin {module})"
    if not model_types or isinstance(model_types, str) or not all(isinstance(t, str) and t for t in model_types):
        raise PluginError(f"{where}: family_model_types must return a non-empty list of names, got {model_types!r}")
    if not isinstance(switch, str) or not SWITCH_NAME.match(switch):
        raise PluginError(f"{where}: family_request_starts_switch must return a name like TF_NAME_REQUEST_STARTS, "
                          f"got {switch!r}")
