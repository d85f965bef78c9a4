"""The model's kernels: the C library (csrc/, built once per machine by build.py, its ABI
in abi.py), the tensor-level wrappers of each of its entry points (ops.py: the only
place that passes tensor addresses to C), the GGUF weight types they read (weights.py),
and the Triton kernels (triton_attention.py). Nothing outside this package calls the
library or takes a tensor's address (tests/unit/test_layering.py checks it)."""
