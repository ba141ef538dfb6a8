"""Liger's kernels, stood in by torch for a trace: `make bench-stacks`' `--stack trl --liger` cases.

Liger-Kernel's kernels are Triton and need a GPU, so its own code cannot run in a fake-tensor or CPU trace. These
stand-ins patch the same places `apply_liger_kernel_to_llama` patches (liger-kernel 0.8.2,
src/liger_kernel/transformers/monkey_patch.py): the RMSNorm's forward, the MLP's forward and
`modeling_llama.apply_rotary_pos_emb`. Each is an autograd.Function that keeps for backward exactly what Liger's
function keeps and allocates what Liger's kernel writes; the arithmetic runs out of the tracker's sight
(`unseen`), as a Triton kernel's registers are (the pattern of stack_trace.cuda_fused_head):

- RMSNorm (LigerRMSNormFunction, ops/rms_norm.py): writes Y in the input's dtype and one fp32 rsqrt per row, saves
  the input X and that rsqrt; backward writes the input's gradient over the incoming one (in_place=True).
- SwiGLU (LigerSiLUMulFunction, ops/swiglu.py): writes silu(gate) x up, saves gate and up; backward writes their
  gradients over them.
- rotary (LigerRopeFunction, ops/rope.py): saves cos and sin only. Liger rotates q and k in place; the stand-in
  writes them into new tensors, which leaves the same tensors alive once the unrotated ones are dropped.

- fused linear cross-entropy (LigerFusedLinearCrossEntropyFunction and lce_forward), for the Trainer stacks
  (`fused_loss`; TRL's SFTTrainer turns it off and keeps its own fused head): see fused_linear_cross_entropy.

What this checks: the tensors the Liger step keeps alive and when, inside TRL's SFTTrainer.train() and the
Trainer's (peft-kbit). What it does not: Liger's Triton code itself (its arithmetic, any scratch memory it might
allocate) and transformers' apply_liger_kernel entry point (use_liger_kernel needs the package installed).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any


def unseen(function: Callable[..., Any]) -> Callable[..., Any]:
    """Run `function` with the dispatch modes (the tracker, the data stand-ins) off: a kernel's own registers."""

    def run(*args: Any, **kwargs: Any) -> Any:
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():
            return function(*args, **kwargs)

    return run


