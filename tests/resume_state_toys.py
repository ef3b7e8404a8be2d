"""Experiments over sources without random access whose iterators save their state, and the
child process of tests/test_data_resume_state.py's crash test:
`python -c "import resume_state_toys; resume_state_toys.main()" KIND RUN_DIR READS STEP`
resumes experiment KIND (`grain` or `hf`) from RUN_DIR and SIGKILLs itself at step STEP.

Each source appends the id of every sample it reads to the file READS (an experiment
field), so a test can see which samples a process pulled."""

from __future__ import annotations

import sys
from pathlib import Path

import datasets
import grain
import numpy as np
from grain_toys import Augmented, jitter, rows
from lifecycle_toys import KillAt

import nitro
from nitro.data import HFIterableSource

SAMPLES = 64  # a training epoch: 8 batches of 8


class Reads:
    """Appends each sample's id to a file, as the sample is read."""

    def __init__(self, path: str):
        self.path = path

    def __call__(self, sample):
        with open(self.path, "a") as file:
            file.write(f"{int(sample['id'])}\n")
        return sample


def read_ids(path: Path) -> list[int]:
    return [int(line) for line in path.read_text().split()] if path.exists() else []


def with_ids(lo: int, hi: int) -> list[dict[str, np.ndarray]]:
    return [dict(row, id=np.int64(i)) for i, row in zip(range(lo, hi), rows(lo, hi), strict=True)]


def validation() -> nitro.data.ArrayLoader:
    samples = rows(64, 96)
    arrays = {k: np.stack([s[k] for s in samples]) for k in ("x", "y")}
    return nitro.data.ArrayLoader(arrays, batch_size=8, shuffle=False, drop_last=False)


def jitter_with_id(sample, rng: np.random.Generator):
    return dict(jitter(sample, rng), id=sample["id"])


@nitro.experiment
class IterAugmented(Augmented):
    """Eight batches of 8 an epoch from a `grain.IterDataset` that augments randomly
    (`random_map`, seeded by Grain), read one sample at a time (no read-ahead); arrays
    for 'val'."""

    max_epochs: int = 3
    reads: str = ""

    def build_data(self):
        pipeline = (
            grain.MapDataset.source(with_ids(0, SAMPLES))
            .to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
            .map(Reads(self.reads))
            .random_map(jitter_with_id, seed=11)
            .batch(8, drop_remainder=True)
        )
        return {"train": pipeline, "val": validation()}


def table(lo: int, hi: int) -> datasets.Dataset:
    samples = with_ids(lo, hi)
    return datasets.Dataset.from_dict(
        {
            "x": np.stack([s["x"] for s in samples]),
            "y": np.stack([s["y"] for s in samples]),
            "id": np.arange(lo, hi),
        }
    )


@nitro.experiment
class StreamState(Augmented):
    """A `datasets.IterableDataset` of 4 shards built in memory, its shards' order shuffled
    by the run's seed each epoch (`buffer_size=1`: no shuffle buffer, so its state resumes
    it exactly)."""

    max_epochs: int = 3
    reads: str = ""

    def build_data(self):
        stream = table(0, SAMPLES).to_iterable_dataset(num_shards=4).map(Reads(self.reads))
        return {
            "train": HFIterableSource(stream, 8, buffer_size=1),
            "val": validation(),
        }


KINDS = {"grain": IterAugmented, "hf": StreamState}


def main(argv: list[str] | None = None) -> None:
    kind, run_dir, reads, step = argv if argv is not None else sys.argv[1:]
    checkpoints = Path(run_dir) / "checkpoints"
    newest = max(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit())
    nitro.Nitro(
        KINDS[kind](reads=reads),
        run_dir=run_dir,
        resume="auto",
        checkpointer=nitro.Checkpointer(budget=None),
        progress=KillAt(int(step), checkpoints / str(newest)),
        logger=None,
    ).train()
    raise SystemExit("the run was not killed")


@nitro.experiment
class Loaded(Augmented):
    """A `grain.DataLoader` (no worker processes) over the samples, in batches of 8: its
    iterator's state is JSON text in bytes."""

    max_epochs: int = 3

    def build_data(self):
        loader = grain.DataLoader(
            data_source=with_ids(0, SAMPLES),
            sampler=grain.samplers.IndexSampler(SAMPLES, shuffle=True, seed=3, num_epochs=1),
            operations=[grain.transforms.Batch(8, drop_remainder=True)],
            worker_count=0,
        )
        return {"train": loader, "val": validation()}
