"""Populations in a real kernel: `%nitro train pop`, its live panel (every member's curves, a
table of them in member order with their ranks, a Stop button per member), pruning from the panel and from the
magic, `%nitro status`, and the record the run leaves."""

from __future__ import annotations

import ast
import re

from notebook_kernel import kernel_fixture  # noqa: F401 - provides the `kernel` fixture

PANEL = "nitro_ipython.live_panel({})"

# Defined in the kernel: the live table's member order and rank column, and the members best
# first by their latest val_loss in the history (what the ranks must say).
HELPERS = """
import re as _re

def _table_order(pop):
    panel = nitro_ipython.live_panel(pop)
    return [panel.member_rows.index(row) for row in panel.table.children[1:]]

def _table_ranks(pop):
    cells = nitro_ipython.live_panel(pop).member_cells
    return [_re.search("width:40px;[^>]*>([^<]*)</span>", c.value).group(1) for c in cells]

def _ranked(pop):
    latest = pop.history().groupby(level="member").tail(1).reset_index()
    return latest.sort_values(["val_loss", "member"])["member"].tolist()

def _ranks(pop):
    ranked = _ranked(pop)
    return [str(ranked.index(member) + 1) for member in range(len(pop))]

def _table_is_ranked(pop):
    history = len(pop.history())  # the history before and after: one epoch's table
    ranks, expected = _table_ranks(pop), _ranks(pop)
    return history > 0 and history == len(pop.history()) and ranks == expected
"""


def _saved(kernel, cell_id: str) -> list[dict]:
    """The display outputs of the cell `cell_id` in a notebook saved now (schema-checked)."""
    import nbformat

    outputs = kernel.outputs(cell_id)
    cell = nbformat.v4.new_code_cell(outputs=outputs)
    nbformat.validate(nbformat.v4.new_notebook(cells=[cell]))
    return [o for o in outputs if o["output_type"] == "display_data"]


def _record_members(html: str) -> list[int]:
    """The members of a record's table, in its order."""
    return [int(i) for i in re.findall(r"&#x25A0;</span> (\d+)</span>", html)]


def _record_ranks(html: str) -> list[str]:
    """The rank column of a record's table, in its order."""
    return re.findall(r"&#x25A0;</span> \d+</span><span [^>]*>([^<]*)</span>", html)


def _comms(kernel) -> int:
    return int(kernel.eval("len(__import__('comm').get_comm_manager().comms)"))


def _opened(cell, model: str) -> list[dict]:
    return [
        m["content"]["data"]["state"]
        for m in cell.messages
        if m["msg_type"] == "comm_open" and m["content"]["data"]["state"]["_model_name"] == model
    ]


def test_a_population_trained_with_the_magic_leaves_a_record_of_every_member_ranked(kernel):
    kernel.run(
        "pop = nitro.Population(tiny_exp.Tiny(batches=5, max_epochs=2), "
        "learning_rate=[1e-3, 3e-2, 1e-1], seed=[0, 1])"
    )
    assert kernel.eval("type(pop.reporter).__name__") == "'PanelReporter'"  # a run's
    before = _comms(kernel)
    cell = kernel.run("%nitro train pop")
    buttons = _opened(cell, "ButtonModel")  # the run's Stop, then one per member
    assert [b["description"] for b in buttons] == ["Interrupt ■ to stop"] + ["Stop"] * 6
    assert all(b["disabled"] for b in buttons)  # a foreground run: the interrupt button stops

    kernel.run(HELPERS)
    ranks = ast.literal_eval(kernel.eval("_ranks(pop)"))
    summary, curves = _saved(kernel, cell.msg_id)  # the record replaced panel and stand-in
    html, text = summary["data"]["text/html"], summary["data"]["text/plain"]
    assert _record_members(html) == list(range(6))  # member order, as the live table
    assert _record_ranks(html) == ranks and sorted(ranks) == [str(r) for r in range(1, 7)]
    assert re.search(r"<b>done</b> &middot; epoch 2/2 &middot; step 10 &middot; 6 members", html)
    assert "val_loss &#x25B2;" in html  # the column it is sorted by, ascending
    assert text.startswith("Tiny population of 6: done · epoch 2/2 · step 10")
    for member, settings in enumerate(ast.literal_eval(kernel.eval("pop.members"))):
        label = f"learning_rate={settings['learning_rate']:g} seed={settings['seed']}"
        assert f"  {member}: {label}  trained  rank {ranks[member]}  loss " in text
    assert set(curves["data"]) == {"image/png", "text/plain"}  # every member's curves
    assert _comms(kernel) == before  # every widget of the panel closed

    bound = kernel.run("%nitro bind pop").data()[-1]  # its section, then member 0's report
    assert bound.startswith("population\n  members = 6  (this report: member 0, ")
    assert "learning_rate = 0.001  [member 0's setting]" in bound

    again = kernel.run("%nitro train pop").stdout
    assert "pop already trained its 2 epochs" in again and "--epochs N" in again
    more = kernel.run("%nitro train pop --epochs 1")
    assert kernel.eval("(pop.epoch, pop.target_epoch)") == "(3, 3)"
    assert "epoch 3/3" in _saved(kernel, more.msg_id)[0]["data"]["text/plain"]


