"""Memory-bound GPU kernels (Triton), each beside the torch reference it must match.

Each public function picks its Triton kernel on CUDA when Triton is installed and its torch
reference everywhere else, so the same call runs on the CPU (CI) and the GPU.
"""

from kernels.slot_copy import masked_copy_rows, masked_copy_rows_reference

__all__ = ["masked_copy_rows", "masked_copy_rows_reference"]
