"""Host microseconds to enqueue bf16 mm, torch._scaled_mm row-wise and our per-token quantization at the 8B qkv
shape, with M fixed, with a new M every call (as W1's eager prefill steps have), and with those Ms again (run 98):
whether a step's host time depends on shapes seen before. `python scripts/fp8_host_varied_m.py` on a GPU."""
import time, torch
from asyncengine.kernels import quant_fp8, quant_reference
k, n = 4096, 6144
w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
w8, ws = quant_reference.quantize_fp8(w.float(), dim=-1)
wr = ws.reshape(1, -1).contiguous()
xs = {m: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for m in range(3000, 3400, 2)}
q = {m: quant_fp8.quantize_per_token(x) for m, x in xs.items()}
torch.cuda.synchronize()
def host(name, fn, ms):
    torch.cuda.synchronize(); t = time.perf_counter()
    for m in ms: fn(m)
    h = (time.perf_counter() - t) / len(ms) * 1e6; torch.cuda.synchronize()
    print(f"{name:40} {h:8.1f} us host per call")
fixed = [3000] * 200
varied = list(xs)  # 200 distinct M
for label, ms in (("fixed M", fixed), ("a new M each call", varied), ("the same new Ms again", varied)):
    host(f"bf16 mm, {label}", lambda m: xs[m] @ w.t(), ms)
    host(f"_scaled_mm row-wise, {label}", lambda m: torch._scaled_mm(q[m][0], w8.t(), scale_a=q[m][1], scale_b=wr, out_dtype=torch.bfloat16), ms)
    host(f"quantize_per_token, {label}", lambda m: quant_fp8.quantize_per_token(xs[m]), ms)
