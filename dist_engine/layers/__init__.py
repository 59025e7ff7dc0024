"""The building blocks decoder layers are made of, each single-device and architecture-free
(sizes in, no model config): `linear`, `norm` (RMSNorm), `rotary` (default RoPE and YaRN),
`mlp` (dense SwiGLU), `attention` (grouped-query attention over the paged cache, through an
attention backend), `mla` (Multi-head Latent Attention over the latent cache) and `moe`
(router + `moe.MoELayer` + shared experts, plus the native expert backend)."""
