"""sha256 of moe_mlp's outputs and gradients and of every plan method, on fixed seeded inputs (GPU)."""
import hashlib, json, sys, time
import torch
from moeblaze_megatron import build_routing_plan, moe_mlp

SHAPES = {"small": (1000, 256, 512, 8, 2), "topk_eq_e": (777, 128, 192, 4, 4),
          "7b": (24576, 1536, 256, 128, 8), "qwen3": (32768, 2048, 768, 128, 8),
          "conf4": (32768, 2048, 8192, 16, 4), "dsv3": (8192, 7168, 2048, 256, 8)}
def h(t):
    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()[:16]
out = {}
for name, (T, d, hh, E, K) in SHAPES.items():
    acts = ["swiglu", "silu", "gelu"] if name in ("small", "topk_eq_e") else ["swiglu"]
    recs = ["activation", "fc1"] if name in ("small", "7b") else ["activation"]
    for act in acts:
        for rec in recs:
            t0 = time.time()
            g = torch.Generator(device="cuda").manual_seed(T + d)
            dt = torch.bfloat16
            x = torch.randn(T, d, generator=g, device="cuda", dtype=dt).requires_grad_()
            logits = torch.randn(T, E, generator=g, device="cuda")
            vals, ids = logits.topk(K, dim=1)
            probs = torch.softmax(vals, 1).requires_grad_()
            w1 = (torch.randn(E, (2 if act == "swiglu" else 1) * hh, d, generator=g, device="cuda") * d ** -0.5).to(dt).requires_grad_()
            w2 = (torch.randn(E, d, hh, generator=g, device="cuda") * hh ** -0.5).to(dt).requires_grad_()
            plans = {m: build_routing_plan(ids, E, method=m) for m in ("three_step", "sort", "torch")}
            rec_ = {}
            for m, p in plans.items():
                rec_[f"plan_{m}"] = h(torch.cat([p.expert_token_indices.flatten(), p.expert_token_offsets.flatten(),
                                                 p.token_expert_indices.flatten(), p.token_index_map.flatten()]))
            y = moe_mlp(x, ids, probs, w1, w2, act, plans["three_step"], recompute=rec)
            gy = torch.randn(y.shape, generator=g, device="cuda", dtype=y.dtype)
            y.backward(gy)
            rec_.update(y=h(y), dx=h(x.grad), dprobs=h(probs.grad), dw1=h(w1.grad), dw2=h(w2.grad))
            torch.cuda.synchronize()
            rec_["s"] = round(time.time() - t0, 2)
            out[f"{name}/{act}/{rec}"] = rec_
            print(name, act, rec, rec_, flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