def functions() -> tuple[Any, Any, Any]:
    """The three autograd.Functions (built here: torch is imported only when a trace runs)."""
    import torch
    import torch.nn.functional as F

    @unseen
    def normed(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        rstd = torch.rsqrt(x.float().pow(2).mean(-1) + eps)
        return weight * (x.float() * rstd.unsqueeze(-1)).to(x.dtype), rstd

    @unseen
    def normed_grad(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
        xhat = x.float() * rstd.unsqueeze(-1)
        g = dy.float() * weight.float()
        return rstd.unsqueeze(-1) * (g - xhat * (g * xhat).mean(-1, keepdim=True))

    class RMSNorm(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
            y = torch.empty_like(x)
            rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
            value, rstd_value = normed(x, weight, eps)
            unseen(y.copy_)(value)
            unseen(rstd.copy_)(rstd_value)
            ctx.save_for_backward(x, weight, rstd)
            return y

        @staticmethod
        def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
            x, weight, rstd = ctx.saved_tensors
            if weight.requires_grad:
                raise NotImplementedError("the stand-in covers LoRA steps: a frozen norm weight")
            unseen(dy.copy_)(normed_grad(dy, x, weight, rstd))  # dX written over dY (in_place=True)
            return dy, None, None

    class SiLUMul(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
            out = torch.empty_like(gate)
            unseen(lambda: out.copy_(F.silu(gate) * up))()
            ctx.save_for_backward(gate, up)
            return out

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            gate, up = ctx.saved_tensors

            @unseen
            def over_inputs() -> None:  # silu recomputed; the gradients written over gate and up
                sig = torch.sigmoid(gate.float())
                silu = gate.float() * sig
                d_gate = grad.float() * up.float() * (sig * (1 + gate.float() * (1 - sig)))
                up.copy_(grad.float() * silu)
                gate.copy_(d_gate)

            over_inputs()
            return gate, up

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    class Rope(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Any:
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
            q_out, k_out = torch.empty_like(q), torch.empty_like(k)
            unseen(lambda: (q_out.copy_(q * cos + rotate_half(q) * sin), k_out.copy_(k * cos + rotate_half(k) * sin)))()
            ctx.save_for_backward(cos, sin)
            return q_out, k_out

        @staticmethod
        def backward(ctx: Any, dq: torch.Tensor, dk: torch.Tensor) -> tuple[Any, ...]:
            cos, sin = ctx.saved_tensors
            dq_out, dk_out = torch.empty_like(dq), torch.empty_like(dk)
            unseen(
                lambda: (
                    dq_out.copy_(dq * cos - rotate_half(dq * sin)),
                    dk_out.copy_(dk * cos - rotate_half(dk * sin)),
                )
            )()
            return dq_out, dk_out, None, None

    return RMSNorm, SiLUMul, Rope


def fused_linear_cross_entropy() -> Any:
    """Liger's fused linear cross-entropy (LigerFusedLinearCrossEntropyFunction, ops/fused_linear_cross_entropy.py,
    mean or sum reduction): chunks of next_pow2(tokens / ceil(V / h)) tokens; each chunk's logits made by the head's
    matmul (under autocast, as Liger's), turned into their gradient in place, and the chunk's hidden-state gradient
    written into one zeros_like(hidden states) tensor, which is all it keeps for backward; backward scales it in
    place."""
    import torch

    class FusedLinearCrossEntropy(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, scale: float) -> Any:
            tokens, hidden = x.shape
            per_chunk = -(-tokens // -(-weight.shape[0] // hidden))
            chunk = 1 << (per_chunk - 1).bit_length()
            grad_input = torch.zeros_like(x)
            losses = torch.zeros(tokens, dtype=torch.float32, device=x.device)
            for start in range(0, tokens, chunk):
                end = min(start + chunk, tokens)
                logits = x[start:end] @ weight.t()
                unseen(_logits_to_gradient)(logits, target[start:end], losses[start:end], scale)
                grad_input[start:end] = logits @ weight
            ctx.save_for_backward(grad_input)
            return losses.sum()

        @staticmethod
        def backward(ctx: Any, grad: Any) -> tuple[Any, ...]:
            (grad_input,) = ctx.saved_tensors
            unseen(grad_input.mul_)(grad)
            return grad_input, None, None, None

    return FusedLinearCrossEntropy


def _logits_to_gradient(logits: Any, target: Any, losses: Any, scale: float) -> None:
    """liger_cross_entropy_kernel's work on one chunk: the scaled losses, and the logits' gradient in their place."""
    import torch

    valid = target != -100
    picked = target.clamp(min=0)[:, None]
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    losses.copy_(-log_probs.gather(1, picked)[:, 0] * valid * scale)
    grad = log_probs.exp().scatter_add_(1, picked, -valid[:, None].float())
    logits.copy_(grad * valid[:, None] * scale)


def fused_loss_forward(forward: Callable[..., Any], loss: Any) -> Callable[..., Any]:
    """Liger's lce_forward (transformers/model/llama.py): in training with labels the decoder's hidden states go
    straight into the fused loss and no logits are made; otherwise transformers' forward."""
    from torch.nn import functional as F
    from transformers.modeling_outputs import CausalLMOutputWithPast

    def lce_forward(self: Any, input_ids: Any = None, labels: Any = None, **kwargs: Any) -> Any:
        if not (self.training and labels is not None):
            return forward(self, input_ids=input_ids, labels=labels, **kwargs)
        items = kwargs.get("num_items_in_batch")
        kwargs.pop("logits_to_keep", None)
        hidden = self.model(input_ids=input_ids, **kwargs).last_hidden_state
        shifted = F.pad(labels, (0, 1), value=-100)[..., 1:].reshape(-1)
        scale = 1.0 / float(items if items is not None else (shifted != -100).sum())
        value = loss.apply(hidden.reshape(-1, hidden.shape[-1]), self.lm_head.weight, shifted, scale)
        return CausalLMOutputWithPast(loss=value, logits=None)

    return lce_forward


@contextlib.contextmanager
def liger_kernels(fused_loss: bool = False) -> Iterator[None]:
    """Llama's RMSNorm and MLP forwards and its rotary function (and with `fused_loss` its causal LM's forward)
    replaced by the stand-ins until the context ends. Liger patches the model instance (or, before it is built,
    the classes); the classes are patched here, which holds whatever a trainer does to its modules' attributes."""
    from transformers.models.llama import modeling_llama

    rms_norm, silu_mul, rope = functions()

    def norm_forward(self: Any, hidden_states: Any) -> Any:
        return rms_norm.apply(hidden_states, self.weight, self.variance_epsilon)

    def mlp_forward(self: Any, x: Any) -> Any:
        return self.down_proj(silu_mul.apply(self.gate_proj(x), self.up_proj(x)))

    def rotary(q: Any, k: Any, cos: Any, sin: Any, unsqueeze_dim: int = 1) -> Any:
        return rope.apply(q, k, cos, sin)

    norm, mlp, causal_lm = modeling_llama.LlamaRMSNorm, modeling_llama.LlamaMLP, modeling_llama.LlamaForCausalLM
    saved = (norm.forward, mlp.forward, causal_lm.forward, modeling_llama.apply_rotary_pos_emb)
    norm.forward, mlp.forward, modeling_llama.apply_rotary_pos_emb = norm_forward, mlp_forward, rotary
    if fused_loss:
        causal_lm.forward = fused_loss_forward(saved[2], fused_linear_cross_entropy())
    try:
        yield
    finally:
        norm.forward, mlp.forward, causal_lm.forward, modeling_llama.apply_rotary_pos_emb = saved
