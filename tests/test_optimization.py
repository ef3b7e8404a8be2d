"""The optimization suite: parameter groups, decoupled weight decay, global-norm clipping,
checkpoint averaging and Linen models, each checked against its optax reference."""

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from toys import Toy, X, Y

import nitro

LR = 1e-2


def unshuffled(samples=64, batch_size=16):
    return nitro.data.ArrayLoader({"x": X[:samples], "y": Y[:samples]}, batch_size, shuffle=False)


@nitro.experiment
class Plain(Toy):
    """Toy on unshuffled batches: a reference loop sees the same batches in the same order."""

    def build_data(self):
        return {"train": unshuffled()}


@nitro.experiment
class Grouped(Plain):
    def param_group(self, path):
        return "body" if path.startswith("hidden") else "head"


def batches():
    return [(X[i : i + 16], Y[i : i + 16]) for i in range(0, 64, 16)]


def reference(tx, epochs=2, experiment=None, params_for_update=None):
    """Params after a hand-written loop with `tx` over the same batches as a Nitro run.
    `params_for_update(params)` is what `tx.update` sees as the parameters (default: them)."""
    experiment = experiment or Plain()
    graphdef, params, rest = nnx.split(experiment.build_model(nnx.Rngs(0)), nnx.Param, ...)
    state = tx.init(params)

    def loss(params, x, y):
        model = nnx.merge(graphdef, params, rest)
        return experiment.loss(experiment.forward(model, x=x), y=y)

    @jax.jit
    def step(params, state, x, y):
        grads = jax.grad(loss)(params, x, y)
        seen = params_for_update(params) if params_for_update else params
        updates, state = tx.update(grads, state, seen)
        return optax.apply_updates(params, updates), state

    for _ in range(epochs):
        for x, y in batches():
            params, state = step(params, state, x, y)
    return [np.asarray(p) for p in jax.tree.leaves(params)]


def trained(experiment=None, **keywords):
    n = nitro.Nitro(experiment or Plain(), max_epochs=2, progress=False, **keywords)
    n.train()
    return n


def params_of(n):
    return [np.asarray(p) for p in n.state.variables.params]


def assert_close(a, b, rtol=1e-5, atol=2e-6):
    """Equal up to float32 rounding of a different but equivalent order of operations."""
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol)


def matrices(path, leaf):
    return leaf.ndim > 1


def ndim_mask(params):
    """optax's form of the default decay rule: a tree of booleans."""
    return jax.tree.map(lambda x: x.ndim > 1, params)


# ----------------------------------------------------------------------- decoupled weight decay


def test_weight_decay_matches_optax_adamw_with_an_ndim_mask():
    n = trained(learning_rate=LR, weight_decay=0.5)
    expected = reference(optax.adamw(LR, weight_decay=0.5, mask=ndim_mask))
    assert_close(params_of(n), expected)
    # biases are not decayed: the reference without decay on them agrees, adamw on all does not
    everything = reference(optax.adamw(LR, weight_decay=0.5))
    assert not np.allclose(params_of(n)[0], everything[0])


def test_weight_decay_with_sgd_and_a_mask_matches_add_decayed_weights_before_the_rate():
    def kernels_of_hidden(path, leaf):
        return path == "hidden.kernel"

    n = trained(
        optimizer=optax.sgd, learning_rate=0.1, weight_decay=0.3, decay_mask=kernels_of_hidden
    )
    graphdef, params, _ = nnx.split(Plain().build_model(nnx.Rngs(0)), nnx.Param, ...)
    flags = [path == "hidden.kernel" for path in nitro.optim.param_groups.leaf_paths(params)]
    mask = lambda p: jax.tree.unflatten(jax.tree.structure(p), flags)  # noqa: E731
    expected = reference(optax.chain(optax.add_decayed_weights(0.3, mask), optax.sgd(0.1)))
    assert_close(params_of(n), expected)


