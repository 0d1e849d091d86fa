"""Run 109: the fused add + RMSNorm at M = 4,096 x 4,096, bf16, 10 random draws: the plain kernel against itself, the
one with the FP8 copy against itself, and the two against each other, with PDL on and off (differing elements)."""
import os, torch
from asyncengine.kernels import norm, pdl
for pdl_on in ("1", "0"):
    os.environ[pdl.ENV_SWITCH] = pdl_on
    torch.manual_seed(0)
    counts = {"plain vs plain": 0, "copy vs copy": 0, "plain vs copy": 0}
    for trial in range(10):
        x, residual = (torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
        a, _ = norm.fused_add_rms_norm(x, residual.clone(), w, 1e-5)
        b, _ = norm.fused_add_rms_norm(x, residual.clone(), w, 1e-5)
        c, _ = norm.fused_add_rms_norm(x, residual.clone(), w, 1e-5, fp8_copy=True)
        d, _ = norm.fused_add_rms_norm(x, residual.clone(), w, 1e-5, fp8_copy=True)
        counts["plain vs plain"] += int((a != b).sum())
        counts["copy vs copy"] += int((c.value != d.value).sum())
        counts["plain vs copy"] += int((a != c.value).sum())
    print("PDL", pdl_on, counts)
