"""Export: a handle becomes a bundle that runs with JAX, NumPy and safetensors alone."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from system import fill, mounted
from toys import Tagged, Toy, X

import nitro
import nitro.bundle
from nitro.serving.export import DEFAULT_PLATFORMS, ExportError

HERE = os.path.dirname(os.path.abspath(__file__))
RNG = np.random.default_rng(1)


def batch(rows: int) -> np.ndarray:
    return RNG.normal(size=(rows, 5)).astype(np.float32)


@nitro.experiment
class Pixels(Toy):
    """Takes uint8 pixels on the wire, scales them in the bundle, returns float16 logits."""

    def export_inputs(self):
        return {"pixels": jax.ShapeDtypeStruct((5,), jnp.uint8)}

    def export_preprocess(self, *, pixels):
        return {"x": pixels.astype(jnp.float32) / 255.0}

    def export_outputs(self):
        return {"logits": "float16"}


@nitro.experiment
class Doubled(Toy):
    def export_preprocess(self, *, x):  # the wire input takes its dtype and shape from the data
        return {"x": x * 2.0}


@nitro.experiment
class Declared(Toy):
    def export_inputs(self):
        return {"x": jax.ShapeDtypeStruct((5,), jnp.float32)}


@nitro.experiment
class FixedBatch(Toy):
    def forward(self, model, *, x):
        return model(x.reshape(16, 5))


@nitro.experiment
class HostCheck(Toy):
    """A forward that calls back to Python on the host, as a library's runtime check does."""

    def forward(self, model, *, x):
        jax.debug.callback(lambda rows: None, x)
        return model(x)


@nitro.experiment
class HostTransform(Toy):
    def forward(self, model, *, x):
        doubled = jax.pure_callback(
            lambda rows: np.asarray(rows) * 2, jax.ShapeDtypeStruct(x.shape, x.dtype), x
        )
        return model(doubled)


@nitro.experiment
class TwoOutputs(Toy):
    def export_outputs(self):
        return {"a": None, "b": None}


@nitro.experiment
class TaggedClash(Tagged):
    def export_outputs(self):
        return {"id": None}


@nitro.experiment
class Labelled(Tagged):
    """A host hook turns the logits into a label and its probability; the id is echoed."""

    def postprocess(self, outputs, **inputs):
        logits = outputs["output"].astype(np.float64) * self.width / 8
        probabilities = np.exp(logits - logits.max(1, keepdims=True))
        probabilities /= probabilities.sum(1, keepdims=True)
        return {"label": probabilities.argmax(1), "p": probabilities.max(1)}


@nitro.experiment
class Failing(Tagged):
    def postprocess(self, outputs, **inputs):
        if (inputs["id"] < 0).any():
            raise ValueError("ids must not be negative")
        return {"label": outputs["output"].argmax(1)[:2]}  # wrong from 3 rows on


@pytest.fixture(scope="module")
def trained():
    n = nitro.Nitro(Toy(), seed=0, progress=False)
    n.train()
    return n


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    directory = tmp_path_factory.mktemp("bundles") / "toy"
    trained.export(str(directory))
    return directory


def bundle_files(directory) -> list[str]:
    """The files of a bundle: its manifest, program and weights, and the uncommitted diff of
    the code when its manifest says the work tree was dirty (as it is while developing)."""
    manifest = json.loads((Path(directory) / "manifest.json").read_text())
    git = manifest["provenance"]["git"]
    patch = ["working_tree.patch"] if git is not None and git["dirty"] else []
    return sorted(["manifest.json", "program.jaxexport", "weights.safetensors", *patch])


