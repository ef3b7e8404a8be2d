"""`n.profile()`, the history's host_ms / device_ms, and what `%nitro cache` says a program
costs: structure and consistency (parts never exceed the time they split, FLOPs are XLA's),
never timing thresholds."""

from __future__ import annotations

import gzip
import json
import math
import re
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from notebook_kernel import kernel_fixture  # noqa: F401 - provides the `kernel` fixture

import nitro
from nitro.examples.digits import Digits
from nitro.handle.profile import ROWS, ProfileReport

PARTS = ("data", "feed", "compile", "device", "readback", "bookkeeping")


def _handle(**keywords):
    keywords = {"seed": 0, "progress": False, **keywords}
    return nitro.Nitro(Digits(width=32, max_epochs=3), **keywords)


def _nbytes(leaves) -> int:
    return sum(int(np.asarray(x).nbytes) for x in leaves)


def test_profile_reports_every_part_of_every_call_consistently():
    n = _handle(steps_per_dispatch=1)
    n.train(epochs=1)  # 9 steps: compiled before the profile
    before = n.step
    report = n.profile(steps=6)

    assert isinstance(report, ProfileReport)
    assert n.step == before + 6 == report.steps + before  # training steps: the handle moved on
    assert [c.steps for c in report.calls] == [1] * 6
    assert [c.index for c in report.calls] == list(range(before, before + 6))
    for call in report.calls:
        assert all(getattr(call, part) >= 0 for part in PARTS)
        assert call.device > 0 and call.feed > 0
        assert math.isclose(call.total, sum(getattr(call, p) for p in PARTS))
    totals = report.total_seconds()
    assert sum(totals.values()) <= report.wall_seconds  # the parts split the calls' time
    assert sum(c.total for c in report.calls) <= report.wall_seconds
    means = report.part_seconds()
    assert list(means) == [label for label, _ in ROWS]
    assert all(v >= 0 for v in means.values())
    assert sum(means.values()) <= max(c.total for c in report.calls) + 1e-12

    (program,) = report.programs
    compiled = report.calls[0].program
    assert program.title == "train step" and program.calls == 6 and program.steps == 1
    xla = compiled.compiled.cost_analysis()
    assert program.cost.flops == xla["flops"] > 0  # one step a call: XLA's figure as it is
    assert program.cost.bytes_accessed == xla["bytes accessed"] > 0
    memory = compiled.compiled.memory_analysis()
    assert program.cost.temp_bytes == memory.temp_size_in_bytes
    assert program.cost.argument_bytes == memory.argument_size_in_bytes
    assert program.cost.memory_bytes > 0
    variables = n.state.variables
    assert program.cost.arguments["parameters"] == _nbytes(variables.params)
    assert program.cost.arguments["optimizer state"] == _nbytes(variables.opt_state)
    assert program.peak is not None and program.peak.flops > 0
    assert "measured" in program.peak.source and "matmul" in program.peak.source  # on a CPU
    assert program.achieved_flops == pytest.approx(program.cost.flops / program.device_seconds)
    assert program.utilization == pytest.approx(program.achieved_flops / program.peak.flops)

    text = str(report)
    for label, _ in ROWS:
        assert label in text
    assert "These 6 steps trained the handle" in text and "FLOP" in text and "peak" in text
    assert report.advice and report.advice in text
    html = report._repr_html_()
    assert "<table>" in html and "device program" in html
    frame = report.to_frame()
    assert list(frame.index) == [c.index + 1 for c in report.calls]
    assert {f"{p}_ms" for p in PARTS} <= set(frame.columns)


def test_the_trace_is_written_where_tensorboard_and_perfetto_read_it_and_parses():
    n = _handle(steps_per_dispatch=1)
    n.train(steps=2)
    report = n.profile(steps=4)

    trace_dir = Path(report.trace_dir)
    assert trace_dir.parent == Path(n.run_dir) / "profile" / "plugins" / "profile"
    names = {Path(f).name for f in report.trace_files}
    assert set(report.trace_files) == {str(p) for p in trace_dir.iterdir()}
    (xplane,) = [f for f in report.trace_files if f.endswith(".xplane.pb")]
    assert "perfetto_trace.json.gz" in names
    assert any(name.endswith(".trace.json.gz") for name in names - {"perfetto_trace.json.gz"})

    # the XSpace, read by jax's own reader (no TensorFlow): the train step ran once a call
    data = jax.profiler.ProfileData.from_file(xplane)
    runs = {
        dict(e.stats).get("run_id")
        for plane in data.planes
        for line in plane.lines
        for e in line.events
        if dict(e.stats).get("hlo_module") == "jit_step"
    }
    assert len(runs) == len(report.calls) == 4

    # Perfetto's JSON: each call is a "train" step named by its first step's index
    with gzip.open(trace_dir / "perfetto_trace.json.gz", "rt") as file:
        events = json.load(file)["traceEvents"]
    steps = [e for e in events if e.get("name") == "train" and e.get("ph") == "X"]
    assert len(steps) == 4


