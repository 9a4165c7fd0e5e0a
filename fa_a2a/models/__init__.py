"""DiT models under diffusers' context parallelism with fa-a2a: the attention backend
(diffusers_backend) and the fused attention block in each model's processor (flux, dit_blocks)."""
