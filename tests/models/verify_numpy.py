#!/usr/bin/env python3
"""Independent float64 numpy forward for the fixtures in this folder (no torch, no transformers).

Reads config.json + model.safetensors (per-expert Hub names) + ref.json of every fixture folder
and recomputes logits.npy, hidden_states.npy and greedy_ids from scratch: RMSNorm, RoPE (rotate-half),
GQA, qwen3 per-head / olmoe whole-projection q/k norm, softmax top-k routing with or without
norm_topk_prob (mixtral always renormalises), qwen2_moe sigmoid-gated shared expert, dense
layers, tied embeddings, legacy top-level rope_theta. Exits non-zero on a mismatch.

Usage: python3 tests/models/verify_numpy.py [DIR]   (DIR defaults to this script's folder)
"""
import json, struct, sys, os
import numpy as np

def load_st(p):
    f = open(p, "rb"); n = struct.unpack("<Q", f.read(8))[0]; h = json.loads(f.read(n)); data = f.read()
    out = {}
    for k, v in h.items():
        if k == "__metadata__": continue
        a, b = v["data_offsets"]
        out[k] = np.frombuffer(data[a:b], dtype="<f4").reshape(v["shape"]).astype(np.float64)
    return out

def rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w

def silu(x): return x / (1 + np.exp(-x))

def rope(x, pos, theta):  # x [T, nh, hd]
    hd = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, hd, 2) / hd)
    f = pos[:, None] * inv[None]
    emb = np.concatenate([f, f], -1)
    cos, sin = np.cos(emb)[:, None], np.sin(emb)[:, None]
    rot = np.concatenate([-x[..., hd // 2:], x[..., :hd // 2]], -1)
    return x * cos + rot * sin

def softmax(x):
    x = x - x.max(-1, keepdims=True); e = np.exp(x); return e / e.sum(-1, keepdims=True)

def forward(d, ids=None):
    cfg = json.load(open(f"{d}/config.json")); W = load_st(f"{d}/model.safetensors")
    ref = json.load(open(f"{d}/ref.json"))
    mt = cfg["model_type"]; H = cfg["hidden_size"]; nh = cfg["num_attention_heads"]; nkv = cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or H // nh; eps = cfg["rms_norm_eps"]; L = cfg["num_hidden_layers"]
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta"))
    K = cfg["num_experts_per_tok"]
    norm_topk = True if mt == "mixtral" else cfg["norm_topk_prob"]
    ids = ref["prompt_ids"] if ids is None else ids; T = len(ids); pos = np.arange(T, dtype=np.float64)
    x = W["model.embed_tokens.weight"][ids]
    hs = [x]
    margins = []
    mask = np.triu(np.full((T, T), -np.inf), 1)
    for l in range(L):
        p = f"model.layers.{l}."
        h = rms(x, W[p + "input_layernorm.weight"], eps)
        def lin(name, inp):
            y = inp @ W[p + name + ".weight"].T
            if p + name + ".bias" in W: y = y + W[p + name + ".bias"]
            return y
        q, k, v = lin("self_attn.q_proj", h), lin("self_attn.k_proj", h), lin("self_attn.v_proj", h)
        if mt == "olmoe":
            q = rms(q, W[p + "self_attn.q_norm.weight"], eps); k = rms(k, W[p + "self_attn.k_norm.weight"], eps)
        q = q.reshape(T, nh, hd); k = k.reshape(T, nkv, hd); v = v.reshape(T, nkv, hd)
        if mt == "qwen3_moe":
            q = rms(q, W[p + "self_attn.q_norm.weight"], eps); k = rms(k, W[p + "self_attn.k_norm.weight"], eps)
        q, k = rope(q, pos, theta), rope(k, pos, theta)
        att = np.zeros((T, nh, hd))
        for i in range(nh):
            j = i // (nh // nkv)
            s = q[:, i] @ k[:, j].T / np.sqrt(hd) + mask
            att[:, i] = softmax(s) @ v[:, j]
        x = x + lin("self_attn.o_proj", att.reshape(T, nh * hd))
        h = rms(x, W[p + "post_attention_layernorm.weight"], eps)
        if mt == "mixtral":
            mp, names = p + "block_sparse_moe.", ("w1", "w3", "w2")
        else:
            mp, names = p + "mlp.", ("gate_proj", "up_proj", "down_proj")
        def swiglu(pre, inp):
            g, u, dn = (W[pre + n + ".weight"] for n in names)
            return (silu(inp @ g.T) * (inp @ u.T)) @ dn.T
        if mp + "gate.weight" in W:
            rl = h @ W[mp + "gate.weight"].T
            srt = np.sort(rl, -1)
            margins.append(srt[:, -K] - srt[:, -K - 1])  # k-th minus (k+1)-th router logit
            probs = softmax(rl)
            out = np.zeros_like(h)
            for t in range(T):
                top = np.argsort(-probs[t])[:K]; wts = probs[t, top]
                if norm_topk: wts = wts / wts.sum()
                for e, wt in zip(top, wts):
                    out[t] += wt * swiglu(f"{mp}experts.{e}.", h[t:t+1])[0]
            if mp + "shared_expert.gate_proj.weight" in W:
                sg = 1 / (1 + np.exp(-(h @ W[mp + "shared_expert_gate.weight"].T)))
                out = out + sg * swiglu(mp + "shared_expert.", h)
        else:
            out = swiglu(mp, h)
        x = x + out
        hs.append(x)
    xn = rms(x, W["model.norm.weight"], eps)
    lm = W.get("lm_head.weight", W["model.embed_tokens.weight"])
    return xn @ lm.T, hs, xn, np.concatenate(margins)

root = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
bad = 0
for name in sorted(os.listdir(root)):
    d = os.path.join(root, name)
    if not os.path.isfile(os.path.join(d, "ref.json")):
        continue
    logits, hs, xn, _ = forward(d)
    ref = json.load(open(f"{d}/ref.json"))
    lg = np.load(f"{d}/logits.npy"); HS = np.load(f"{d}/hidden_states.npy")
    rd = np.abs(logits - lg).max() / np.abs(lg).max()
    last = xn if ref["hidden_states_last_is_normed"] else hs[-1]
    hrd = max(np.abs(a - b).max() / np.abs(b).max() for a, b in zip(hs[:-1] + [last], HS))
    # greedy: a causal forward over prompt + greedy[:-1] must pick greedy[i] at prompt end + i
    P, G = ref["prompt_ids"], ref["greedy_ids"]
    gl, _, _, rmarg = forward(d, P + G[:-1])
    gl = gl[len(P) - 1:]
    g_ok = gl.argmax(-1).tolist() == G
    srt = np.sort(gl, -1)
    gmargin = (srt[:, -1] - srt[:, -2]).min()
    ok = rd < 1e-4 and hrd < 1e-4 and g_ok
    bad += not ok
    print(f"{'ok  ' if ok else 'FAIL'} {name:17s} numpy-ref logits rel diff {rd:.2e}  hidden rel diff {hrd:.2e}  argmax agree {np.mean(logits.argmax(-1)==lg.argmax(-1)):.3f}  "
          f"greedy {'matches' if g_ok else 'DIFFERS'} (min top-1 gap {gmargin:.1e}); "
          f"router top-k gap over prompt+greedy: min {rmarg.min():.1e}, <1e-3: {np.mean(rmarg < 1e-3):.3f}")
sys.exit(1 if bad else 0)
