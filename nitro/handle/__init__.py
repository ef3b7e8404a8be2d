"""The handle: `Nitro`, the binding report, and the handle's displays.

`nitro.Nitro` is the public name. Imports `engine` and below.

- `run_handle`: `RunHandle`, what a run's handle and a population's share: training on a worker
  thread, waiting, stopping, closing, the phase and the run's files
- `handle`: `Nitro`
- `population`: `Population`, many variants of one experiment trained as one vmapped program
- `population_members`: a population's members as `Nitro` handles and tables, and its refusals
  of axes and values the members cannot share
- `lr_find`: `n.lr_find()` and its `LRFindResult`, a learning rate from a log grid trained as a
  population
- `population_loggers`: a population's loggers, a logger run per member
- `binding_report`: where every value came from
- `displays`, `plotting`: the handle's repr and HTML; history plots
- `summary`: `n.summary()`, the model's modules, output shapes and sizes (eval_shape, no compile)
- `signature`: `Nitro(...)`'s signature and keyword help, generated from the run keywords
- `profile`: `n.profile(steps=20)`, a few steps under `jax.profiler` and where a call's time went
- `render`: `n.render()`, `n.show_batch()`, `n.top_losses()`, `n.confusion()`: what the model
  does to samples; `gallery`: samples drawn in one figure (the `visualize` hook, the default
  views); `confusion`: a confusion matrix and its per-class metrics
- `time_travel`: `n.snapshots`, `n.rewind(step)`, `n.fork(step, **changes)` and the roll-back over
  a loss spike (`spike=`), on the run's snapshots and checkpoints
"""

from nitro.handle import lr_find as _lr_find  # noqa: F401 - registers `Nitro.lr_find`
from nitro.handle.handle import Nitro
from nitro.handle.population import Population

__all__ = ["Nitro", "Population"]
