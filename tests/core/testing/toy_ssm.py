"""A pure-SSM toy family (Mamba2's shape: a depthwise causal conv, then a selective scan), registered without an
entry point, for the kit and the gates on a Layout with no row states: per layer a conv tail in the model's dtype
and a float32 SSM state, whatever the model's dtype. Two deliberately broken models beside it: one that never
updates its conv tail, one that rounds its state to bf16 between steps. Weights come from the core's default rule
(tiny_checkpoint.draw_weight), so A_log, dt_bias and the conv get their own draws."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.nn.functional as F

from tensorfold.checkpoint import Checkpoint
from tensorfold.hookspecs import hookimpl
from tensorfold.image import ImageFormat
from tensorfold.kv import KvStore
from tensorfold.layout import FixedState, LayerLayout, Layout, dtype_name
from tensorfold.plan import StepPlan
from tensorfold.plugins import register_families
from tensorfold.testing import kit
from tensorfold.testing.tiny_checkpoint import write_tiny_config, write_tiny_weights

CONFIG = {"model_type": "toy_ssm", "vocab_size": 512, "hidden_size": 32, "num_hidden_layers": 2, "num_heads": 4,
          "head_dim": 8, "state_size": 8, "conv_kernel": 4, "layer_norm_epsilon": 1e-5}
CONV, SSM = "conv", "ssm"


@attrs.frozen
class Dims:
    """The toy's sizes: D hidden, H heads of P, N state size, K conv kernel; I = H·P inner, C = I + 2N conv channels."""

    D: int
    H: int
    P: int
    N: int
    K: int
    L: int
    V: int
    eps: float

    @classmethod
    def of(cls, config: Mapping[str, Any]) -> Dims:
        return cls(config["hidden_size"], config["num_heads"], config["head_dim"], config["state_size"],
                   config["conv_kernel"], config["num_hidden_layers"], config["vocab_size"],
                   config["layer_norm_epsilon"])

    @property
    def inner(self) -> int:
        return self.H * self.P

    @property
    def channels(self) -> int:
        return self.inner + 2 * self.N


def shapes(d: Dims) -> dict[str, tuple[int, ...]]:
    """HF Mamba2's tensor names and shapes for these sizes."""
    out = {"backbone.embeddings.weight": (d.V, d.D), "backbone.norm_f.weight": (d.D,), "lm_head.weight": (d.V, d.D)}
    for i in range(d.L):
        m = f"backbone.layers.{i}.mixer."
        out |= {f"backbone.layers.{i}.norm.weight": (d.D,), m + "in_proj.weight": (2 * d.inner + 2 * d.N + d.H, d.D),
                m + "conv1d.weight": (d.channels, 1, d.K), m + "conv1d.bias": (d.channels,), m + "A_log": (d.H,),
                m + "dt_bias": (d.H,), m + "D": (d.H,), m + "norm.weight": (d.inner,),
                m + "out_proj.weight": (d.D, d.inner)}
    return out


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32, back in x's dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


