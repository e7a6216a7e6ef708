"""Model families: one module per architecture, registered in engine.registry.FAMILIES (or the
entry-point group `moebench.families`).

    base         Family: the interface (config.json in and out, layers from blocks, expert layout, presets)
    gqa          GQAConfig, GQAFamily, SparseStepFamily: the first wave's shape, shared by
    mixtral      the worked example
    qwen2_moe, qwen3_moe, olmoe
    sigmoid_moe  SigmoidRouting, SigmoidMoEFamily: DeepSeek-V3's MoE layers, shared by
    deepseek_v3  DeepSeek-V3, Kimi-K2, Moonlight (multi-head latent attention)
    glm4_moe     GLM-4.5 / 4.6 (on gqa's attention)
    gpt_oss    sliding/full attention with sinks, YaRN, MXFP4 clamped-SwiGLU experts
    qwen3_next Qwen3-Next and Qwen3.5-MoE's text model: gated DeltaNet (recurrent state) + gated attention
    gemma4     Gemma 4's MoE text model: sandwich layers, dense MLP beside the experts, per-layer inputs

How to add one -- which interfaces to implement, where state kinds plug in, how the planner
terms are reported, how to test against transformers: engine/families/README.md.
"""
