"""`n.summary()`: the model's modules, their output shapes for one batch, parameters and
bytes, on a handle that never trained and compiles nothing."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from gan_toys import GAN

import nitro
from nitro.errors import SetupError
from nitro.examples.digits import Digits


class CNN(nnx.Module):
    """A small CNN on the 8x8 digits: convolutions, batch norm, dropout (no call-time rngs:
    the summary traces forward in eval mode), a list of blocks."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.conv = nnx.Conv(1, 8, kernel_size=(3, 3), rngs=rngs)
        self.norm = nnx.BatchNorm(8, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.blocks = nnx.List([nnx.Linear(128, 128, rngs=rngs) for _ in range(2)])
        self.head = nnx.Linear(128, 10, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.norm(self.conv(x.reshape(-1, 8, 8, 1))))
        x = nnx.avg_pool(x, window_shape=(2, 2), strides=(2, 2)).reshape(x.shape[0], -1)
        for block in self.blocks:
            x = nnx.relu(block(self.drop(x)))
        return self.head(x)


@nitro.experiment
class DigitsCNN:
    batch_size: int = 32

    def build_data(self):
        return nitro.datasets.digits(batch_size=self.batch_size)

    def build_model(self, rngs):
        return CNN(rngs=rngs)

    def forward(self, model, *, x):
        return model(x)

    def loss(self, logits, *, y):
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def rows_by_path(summary):
    return {row.path: row for row in summary.rows}


def test_digits_mlp_summary_compiles_nothing(fresh_cache):
    n = nitro.Nitro(Digits(width=32), progress=False)
    summary = n.summary()
    stats = nitro.cache_stats()
    assert (stats.misses, stats.entries) == (0, 0)
    assert n.held_programs() == []
    rows = rows_by_path(summary)
    assert list(rows) == ["", "hidden1", "hidden2", "out"]
    assert [rows[p].type for p in rows] == ["MLP", "Linear", "Linear", "Linear"]
    assert rows["hidden1"].output == "f32[128,32]"
    assert rows["out"].output == "f32[128,10]"
    assert rows[""].output == "f32[128,10]"
    assert rows["hidden1"].params == 64 * 32 + 32
    assert rows["hidden1"].bytes == (64 * 32 + 32) * 4
    assert summary.params == rows[""].params == n.param_count
    assert summary.param_bytes == 4 * n.param_count and summary.state_bytes == 0
    assert summary.batch == {"x": "f32[128,64]"}
    assert summary.forward_output == "f32[128,10]"
    text = str(summary)
    assert "hidden1" in text and "f32[128,32]" in text and f"{n.param_count:,}" in text
    assert repr(summary) == text
    html = summary._repr_html_()
    assert html.startswith("<table>") and "<code>f32[128,32]</code>" in html
    frame = summary.to_frame()
    assert list(frame["path"]) == ["", "hidden1", "hidden2", "out"]
    assert int(frame["params"].iloc[0]) == n.param_count


def test_summary_follows_the_split_and_an_explicit_batch():
    n = nitro.Nitro(Digits(width=32, batch_size=16), progress=False)
    assert rows_by_path(n.summary())["out"].output == "f32[16,10]"
    assert n.summary(split="val").source == "the 'val' split's batch"
    given = n.summary(batch={"x": np.zeros((3, 64), np.float32)})
    assert rows_by_path(given)["hidden2"].output == "f32[3,32]"
    shaped = n.summary(batch={"x": jax.ShapeDtypeStruct((5, 64), np.float32)})
    assert shaped.forward_output == "f32[5,10]" and shaped.source == "batch="
    assert [row.path for row in n.summary(depth=0).rows] == [""]


def test_cnn_summary_shows_state_and_nested_lists():
    n = nitro.Nitro(DigitsCNN(), progress=False)
    linear_call = vars(nnx.Linear)["__call__"]
    summary = n.summary()
    assert vars(nnx.Linear)["__call__"] is linear_call  # the wrapping is undone
    rows = rows_by_path(summary)
    assert rows["conv"].output == "f32[32,8,8,8]"
    assert rows["norm"].output == "f32[32,8,8,8]"
    assert rows["drop"].output == "f32[32,128]"  # first call
    assert rows["blocks.0"].output == rows["blocks.1"].output == "f32[32,128]"
    assert rows["blocks"].type == "List" and rows["blocks"].output is None  # never called
    assert rows["blocks"].params == 2 * (128 * 128 + 128)
    assert rows["head"].output == "f32[32,10]"
    assert rows["norm"].params == 16  # scale and bias; the batch statistics are state
    assert rows["norm"].bytes >= 4 * 32
    assert summary.state_bytes > 0 and summary.params == n.param_count
    assert rows["blocks.0"].depth == 2


def test_gan_summary_covers_both_models():
    n = nitro.Nitro(GAN(), progress=False)
    summary = n.summary()
    rows = rows_by_path(summary)
    assert list(rows) == ["", "disc", "disc.hidden", "disc.out", "gen", "gen.hidden", "gen.out"]
    assert rows[""].type == "Dict" and rows["gen"].type == "MLP"
    assert rows["gen.out"].output == "f32[64,2]"
    assert rows["disc"].output is None  # forward calls the generator only
    assert rows["disc"].params + rows["gen"].params == summary.params == n.param_count
    assert "-" in str(summary)


def test_summary_refuses_bad_input():
    n = nitro.Nitro(Digits(width=32), progress=False)
    with pytest.raises(SetupError, match=r"split='nope' is not a split.*'test', 'train', 'val'"):
        n.summary(split="nope")
    with pytest.raises(SetupError, match=r"batch= lacks 'x', which forward needs"):
        n.summary(batch={"y": np.zeros(3)})
    with pytest.raises(SetupError, match=r"batch= takes a dict of batch fields"):
        n.summary(batch=np.zeros((3, 64)))
    with pytest.raises(SetupError, match=r"holds <U1 values"):
        n.summary(batch={"x": np.array(["a"])})
    with pytest.raises(SetupError, match=r"depth= takes a whole number"):
        n.summary(depth=-1)
    with pytest.raises(TypeError) as failed:  # forward's own error, with where it came from
        n.summary(batch={"x": np.zeros((3, 7), np.float32)})
    assert any("summary() traced it on batch=" in note for note in failed.value.__notes__)


def test_summary_without_splits_lists_modules_without_shapes():
    n = nitro.Nitro(Digits(width=32), data={}, progress=False)
    summary = n.summary()
    assert summary.batch is None and all(row.output is None for row in summary.rows)
    assert "pass summary(batch=" in str(summary)
    assert summary.params == n.param_count