def test_a_bundle_loads_without_nitro_flax_or_optax_and_matches_predict(
    trained, exported, tmp_path
):
    for rows in (1, 7, 300):
        np.save(tmp_path / f"in{rows}.npy", batch(rows))
    child = textwrap.dedent(
        f"""
        import json, sys
        import numpy as np
        import nitro.bundle
        model = nitro.bundle.load({str(exported)!r})
        for rows in (1, 7, 300):
            x = np.load({str(tmp_path)!r} + f"/in{{rows}}.npy")
            np.save({str(tmp_path)!r} + f"/out{{rows}}.npy", model(x=x)["output"])
        roots = ("flax", "optax", "orbax", "nitro")
        print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in roots)))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", child], capture_output=True, text=True, timeout=120, cwd=HERE
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout) == [
        "nitro",
        "nitro._public_path",  # leaves: they import nothing of nitro
        "nitro._version",
        "nitro.bundle",
        "nitro.serving",
        "nitro.serving.bundle",
    ]
    for rows in (1, 7, 300):
        x = np.load(tmp_path / f"in{rows}.npy")
        served = np.load(tmp_path / f"out{rows}.npy")
        assert served.shape == (rows, 2)
        np.testing.assert_allclose(served, trained.predict({"x": x}), rtol=0, atol=1e-6)


def test_the_manifest_records_the_wire_device_values_and_provenance(trained, exported):
    manifest = json.loads((exported / "manifest.json").read_text())
    assert (manifest["format"], manifest["format_version"], manifest["name"]) == (
        "nitro-bundle",
        1,
        "toy",
    )
    assert manifest["inputs"] == [
        {"name": "x", "dtype": "float32", "shape": [-1, 5], "axes": ["batch", None]}
    ]
    assert manifest["outputs"] == [
        {"name": "output", "dtype": "float32", "shape": [-1, 2], "axes": ["batch", None]}
    ]
    assert manifest["device_values"] == {"scale": 1.0}
    assert manifest["program"]["platforms"] == ["cpu", "cuda", "rocm", "tpu"]
    assert manifest["weights"] == {"tensors": 4, "elements": trained.param_count}
    provenance = manifest["provenance"]
    assert provenance["experiment"] == "toys.Toy"
    assert provenance["graphconst"] == {"width": 8, "offset": 0.0}
    assert (provenance["seed"], provenance["step"], provenance["epoch"]) == (0, 8, 2)
    assert provenance["versions"]["nitro"] == nitro.__version__
    assert provenance["versions"]["jax"] == jax.__version__
    assert len(provenance["git"]["commit"]) == 40 and isinstance(provenance["git"]["dirty"], bool)
    assert provenance["run_id"] == trained.run_id
    assert provenance["checkpoint"] is None  # its weights came from build_model and training
    assert sorted(os.listdir(exported)) == bundle_files(exported)


def test_weights_are_arguments_of_the_program_not_constants(tmp_path):
    sizes = {}
    for width in (8, 2048):
        n = nitro.Nitro(Toy(width=width), progress=False)
        n.export(str(tmp_path / str(width)))
        sizes[width] = [
            os.path.getsize(tmp_path / str(width) / f)
            for f in ("program.jaxexport", "weights.safetensors")
        ]
    assert abs(sizes[2048][0] - sizes[8][0]) < 200  # the program does not grow with the model
    assert sizes[2048][1] - sizes[8][1] >= (2048 - 8) * (5 + 1 + 2) * 4


def test_export_compiles_outside_the_program_cache_and_says_so(trained, tmp_path, fresh_cache):
    trained.export(str(tmp_path / "logged"))
    stats = nitro.cache_stats()
    assert (stats.misses, stats.entries) == (0, 0)
    record = nitro.explain_compiles()[-1]
    assert (record.program, record.owner) == ("export", "toys.Toy")
    assert (
        "outside the program cache" in record.reason and str(tmp_path / "logged") in record.reason
    )


def test_an_untrained_handle_exports_the_weights_build_model_made(tmp_path):
    n = nitro.Nitro(Toy(), seed=3, progress=False)
    n.export(str(tmp_path / "fresh"), name="fresh-toy")
    model = nitro.bundle.load(tmp_path / "fresh")
    x = batch(9)
    assert model.name == "fresh-toy" and model.manifest["provenance"]["step"] == 0
    np.testing.assert_allclose(model(x=x)["output"], n.predict({"x": x}), atol=1e-6)


def test_a_device_field_is_frozen_into_the_bundle(trained, tmp_path):
    n = nitro.Nitro(Toy(), weights=trained, progress=False).set_device(scale=2.0)
    n.export(str(tmp_path / "scaled"))
    model = nitro.bundle.load(tmp_path / "scaled")
    x = batch(5)
    assert model.manifest["device_values"] == {"scale": 2.0}
    np.testing.assert_allclose(model(x=x)["output"], n.predict({"x": x}), atol=1e-6)
    assert np.abs(model(x=x)["output"] - trained.predict({"x": x})).max() > 1e-3


def test_a_handle_without_data_exports_with_export_inputs(trained, tmp_path):
    n = nitro.Nitro(Declared(), weights=trained, data={}, progress=False)
    n.export(str(tmp_path / "nodata"))
    model = nitro.bundle.load(tmp_path / "nodata")
    x = batch(7)
    np.testing.assert_allclose(model(x=x)["output"], trained.predict({"x": x}), atol=1e-6)

    bare = nitro.Nitro(Toy(), weights=trained, data={}, progress=False)
    with pytest.raises(ExportError, match=r"no data to take the input shapes from.*export_inputs"):
        bare.export(str(tmp_path / "bare"))


def test_a_handle_built_from_a_checkpoint_without_data_exports_with_its_provenance(tmp_path):
    source = nitro.Nitro(Declared(max_epochs=3), progress=False)
    source.train()
    best = source.checkpoints().sort_values("val_loss").iloc[0]
    n = nitro.Nitro(Declared(), weights=(source.run_dir, "best"), data={}, progress=False)
    manifest = n.export(str(tmp_path / "from_checkpoint"))
    checkpoint = manifest["provenance"]["checkpoint"]
    assert checkpoint["run_id"] == source.run_id and checkpoint["step"] == best["step"]
    assert checkpoint["metrics"]["val_loss"] == pytest.approx(best["val_loss"])
    source.restore_best()
    x = batch(9)
    model = nitro.bundle.load(tmp_path / "from_checkpoint")
    np.testing.assert_allclose(model(x=x)["output"], source.predict({"x": x}), atol=1e-6)


def test_export_hooks_name_type_and_preprocess_the_wire(trained, tmp_path):
    n = nitro.Nitro(Pixels(), weights=trained, progress=False)
    n.export(str(tmp_path / "pixels"))
    model = nitro.bundle.load(tmp_path / "pixels")
    assert [str(s) for s in model.inputs] == ["pixels: uint8[batch, 5]"]
    assert [str(s) for s in model.outputs] == ["logits: float16[batch, 2]"]
    pixels = RNG.integers(0, 256, size=(6, 5), dtype=np.uint8)
    expected = trained.predict({"x": pixels.astype(np.float32) / 255.0}).astype(np.float16)
    np.testing.assert_allclose(model(pixels=pixels)["logits"], expected, atol=1e-3)

    doubled = nitro.Nitro(Doubled(), weights=trained, progress=False)
    doubled.export(str(tmp_path / "doubled"))
    model = nitro.bundle.load(tmp_path / "doubled")
    x = batch(4)
    assert [str(s) for s in model.inputs] == ["x: float32[batch, 5]"]
    np.testing.assert_allclose(model(x=x)["output"], trained.predict({"x": 2 * x}), atol=1e-6)


def test_python_lists_convert_by_the_input_dtype_and_values_that_do_not_fit_are_refused(
    trained, exported, tmp_path
):
    nitro.Nitro(Pixels(), weights=trained, progress=False).export(str(tmp_path / "pixels"))
    pixels = nitro.bundle.load(tmp_path / "pixels")
    row = [0, 255, 3, 4, 5]
    np.testing.assert_array_equal(
        pixels(pixels=[row])["logits"], pixels(pixels=np.array([row], np.uint8))["logits"]
    )
    error = nitro.bundle.BundleError
    with pytest.raises(
        error,
        match=r"input 'pixels' must be uint8\[batch, 5\]: 1\.7 is not a whole number, and "
        r"uint8 takes integers only; give values that fit, or an array of that dtype",
    ):
        pixels(pixels=[[1.7, 0, 0, 0, 0]])
    with pytest.raises(error, match=r"1099511627776 is out of the range of uint8 \(0 to 255\)"):
        pixels(pixels=[[2**40, 0, 0, 0, 0]])
    with pytest.raises(error, match=r"256 is out of the range of uint8"):
        pixels(pixels=[[256, 0, 0, 0, 0]])
    floats = nitro.bundle.load(exported)
    with pytest.raises(error, match=r"input 'x' must be float32\[batch, 5\]: 1e\+39 is out of"):
        floats(x=[[1e39, 0.0, 0.0, 0.0, 0.0]])
    assert floats(x=[[1.7, 0.0, 0.0, 0.0, 0.0]])["output"].shape == (1, 2)


@pytest.mark.parametrize(
    ("experiment", "primitive"),
    [(HostCheck, "debug_callback"), (HostTransform, "pure_callback")],
)
@pytest.mark.parametrize("platforms", [("cpu",), DEFAULT_PLATFORMS])
def test_a_forward_with_a_host_callback_is_refused_naming_the_cause_and_the_fix(
    trained, tmp_path, experiment, primitive, platforms
):
    n = nitro.Nitro(experiment(), weights=trained, progress=False)
    assert n.predict({"x": X[:3]}).shape == (3, 2)  # it trains and predicts in the process
    with pytest.raises(
        ExportError,
        match=rf"forward holds 1 host callback \({primitive} at .*test_export\.py.*\).*a bundle "
        r"cannot hold.*EQX_ON_ERROR=nan.*throw=False",
    ):
        n.export(str(tmp_path / "bundle"), platforms=platforms)
    assert not (tmp_path / "bundle").exists()


def test_export_errors_name_the_hook_or_argument_and_the_fix(trained, tmp_path):
    with pytest.raises(ExportError, match=r"does not trace for a batch of 1.*Python int"):
        nitro.Nitro(FixedBatch(), progress=False).export(str(tmp_path / "fixed"))
    with pytest.raises(
        ExportError, match=r"export_outputs\(\) names 2 outputs but forward returns 1 array"
    ):
        nitro.Nitro(TwoOutputs(), progress=False).export(str(tmp_path / "two"))
    with pytest.raises(ExportError, match=r"bundle name 'my model' must start"):
        trained.export(str(tmp_path / "named"), name="my model")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match=r"busy is not empty and holds no bundle"):
        trained.export(str(tmp_path / "busy"))


def test_reexporting_to_the_same_directory_replaces_the_bundle(tmp_path):
    n = nitro.Nitro(Toy(max_epochs=1), seed=0, progress=False)
    n.export(str(tmp_path / "again"))
    before = nitro.bundle.load(tmp_path / "again")
    n.train()
    n.export(str(tmp_path / "again"))
    after = nitro.bundle.load(tmp_path / "again")
    x = batch(3)
    assert sorted(os.listdir(tmp_path / "again")) == bundle_files(tmp_path / "again")
    assert after.manifest["provenance"]["step"] == 4 and before.manifest["provenance"]["step"] == 0
    np.testing.assert_allclose(after(x=x)["output"], n.predict({"x": x}), atol=1e-6)


def test_a_reexport_swaps_the_whole_directory_in_and_keeps_a_symlink(tmp_path):
    place = tmp_path / "exports"
    place.mkdir()
    n = nitro.Nitro(Toy(max_epochs=1), seed=0, progress=False)
    (place / "real").mkdir()
    (place / "real" / ".program.jaxexport.123.tmp").write_bytes(b"left by an old export")
    os.symlink(place / "real", place / "link")
    n.export(str(place / "link"))
    n.train()
    n.export(str(place / "link"))
    assert os.path.islink(place / "link")
    assert sorted(os.listdir(place / "real")) == bundle_files(place / "real")  # no temporary
    assert sorted(os.listdir(place)) == ["link", "real"]  # nothing left beside it
    x = batch(3)
    model = nitro.bundle.load(place / "link")
    np.testing.assert_allclose(model(x=x)["output"], n.predict({"x": x}), atol=1e-6)

    (place / "real" / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match=r"real holds files that are not part of its bundle "):
        n.export(str(place / "real"))
    assert (place / "real" / "notes.txt").read_text() == "mine"


@pytest.fixture
def small_disk(tmp_path):
    """A 256 KiB tmpfs, mounted for the test and unmounted after it."""
    with mounted(tmp_path / "disk", "size=256k") as disk:
        yield disk


def test_a_reexport_that_fills_the_disk_leaves_the_previous_bundle_whole(small_disk):
    n = nitro.Nitro(Toy(width=64, max_epochs=1), seed=0, progress=False)
    target = small_disk / "bundle"
    n.export(str(target))
    x = batch(6)
    before = nitro.bundle.load(target)(x=x)["output"]
    fill(small_disk / "filler", leave=8192)  # room for part of a bundle, not all of it
    n.train()
    with pytest.raises(
        ExportError,
        match=re.escape(f"cannot write the bundle to {target} (No space left on device); the ")
        + r"previous bundle there is unchanged\. Free space on that disk \(the bundle takes "
        r"[\d,]+ bytes\) or export elsewhere",
    ):
        n.export(str(target))
    assert sorted(os.listdir(small_disk)) == ["bundle", "filler"]  # no temporary left
    assert sorted(os.listdir(target)) == bundle_files(target)
    model = nitro.bundle.load(target)
    assert model.manifest["provenance"]["step"] == 0
    np.testing.assert_array_equal(model(x=x)["output"], before)

    with pytest.raises(ExportError, match=r"No space left on device\); nothing was written"):
        n.export(str(small_disk / "second"))
    assert sorted(os.listdir(small_disk)) == ["bundle", "filler"]

    os.remove(small_disk / "filler")  # with room again, the re-export goes through
    n.export(str(target))
    assert sorted(os.listdir(small_disk)) == ["bundle"]
    after = nitro.bundle.load(target)
    assert after.manifest["provenance"]["step"] == 4
    np.testing.assert_allclose(after(x=x)["output"], n.predict({"x": x}), atol=1e-6)


def test_platforms_must_name_platforms_jax_export_lowers_for(trained, tmp_path):
    valid = r"the valid platforms are 'cpu', 'cuda', 'rocm', 'tpu'"
    cases = [
        ((), r"platforms=\(\) names no platform to lower for; name at least one of 'cpu', "),
        (("tpux",), rf"platforms names 'tpux', which jax.export cannot lower for; {valid}"),
        (("cpu", "gpu"), rf"names 'gpu'.*{valid} \('cuda' for NVIDIA GPUs, 'rocm' for AMD\)"),
        ("cpu", r"platforms must be a tuple of platform names, e\.g\. platforms=\('cpu',\)"),
        (("cpu", "cpu"), r"platforms names a platform twice"),
    ]
    for platforms, message in cases:
        with pytest.raises(ExportError, match=message):
            trained.export(str(tmp_path / "bundle"), platforms=platforms)
        assert not (tmp_path / "bundle").exists()
    manifest = trained.export(str(tmp_path / "bundle"), platforms=("cpu",))
    assert manifest["program"]["platforms"] == ["cpu"]


# ---------------------------------------------------------------------------------------------
# damaged bundles and bad calls


@pytest.fixture
def damaged(exported, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(exported, copy)
    return copy


def test_a_missing_file_is_named(damaged):
    os.remove(damaged / "weights.safetensors")
    with pytest.raises(nitro.bundle.BundleError, match=r"weights\.safetensors is missing"):
        nitro.bundle.load(damaged)
    os.remove(damaged / "manifest.json")
    with pytest.raises(nitro.bundle.BundleError, match=r"manifest\.json is missing"):
        nitro.bundle.load(damaged)


def test_truncated_weights_are_named_with_the_expected_size(damaged):
    path = damaged / "weights.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    message = f"has {len(data) - 10} bytes but the manifest expects {len(data)}"
    with pytest.raises(nitro.bundle.BundleError, match=message):
        nitro.bundle.load(damaged)


def test_a_changed_program_fails_its_checksum(damaged):
    path = damaged / "program.jaxexport"
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(
        nitro.bundle.BundleError, match=r"program\.jaxexport does not match the sha256"
    ):
        nitro.bundle.load(damaged)


def test_a_manifest_from_a_newer_format_says_to_upgrade(damaged):
    manifest = json.loads((damaged / "manifest.json").read_text())
    manifest["format_version"] = 3
    (damaged / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(
        nitro.bundle.BundleError, match=r"format 3; this nitro\.bundle reads format 2.*Upgrade"
    ):
        nitro.bundle.load(damaged)


def _edit(entry: dict, **changes) -> None:
    for key, value in changes.items():
        if value is None:
            del entry[key]
        else:
            entry[key] = value


TAMPERINGS = {
    "a missing key": (
        lambda m: _edit(m, outputs=None),
        r"manifest\.json has no 'outputs' entry",
    ),
    "an input without a dtype": (
        lambda m: _edit(m["inputs"][0], dtype=None),
        r"manifest\.json: inputs\[0\] has no 'dtype'",
    ),
    "a file entry without its size": (
        lambda m: _edit(m["files"]["weights.safetensors"], bytes=None),
        r"manifest\.json: files\['weights\.safetensors'\]\['bytes'\] must be a byte count",
    ),
    "files as a list": (
        lambda m: _edit(m, files=[1]),
        r"manifest\.json: 'files' must be an object",
    ),
    "a wrong input shape": (
        lambda m: _edit(m["inputs"][0], shape=[-1, 4]),
        r"manifest\.json: inputs\[0\] \('x'\) has shape \[-1, 4\], but \S+program\.jaxexport "
        r"takes x: float32\[batch, 5\]",
    ),
    "a wrong output shape": (
        lambda m: _edit(m["outputs"][0], shape=[3], axes=[None]),
        r"outputs\[0\] \('output'\) has shape \[3\], but \S+ returns output: float32\[batch, 2\]",
    ),
    "a wrong input dtype": (
        lambda m: _edit(m["inputs"][0], dtype="int32"),
        r"inputs\[0\] \('x'\) has dtype 'int32', but \S+program\.jaxexport takes x: float32",
    ),
    "a wrong input name": (
        lambda m: _edit(m["inputs"][0], name="image"),
        r"manifest\.json: 'inputs' names \['image'\], but \S+program\.jaxexport takes \['x'\]",
    ),
    "a shape that is not a list of sizes": (
        lambda m: _edit(m["inputs"][0], shape="[-1, 5]"),
        r"inputs\[0\]\['shape'\] must be a list of sizes \(-1 for the batch axis\)",
    ),
    "axes that do not match the shape": (
        lambda m: _edit(m["inputs"][0], axes=["batch"]),
        r"inputs\[0\]\['axes'\] must name each of the 2 axes \(a name or null\)",
    ),
    "an echo of an input the bundle does not take": (
        lambda m: m["outputs"].append({**m["inputs"][0], "name": "id", "echo": "id"}),
        r"outputs\[1\] \('id'\) echoes input 'id', which the bundle does not take",
    ),
    "a name that is not a string": (
        lambda m: _edit(m, name=5),
        r"manifest\.json: 'name' must be a non-empty string",
    ),
    "not JSON": ("{not json", r"manifest\.json is not valid JSON"),
}


@pytest.mark.parametrize("tampering", sorted(TAMPERINGS))
def test_a_tampered_manifest_is_refused_naming_the_file_and_the_key(damaged, tampering):
    change, message = TAMPERINGS[tampering]
    path = damaged / "manifest.json"
    if isinstance(change, str):
        path.write_text(change)
    else:
        manifest = json.loads(path.read_text())
        change(manifest)
        path.write_text(json.dumps(manifest))
    with pytest.raises(nitro.bundle.BundleError, match=message) as raised:
        nitro.bundle.load(damaged)
    assert str(damaged) in str(raised.value) and "re-export" in str(raised.value)


def test_wrong_inputs_at_call_time_name_the_input_and_what_was_expected(exported):
    model = nitro.bundle.load(exported)
    error = nitro.bundle.BundleError
    with pytest.raises(error, match=r"input 'x' must be float32\[batch, 5\]; got float64\[3, 5\]"):
        model(x=np.zeros((3, 5)))
    with pytest.raises(error, match=r"input 'x' must have shape \[batch, 5\]; got float32\[3, 4\]"):
        model(x=np.zeros((3, 4), np.float32))
    with pytest.raises(error, match=r"toy has no input 'y'; it takes x: float32\[batch, 5\]"):
        model(x=X[:2], y=X[:2])
    with pytest.raises(error, match=r"toy needs input 'x'"):
        model()
    with pytest.raises(
        error,
        match=r"input 'x' must have shape \[batch, 5\]; got float32\[5\]\. For a single "
        r"example, add the batch axis: x\[None\]",
    ):
        model(x=np.zeros(5, np.float32))
    with pytest.raises(error, match=r"input 'x' must be float32\[batch, 5\]: could not convert"):
        model(x="abc")
    with pytest.raises(error, match=r"input 'x' has no rows"):
        model(x=np.zeros((0, 5), np.float32))
    assert model({"x": [[0.0] * 5]})["output"].shape == (1, 2)  # a list takes the input's dtype


# ---------------------------------------------------------------------------------------------
# a mesh-trained handle exports for one device


def test_a_handle_trained_on_a_mesh_exports_for_one_device(tmp_path):
    env = dict(
        os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu"
    )
    done = subprocess.run(
        [sys.executable, os.path.join(HERE, "export_mesh_checks.py"), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=os.path.dirname(HERE),
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert json.loads(done.stdout) == {"devices": 4, "n_devs": 4}
    model = nitro.bundle.load(tmp_path / "bundle")
    x = np.load(tmp_path / "x.npy")
    assert len(jax.devices()) == 1
    np.testing.assert_allclose(model(x=x)["output"], np.load(tmp_path / "predicted.npy"), atol=1e-5)
    names = {
        name for name in nitro.bundle.read_weights(str(tmp_path / "bundle" / "weights.safetensors"))
    }
    assert {"norm.mean", "norm.var", "hidden.kernel"} <= names  # BatchNorm statistics travel too


def test_an_echoed_input_comes_back_unchanged_beside_the_outputs(trained, tmp_path):
    n = nitro.Nitro(Tagged(), weights=trained, progress=False)
    manifest = n.export(str(tmp_path / "tagged"), echo=("id",))
    assert manifest["format_version"] == nitro.bundle.FORMAT_VERSION
    assert manifest["outputs"][1] == {
        "name": "id",
        "dtype": "int32",
        "shape": [-1],
        "axes": ["batch"],
        "echo": "id",
    }
    model = nitro.bundle.load(tmp_path / "tagged")
    assert [str(s) for s in model.outputs] == ["output: float32[batch, 2]", "id: int32[batch]"]
    x, ids = batch(3), np.array([7, -1, 2**31 - 1], np.int32)
    result = model(x=x, id=ids)
    assert list(result) == ["output", "id"]
    np.testing.assert_array_equal(result["id"], ids)
    np.testing.assert_allclose(result["output"], trained.predict({"x": x}), atol=1e-6)
    with pytest.raises(ExportError, match=r"echo names 'key', which is not an input.*id: int32"):
        n.export(str(tmp_path / "other"), echo=("key",))
    clash = nitro.Nitro(TaggedClash(), weights=trained, progress=False)
    with pytest.raises(ExportError, match=r"the bundle already returns an output 'id'; rename"):
        clash.export(str(tmp_path / "other"), echo=("id",))


def test_a_postprocess_hook_runs_its_recorded_source_when_the_loader_trusts_it(trained, tmp_path):
    n = nitro.Nitro(Labelled(), weights=trained, progress=False)
    manifest = n.export(str(tmp_path / "labelled"), echo=("id",))
    hook = manifest["postprocess"]
    assert hook["source"].startswith("def postprocess(self, outputs, **inputs):\n")
    assert hook["sha256"] == hashlib.sha256(hook["source"].encode()).hexdigest()
    assert hook["fields"] == {"width": 8, "offset": 0.0, "scale": 1.0}
    assert [e["name"] for e in hook["program_outputs"]] == ["output"]
    assert [(e["name"], e["dtype"], e["shape"]) for e in manifest["outputs"]] == [
        ("label", "int64", [-1]),
        ("p", "float64", [-1]),
        ("id", "int32", [-1]),
    ]
    with pytest.raises(
        nitro.bundle.BundleError, match=r"holds a postprocess hook .*trust_code=True"
    ):
        nitro.bundle.load(tmp_path / "labelled")
    model = nitro.bundle.load(tmp_path / "labelled", trust_code=True)
    x, ids = batch(4), np.arange(4, dtype=np.int32)
    result = model(x=x, id=ids)
    np.testing.assert_array_equal(result["label"], trained.predict({"x": x}).argmax(1))
    assert result["p"].shape == (4,) and (result["p"] >= 0.5).all()
    np.testing.assert_array_equal(result["id"], ids)


def test_a_hook_that_raises_or_returns_another_shape_gives_no_outputs(trained, tmp_path):
    nitro.Nitro(Failing(), weights=trained, progress=False).export(str(tmp_path / "failing"))
    model = nitro.bundle.load(tmp_path / "failing", trust_code=True)
    assert model(x=batch(2), id=np.array([1, 2], np.int32))["label"].shape == (2,)
    with pytest.raises(nitro.bundle.OutputError, match=r"postprocess hook raised ValueError: ids"):
        model(x=batch(3), id=np.array([1, -2, 3], np.int32))
    with pytest.raises(
        nitro.bundle.OutputError, match=r"output 'label' is int64\[2\] for 3 rows, but its manifest"
    ):
        model(x=batch(3), id=np.array([1, 2, 3], np.int32))


def test_batch_sizes_pad_a_call_to_the_smallest_that_fits(trained, tmp_path):
    manifest = trained.export(str(tmp_path / "sized"), batch_sizes=(1, 8, 32))
    assert manifest["program"]["batch_sizes"] == [1, 8, 32]
    model = nitro.bundle.load(tmp_path / "sized")
    assert [model.width(rows) for rows in (1, 2, 8, 9, 32, 33, 70)] == [1, 8, 8, 32, 32, 64, 96]
    for rows in (3, 5, 70):
        x = batch(rows)
        result = model(x=x)["output"]
        assert result.shape == (rows, 2)
        np.testing.assert_allclose(result, trained.predict({"x": x}), atol=1e-6)
    assert model.program.call._cache_size() == 2  # widths 8 and 32 (70 rows: 3 calls of 32)
    for wrong in ((8, 1), (0, 4), (2.0,), ()):
        with pytest.raises(
            ExportError, match=r"batch_sizes must be .*e\.g\. batch_sizes=\(1, 8, 32\)"
        ):
            trained.export(str(tmp_path / "wrong"), batch_sizes=wrong)


@nitro.experiment
class Grid(Toy):
    """Takes a one-row grid of five cells on the wire: an input of three axes."""

    def export_inputs(self):
        return {"grid": jax.ShapeDtypeStruct((1, 5), jnp.float32)}

    def export_preprocess(self, *, grid):
        return {"x": grid.reshape(grid.shape[0], 5)}


def test_axes_name_the_axes_of_inputs_and_outputs_beside_the_batch(trained, tmp_path):
    n = nitro.Nitro(Grid(), weights=trained, progress=False)
    axes = {"grid": ("batch", "height", "width"), "output": ("batch", "class")}
    manifest = n.export(str(tmp_path / "grid"), axes=axes)
    assert manifest["inputs"] == [
        {
            "name": "grid",
            "dtype": "float32",
            "shape": [-1, 1, 5],
            "axes": ["batch", "height", "width"],
        }
    ]
    assert manifest["outputs"][0]["axes"] == ["batch", "class"]
    model = nitro.bundle.load(tmp_path / "grid")
    assert [str(s) for s in model.inputs] == ["grid: float32[batch, height=1, width=5]"]
    assert model.outputs[0].axes == ("batch", "class")
    x = batch(3)
    np.testing.assert_allclose(
        model(grid=x[:, None, :])["output"], trained.predict({"x": x}), atol=1e-6
    )
    tagged = nitro.Nitro(Tagged(), weights=trained, progress=False)
    echoed = tagged.export(str(tmp_path / "tagged"), echo=("id",), axes={"id": ("batch",)})
    assert echoed["outputs"][1]["axes"] == ["batch"]  # an echoed input keeps its input's names


@pytest.mark.parametrize(
    ("axes", "message"),
    [
        (
            {"grid": ("batch", "cells")},
            "axes['grid'] names 2 axes ('batch', 'cells'), but grid: float32[batch, 1, 5] has "
            "3; give one name (or None) per axis, 'batch' for the batch axis: e.g. "
            "axes={'grid': ('batch', 'axis1', 'axis2')}",
        ),
        (
            {"grid": ("rows", "height", "width")},
            "axes['grid'] = ('rows', 'height', 'width') does not name the batch axis of grid: "
            "float32[batch, 1, 5] 'batch' (and only it",
        ),
        (
            {"output": ("batch", "batch")},
            "axes['output'] = ('batch', 'batch') names an axis twice",
        ),
        (
            {"image": ("batch", "height", "width")},
            "axes names 'image', which the bundle neither takes nor returns (inputs grid: "
            "float32[batch, 1, 5]; outputs output: float32[batch, 2]); name those",
        ),
        (["grid"], "axes must be a dict {input or output name: a name per axis}"),
        ({"grid": "batch"}, "axes['grid'] must be a tuple with a name (or None) for each axis"),
        ({"grid": ("batch", "", None)}, "each axis name must be a non-empty string or None"),
    ],
)
def test_axes_that_do_not_fit_the_wire_are_refused_naming_the_fix(trained, tmp_path, axes, message):
    n = nitro.Nitro(Grid(), weights=trained, progress=False)
    with pytest.raises(ExportError) as error:
        n.export(str(tmp_path / "wrong"), axes=axes)
    assert message in str(error.value)
    assert not (tmp_path / "wrong").exists()