def test_a_member_stop_button_prunes_it_and_the_others_train_on(kernel):
    kernel.run(HELPERS)
    kernel.run(
        "popb = nitro.Population(tiny_exp.Tiny(batches=8, delay=0.005, max_epochs=1000), "
        "learning_rate=[1e-3, 3e-2, 1e-1], steps_per_dispatch=1)"
    )
    started = kernel.run("%nitro train popb --background")
    assert "in the background" not in started.stdout  # said in the panel, never under its record
    said = kernel.eval("nitro_ipython.live_panel(popb).hint.value")
    assert "popb (3 members) is training in the background" in said
    kernel.wait_until("popb.epoch >= 2")
    kernel.wait_until("_table_is_ranked(popb)")  # the live table: each member's rank
    # the run's plots: the loss and acc (each member's), then the members named
    shown = f"[p.layout.display for p in {PANEL.format('popb')}.plots]"
    kernel.wait_until(f"{shown} == ['', '', '', 'none']")
    # its rows stay in member order, although the best member is not member 0
    assert kernel.eval("_ranked(popb)[0] != 0 and _table_order(popb) == [0, 1, 2]") == "True"
    rows = kernel.eval(f"[row.model_id for row in {PANEL.format('popb')}.table.children]")

    def standin() -> str:  # what a notebook saved now shows where the widget is dead
        kernel.pump(0.2)
        shown = _saved(kernel, started.msg_id)[1]["data"].get("text/html", "")
        return shown if "nitro-standin" in shown else ""

    live = r"last seen (training|validating) &middot; epoch [1-9]\d*/1000"  # not in bold
    kernel.wait_until("True", lambda _: re.search(live, standin()) is not None)
    shown = standin()  # refreshed as epochs end: every member, with its results
    assert sorted(_record_members(shown)) == [0, 1, 2] and "val_loss &#x25B2;" in shown

    panel = PANEL.format("popb")
    button = ast.literal_eval(kernel.eval(f"{panel}.member_buttons[1].model_id"))
    assert kernel.eval(f"{panel}.member_buttons[1].disabled") == "False"
    kernel.click(button)
    kernel.wait_until("1 in popb.stopped")
    assert kernel.eval("popb.stopped") == "{1: 'stopped by its Stop button in the panel'}"
    kernel.wait_until(f"{panel}.member_buttons[1].description == 'Stopped'")
    assert "stopped by its Stop button in the panel" in kernel.eval(
        f"{panel}.member_cells[1].value"
    )

    epoch = int(kernel.eval("popb.epoch"))
    kernel.wait_until(f"popb.epoch >= {epoch + 2}")  # the others train on
    kernel.wait_until("_table_is_ranked(popb)")
    assert kernel.eval(f"[row.model_id for row in {panel}.table.children]") == rows
    kernel.run("%nitro stop popb")
    val = ast.literal_eval(
        kernel.eval(
            "popb.history()['val_loss'].unstack('member')[[0, 2]].iloc[-2:].values.tolist()"
        )
    )
    assert val[0][0] != val[1][0] and val[0][1] != val[1][1]  # the others' weights change
    # the pruned member's record ended at its stop: its epoch no longer counts
    last = int(kernel.eval("int(popb.history().loc[1].index[-1])"))
    assert last <= epoch + 1 < int(kernel.eval("popb.epoch"))
    step = "int(popb.history().loc[1, 'step'].iloc[-1]) == popb.stopped_at[1]"
    assert kernel.eval(step) == "True"  # its last row is where it stopped

    kernel.wait_for(
        lambda m: (
            m["parent_header"].get("msg_id") == started.msg_id
            and m["msg_type"] == "update_display_data"
            and "image/png" in m["content"]["data"]
        ),
        what="the stopped run's curves",
    )
    summary = _saved(kernel, started.msg_id)[0]["data"]
    assert "<b>stopped</b>" in summary["text/html"]
    assert sorted(_record_members(summary["text/html"])) == [0, 1, 2]
    assert "1: learning_rate=0.03  stopped by its Stop button in the panel" in summary["text/plain"]


