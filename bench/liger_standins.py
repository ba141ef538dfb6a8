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

What this checks: the tensors the Liger step keeps alive and when, inside TRL's own SFTTrainer.train() (its
fused LM head stays on: SFTTrainer turns Liger's fused linear cross-entropy off). What it does not: Liger's
Triton code itself (its arithmetic, any scratch memory it might allocate), transformers' apply_liger_kernel entry
point (use_liger_kernel needs the package installed), and Liger's fused linear cross-entropy.
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


@contextlib.contextmanager
def liger_kernels() -> Iterator[None]:
    """Llama's RMSNorm and MLP forwards and its rotary function replaced by the stand-ins until the context ends.
    Liger patches the model instance (or, before it is built, the classes); the classes are patched here, which
    holds for a model whatever the trainer does to its modules' attributes on the way."""
    from transformers.models.llama import modeling_llama

    rms_norm, silu_mul, rope = functions()

    def norm_forward(self: Any, hidden_states: Any) -> Any:
        return rms_norm.apply(hidden_states, self.weight, self.variance_epsilon)

    def mlp_forward(self: Any, x: Any) -> Any:
        return self.down_proj(silu_mul.apply(self.gate_proj(x), self.up_proj(x)))

    def rotary(q: Any, k: Any, cos: Any, sin: Any, unsqueeze_dim: int = 1) -> Any:
        return rope.apply(q, k, cos, sin)

    norm, mlp, rotate = (
        modeling_llama.LlamaRMSNorm.forward,
        modeling_llama.LlamaMLP.forward,
        modeling_llama.apply_rotary_pos_emb,
    )
    modeling_llama.LlamaRMSNorm.forward, modeling_llama.LlamaMLP.forward = norm_forward, mlp_forward
    modeling_llama.apply_rotary_pos_emb = rotary
    try:
        yield
    finally:
        modeling_llama.LlamaRMSNorm.forward, modeling_llama.LlamaMLP.forward = norm, mlp
        modeling_llama.apply_rotary_pos_emb = rotate