def test_profile_steps_are_training_steps_and_an_epoch_ending_among_them_commits():
    n = _handle(steps_per_dispatch=1)
    n.train(epochs=1)
    weights = [np.asarray(x).copy() for x in n.state.variables.params]
    report = n.profile(steps=12)  # 9 batches an epoch: epoch 2 ends, validates, commits

    assert n.step == 21 and n.epoch == 2 and len(n.history()) == 2
    changed = [
        not np.array_equal(a, np.asarray(b))
        for a, b in zip(weights, n.state.variables.params, strict=True)
    ]
    assert all(changed)
    # validation and the checkpoint at the epoch's end are in the wall time, in no call
    assert sum(c.total for c in report.calls) <= report.wall_seconds
    assert sum(c.steps for c in report.calls) == 12


@pytest.mark.parametrize("steps_per_dispatch", [1, 3])
def test_profiled_steps_train_the_weights_and_the_history_of_the_same_steps_unprofiled(
    steps_per_dispatch,
):
    profiled = _handle(steps_per_dispatch=steps_per_dispatch)
    plain = _handle(steps_per_dispatch=steps_per_dispatch)
    for n in (profiled, plain):
        n.train(epochs=1)
    report = profiled.profile(steps=12)  # 9 batches an epoch: epoch 2 ends among them
    plain.train(steps=12)

    assert sum(c.steps for c in report.calls) == 12
    assert profiled.step == plain.step == 21
    for a, b in zip(profiled.state.variables.params, plain.state.variables.params, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    columns = ["step", "loss", "val_loss"]
    mine, theirs = profiled.history()[columns], plain.history()[columns]
    assert len(mine) == 2
    np.testing.assert_array_equal(mine.to_numpy(), theirs.to_numpy())


def test_fused_calls_count_xla_loop_body_once_per_step(fresh_cache):
    """XLA's cost analysis counts a loop's body once: a call of 3 fused steps reports one
    step's FLOPs, and the report multiplies by the steps."""
    single = _handle(steps_per_dispatch=1)
    single.train(steps=1)
    fused = _handle(steps_per_dispatch=3)
    fused.train(steps=3)
    report = fused.profile(steps=6)

    (program,) = report.programs
    assert program.steps == 3 and [c.steps for c in report.calls] == [3, 3]
    xla = report.calls[0].program.compiled.cost_analysis()["flops"]
    assert program.cost.flops == 3 * xla and program.cost.flops_per_step == xla
    one = [p for p in nitro.cache_stats().programs if p["program"] == "train step"][0]
    assert program.cost.flops_per_step == pytest.approx(one["flops"], rel=0.01)


def test_profile_leaves_an_undecided_auto_as_it_was():
    n = _handle()  # steps_per_dispatch="auto": still timing its first steps
    n.train(steps=2)
    assert n.dispatch.probing
    report = n.profile(steps=3)
    assert [c.steps for c in report.calls] == [1, 1, 1]
    assert n.dispatch.probing  # the profile's waits did not feed its measurement
    assert any('"auto" had not decided yet' in note for note in report.notes)


def test_profile_refuses_bad_steps_a_running_handle_and_a_running_trace(tmp_path):
    n = _handle()
    for steps in (0, -1, True, 2.5):
        with pytest.raises(ValueError, match=r"profile\(steps=\.\.\.\) takes a positive int"):
            n.profile(steps=steps)  # pyright: ignore[reportArgumentType]
    assert n.step == 0

    jax.profiler.start_trace(str(tmp_path / "elsewhere"))  # one trace at a time, in a process
    try:
        with pytest.raises(nitro.RunningError, match=r"jax\.profiler\.stop_trace\(\) ends it"):
            n.profile(steps=2)
    finally:
        jax.profiler.stop_trace()
    assert n.step == 0 and n.runtime.profiler is None
    assert n.profile(steps=2, trace=False).trace_dir is None and n.step == 2

    busy = nitro.Nitro(Digits(width=32, max_epochs=10_000), seed=0, progress=False)
    busy.train(background=True)
    try:
        with pytest.raises(nitro.RunningError, match=r"cannot start profile\(\).*training"):
            busy.profile(steps=2)
    finally:
        busy.stop().wait()
    assert busy.runtime.profiler is None


def test_a_trace_directory_that_cannot_be_created_is_refused_before_anything_trains(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "profile").write_text("a file where the trace directory would go")
    n = _handle(run_dir=str(run_dir))
    with pytest.raises(
        OSError,
        match=r"profile\(\) writes its trace under .*run/profile, which "
        r"cannot be created.*profile\(trace=False\).*Nothing was trained",
    ):
        n.profile(steps=2)
    assert n.step == 0 and n.runtime.profiler is None
    report = n.profile(steps=2, trace=False)
    assert report.steps == 2 and report.trace_dir is None


def test_a_trace_directory_taken_away_during_the_steps_keeps_the_report_and_the_trace(tmp_path):
    class TakesTheTraceDirectoryAway:
        """Something else replaces the trace directory with a file while the steps train."""

        def start_run(self, handle, target_epoch):
            folder = Path(handle.run_dir) / "profile"
            shutil.rmtree(folder)
            folder.write_text("in the way")

    n = _handle(run_dir=str(tmp_path / "run"))
    taker = TakesTheTraceDirectoryAway()
    n.events.add(taker)
    report = n.profile(steps=3)
    assert report.steps == 3 == n.step
    assert any("The trace could not be moved under" in note for note in report.notes)
    kept = Path(report.trace_dir)
    assert not kept.is_relative_to(tmp_path) and (kept / "perfetto_trace.json.gz").is_file()
    shutil.rmtree(kept.parents[2])

    n.events.remove(taker)
    (tmp_path / "run" / "profile").unlink()
    again = n.profile(steps=1)  # jax's profiler is free again
    assert Path(again.trace_dir).parent == tmp_path / "run" / "profile" / "plugins" / "profile"
    assert {Path(f).name for f in again.trace_files} >= {"perfetto_trace.json.gz"}


def test_every_epoch_has_host_ms_and_device_ms_that_split_its_time():
    n = _handle()
    n.train(epochs=3)
    history = n.history()
    for epoch, row in history.iterrows():
        assert row["host_ms"] >= 0 and row["device_ms"] >= 0, epoch
        steps = 9
        split = (row["host_ms"] + row["device_ms"]) * steps / 1e3
        waited = row["data_wait_frac"] * row["epoch_seconds"]
        assert split + waited <= row["epoch_seconds"] + 1e-9
    # timing columns are not results: the plot and the progress lines leave them out
    assert "host_ms" not in nitro.progress.format_row(dict(n.history().reset_index().iloc[-1]))


def test_a_run_stopped_mid_epoch_resumes_with_the_epoch_timings_it_had():
    n = _handle(steps_per_dispatch=1)
    n.train(steps=4)
    totals = n.state.totals
    assert totals is not None and totals.device_seconds > 0
    n.close()
    resumed = nitro.Nitro(Digits(width=32, max_epochs=3), seed=0, progress=False, resume=n.run_dir)
    again = resumed.state.totals
    assert again is not None
    assert again.device_seconds == totals.device_seconds
    assert again.untimed_seconds == totals.untimed_seconds
    resumed.train(epochs=1)
    assert {"host_ms", "device_ms"} <= set(resumed.history().columns)


def test_cache_stats_give_each_program_its_flops_and_memory():
    n = _handle(steps_per_dispatch=1)
    n.train(steps=2)
    n.validate()
    programs = {p["program"]: p for p in nitro.cache_stats().programs}
    for title in ("train step", "eval forward"):
        p = programs[title]
        assert p["flops"] > 0 and p["bytes_accessed"] > 0, title
        assert p["memory_bytes"] >= p["temp_bytes"] >= 0
        assert p["arguments"]["parameters"] == _nbytes(n.state.variables.params)
    assert "FLOP a call" in str(nitro.cache_stats())


def test_the_status_line_shows_a_steps_split_between_host_and_device():
    from nitro_ipython.panel import status_text
    from nitro_ipython.runs import RunStats

    row = {"epoch": 1, "host_ms": 0.25, "device_ms": 1.5}
    parts = status_text("training", 1, 3, 4, 9, RunStats(), True, row)
    assert "host 0.25 ms + device wait 1.5 ms a step" in parts
    assert not any("host" in p for p in status_text("training", 0, 3, 4, 9, RunStats(), True))


# --- in a real kernel ------------------------------------------------------------------------


def test_nitro_profile_in_a_notebook(kernel):
    kernel.run(
        "prof_exp = tiny_exp.Tiny(batches=6, max_epochs=3)\n%nitro train prof_exp --epochs 1"
    )
    cell = kernel.run("%nitro profile prof_exp_run --steps 4")
    (result,) = [m["content"]["data"] for m in cell.messages if m["msg_type"] == "execute_result"]
    html, text = result["text/html"], result["text/plain"]  # (the steps' panel shows above)
    assert "profile of Tiny: 4 steps" in html and "device program" in html and "trace:" in html
    assert "host: feed and dispatch" in text and "FLOP" in text
    assert kernel.eval("prof_exp_run.step") == "10"
    refused = kernel.run("%nitro profile prof_exp_run --steps 0", check=False)
    assert refused.reply["content"]["ename"] == "UsageError" and "--steps" in refused.error
    assert kernel.eval("prof_exp_run.step") == "10"


def test_nitro_cache_lists_flops_and_memory_beside_compile_time(kernel):
    kernel.run("cache_exp = tiny_exp.Tiny(batches=4)\n%nitro train cache_exp")
    html = kernel.run("%nitro cache").data("text/html")[-1]
    assert "<th style='text-align:left'>FLOPs a call</th>" in html
    assert "<th style='text-align:left'>memory</th>" in html
    row = html.split("<td style='text-align:left'>train step</td>", 1)[1].split("</tr>", 1)[0]
    assert "FLOP</td>" in row and "KiB</td>" in row


def test_a_call_that_compiles_its_program_is_kept_apart_from_the_averages():
    n = nitro.Nitro(Digits(width=24, max_epochs=3), seed=0, progress=False, steps_per_dispatch=1)
    report = n.profile(steps=3)  # width 24 compiles nowhere else: its first call compiles

    first, *rest = report.calls
    assert first.first and first.compile > 0 and not any(c.first for c in rest)
    assert report.timed_calls == tuple(rest)
    assert report.total_seconds()["compile"] == first.compile
    assert "(the 1 that compiled its program" in str(report)


def test_a_profiles_counts_and_shares_agree_in_the_panel_the_tables_and_the_verdict(kernel):
    kernel.run("agree = tiny_exp.Tiny(batches=5, max_epochs=1)\n%nitro train agree")
    cell = kernel.run("%nitro profile agree_run --steps 7")  # steps 6-12: they end in epoch 3
    assert kernel.eval("(agree_run.epoch, agree_run.step)") == "(2, 12)"
    counted = "epoch 2/3"
    panel = kernel.eval("nitro_ipython.live_panel(agree_run).status.value")
    assert f"done &middot; {counted} &middot;" in re.sub(r"<[^>]+>", "", panel)
    assert f"{counted}," in kernel.run("%nitro status agree_run").stdout
    assert re.search(r"agree_run +Tiny +done +2/3 ", kernel.run("%nitro runs").data()[-1])
    assert f"{counted}," in kernel.eval("repr(agree_run)")
    assert "device wait" in panel  # the history's device_ms: a wait, not the program's time

    (text,) = [
        m["content"]["data"]["text/plain"]
        for m in cell.messages
        if m["msg_type"] == "execute_result"
    ]
    table = dict(re.findall(r"^  (\S.*?) +[\d.]+ ms +([\d.]+%)$", text, flags=re.M))
    assert len(table) == len(ROWS)
    verdict = re.search(r"takes the most of a call \(([\d.]+%)(?:: (.*?))?\)", text)
    quoted = dict(re.findall(r"(\D+?) ([\d.]+%)(?: \+ |$)", verdict.group(2) or ""))
    for label, share in quoted.items():
        assert table[label] == share, (label, share, table)  # the table's number, quoted
    if quoted:  # the host's or the device's rows, added up (to the table's rounding)
        total = sum(float(share.rstrip("%")) for share in quoted.values())
        assert abs(float(verdict.group(1).rstrip("%")) - total) < 0.15, (verdict, table)
    else:
        assert verdict.group(1) == table["waiting for data"]
