"""Model-independent layers shared by the model families: the sparse MoE block (torch path and
Triton fused grouped GEMM) and weight-only FP8 linears."""
