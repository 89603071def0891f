# Copied from ../shared/fixtures/make_w2.py with two changes: minimax_m2 gets partial_rotary_factor 0.5 (transformers
# 5.17 ignores rotary_dim, the Hub configs carry both) and a deepseek_v2_yarn case. Run as: python3 make_fixtures_w2.py OUT [names]
# Reference checkpoints for the families after the first four (DeepSeek-V3/V2, GLM-4.5, MiniMax-M2, gpt-oss,
# Qwen3.5-MoE, Qwen3-Next, Gemma 4), made with transformers. NOT RUN YET: configs follow transformers 5.x names as
# read from its docs; a case that fails prints why — fix the config (check the model's configuration_*.py there).
# Run on the GPU machine (torch + transformers there): python3 make_w2.py OUT_DIR [name,name,...]
# Each OUT_DIR/<name>/: config.json, model.safetensors, generation_config.json, ref.json (prompt_ids, greedy_ids,
# model_type, transformers version), logits.npy [T, vocab], hidden_states.npy [n_layers+1, T, d_model].
import json, os, sys, traceback, numpy as np, torch, transformers
from transformers import AutoConfig, AutoModelForCausalLM
out = sys.argv[1]; V = 512
yarn = lambda theta, f, orig: {"rope_type": "yarn", "rope_theta": theta, "factor": f, "original_max_position_embeddings": orig,
                               "beta_fast": 32.0, "beta_slow": 1.0}
cases = {
 # DeepSeek-V3 / Kimi-K2 layout: MLA with q LoRA, sigmoid scores + correction bias, groups, dense lead layers, YaRN.
 "deepseek_v3": ("deepseek_v3", dict(hidden_size=96, intermediate_size=192, moe_intermediate_size=40, num_hidden_layers=4,
     num_attention_heads=6, num_key_value_heads=6, q_lora_rank=64, kv_lora_rank=48, qk_nope_head_dim=32, qk_rope_head_dim=16,
     v_head_dim=24, head_dim=16, n_routed_experts=32, n_shared_experts=2, num_experts_per_tok=6, n_group=8, topk_group=3,
     first_k_dense_replace=2, routed_scaling_factor=1.8, norm_topk_prob=True, rope_interleave=True,
     rope_parameters=dict(yarn(10000.0, 4.0, 256), mscale=1.0, mscale_all_dim=1.0), max_position_embeddings=1024)),
 # DeepSeek-V2-Lite layout: MLA without q LoRA, softmax over all experts, no renormalisation.
 "deepseek_v2": ("deepseek_v2", dict(hidden_size=96, intermediate_size=192, moe_intermediate_size=40, num_hidden_layers=3,
     num_attention_heads=6, num_key_value_heads=6, q_lora_rank=None, kv_lora_rank=48, qk_nope_head_dim=32, qk_rope_head_dim=16,
     v_head_dim=24, head_dim=16, n_routed_experts=16, n_shared_experts=2, num_experts_per_tok=4, first_k_dense_replace=1,
     routed_scaling_factor=1.0, norm_topk_prob=False, topk_method="greedy", n_group=None, topk_group=None,
     rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, max_position_embeddings=1024)),
 # DeepSeek-V2-Lite's rope and V2's group-limited softmax routing: YaRN with mscale 0.707 (scales the softmax).
 "deepseek_v2_yarn": ("deepseek_v2", dict(hidden_size=96, intermediate_size=192, moe_intermediate_size=40, num_hidden_layers=3,
     num_attention_heads=6, num_key_value_heads=6, q_lora_rank=None, kv_lora_rank=48, qk_nope_head_dim=32, qk_rope_head_dim=16,
     v_head_dim=24, head_dim=16, n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4, first_k_dense_replace=1,
     routed_scaling_factor=1.5, norm_topk_prob=False, topk_method="group_limited_greedy", n_group=4, topk_group=2,
     rope_parameters=dict(yarn(10000.0, 40.0, 16), mscale=0.707, mscale_all_dim=0.707), max_position_embeddings=640)),
 # GLM-4.5 layout: partial RoPE, attention bias, sigmoid + correction bias with one group, scaling 2.5, shared expert.
 "glm4_moe": ("glm4_moe", dict(hidden_size=96, intermediate_size=192, moe_intermediate_size=40, num_hidden_layers=3,
     num_attention_heads=6, num_key_value_heads=2, head_dim=32, attention_bias=True, use_qk_norm=True, partial_rotary_factor=0.5,
     n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4, n_group=1, topk_group=1, first_k_dense_replace=1,
     routed_scaling_factor=2.5, norm_topk_prob=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
     "partial_rotary_factor": 0.5}, max_position_embeddings=1024)),
 "minimax_m2": ("minimax_m2", dict(hidden_size=96, intermediate_size=64, num_hidden_layers=3, num_attention_heads=6,
     num_key_value_heads=2, head_dim=32, num_local_experts=16, num_experts_per_tok=4, rotary_dim=16,
     rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "partial_rotary_factor": 0.5},
     max_position_embeddings=1024)),
 # gpt-oss: sinks, alternating sliding window, biases everywhere, router bias, clamped SwiGLU, YaRN.
 "gpt_oss": ("gpt_oss", dict(hidden_size=96, intermediate_size=64, num_hidden_layers=3, num_attention_heads=6,
     num_key_value_heads=2, head_dim=32, num_local_experts=16, num_experts_per_tok=4, sliding_window=6,
     layer_types=["sliding_attention", "full_attention", "sliding_attention"],
     rope_parameters=yarn(150000.0, 32.0, 4096), max_position_embeddings=1024)),
 # Qwen3.5-MoE (the Qwen 3.6 35B-A3B layout) and Qwen3-Next: gated DeltaNet linear attention + gated full attention.
 "qwen3_5_moe": ("qwen3_5_moe_text", dict(hidden_size=96, num_hidden_layers=4, num_attention_heads=6, num_key_value_heads=2,
     head_dim=32, moe_intermediate_size=40, shared_expert_intermediate_size=80, num_experts=16, num_experts_per_tok=4,
     linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=24, linear_value_head_dim=16,
     linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
     partial_rotary_factor=0.25, rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
     "partial_rotary_factor": 0.25}, max_position_embeddings=1024)),
 "qwen3_next": ("qwen3_next", dict(hidden_size=96, intermediate_size=192, num_hidden_layers=4, num_attention_heads=6,
     num_key_value_heads=2, head_dim=32, moe_intermediate_size=40, shared_expert_intermediate_size=80, num_experts=16,
     num_experts_per_tok=4, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
     linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=24, linear_value_head_dim=16,
     linear_conv_kernel_dim=4, layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
     partial_rotary_factor=0.25, max_position_embeddings=1024)),
}
def gemma4_case():
    c = AutoConfig.for_model("gemma4"); t = c.text_config
    d = t.to_dict()
    print("gemma4 text config keys:", sorted(d.keys()))
    kw = dict(hidden_size=96, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
              num_hidden_layers=3, sliding_window=6, max_position_embeddings=1024)
    for k, v in dict(enable_moe_block=True, num_experts=16, top_k_experts=4, moe_intermediate_size=40, global_head_dim=32,
                     num_global_key_value_heads=2, hidden_size_per_layer_input=0, vocab_size_per_layer_input=V).items():
        if k in d: kw[k] = v
    lt = d.get("layer_types")
    if isinstance(lt, list) and lt:
        kinds = list(dict.fromkeys(lt)); kw["layer_types"] = [kinds[i % len(kinds)] for i in range(3)]
    return type(t).model_type if hasattr(type(t), "model_type") else "gemma4_text", kw
