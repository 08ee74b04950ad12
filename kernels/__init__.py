"""Fused GPU kernels (Triton; one in CUDA C++), each in a small module beside the torch reference it must match.

Every public function takes its Triton kernel on CUDA (when Triton is installed and no autograd
graph runs through it) and its torch reference everywhere else, so one call site runs on the
CPU (CI), in training, and inside a captured CUDA graph. :func:`reference_only` forces the
references (before/after measurements in one process).

===============================  ========================================================================
module                           kernels
===============================  ========================================================================
``kernels.norm``                 residual add + RMSNorm / LayerNorm; pi0.5's gated add + adaptive RMSNorm
``kernels.activation``           gated-MLP activation ``gelu_tanh(gate) * up``; GELU + FP8 quantiser
``kernels.rotary``               QKV split + rotary embedding, keys/values written into cache views
``kernels.norm_linear``          RMSNorm + projection + its consumer (rotary split, or GeGLU) in one pass
``kernels.matmul``               few-row projection (+ GELU, + GeGLU), added onto the residual, or as split-k partials
``kernels.grouped_attention``    grouped-query attention over context segments and own keys in place, rotary on load
``kernels.flow``                 folded time embedding, and final norm + output projection + Euler update
``kernels.rng``                  per-slot counter-based Gaussian noise (draw + counter bump); slot keys, reseeds
``kernels.slot_copy``            masked row copy / gather (restore, autoreset) and row scatter (fork)
``kernels.expert_layer``         the expert's decoder layer at up to 8 slots (CUDA C++, a cluster of 8 CTAs a slot)
``kernels.fp8``                  e4m3 weights per channel, activations per token; _scaled_mm, few-row kernel
===============================  ========================================================================
"""

from flashrt.kernels.activation import gelu, gelu_mul
from flashrt.kernels.backend import implementation, reference_only, use_triton
from flashrt.kernels.flow import euler_step, time_embed
from flashrt.kernels.grouped_attention import attention
from flashrt.kernels.matmul import PartialProduct, add_matmul, linear, linear_geglu, linear_gelu, linear_partials
from flashrt.kernels.norm import add_ada_rms_norm, add_layer_norm, add_partials, add_rms_norm, gated_add
from flashrt.kernels.norm_linear import rms_norm_geglu, rms_norm_qkv_rope
from flashrt.kernels.rng import draw_normal_
from flashrt.kernels.rotary import qkv_rope
from flashrt.kernels.slot_copy import masked_copy_rows, masked_copy_rows_reference, scatter_rows

__version__ = "0.22.0"  # bump when a kernel's numerics change: capsules name the version they were made with

__all__ = [
    "PartialProduct",
    "add_ada_rms_norm",
    "add_layer_norm",
    "add_matmul",
    "add_partials",
    "add_rms_norm",
    "attention",
    "draw_normal_",
    "euler_step",
    "gated_add",
    "gelu",
    "gelu_mul",
    "implementation",
    "linear",
    "linear_geglu",
    "linear_gelu",
    "linear_partials",
    "masked_copy_rows",
    "masked_copy_rows_reference",
    "qkv_rope",
    "reference_only",
    "rms_norm_geglu",
    "rms_norm_qkv_rope",
    "scatter_rows",
    "time_embed",
    "use_triton",
]
