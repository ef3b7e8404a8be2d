"""What a user declares: the field kinds (`GraphConst`, `Device`, Host), their declared types,
the `@experiment` decorator and its field specs, the stripped view traced hooks see, the routing of
batch fields to hooks, the code fingerprints of hooks, and Flax Linen and equinox models.

The lowest layer: it imports nothing of nitro but `nitro.errors`.

- `declaration`: the markers, `@experiment`, field specs, the edit generation
- `presets`: the named partial configurations an experiment declares, `from_preset`, and the
  preset an instance was built from
- `field_types`: GraphConst and Device values checked against their declared types
- `trace_view`: the `self` traced hooks see; records GraphConst reads
- `routing`: which batch fields each hook receives
- `fingerprint`: digests of the code a program runs (hooks, helpers, classes)
- `hooks`: hooks as values (`hooks=`): sets of hook functions overriding the methods of a class
- `linen`: Flax Linen modules through `flax.nnx.bridge`
- `equinox`: equinox modules, their arrays as NNX variables
"""

from nitro.experiments.declaration import (
    DRIVER_ONLY_NAMES,
    REQUIRED_HOOKS,
    Device,
    ExperimentError,
    FieldKind,
    FieldSpec,
    GraphConst,
    experiment,
    field_specs,
    fields,
    is_experiment,
)
from nitro.experiments.presets import from_preset, preset_of, presets

__all__ = [
    "Device",
    "FieldKind",
    "FieldSpec",
    "GraphConst",
    "ExperimentError",
    "experiment",
    "fields",
    "field_specs",
    "from_preset",
    "preset_of",
    "presets",
    "is_experiment",
    "REQUIRED_HOOKS",
    "DRIVER_ONLY_NAMES",
]
