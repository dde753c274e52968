"""Method code that more than one modifier uses (the engine's, so modifiers never import each other).

* :func:`fold_norm_into`: RMSNorm gain folded into the linears that read it (FuseNorm; the arithmetic
  FlattenAdjacent's merged layers rely on).
* :func:`top_k_kl`: distillation loss on the teacher's top-k tokens (LoRARecovery, LinearPatch).
"""
from __future__ import annotations

from typing import Literal

import torch


@torch.no_grad()
def fold_norm_into(norm: torch.nn.Module, linears: list[torch.nn.Linear], adapter) -> None:
    """``W ← W diag(g)`` for every linear reading ``RMSNorm(x) = g ⊙ x / rms(x)``, then ``g ← 1``.

    ``g`` is the gain as applied (``adapter.norm_gain``: Gemma's ``1 + w``). Computed in fp32 and cast back
    to the weights' dtype; biases are unchanged.
    """
    gain = adapter.norm_gain(norm)
    for linear in linears:
        linear.weight.copy_((linear.weight.float() * gain[None, :]).to(linear.weight.dtype))
    adapter.set_norm_gain(norm, 1.0)


def top_k_kl(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor, k: int,
             student_over: Literal["vocabulary", "top_k"]) -> torch.Tensor:
    """Mean over masked positions of ``KL(p̂_T ‖ q_S)`` on the teacher's ``k`` most likely tokens (fp32).

    ``p̂_T`` is the softmax of the teacher's top-k logits (renormalised over them). ``student_over`` says
    where the student's distribution is normalised: ``vocabulary``: its full-vocabulary log-softmax gathered
    at those tokens (sparse logit distillation, Minitron §2.3); ``top_k``: the softmax of its logits at those
    tokens only (LinearPatch Eq. 9, ``KL(z(o_t^K) ‖ z(o_s^K))``). ``mask``: positions that count (bool or 0/1).
    """
    values, index = teacher.float().topk(k, dim=-1)
    log_target = values.log_softmax(dim=-1)
    logits = student.float()
    log_student = (logits.log_softmax(dim=-1).gather(-1, index) if student_over == "vocabulary"
                   else logits.gather(-1, index).log_softmax(dim=-1))
    kl = (log_target.exp() * (log_target - log_student)).sum(dim=-1)
    weight = mask.to(kl.dtype)
    return (kl * weight).sum() / weight.sum().clamp(min=1)
