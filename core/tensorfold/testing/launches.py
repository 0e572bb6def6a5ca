"""How many device ops a model function issues, counted on the CPU: a proxy for its GPU launches, so a test can pin
a layer's launch count without a GPU.

Counted: aten ops that compute (views and bare allocations are not), each one launch on CUDA, and Triton kernels,
each replaced by a `KernelStub` that counts one launch as "triton:<name>" and runs nothing, or a stand-in (`effect`)
that writes what later ops read (a routing kernel's pairs, which the grouping after it indexes by); the stand-in's
own ops are not counted. The families' launch tests (test_qwen_launches.py, test_glm_launches.py) count with it.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# allocations and metadata only
FREE = {"empty", "empty_like", "empty_strided", "new_empty", "_unsafe_view", "promote_types"}

Effect = Callable[..., None]


class Launches(TorchDispatchMode):
    """Counts the aten ops that compute, by name, outside `uncounted` blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.inside = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.inside and not func.is_view and name not in FREE:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))

    @contextmanager
    def uncounted(self) -> Iterator[None]:
        """Ops run here are not counted (a stub's stand-in)."""
        self.inside += 1
        try:
            yield
        finally:
            self.inside -= 1


class KernelStub:
    """A Triton kernel that counts its launches as "triton:<name>" and runs `effect` (uncounted) or nothing."""

    def __init__(self, mode: Launches, name: str, effect: Effect | None = None) -> None:
        self.mode, self.name, self.effect = mode, name, effect

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        def launch(*args: Any, **kwargs: Any) -> None:
            self.mode.ops[f"triton:{self.name}"] += 1
            if self.effect is not None:
                with self.mode.uncounted():
                    self.effect(*args, **kwargs)

        return launch


@contextmanager
def counting_triton(monkeypatch: Any, kernels: Mapping[ModuleType, tuple[str, ...]],
                    triton_users: tuple[ModuleType, ...], effects: Mapping[str, Effect] | None = None
                    ) -> Iterator[Launches]:
    """The Triton path forced on CPU tensors (`use_triton` true in `triton_users`), every kernel named in `kernels`
    a KernelStub (with its `effects` entry), aten ops counted; `monkeypatch` (pytest's) undoes the patches."""
    mode = Launches()
    for module, names in kernels.items():
        for name in names:
            monkeypatch.setattr(module, name, KernelStub(mode, name, (effects or {}).get(name)))
    for module in triton_users:
        monkeypatch.setattr(module, "use_triton", lambda tensor: True)
    with torch.no_grad(), mode:
        yield mode


def triton_kernels(*packages: ModuleType) -> dict[ModuleType, tuple[str, ...]]:
    """Every Triton function (jit, autotuned, heuristics) bound in the modules of `packages` (each a package, walked,
    or a module), by module: what `counting_triton` stubs to count a whole step's launches."""
    modules = []
    for package in packages:
        modules.append(package)
        if hasattr(package, "__path__"):
            modules += [importlib.import_module(info.name)
                        for info in pkgutil.walk_packages(package.__path__, package.__name__ + ".")]
    found = {m: tuple(name for name, value in vars(m).items() if _is_triton_kernel(value)) for m in modules}
    return {m: names for m, names in found.items() if names}


def _is_triton_kernel(value: object) -> bool:
    """A triton KernelInterface (found by its class's name: triton is not among this package's requirements)."""
    return any(c.__name__ == "KernelInterface" and c.__module__.startswith("triton.") for c in type(value).__mro__)
