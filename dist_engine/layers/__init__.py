"""The building blocks decoder layers are made of, each single-device and architecture-free
(sizes in, no model config): `linear`, `norm` (RMSNorm), `rotary`, `mlp` (dense SwiGLU),
`attention` (grouped-query attention over the paged cache, through an attention backend) and
`moe` (router + `moe.MoELayer`, plus the native expert backend)."""