def test_decay_toward_init_is_adamw_applied_to_the_offset_from_the_initial_weights():
    initial = nnx.split(Plain().build_model(nnx.Rngs(0)), nnx.Param, ...)[1]
    n = trained(learning_rate=LR, weight_decay=0.5, decay_to="init")
    expected = reference(
        optax.adamw(LR, weight_decay=0.5, mask=ndim_mask),
        params_for_update=lambda p: jax.tree.map(jnp.subtract, p, initial),
    )
    assert_close(params_of(n), expected)


def test_decay_toward_a_given_model_uses_its_weights_as_the_anchor():
    anchor_model = Plain().build_model(nnx.Rngs(7))
    anchor = nnx.split(anchor_model, nnx.Param, ...)[1]
    n = trained(learning_rate=LR, weight_decay=0.5, decay_to=anchor_model)
    expected = reference(
        optax.adamw(LR, weight_decay=0.5, mask=ndim_mask),
        params_for_update=lambda p: jax.tree.map(jnp.subtract, p, anchor),
    )
    assert_close(params_of(n), expected)
    assert "decoupled weight decay toward the given anchor: 2 of 4 leaves" in str(
        n.binding_report()
    )


# ------------------------------------------------------------------------------- clipping


def test_gradient_clipping_matches_optax_clip_by_global_norm():
    n = trained(learning_rate=LR, gradient_clip_norm=0.05)
    expected = reference(optax.chain(optax.clip_by_global_norm(0.05), optax.adam(LR)))
    assert_close(params_of(n), expected)
    # adam is nearly scale-free, so clip sgd to see the clipping act
    clipped = trained(optimizer=optax.sgd, learning_rate=0.5, gradient_clip_norm=0.05)
    plain = trained(optimizer=optax.sgd, learning_rate=0.5)
    expected = reference(optax.chain(optax.clip_by_global_norm(0.05), optax.sgd(0.5)))
    assert_close(params_of(clipped), expected)
    assert not np.allclose(params_of(clipped)[1], params_of(plain)[1], atol=1e-3)


def lowered_update(optimizer, params):
    """The optimizer's update, fed and stripped as the train step does, lowered to text."""
    names = optimizer.names
    state = optimizer.strip(optimizer.tx.init(params))

    def update(grads, state, hparams, params):
        updates, new = optimizer.tx.update(grads, optimizer.inject(state, hparams), params)
        return updates, optimizer.strip(new)

    hparams = jnp.zeros(len(names), jnp.float32)
    return jax.jit(update).lower(params, state, hparams, params).as_text()


def operations(text):
    return re.findall(r"stablehlo\.[a-z_]+", text)


def test_with_every_switch_off_the_optimizer_is_plain_inject_hyperparams():
    graphdef, params, _ = nnx.split(Plain().build_model(nnx.Rngs(0)), nnx.Param, ...)
    off = nitro.Nitro(Plain(), progress=False).optimizer
    explicit_off = nitro.Nitro(
        Plain(), gradient_clip_norm=None, weight_decay=None, progress=False
    ).optimizer
    assert lowered_update(off, params) == lowered_update(explicit_off, params)
    # the operations of optax's own injected adam, in the same order
    plain = optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)
    assert off.names == tuple(sorted(plain.init(params).hyperparams))

    def reference_update(grads, state, hparams, params):
        injected = state._replace(hyperparams=dict(zip(off.names, hparams, strict=True)))
        updates, new = plain.update(grads, injected, params)
        return updates, new._replace(hyperparams={})

    stripped = plain.init(params)._replace(hyperparams={})
    hparams = jnp.zeros(len(off.names), jnp.float32)
    reference_text = jax.jit(reference_update).lower(params, stripped, hparams, params).as_text()
    assert operations(lowered_update(off, params)) == operations(reference_text)
    # clipping on adds its norm: reductions the plain update does not have
    clipped = nitro.Nitro(Plain(), gradient_clip_norm=1.0, progress=False).optimizer
    assert "stablehlo.reduce" not in operations(lowered_update(off, params))
    assert "stablehlo.reduce" in operations(lowered_update(clipped, params))