class ToySsm:
    """The forward: per stream, per layer x + mixer(norm(x)); the mixer convolves [tail, tokens] and scans."""

    def __init__(self, weights: dict[str, torch.Tensor], d: Dims, dtype: torch.dtype) -> None:
        self.w, self.d, self.dtype = weights, d, dtype
        self.vocab_size = d.V

    def keep_tail(self, kv: KvStore, layer: int, slot: int, window: torch.Tensor) -> None:
        """The conv tail after this step: the last K - 1 conv inputs."""
        kv.write_fixed(layer, CONV, slot, window[:, window.shape[1] - (self.d.K - 1):].contiguous())

    def keep_state(self, state: torch.Tensor, h: torch.Tensor) -> None:
        """The SSM state after this step, kept in float32."""
        state.copy_(h)

    def mixer(self, layer: int, x: torch.Tensor, kv: KvStore, slot: int) -> torch.Tensor:
        d, m = self.d, f"backbone.layers.{layer}.mixer."
        w = {name.removeprefix(m): t for name, t in self.w.items() if name.startswith(m)}
        z, xbc, dt = F.linear(x, w["in_proj.weight"]).split([d.inner, d.channels, d.H], dim=-1)  # [T, I], [T, C]
        window = torch.cat([kv.fixed(layer, CONV, slot), xbc.T], dim=1)                           # [C, K-1+T]
        conv = F.conv1d(window[None], w["conv1d.weight"], w["conv1d.bias"], groups=d.channels)[0]  # [C, T]
        self.keep_tail(kv, layer, slot, window)
        xs, b, c = F.silu(conv.T).float().split([d.inner, d.N, d.N], dim=-1)
        step = F.softplus(dt.float() + w["dt_bias"].float())                                        # [T, H]
        a = -torch.exp(w["A_log"].float())                                                          # [H]
        state = kv.fixed(layer, SSM, slot, dtype=torch.float32)                                     # [H, P, N]
        h, ys = state.clone(), []
        for t in range(x.shape[0]):
            xt = xs[t].view(d.H, d.P)
            h = torch.exp(step[t] * a)[:, None, None] * h + (step[t][:, None] * xt)[:, :, None] * b[t]
            ys.append(h @ c[t] + w["D"].float()[:, None] * xt)                                      # [H, P]
        self.keep_state(state, h)
        y = torch.stack(ys).reshape(-1, d.inner) * F.silu(z.float())
        return F.linear(rms(y, w["norm.weight"], d.eps).to(x.dtype), w["out_proj.weight"])

    @torch.no_grad()
    def forward(self, plan: StepPlan, kv: KvStore) -> torch.Tensor:
        picked = []
        for share in plan.streams:
            x = self.w["backbone.embeddings.weight"][list(share.tokens)]
            for i in range(self.d.L):
                x = x + self.mixer(i, rms(x, self.w[f"backbone.layers.{i}.norm.weight"], self.d.eps), kv, share.slot)
            every = getattr(share, "every_row", False)
            if every or share.sample:
                last = rms(x if every else x[-1:], self.w["backbone.norm_f.weight"], self.d.eps)
                picked.append(F.linear(last, self.w["lm_head.weight"]).float())
        return torch.cat(picked) if picked else torch.empty(0, self.d.V)


class FrozenConv(ToySsm):
    """Broken: the conv tail is never updated, so every step's conv starts from zeros."""

    def keep_tail(self, kv: KvStore, layer: int, slot: int, window: torch.Tensor) -> None:
        pass


class RoundedState(ToySsm):
    """Broken: the float32 state goes through bf16 between steps."""

    def keep_state(self, state: torch.Tensor, h: torch.Tensor) -> None:
        state.copy_(h.to(torch.bfloat16).float())


# ---------------------------------------------------------------- the hooks

@hookimpl
def family_model_types() -> list[str]:
    return ["toy_ssm"]


@hookimpl
def family_load(checkpoint: Checkpoint, dtype: torch.dtype, device: torch.device) -> ToySsm:
    weights = {name: t.to(device=device, dtype=dtype) for name, t in checkpoint.tensors(progress=False)}
    return ToySsm(weights, Dims.of(checkpoint.config), dtype)


@hookimpl
def family_make_tiny(directory: Path, seed: int) -> None:
    config = write_tiny_config(Path(directory), CONFIG)
    write_tiny_weights(Path(directory), shapes(Dims.of(config)), seed=seed)


@hookimpl
def family_kv_layout(config: Mapping[str, Any], dtype: torch.dtype) -> Layout:
    d = Dims.of(config)
    fixed = [FixedState(CONV, (d.channels, d.K - 1), dtype_name(dtype)), FixedState(SSM, (d.H, d.P, d.N), "float32")]
    return Layout([LayerLayout("ssm", fixed=fixed) for _ in range(d.L)])


@hookimpl
def family_state_image(config: Mapping[str, Any], layout: Layout) -> ImageFormat:
    return ImageFormat.of_layout("toy-ssm", 1, layout)


@hookimpl
def family_identity(config: Mapping[str, Any], dtype: torch.dtype) -> dict[str, str]:
    return {"format": "toy-ssm/1", "dtype": dtype_name(dtype), "layers": str(config["num_hidden_layers"])}


@hookimpl
def family_request_starts_switch() -> str:
    return "TF_TOYSSM_REQUEST_STARTS"


@hookimpl
def family_refusals(config: Mapping[str, Any], settings: Any) -> list[str]:
    return []


def subject(directory: Path, dtype: torch.dtype = torch.float32, broken: type[ToySsm] | None = None) -> kit.Subject:
    """The toy family loaded on a fresh tiny checkpoint in `directory`, its model swapped for `broken`'s if given."""
    family = register_families({"toyssm": sys.modules[__name__]})["toyssm"]
    family.make_tiny(directory, seed=3)
    found = kit.load(family, directory, dtype=dtype)
    if broken is None:
        return found
    return attrs.evolve(found, model=broken(found.model.w, found.model.d, dtype))
