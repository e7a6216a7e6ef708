"""Model families: one module per architecture, registered in engine.registry.FAMILIES (or the
entry-point group `moebench.families`).

    base       Family: the interface (config.json in and out, layers from blocks, expert layout, presets)
    gqa        GQAConfig, GQAFamily, SparseStepFamily: the first wave's shape, shared by
    mixtral    the worked example
    qwen2_moe, qwen3_moe, olmoe

How to add one -- which interfaces to implement, where state kinds plug in, how the planner
terms are reported, how to test against transformers: engine/families/README.md.
"""