# ------------------------------------------------------------------------------ parameter groups


def test_parameter_groups_match_optax_partition_with_the_ratios():
    n = trained(Grouped(), learning_rate=LR, group_lr={"body": 0.1})
    graphdef, params, _ = nnx.split(Plain().build_model(nnx.Rngs(0)), nnx.Param, ...)
    labels = [
        "body" if p.startswith("hidden") else "head"
        for p in nitro.optim.param_groups.leaf_paths(params)
    ]
    expected = reference(
        optax.partition(
            {"body": optax.adam(LR * 0.1), "head": optax.adam(LR)},
            lambda p: jax.tree.unflatten(jax.tree.structure(p), labels),
        )
    )
    assert_close(params_of(n), expected)
    assert n.hyperparameters["body/learning_rate"] == pytest.approx(LR * 0.1)
    assert n.hyperparameters["head/learning_rate"] == pytest.approx(LR)


def test_groups_decay_and_clipping_compose_like_their_optax_chain():
    n = trained(
        Grouped(),
        learning_rate=LR,
        group_lr={"body": 0.5},
        weight_decay=0.2,
        gradient_clip_norm=0.1,
        schedules={"head/weight_decay": 0.0},
    )
    graphdef, params, _ = nnx.split(Plain().build_model(nnx.Rngs(0)), nnx.Param, ...)
    labels = [
        "body" if p.startswith("hidden") else "head"
        for p in nitro.optim.param_groups.leaf_paths(params)
    ]
    expected = reference(
        optax.chain(
            optax.clip_by_global_norm(0.1),
            optax.partition(
                {
                    "body": optax.adamw(LR * 0.5, weight_decay=0.2, mask=ndim_mask),
                    "head": optax.adam(LR),
                },
                lambda p: jax.tree.unflatten(jax.tree.structure(p), labels),
            ),
        )
    )
    assert_close(params_of(n), expected)


def test_a_group_schedule_moves_only_that_group():
    start = params_of(nitro.Nitro(Grouped(), progress=False))
    n = trained(Grouped(), learning_rate=LR, schedules={"head/learning_rate": 0.0})
    after = params_of(n)
    paths = n.setup.model.leaf_paths["parameter"]
    for path, a, b in zip(paths, start, after, strict=True):
        assert np.array_equal(a, b) == path.startswith("out"), path


def test_a_bare_learning_rate_schedule_moves_every_group_by_its_ratio():
    schedule = optax.linear_schedule(LR, 0.0, 8)
    n = nitro.Nitro(
        Grouped(max_epochs=1),
        group_lr={"body": 0.25},
        schedules={"learning_rate": schedule},
        progress=False,
    )
    n.train()  # 4 steps: the last used step 3
    assert n.hyperparameters["head/learning_rate"] == pytest.approx(float(schedule(3)))
    assert n.hyperparameters["body/learning_rate"] == pytest.approx(0.25 * float(schedule(3)))


def test_switches_and_their_schedules_recompile_nothing(fresh_cache):
    runs = [
        dict(group_lr={"body": 0.1}, weight_decay=1e-2, gradient_clip_norm=1.0),
        dict(group_lr={"body": 0.5}, weight_decay=0.3, gradient_clip_norm=0.2, learning_rate=0.1),
        dict(
            group_lr={"body": 0.0},
            weight_decay=0.0,
            gradient_clip_norm=5.0,
            schedules={
                "gradient_clip_norm": lambda step: 1.0 + step,
                "weight_decay": optax.linear_schedule(0.1, 0.0, 8),
                "head/weight_decay": 0.5,
                "learning_rate": optax.cosine_decay_schedule(1e-2, 8),
                "body/b1": 0.5,
            },
        ),
    ]
    nitro.Nitro(Grouped(), progress=False, **runs[0]).train()
    first = nitro.cache_stats().misses
    for keywords in runs[1:]:
        nitro.Nitro(Grouped(), progress=False, **keywords).train()
    assert nitro.cache_stats().misses == first == 1  # the train step, compiled once


