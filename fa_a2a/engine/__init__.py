"""The engine under the public face (fa_a2a.op, fa_a2a.attention, fa_a2a.block): no public names.

  problem    a call's checks (the one home of the argument rules) and its agreement across ranks
  forward    the rank windows (WindowPlan), one rank's call and P emulated ranks' calls per impl
  projection the block's QKV projection into the rank windows and its prepared call (around forward's)
  autotune   impl="auto": the candidate paths timed at a signature's first call, kept on disk
  pacing     the fused kernel's and the projection's store pacing
  backward   gradients through the op
  tiles      FA4's tile geometry on the SMs (what pacing reads; the X-Stage model builds on it)
Arrows point down: the public face imports the engine, the engine imports cute_kernels and ulysses,
never the public face, the tools (fa_a2a.tools) or the models (fa_a2a.models).
"""