def test_stop_a_member_with_the_magic_and_status_lists_the_population(kernel):
    kernel.run(
        "popc = nitro.Population(tiny_exp.Tiny(batches=8, delay=0.005, max_epochs=1000), "
        "learning_rate=[1e-3, 3e-2, 1e-1], steps_per_dispatch=1)\n"
        "%nitro train popc --background"
    )
    kernel.wait_until("popc.epoch >= 1")
    status = kernel.run("%nitro status").stdout
    assert re.search(
        r"popc \(Tiny population of 3\): (training|validating), epoch \d+/1000, step \d+, "
        r"3 of 3 members training, best val_loss [\d.e+-]+ \(member \d: learning_rate=",
        status,
    )

    refused = kernel.run("%nitro stop popc 9", check=False)
    assert refused.reply["content"]["ename"] == "UsageError"
    assert "popc has 3 members, numbered 0 to 2" in refused.error
    assert "popc has 3 members" in kernel.run("%nitro stop popc one", check=False).error

    stopped = kernel.run("%nitro stop popc 1").stdout
    said = re.match(
        r"nitro: stopped member 1 \(learning_rate=0.03\) of popc at step (\d+); 2 of 3 members "
        r"train on",
        stopped,
    )
    assert said and int(said.group(1)) == int(kernel.eval("popc.stopped_at[1]"))
    assert kernel.eval("popc.stopped") == "{1: 'stopped by %nitro stop popc 1'}"
    status = kernel.run("%nitro status popc").stdout
    assert "2 of 3 members training" in status
    stopped_at = (
        f"  member 1 (learning_rate=0.03): stopped by %nitro stop popc 1 (at step {said[1]})"
    )
    assert stopped_at in status  # the step its record ends at, while the others train on
    assert "already stopped" in kernel.run("%nitro stop popc 1").stdout
    panel = PANEL.format("popc")
    kernel.wait_until(f"{panel}.member_buttons[1].description == 'Stopped'")

    step = int(kernel.eval("popc.step"))
    kernel.wait_until(f"popc.step > {step + 10}")  # the others train on
    # one number: its record's last row has the step the magic said
    kernel.wait_until("bool(popc.epoch > popc.history().loc[1].index[-1])")
    assert int(kernel.eval("int(popc.history().loc[1, 'step'].iloc[-1])")) == int(said.group(1))
    ended = kernel.run("%nitro stop popc").stdout
    assert re.match(r"nitro: stopped popc at epoch \d+, step \d+ .*`%nitro train popc`", ended)
    assert "1 of 3 members stopped" in kernel.run("%nitro status popc").stdout
    assert "popc is not running" in kernel.run("%nitro stop popc").stdout
    # %nitro runs lists the population beside the runs, with its best member
    listed = kernel.run("%nitro runs").data()[-1]
    assert "populations:" in listed
    row = re.search(
        r"^popc +Tiny +stopped +\d+/1000 +\d+ +1 of 3 members stopped +(.*)$", listed, re.M
    )
    assert row and re.match(r"val_loss [\d.e+-]+ \(member [02]: learning_rate=", row.group(1))
    # and its run directory among the runs on disk, named as the notebook names it
    run_id = ast.literal_eval(kernel.eval("popc.run_id"))
    assert re.search(rf"^{run_id} +popc +Tiny ", listed.split("on disk:")[1], re.M), listed


def test_a_population_refuses_what_it_does_not_take_in_one_line(kernel):
    kernel.run(
        "popd = nitro.Population(tiny_exp.Tiny(batches=4, delay=0.01, max_epochs=2), "
        "learning_rate=[1e-3, 1e-2])\n"
        "%nitro train popd --background"
    )
    waited = kernel.run("%nitro wait popd").stdout
    assert waited.startswith("popd (Tiny population of 2): done, epoch 2/2, step 8, 2 members")

    fresh = kernel.run("%nitro train popd --fresh", check=False)
    assert "popd is a nitro.Population" in fresh.error and "--fresh" in fresh.error
    validate = kernel.run("%nitro predict popd", check=False)
    assert "'popd' is a nitro.Population" in validate.error and "popd.best()" in validate.error
    rows = kernel.run("%nitro validate popd").data()[-1]  # a row per member, as pop.validate()
    assert "val_loss" in rows and "learning_rate" in rows
    extra = kernel.run("%nitro train popd 1", check=False)
    assert "%nitro train takes one target" in extra.error
    kernel.run("solo = tiny_exp.Tiny(batches=2)\n%nitro train solo")
    member = kernel.run("%nitro stop solo_run 1", check=False)
    assert "a member is for a population" in member.error
    assert all(
        cell.reply["content"]["traceback"] == [] for cell in (fresh, validate, extra, member)
    )