def test_a_decay_mask_recompiles_the_train_step_only_when_it_picks_other_leaves(fresh_cache):
    def train(mask):
        before = len(nitro.explain_compiles())
        keywords = dict(weight_decay=1e-2, steps_per_dispatch=1, progress=False)
        nitro.Nitro(Plain(), decay_mask=mask, **keywords).train()
        return [(r.program, r.reason) for r in nitro.explain_compiles()[before:]]

    assert train(matrices) == [("train step", "new program")]
    assert train(lambda path, leaf: leaf.ndim >= 2) == []  # another function, the same leaves
    assert train(lambda path, leaf: path.startswith("out")) == [
        ("train step", "code changed: optimizer update")
    ]


# ----------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "keywords, message",
    [
        (
            dict(gradient_clip_norm=-1.0),
            r"gradient_clip_norm must be a finite number > 0, got -1.0",
        ),
        (dict(gradient_clip_norm=0), r"gradient_clip_norm must be a finite number > 0, got 0"),
        (dict(weight_decay=-0.1), r"weight_decay must be a finite number >= 0, got -0.1"),
        (dict(weight_decay="big"), r"weight_decay must be a finite number >= 0, got 'big'"),
        (dict(decay_to="pretrained"), r"decay_to must be 'zero', 'init'"),
        (dict(group_lr={"body": -1}), r"group_lr\['body'\] must be a finite number >= 0"),
        (dict(group_lr=[0.1]), r"group_lr must be a dict of parameter group"),
        (dict(decay_mask=3), r"decay_mask must be a function \(path, leaf\) -> bool"),
    ],
)
def test_bad_switch_values_name_the_keyword_and_source(keywords, message):
    with pytest.raises(ValueError, match=message + r".*\[Nitro keyword\]"):
        nitro.Nitro(Grouped(), **keywords)


def test_group_lr_for_a_group_no_parameter_belongs_to_is_an_error():
    with pytest.raises(
        nitro.OptimizerError,
        match=r"group_lr names 'bdy', but no parameter belongs to it: param_group puts the "
        r"parameters in 'body', 'head'. Did you mean 'body'\?",
    ):
        nitro.Nitro(Grouped(), group_lr={"bdy": 0.1})
    with pytest.raises(nitro.OptimizerError, match=r"group_lr=.* needs parameter groups"):
        nitro.Nitro(Plain(), group_lr={"body": 0.1})


def test_wrong_combinations_are_errors_that_say_what_to_do():
    with pytest.raises(nitro.OptimizerError, match="decay_to is set, but weight decay is off"):
        nitro.Nitro(Plain(), decay_to="init")
    with pytest.raises(nitro.OptimizerError, match="decay_mask is set, but weight decay is off"):
        nitro.Nitro(Plain(), decay_mask=matrices)
    with pytest.raises(nitro.OptimizerError, match=r"drop weight_decay= or .*optax.adam"):
        nitro.Nitro(Plain(), optimizer=optax.adamw, weight_decay=1e-4)
    with pytest.raises(nitro.OptimizerError, match=r"does not inject one"):
        nitro.Nitro(Plain(), optimizer=optax.sgd(0.1), weight_decay=1e-4)
    with pytest.raises(nitro.ScheduleError, match=r"group 'body' has a learning rate twice"):
        nitro.Nitro(Grouped(), group_lr={"body": 0.1}, schedules={"body/learning_rate": 1e-3})
    with pytest.raises(nitro.ScheduleError, match=r"weight_decay= turns on decoupled weight"):
        nitro.Nitro(Plain(), schedules={"weight_decay": 0.1})
    with pytest.raises(
        nitro.ScheduleError, match=r"'gradient_clip_norm'.*must be a finite number > 0"
    ):
        nitro.Nitro(
            Plain(), gradient_clip_norm=1.0, schedules={"gradient_clip_norm": lambda s: 0.0}
        )
    with pytest.raises(nitro.ScheduleError, match=r"'head/learnin_rate'.*'head/learning_rate'"):
        nitro.Nitro(Grouped(), schedules={"head/learnin_rate": 0.1})