def build(mtype, kw):
    cfg = AutoConfig.for_model(mtype, vocab_size=V, tie_word_embeddings=False, initializer_range=0.08, **kw)
    if getattr(cfg, "text_config", None) is not None and mtype == "gemma4": cfg = cfg.text_config
    cfg._attn_implementation = "eager"
    return cfg, AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
def run(name, mtype, kw):
    cfg, m = build(mtype, kw)
    with torch.no_grad():
        for n_, p in m.named_parameters():
            if p.dim() == 1 and "norm" in n_: p.copy_(p + 0.2 * torch.randn_like(p))
            elif p.dim() == 1 and ("bias" in n_ or "sinks" in n_ or "scale" in n_): p.copy_(0.3 * torch.randn_like(p))
        for n_, b in m.named_buffers():
            if "correction_bias" in n_: b.copy_(0.3 * torch.randn_like(b))
    d = os.path.join(out, name); os.makedirs(d, exist_ok=True)
    m.save_pretrained(d, safe_serialization=True)
    g = torch.Generator().manual_seed(4242); prompt = torch.randint(0, V, (45,), generator=g).tolist()
    with torch.no_grad():
        ids = torch.tensor([prompt]); o = m(ids, output_hidden_states=True)
        gen = m.generate(ids, max_new_tokens=24, do_sample=False, attention_mask=torch.ones_like(ids))[0, len(prompt):].tolist()
    np.save(os.path.join(d, "logits.npy"), o.logits[0].float().numpy())
    np.save(os.path.join(d, "hidden_states.npy"), torch.stack([h[0] for h in o.hidden_states]).float().numpy())
    json.dump({"model_type": getattr(cfg, "model_type", mtype), "prompt_ids": prompt, "greedy_ids": gen,
               "transformers": transformers.__version__}, open(os.path.join(d, "ref.json"), "w"), indent=1)
    print(name, "ok", type(m).__name__, "layers", cfg.num_hidden_layers, "bytes",
          sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d)))
names = sys.argv[2].split(",") if len(sys.argv) > 2 else list(cases) + ["gemma4"]
torch.manual_seed(20261207)
for name in names:
    try:
        mt, kw = gemma4_case() if name == "gemma4" else cases[name]
        run(name, mt, kw)
    except Exception as e:
        print(name, "FAILED", type(e).__name__, str(e)[:400]); traceback.print_exc(limit=3)
print("transformers", transformers.__version__, "torch", torch.__version__)
