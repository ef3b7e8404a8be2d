"""Export and serving: StableHLO bundles written with `jax.export`, loaded with nothing but JAX,
NumPy and safetensors, and served with KServe's model server.

Public import paths: `nitro.bundle` (loading) and `nitro.serve` (`nitro serve`). Imports
`programs` and below (export traces the experiment's hooks).

- `export`: writing a bundle (`Nitro.export`)
- `bundle`: loading a bundle
- `server`: the KServe adapters (model, repository, model server)
- `paging`: weight sets paged between disk, host memory and the device within budgets
- `transport`: the wire's hardening (limits, framing and request checks, one host for gRPC)
- `publish`: a handle's weights swapped into a running server (`Nitro.publish`)
- `serve`: the `nitro serve` command
"""

__all__: list[str] = []