def test_optax_multisteps_is_refused_with_a_pointer_to_accum():
    wrapped = optax.MultiSteps(optax.adam(1e-3), every_k_schedule=2)
    with pytest.raises(nitro.OptimizerError) as raised:
        nitro.Nitro(Plain(), optimizer=wrapped, progress=False)
    assert str(raised.value) == (
        "optimizer is an optax.MultiSteps, which accumulates gradients inside the optimizer; "
        "Nitro accumulates them itself with the accum= run keyword (the same updates as "
        "MultiSteps, and schedules, checkpoints and n.step count optimizer steps). Pass the "
        "inner optimizer and accum: Nitro(..., optimizer=optax.adam, accum=2)"
    )
    # its GradientTransformation form too, inside a factory, found by its state
    with pytest.raises(nitro.OptimizerError, match=r"optax\.MultiSteps.*accum="):
        nitro.Nitro(Plain(), optimizer=lambda learning_rate: wrapped.gradient_transformation())
    # the fix: the inner optimizer and accum= (4 batches an epoch: 2 updates, over 2 epochs)
    fixed = nitro.Nitro(Plain(), optimizer=optax.adam, accum=2, progress=False)
    assert fixed.train().step == 4


def test_param_group_must_return_a_group_name():
    @nitro.experiment
    class Numbered(Plain):
        def param_group(self, path):
            return 1

    with pytest.raises(nitro.OptimizerError, match=r"param_group\('hidden.bias'\) returned 1"):
        nitro.Nitro(Numbered())


def test_decay_to_a_tree_that_does_not_fit_names_the_leaves():
    wider = nnx.split(Plain(width=4).build_model(nnx.Rngs(0)), nnx.Param, ...)[1]
    with pytest.raises(
        nitro.OptimizerError, match=r"(?s)decay_to does not fit.*hidden.kernel: parameter shape"
    ):
        nitro.Nitro(Plain(), weight_decay=0.1, decay_to=wider)
    with pytest.raises(nitro.OptimizerError, match=r"decay_to is a Nitro; give 'zero', 'init'"):
        nitro.Nitro(Plain(), weight_decay=0.1, decay_to=nitro.Nitro(Plain(), progress=False))


def test_decay_to_a_tree_with_a_nan_leaf_is_refused_at_setup_naming_the_leaf():
    anchors = nnx.split(Plain().build_model(nnx.Rngs(0)), nnx.Param, ...)[1]
    bias = anchors["hidden"]["bias"]
    bias[...] = bias[...].at[1].set(float("nan"))
    with pytest.raises(
        nitro.OptimizerError,
        match=r"(?s)decay_to does not fit.*of finite values.*\n  hidden.bias: 1 of \d+ values "
        r"are not finite$",
    ):
        nitro.Nitro(Plain(), weight_decay=0.1, decay_to=anchors)


# ---------------------------------------------------------------------------- binding report


def test_binding_report_shows_each_groups_leaves_and_values():
    n = nitro.Nitro(
        Grouped(),
        group_lr={"body": 0.1},
        weight_decay=1e-2,
        decay_to="init",
        gradient_clip_norm=1.0,
        schedules={"learning_rate": optax.linear_schedule(1e-2, 0.0, 8)},
        progress=False,
    )
    report = str(n.binding_report())
    for line in [
        "group_lr = {'body': 0.1}  [Nitro keyword]",
        "gradient_clip_norm = 1 (constant, fed per step)",
        "parameter groups  [param_group method]",
        "body: 2 leaves, 48 parameters: hidden.bias, hidden.kernel",
        "learning_rate = 0.001 at step 0 (0.1 x the learning_rate schedule, fed per step)",
        "learning_rate = 0.01 at step 0 (the learning_rate schedule, fed per step)",
        "weight_decay = 0.01 (constant, fed per step)",
        "decoupled weight decay toward the initial weights: 1 of 2 leaves (ndim > 1): "
        "hidden.kernel; not hidden.bias",
        "head: 2 leaves, 18 parameters: out.bias, out.kernel",
    ]:
        assert line in report, line


