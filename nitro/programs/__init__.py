"""The compiled programs: the compile cache (the only place that calls `jax.jit`), JAX's persistent
cache, tracing, the program specs (train step, evaluation, prediction) and what an edit reaches.

Internal, except `nitro.staleness` and `nitro.manual` (public import paths of `staleness` and
`manual`). Imports `core` and below.

- `compile_cache`: the module-level cache, its keys, explanations and statistics
- `persistent_cache`: JAX's persistent compilation cache: its directory, safe writes
- `tracing`: what every program needs while traced: the view, hook calls, checks
- `train_step`: the train step assembled from `optim.stages`, and K of them fused (`lax.scan`)
- `manual`: `nitro.manual.Step` for `train_step` hooks, one optimizer per model
- `specs`: evaluation, prediction and device-metric specs; `ProgramSet`
- `staleness`: what an edit changed and which programs it reaches
- `compile_options`: `compile_options=`, XLA's options per program kind, checked with XLA
- `remat`: `remat=`, the modules the train step's backward pass recomputes and their policies
- `costs`: what a compiled program costs (FLOPs, bytes accessed, memory), as XLA reports it
- `population`: a population's programs: the train step and eval forward, vmapped over members
"""

__all__: list[str] = []
