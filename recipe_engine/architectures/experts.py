"""Mixture-of-experts layers as transformers 5 holds them: the experts of a layer as 3-D tensors.

An MoE decoder layer's MLP is a router (``mlp.gate`` or ``mlp.router``: one logit per expert) and the experts,
fused per layer into ``experts.gate_up_proj`` (gate and up rows of every expert) and ``experts.down_proj``,
each of shape ``(experts, out, in)`` — or ``(experts, in, out)`` where the layout is ``transposed``
(gpt-oss, which also carries per-expert biases and interleaves gate and up columns). The block's output is
``Σ_e g_e(x) · down_e(act(gate_e x) ⊙ up_e x)`` over the routed experts, plus a shared expert where the
architecture has one. A linear map ``T`` on that output (row vectors, ``y ← y T``) therefore folds exactly
into every expert's down projection (and the shared expert's): :meth:`ExpertLayout.fold_output`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..numerics.linalg import set_linear_weight


@dataclass(frozen=True)
class ExpertLayout:
    """Where an architecture keeps its experts and how their tensors are laid out.

    ``path``: the experts module inside a decoder layer; ``router``: the router module; ``count``: config
    attributes holding the number of experts (first present wins); ``width``: the config attribute of one
    expert's intermediate size; ``transposed``: expert weights are ``(experts, in, out)`` (``x @ W``);
    ``interleaved``: gate and up alternate along the gate_up output (gpt-oss) rather than stack;
    ``biases``: per-expert biases ``gate_up_proj_bias`` / ``down_proj_bias``; ``router_bias``: the router has a
    bias; ``shared``: a shared expert's MLP (a plain gated MLP of linears, run on every token and scaled by a
    sigmoid gate ``Linear(hidden, 1)``: Qwen2-MoE), or None, with its width in config attribute ``shared_width``;
    ``packed_problem``: why a packed (per-linear) checkpoint format cannot hold the experts (None: the Hub
    checkpoint names every expert's projections as linears, which transformers fuses at load)."""

    path: str = "mlp.experts"
    router: str = "mlp.gate"
    count: tuple[str, ...] = ("num_local_experts", "num_experts")
    width: str = "intermediate_size"
    transposed: bool = False
    interleaved: bool = False
    biases: bool = False
    router_bias: bool = False
    shared: str | None = None
    shared_width: str = "shared_expert_intermediate_size"
    packed_problem: str | None = None

    def num_experts(self, config) -> int:
        return next(int(getattr(config, name)) for name in self.count if getattr(config, name, None))

    def intermediate_size(self, config) -> int:
        return int(getattr(config, self.width))

    def shared_size(self, config) -> int:
        """The shared expert's intermediate size (0: none)."""
        return int(getattr(config, self.shared_width)) if self.shared else 0

    def sizes(self, config) -> dict[str, int]:
        """``ArchitectureAdapter.moe_sizes``: experts per layer and per token, one expert's width, a shared one's."""
        sizes = {"count": self.num_experts(config), "used": config.num_experts_per_tok,
                 "width": self.intermediate_size(config)}
        return {**sizes, "shared_width": self.shared_size(config)} if self.shared else sizes

    def experts(self, layer: nn.Module) -> nn.Module:
        return layer.get_submodule(self.path)

    def expert_width(self, layer: nn.Module) -> int:
        """One expert's intermediate size, read from the weights."""
        down = self.experts(layer).down_proj
        return down.shape[1] if self.transposed else down.shape[2]

    def mlp_tensors(self, hidden: int, width: int, experts: int, shared: int = 0) -> list[int]:
        """Elements of each tensor of one MoE MLP: the fused gate/up and down of every expert, the router, the
        biases, and a shared expert of width ``shared`` (gate, up, down) with its gate."""
        tensors = [experts * 2 * width * hidden, experts * hidden * width, experts * hidden]
        tensors += [experts] if self.router_bias else []
        tensors += [experts * 2 * width, experts * hidden] if self.biases else []
        tensors += [hidden * shared] * 3 + [hidden] if shared else []
        return tensors

    def mlp_parameters(self, hidden: int, width: int, experts: int, shared: int = 0) -> int:
        """Parameters of one MoE MLP (:meth:`mlp_tensors`)."""
        return sum(self.mlp_tensors(hidden, width, experts, shared))

    @torch.no_grad()
    def fold_output(self, layer: nn.Module, transform: torch.Tensor) -> None:
        """``y ← y T`` on the MoE block's output, folded into the weights (fp64 products, cast back): every
        expert's down projection ``W_e ← Tᵀ W_e`` (transposed layout: ``W_e ← W_e T``), its bias
        ``b_e ← b_e T``, and the shared expert's ``down_proj``. Exact: the output is a gate-weighted sum of
        those projections (the shared expert's gate is a scalar per token)."""
        experts = self.experts(layer)
        down = experts.down_proj
        t = transform.to(down.device, torch.float64)
        folded = down.double() @ t if self.transposed else t.T @ down.double()
        down.copy_(folded.to(down.dtype))
        if self.biases:
            experts.down_proj_bias.copy_((experts.down_proj_bias.double() @ t).to(experts.down_proj_bias.dtype))
        if self.shared is not None:
            linear = layer.get_submodule(f"{self.shared}.down_proj")
            bias = t.T @ linear.bias.double() if linear.bias is not None else None
            set_linear_weight(linear, t.T @ linear.weight.double(), bias)


    # -- one expert as linears [out, in] (quantizing steps) ---------------------------------------

    def units(self, layer: nn.Module) -> int:
        """Experts to quantize: the routed ones, then the shared expert where the architecture has one."""
        return self.experts(layer).down_proj.shape[0] + (1 if self.shared else 0)

    def is_shared(self, layer: nn.Module, index: int) -> bool:
        return index == self.experts(layer).down_proj.shape[0]

    def weight(self, layer: nn.Module, index: int, tensor: str) -> torch.Tensor:
        """Expert ``index``'s ``gate_up_proj`` or ``down_proj`` as one linear weight ``[out, in]`` (a copy for the
        shared expert's gate/up, a view otherwise). Rows keep the stored order (gpt-oss interleaves gate and up
        rows): GPTQ and round-to-nearest treat rows independently, groups run along the input."""
        if self.is_shared(layer, index):
            shared = layer.get_submodule(self.shared)
            if tensor == "down_proj":
                return shared.down_proj.weight
            return torch.cat([shared.gate_proj.weight, shared.up_proj.weight])
        stored = getattr(self.experts(layer), tensor)[index]
        return stored.T if self.transposed else stored

    @torch.no_grad()
    def set_weight(self, layer: nn.Module, index: int, tensor: str, value: torch.Tensor) -> None:
        """Write ``value`` ``[out, in]`` back where :meth:`weight` read it (cast to the stored dtype)."""
        if self.is_shared(layer, index) and tensor == "gate_up_proj":
            shared = layer.get_submodule(self.shared)
            gate, up = value.split([shared.gate_proj.out_features, shared.up_proj.out_features])
            shared.gate_proj.weight.copy_(gate.to(shared.gate_proj.weight.dtype))
            shared.up_proj.weight.copy_(up.to(shared.up_proj.weight.dtype))
            return
        target = self.weight(layer, index, tensor)
        target.copy_(value.to(target.dtype))

    def quantized_parts(self, layer: nn.Module, tensor: str,
                        per_unit: list[torch.Tensor]) -> list[tuple[nn.Module, str, torch.Tensor]]:
        """``(module, parameter, values)`` where per-unit ``[rows, groups]`` quantization parameters (scales or
        zero points of :meth:`weight`'s rows, in :meth:`units` order) belong: the routed experts' stacked
        ``[experts, rows, groups]`` on ``(experts module, tensor)``, the shared expert's on its linears (gate/up
        rows split)."""
        routed = self.experts(layer).down_proj.shape[0]
        parts = [(self.experts(layer), tensor, torch.stack(per_unit[:routed]))]
        if self.shared and len(per_unit) > routed:
            shared = layer.get_submodule(self.shared)
            linears = [shared.down_proj] if tensor == "down_proj" else [shared.gate_proj, shared.up_proj]
            values = per_unit[routed].split([linear.out_features for linear in linears])
            parts += [(linear, "weight", value) for linear, value in zip(linears, values)]
        return parts

    def name(self, index: int, tensor: str, layer: nn.Module) -> str:
        """How the quantization log names one expert's tensor (its path inside the decoder layer)."""
        if self.is_shared(layer, index):
            return f"{self.shared}.{'down_proj' if tensor == 'down_proj' else 'gate_proj+up_proj'}"
        return f"{self.path}.{tensor}[{index}]"

    @torch.no_grad()
    def hidden(self, layer: nn.Module, index: int, x: torch.Tensor) -> torch.Tensor:
        """``down_proj``'s input of expert ``index`` for tokens ``x`` [tokens, hidden], as the model computes it:
        ``act(gate x) ⊙ up x`` (gpt-oss: biases, interleaved columns, its clamped GLU)."""
        if self.is_shared(layer, index):
            shared = layer.get_submodule(self.shared)
            return shared.act_fn(shared.gate_proj(x)) * shared.up_proj(x)
        experts = self.experts(layer)
        weight = experts.gate_up_proj[index]
        if self.transposed:
            gate_up = x @ weight + (experts.gate_up_proj_bias[index] if self.biases else 0)
            return experts._apply_gate(gate_up)
        gate, up = nn.functional.linear(x, weight).chunk(2, dim=-1)
        return experts.act_fn(gate) * up

    @torch.no_grad()
    def hidden_batch(self, layer: nn.Module, start: int, stop: int, x: torch.Tensor) -> torch.Tensor:
        """:meth:`hidden` of the routed experts ``start:stop`` on the same tokens, ``[experts, tokens, width]``:
        one batched product (each expert's the same operations as alone)."""
        experts = self.experts(layer)
        weight = experts.gate_up_proj[start:stop]
        if self.transposed:
            gate_up = x @ weight + (experts.gate_up_proj_bias[start:stop, None] if self.biases else 0)
            return experts._apply_gate(gate_up)
        gate, up = (x @ weight.transpose(1, 2)).chunk(2, dim=-1)
        return experts.act_fn(gate) * up

    @torch.no_grad()
    def routed(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``[tokens, experts]`` bool: the experts the router picks for each token of ``x`` (its ``top_k``
        largest logits; the softmax the routers apply first or after keeps that order)."""
        router = layer.get_submodule(self.router)
        logits = nn.functional.linear(x.to(router.weight.dtype), router.weight, getattr(router, "bias", None))
        picked = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
        return picked.scatter_(1, logits.topk(router.top_k, dim=-1).indices, True)


def packed_expert_names(names) -> list[str]:
    """The packed expert linears (``….experts.<e>.<linear>.weight_packed``: the Hub's per-expert names) among a
    checkpoint's tensor ``names``."""
    return [name for name in names if name.endswith(".weight_packed") and ".experts." in name]


#: What the engine refuses by name: MoE (and other) architectures whose layers hold something it cannot
#: process yet, with the reason (``adapter_for``).
UNHANDLED = {
    "deepseek_v2": "DeepSeek's multi-head latent attention (MLA: compressed q/kv projections)",
    "deepseek_v3": "DeepSeek's multi-head latent attention (MLA: compressed q/kv projections)",
    "qwen3_next": "hybrid linear attention (Gated DeltaNet layers beside full attention)",
    "jamba": "hybrid Mamba layers",
    "granitemoehybrid": "hybrid Mamba layers",
}


def layout_problem(config) -> str | None:
    """An MoE config variant the adapters do not handle (None: fine): Qwen3-MoE layers with a dense MLP
    (``mlp_only_layers``, ``decoder_sparse_step``) make the layers unlike one another; gpt-oss's published
    MXFP4 expert blocks are no tensors the engine computes with."""
    if getattr(config, "mlp_only_layers", None):
        return f"dense MLP layers among the MoE layers (mlp_only_layers={list(config.mlp_only_layers)})"
    quantization = getattr(config, "quantization_config", None) or {}
    method = (quantization.get("quant_method") if isinstance(quantization, dict)
              else getattr(quantization, "quant_method", None))
    if method == "mxfp4":
        return "MXFP4-quantized experts (quantization_config); save a bf16 copy first (dequantized by transformers)"
    step = getattr(config, "decoder_sparse_step", 1)
    if step not in (None, 1):
        return f"MoE on every {step}th layer only (decoder_sparse_step={step})"
    return None