# ------------------------------------------------------------------------ checkpoint and resume


def test_a_resumed_run_with_groups_and_decay_to_init_continues_exactly(tmp_path):
    keywords = dict(
        group_lr={"body": 0.5}, weight_decay=0.1, decay_to="init", gradient_clip_norm=0.5
    )
    straight = nitro.Nitro(Grouped(max_epochs=2), progress=False, **keywords)
    straight.train()
    run = tmp_path / "split"
    nitro.Nitro(Grouped(max_epochs=1), run_dir=run, progress=False, **keywords).train()
    resumed = nitro.Nitro(Grouped(max_epochs=2), resume=run, progress=False, **keywords)
    assert resumed.step == 4
    resumed.train()
    assert_close(params_of(resumed), params_of(straight), rtol=0, atol=0)
    anchors = [p for p in resumed.setup.model.leaf_paths["optimizer state"] if ".anchor." in p]
    assert len(anchors) == 2  # hidden.kernel and out.kernel, saved with the state


# ---------------------------------------------------------------------- checkpoint averaging


@nitro.experiment
class Validated(Plain):
    def build_data(self):
        return {"train": unshuffled(), "val": unshuffled(32)}


def saved(path):
    from nitro.runs.checkpoint_reads import read_checkpoint

    path = Path(path)
    return read_checkpoint(path.parent, int(path.name))[0]["params"]


def test_average_of_the_best_k_checkpoints_is_their_mean():
    n = nitro.Nitro(
        Validated(max_epochs=4),
        checkpointer=nitro.Checkpointer(k=3, budget=None),
        learning_rate=LR,
        progress=False,
    )
    n.train()
    best = n.checkpoints().sort_values("val_loss").head(3)
    averaged = nitro.Nitro(Validated(), weights=nitro.average(n.run_dir, k=3), progress=False)
    kernels = [saved(path)["hidden"]["kernel"] for path in best["path"]]
    np.testing.assert_allclose(
        np.asarray(averaged.state.variables.params[1]), np.mean(kernels, 0), rtol=1e-6
    )
    steps = ", ".join(str(s) for s in best["step"])
    assert averaged.weights_origin.endswith(f"(best 3 by val_loss): steps {steps}")
    assert averaged.weights_checkpoint["steps"] == list(best["step"])

    listed = nitro.average(list(best["path"][:2]))
    two = nitro.Nitro(Validated(), weights=listed, progress=False)
    np.testing.assert_allclose(
        np.asarray(two.state.variables.params[1]), np.mean(kernels[:2], 0), rtol=1e-6
    )
    with pytest.raises(nitro.WeightsError, match=r"average\(k=9\) needs 9 checkpoints"):
        nitro.average(n.run_dir, k=9)


# ----------------------------------------------------------------------------------- Linen


class LinenMLP(nn.Module):
    width: int = 16

    @nn.compact
    def __call__(self, x):
        return nn.Dense(2)(nn.relu(nn.Dense(self.width)(x)))


