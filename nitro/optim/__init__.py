"""The optimizer, built from optax stages: parameter groups, decoupled weight decay, clipping,
schedules bound by name, the moving average of the weights (EMA) and SAM/ASAM.

Internal: users reach these through `nitro.EMA`, `nitro.SAM`, `nitro.ASAM` and the run keywords.
Imports only `nitro.errors` and `nitro.experiments`.

- `optimizer`: the default optimizer, groups, clipping and decay composed; fed hyperparameters
- `param_groups`: the `param_group` hook; dotted leaf paths
- `weight_decay`: decoupled decay toward zero, the initial weights or an anchor
- `schedules`: schedules bound to hyperparameters by name
- `plateau`: `nitro.ReduceOnPlateau`, a fed value that drops when a metric stops improving
- `ranges`: the range of every numeric hyperparameter, checked at setup in one place
- `ema`, `sam`: the moving average; SAM and ASAM perturbations
- `stages`: the train step's stages: accumulation, SAM's gradient, the update, the average
- `guard`: the divergence guard's one rule: a skipped step keeps every variable
- `fed_optimizer`: `FedOptimizer`, what the engine needs of an optimizer (both kinds)
- `precision`: mixed precision (`precision=`): the jmp policy, float16's loss scale
- `fine_tuning`: `n.fine_tune`'s per-group schedules; `freeze_batch_stats`'s kept statistics
"""

__all__: list[str] = []
