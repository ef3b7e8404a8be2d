"""Sources without random access resume mid-epoch from their iterator's own state, saved in
every mid-epoch checkpoint: a randomly augmenting `grain.IterDataset` SIGKILLed after a
mid-epoch save and resumed, and a `datasets.IterableDataset` built in memory, both bitwise
equal to a run that was not interrupted; the checkpoint's JSON meta (read with plain orbax)
holds the state, and the resumed process does not pull the batches it skips (each source logs
the samples it reads). Older checkpoints, without a state, still resume by replay."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import grain
import numpy as np
import orbax.checkpoint as ocp
from lifecycle_toys import parameters
from resume_state_toys import SAMPLES, IterAugmented, Loaded, StreamState, read_ids, with_ids
from system import child_env

import nitro
from nitro.data import HFIterableSource
from nitro.data.iter_state import decode, encode

EVERY_EPOCH = nitro.Checkpointer(budget=None)
QUIET = {"progress": False, "logger": None}


def meta_of(run_dir: Path, step: int) -> dict:
    with ocp.CheckpointManager(
        run_dir / "checkpoints", options=ocp.CheckpointManagerOptions(read_only=True)
    ) as manager:
        return manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]


def stopped_at(experiment, run_dir: Path, step: int) -> nitro.Nitro:
    n = nitro.Nitro(
        experiment, run_dir=str(run_dir), checkpointer=EVERY_EPOCH, max_steps=step, **QUIET
    )
    n.train()
    assert (n.step, n.stop_reason) == (step, "max_steps")
    n.close()  # releases the run directory for the next writer
    return n


def resumed(experiment, run_dir: Path) -> nitro.Nitro:
    n = nitro.Nitro(
        experiment, run_dir=str(run_dir), resume="auto", checkpointer=EVERY_EPOCH, **QUIET
    )
    return n.train()


def assert_bitwise_equal(a: nitro.Nitro, b: nitro.Nitro) -> None:
    for column in ("loss", "val_loss"):
        assert a.history()[column].tolist() == b.history()[column].tolist(), column
    pa, pb = parameters(a), parameters(b)
    assert sorted(pa) == sorted(pb)
    for name in pa:
        assert np.array_equal(pa[name], pb[name]), name


def test_a_grain_iter_dataset_killed_after_a_mid_epoch_save_resumes_from_its_iterator_state(
    tmp_path,
):
    """Stopped at step 11 (epoch 2, batch 3: saved), resumed in a child SIGKILLed at step 13,
    and resumed again from the step-11 checkpoint: it restores Grain's iterator state instead
    of pulling batches 0-2 of epoch 2 again."""
    full = nitro.Nitro(IterAugmented(reads=str(tmp_path / "full.txt")), **QUIET).train()
    reads, run = tmp_path / "reads.txt", tmp_path / "run"
    stopped_at(IterAugmented(reads=str(reads)), run, 11)

    partial = meta_of(run, 11)["partial_epoch"]
    pipeline = IterAugmented(reads=str(tmp_path / "probe.txt")).build_data()["train"]
    iterator = iter(pipeline)
    for _ in range(3):
        next(iterator)
    assert partial["position"] == 3 and partial["data_state"] == iterator.get_state()

    code = "import resume_state_toys; resume_state_toys.main()"
    crash = subprocess.run(
        [sys.executable, "-c", code, "grain", str(run), str(reads), "13"],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert crash.returncode == -signal.SIGKILL, crash.stderr
    assert sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == [
        8,
        11,
    ]

    before = len(read_ids(reads))
    again = resumed(IterAugmented(reads=str(reads)), run)
    assert (again.step, again.epoch) == (24, 3)
    assert_bitwise_equal(full, again)
    # setup's probe of the first batch, epoch 2 from batch 3 (samples 24-63), then epoch 3:
    # no replay of samples 0-23
    assert read_ids(reads)[before:] == list(range(8)) + list(range(24, SAMPLES)) + list(
        range(SAMPLES)
    )


def test_a_hugging_face_iterable_dataset_resumes_from_its_state_dict(tmp_path):
    full = nitro.Nitro(StreamState(reads=str(tmp_path / "full.txt")), **QUIET).train()
    reads, run = tmp_path / "reads.txt", tmp_path / "run"
    stopped_at(StreamState(reads=str(reads)), run, 11)
    state = meta_of(run, 11)["partial_epoch"]["data_state"]
    assert state["epoch"] == 1 and "examples_iterable" in state  # HF's own state_dict

    before = len(read_ids(reads))
    again = resumed(StreamState(reads=str(reads)), run)
    assert (again.step, again.epoch) == (24, 3)
    assert_bitwise_equal(full, again)
    # a replay would read epoch 2 whole (64 rows) besides the probe's batch and epoch 3
    assert len(read_ids(reads)[before:]) < 8 + 2 * SAMPLES


def test_a_grain_data_loader_resumes_from_its_iterator_state(tmp_path):
    full = nitro.Nitro(Loaded(), **QUIET).train()
    run = tmp_path / "run"
    stopped_at(Loaded(), run, 11)
    state = meta_of(run, 11)["partial_epoch"]["data_state"]
    assert json.loads(state["json_text"])["last_seen_indices"] == {"0": 23}  # 3 batches of 8
    again = resumed(Loaded(), run)
    assert (again.step, again.epoch) == (24, 3)
    assert_bitwise_equal(full, again)


def test_a_stream_with_a_shuffle_buffer_or_a_checkpoint_without_a_state_resumes_by_replay(
    tmp_path,
):
    # Hugging Face's state leaves out a shuffle buffer's rows: such a pass saves none
    stream = StreamState().build_data()["train"].dataset
    buffered = HFIterableSource(stream, 8, seed=0)
    assert not buffered.exact_state and buffered.iter_epoch(0).get_state() is None

    # a checkpoint from before states were saved: its data_state is gone, the run replays
    full = nitro.Nitro(IterAugmented(reads=str(tmp_path / "full.txt")), **QUIET).train()
    reads, run = tmp_path / "reads.txt", tmp_path / "run"
    stopped_at(IterAugmented(reads=str(reads)), run, 11)
    meta_file = run / "checkpoints" / "11" / "meta" / "metadata"  # orbax's JSON item
    meta = json.loads(meta_file.read_text())
    del meta["partial_epoch"]["data_state"]
    meta_file.write_text(json.dumps(meta))

    before = len(read_ids(reads))
    again = resumed(IterAugmented(reads=str(reads)), run)
    assert_bitwise_equal(full, again)
    assert read_ids(reads)[before:] == list(range(8)) + 2 * list(range(SAMPLES))  # replayed


def test_iterator_states_are_kept_as_json():
    iterator = iter(
        grain.MapDataset.source(with_ids(0, 16))
        .to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
        .batch(4)
    )
    next(iterator)
    state = encode(iterator.get_state())
    assert json.loads(json.dumps(state)) == state == iterator.get_state()
    text = encode(b'{"version": 2}')  # a grain.DataLoader's state: JSON text in bytes
    assert json.loads(json.dumps(text)) == text and decode(text) == b'{"version": 2}'
    assert encode({"rng": object()}) is None  # not JSON: not kept (the resume replays)


def test_auto_says_why_a_source_without_random_access_is_read_on_one_thread(tmp_path):
    for experiment, says in (
        (IterAugmented, "Grain parallelizes it itself"),
        (StreamState, "a datasets.Dataset (random access) is built in parallel"),
    ):
        n = nitro.Nitro(experiment(reads=str(tmp_path / "reads.txt")), **QUIET)
        line = next(x for x in str(n.binding_report()).splitlines() if "train:" in x)
        assert "prefetch single: " in line and "(auto: " in line and says in line, line
        assert "no begin_epoch/batch_at" in line