class LinenNormed(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.relu(nn.Dense(16)(x))
        x = nn.BatchNorm(use_running_average=not train, momentum=0.5)(x)
        x = nn.Dropout(0.5, deterministic=not train)(x)
        return nn.Dense(2)(x)


def test_a_linen_mlp_trains_and_predicts_like_the_same_flax_apply():
    @nitro.experiment
    class Linen(Plain):
        def build_model(self, rngs):
            return LinenMLP()

    n = nitro.Nitro(Linen(max_epochs=3), learning_rate=LR, progress=False)
    n.train()
    losses = n.history()["loss"].tolist()
    assert losses[-1] < losses[0]
    params = nnx.split(n.model, nnx.Param, ...)[1]
    variables = {"params": nnx.to_pure_dict(params)["linen"]}
    expected = LinenMLP().apply(variables, X[:5])
    np.testing.assert_allclose(np.asarray(n.predict({"x": X[:5]})), expected, rtol=1e-5)
    assert n.setup.model.leaf_paths["parameter"][0] == "linen.Dense_0.bias"


def test_a_linen_model_with_batchnorm_and_dropout_trains_in_train_mode_and_evaluates_in_eval():
    @nitro.experiment
    class Normed(Validated):
        def build_model(self, rngs):
            return LinenNormed()

    n = nitro.Nitro(Normed(max_epochs=2), learning_rate=LR, progress=False)
    paths = n.setup.model.leaf_paths["model state"]
    stats = {
        p: np.asarray(x)
        for p, x in zip(paths, n.state.variables.model_state, strict=True)
        if "Batch" in p
    }
    assert sorted(stats) == ["linen.BatchNorm_0.mean", "linen.BatchNorm_0.var"]
    n.train()
    after = dict(zip(paths, n.state.variables.model_state, strict=True))
    for path, before in stats.items():  # the running statistics moved in training
        assert not np.allclose(before, np.asarray(after[path])), path
    model = n.model  # a copy in train mode: dropout draws new keys at each call
    assert not np.allclose(model(X[:8]), model(X[:8]))
    # eval mode: running averages and no dropout, so predictions repeat exactly
    first, again = n.predict({"x": X[:8]}), n.predict({"x": X[:8]})
    np.testing.assert_array_equal(first, again)
    assert np.isfinite(n.history()["val_loss"]).all()


def linen_experiment(activation):
    """An experiment whose Linen module is defined anew, as a re-run notebook cell does."""

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(2)(activation(nn.Dense(8)(x)))

    @nitro.experiment
    class Edited(Plain):
        def build_model(self, rngs):
            return Net()

    return Edited(max_epochs=1)


def test_a_redefined_linen_module_recompiles_only_when_its_code_changed(fresh_cache):
    nitro.Nitro(linen_experiment(nn.relu), progress=False).train()
    nitro.Nitro(linen_experiment(nn.relu), progress=False).train()
    assert nitro.cache_stats().misses == 1  # the same code: the program is reused
    nitro.Nitro(linen_experiment(nn.tanh), progress=False).train()
    assert nitro.cache_stats().misses == 2
    assert "method linen_experiment.<locals>.Net.__call__" in nitro.explain_compiles()[-1].reason


def test_groups_decay_clipping_accumulation_and_ema_fuse_bitwise(fresh_cache):
    """Per-group schedules, decay toward the initial weights, clipping, accumulation and the
    moving average give bitwise the same weights with 2 updates per call as with one."""
    keywords = dict(
        group_lr={"body": 0.5},
        weight_decay=1e-2,
        decay_to="init",
        gradient_clip_norm=0.5,
        accum=2,
        ema=0.9,
        schedules={
            "learning_rate": lambda step: 1e-2 / (1 + step),
            "head/weight_decay": lambda step: 1e-3 * step,
        },
        progress=False,
        checkpointer=None,
        logger=None,
    )
    runs = {}
    for k in (1, 2):
        n = nitro.Nitro(Grouped(max_epochs=3), steps_per_dispatch=k, **keywords)
        n.train()
        runs[k] = (
            params_of(n),
            n.history()["loss"].to_numpy(),
            n.evaluate(split="train", weights="ema"),
        )
    assert runs[2][0] and len(runs[2][1]) == 3
    for a, b in zip(runs[1][0], runs[2][0], strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(runs[1][1], runs[2][1])
    assert runs[1][2] == runs[2][2]
    kinds = {p["program"] for p in nitro.cache_stats().programs}
    assert "multi-step train" in kinds