def test_resume_continues_a_population_s_run_on_disk_or_says_why_it_cannot(kernel):
    build = "nitro.Population(tiny_exp.Tiny(batches=4, max_epochs=3), learning_rate=[2e-3, 2e-2])"
    kernel.run(f"popr = {build}\n%nitro train popr --epochs 2")
    first = kernel.eval("popr.run_dir")
    kernel.run(f"popr = {build}")  # as after a kernel restart: a new population, epoch 0
    assert kernel.eval("(popr.epoch, popr.run_dir != " + first + ")") == "(0, True)"

    cell = kernel.run("%nitro train popr --resume")
    assert re.search(
        r"nitro: popr continues population \S+ from its checkpoint at epoch 2, step 8", cell.stdout
    ), cell.stdout
    assert kernel.eval("(popr.epoch, popr.step, popr.run_dir == " + first + ")") == "(3, 12, True)"
    assert kernel.eval("popr.history().index.get_level_values('epoch').tolist()") == str(
        [1, 2, 3, 1, 2, 3]
    )
    # its panel's curves start with the history it resumed, as a resumed run's do
    curves = "[[r['epoch'] for r in rows] for rows in popr.reporter.curves.rows]"
    assert kernel.eval(curves) == "[[1, 2, 3], [1, 2, 3]]"

    nothing = kernel.run(
        "popn = nitro.Population(tiny_exp.Tiny(batches=4), learning_rate=[2e-3], "
        "run_dir='elsewhere/popn')\n%nitro train popn --resume",
        check=False,
    )
    assert nothing.reply["content"]["ename"] == "UsageError"
    assert "no checkpoint of a Tiny population under" in nothing.error
    assert "elsewhere/popn" in nothing.error and "checkpointer=None" in nothing.error


def test_the_interrupt_button_stops_a_population_trained_in_the_foreground(kernel):
    # an epoch of 10 s at least: the interrupt lands in its middle even on a busy machine
    kernel.run(
        "pope = nitro.Population(tiny_exp.Tiny(batches=1000, delay=0.01), "
        "learning_rate=[1e-3, 1e-2], steps_per_dispatch=1)"
    )
    msg_id = kernel.start("%nitro train pope")

    def mid_epoch(message):  # this cell's progress bar, in the middle of the epoch
        value = message["content"].get("data", {}).get("state", {}).get("value")
        mine = message["parent_header"].get("msg_id") == msg_id
        return (
            mine and message["msg_type"] == "comm_msg" and isinstance(value, float) and value > 0.02
        )

    kernel.wait_for(mid_epoch, timeout=120, what="a progress update in the middle of the epoch")
    kernel.manager.interrupt_kernel()
    cell = kernel.finish(msg_id)
    assert cell.status == "ok" and cell.stderr == ""  # a stop request, not an error
    (record,) = cell.updates()
    assert "<b>stopped</b>" in record, record
    assert sorted(_record_members(record)) == [0, 1], record
    step, reason = ast.literal_eval(kernel.eval("(pope.step, pope.stop_reason)"))
    assert reason == "requested" and 0 < step < 1000


def test_panel_and_history_take_a_population_as_they_take_a_run(kernel):
    """`%nitro panel` shows the panel of a population trained where no cell showed one (as
    an agent's run), with its members' table and curves; `%nitro history` is its history."""
    kernel.run(
        "import threading\n"
        "popt = nitro.Population(tiny_exp.Tiny(batches=4, max_epochs=2), "
        "learning_rate=[1e-3, 1e-1])\n"
        "_thread = threading.Thread(target=popt.train)\n_thread.start()\n_thread.join()"
    )
    assert kernel.eval("(popt.epoch, nitro_ipython.live_panel(popt))") == "(2, None)"
    cell = kernel.run("%nitro panel popt")
    (record,) = cell.updates()  # the run has ended: its record, with the curves so far
    assert _record_members(record) == [0, 1] and "val_loss &#x25B2;" in record
    assert re.search(r"<b>done</b> &middot; epoch 2/2 &middot; step 8 &middot; 2 members", record)
    assert any("image/png" in m["content"]["data"] for m in cell.messages if "data" in m["content"])
    history = kernel.run("%nitro history popt").data()[-1]
    assert "member" in history and "learning_rate" in history and "val_loss" in history
    plot = kernel.run("%nitro plot popt", check=False)
    assert "'popt' is a nitro.Population" in plot.error and "history, panel and bind" in plot.error
    assert "popt.best()" in plot.error
