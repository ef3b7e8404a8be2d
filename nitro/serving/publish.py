"""Publishing a handle's weights to a running `nitro serve` (`Nitro.publish`).

```
GET  /v2/models/NAME/stats            the served bundle's directory, inputs, outputs, axes,
                                      postprocess hook, platforms, echoed inputs, batch sizes
export into that directory            with the same echo, batch sizes and axis names; refused
                                      before writing if the inputs, the outputs or the hook
                                      differ
POST /v2/repository/models/NAME/load  the server re-reads it: weights only if the program is same
GET  /v2/models/NAME/stats            which of the two it did
```

The export swaps the directory in whole and the server swaps the model in whole, so a request
gets the old weights or the new, never a mix. Speaks plain HTTP with the standard library.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from nitro.serving import bundle
from nitro.serving.export import ExportError, export_handle

__all__ = ["PublishError", "publish"]

TIMEOUT_S = 120  # a load compiles a new program for batch 1 before it answers


class PublishError(ExportError):
    """A publish the server could not take: the message names the URL, the model and the fix."""


def _base(url: str) -> str:
    url = url if "://" in url else f"http://{url}"
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise PublishError(
            f"to= must be a model server's address such as 'http://127.0.0.1:8080', not {url!r}"
        )
    return f"{parts.scheme}://{parts.netloc}"


def _call(base: str, method: str, path: str) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(base + path, data=b"" if method == "POST" else None)
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as error:
        body = error.read()
        try:
            answer = json.loads(body)
        except ValueError:
            answer = {"error": body.decode(errors="replace")}
        return error.code, answer if isinstance(answer, dict) else {"error": str(answer)}
    except (urllib.error.URLError, OSError) as error:
        reason = getattr(error, "reason", error)
        raise PublishError(
            f"cannot reach a model server at {base} ({reason}); start one with "
            f"`nitro serve DIR` (it listens on http://127.0.0.1:8080 by default) or pass its "
            f"address: n.publish(NAME, to='http://HOST:PORT')"
        ) from None


def _model_stats(base: str, name: str) -> dict[str, Any]:
    status, answer = _call(base, "GET", f"/v2/models/{urllib.parse.quote(name)}/stats")
    if status == 404:
        raise PublishError(
            f"{base} serves no model named {name!r}; publish to a name it serves, or serve the "
            f"bundle first: n.export('exports/{name}', name={name!r}), then "
            f"`nitro serve exports/{name}`"
        )
    stats = answer.get("model_stats") if status == 200 else None
    if not stats or "bundle" not in stats[0]:
        raise PublishError(
            f"{base} answered GET /v2/models/{name}/stats with {status} "
            f"{answer.get('error', answer)!r}, not a nitro serve model's statistics; publish "
            f"to a `nitro serve` of this version"
        )
    return stats[0]


def _differences(
    manifest: dict[str, Any], served: dict[str, Any], name: str, base: str
) -> dict[str, str]:
    """What of the export's client contract differs from the served bundle's: its inputs,
    its postprocess hook (by sha256) and its outputs, each by name, dtype, shape and axes."""

    def specs(entries: list[dict[str, Any]]) -> list[bundle.TensorSpec]:
        return [bundle.TensorSpec.from_json(e) for e in entries]

    def listed(entries: list[dict[str, Any]]) -> str:
        return ", ".join(
            f"{spec} (echoes {spec.echo})" if spec.echo else str(spec) for spec in specs(entries)
        )

    where = f"{name!r} is served with at {base}"
    found = {}
    if specs(manifest["inputs"]) != specs(served["inputs"]):
        found["inputs"] = (
            f"the export's inputs ({listed(manifest['inputs'])}) do not fit the inputs {where} "
            f"({listed(served['inputs'])})"
        )
    if "outputs" not in served:  # a server from before outputs were listed: inputs alone
        return found
    new, old = (
        str((entry or {}).get("sha256", ""))
        for entry in (manifest.get("postprocess"), served.get("postprocess"))
    )
    if new != old:
        if not old:
            found["postprocess"] = (
                f"the export has a postprocess hook (sha256 {new[:12]}) and {name!r} is served "
                f"without one at {base}"
            )
        elif not new:
            found["postprocess"] = (
                f"the export has no postprocess hook and {name!r} is served with one (sha256 "
                f"{old[:12]}) at {base}"
            )
        else:
            found["postprocess"] = (
                f"the export's postprocess hook (sha256 {new[:12]}) is not the one {where} "
                f"(sha256 {old[:12]})"
            )
    if specs(manifest["outputs"]) != specs(served["outputs"]):
        found["outputs"] = (
            f"the export's outputs ({listed(manifest['outputs'])}) are not the outputs {where} "
            f"({listed(served['outputs'])})"
        )
    return found


def publish(
    handle: Any,
    url: str,
    name: str,
    *,
    variables: Any = None,
    dtype: str | None = None,
    axes: Any = None,
) -> dict[str, Any]:
    """Export `handle` into the directory the server at `url` serves `name` from and have the
    server load it. Returns what it did: `replaced` is "weights" (the program digest was
    unchanged, nothing compiled) or "program" (a full reload). The export keeps the served
    bundle's client contract: its inputs, outputs, axis names and postprocess hook must be the
    served ones, or nothing is written. `axes` defaults to the served bundle's names.

    >>> n.publish("digits", to="http://127.0.0.1:8080")   # doctest: +SKIP
    {'model': 'digits', 'replaced': 'weights', ...}
    """
    start = time.perf_counter()
    base = _base(url)
    before = _model_stats(base, name)
    served = before["bundle"]
    directory = served["directory"]
    if not os.path.isdir(directory):
        raise PublishError(
            f"{base} serves {name!r} from {directory}, which is not a directory on this "
            f"machine; publish from the machine that serves it"
        )
    if axes is None:  # the served bundle's names, so its clients keep them
        axes = {
            e["name"]: tuple(e["axes"])
            for e in (*served["inputs"], *served.get("outputs", ()))
            if "axes" in e
        }

    def accept(manifest: dict[str, Any]) -> None:
        found = _differences(manifest, served, name, base)
        if found:
            fixes = {
                "inputs": "the served inputs (export_inputs)",
                "postprocess": f"the served postprocess hook (its source is under 'postprocess' "
                f"in {os.path.join(directory, bundle.MANIFEST)})",
                "outputs": "the served outputs and their axes (export_outputs, postprocess, axes=)",
            }
            raise PublishError(
                f"{'; '.join(found.values())}; nothing was written. Serve it as a new model "
                f"(n.export('exports/NEW', name='NEW'), then `nitro serve` it), or give the "
                f"experiment {' and '.join(fixes[kind] for kind in found)}"
            )

    manifest = export_handle(
        handle,
        directory,
        name,
        platforms=tuple(served["platforms"]),
        variables=variables,
        dtype=dtype,
        accept=accept,
        echo=tuple(served.get("echo") or ()),  # the served bundle's, so its clients keep them
        batch_sizes=tuple(served.get("batch_sizes") or ()) or None,
        axes=axes,
    )
    status, answer = _call(base, "POST", f"/v2/repository/models/{urllib.parse.quote(name)}/load")
    if status != 200:
        raise PublishError(
            f"{base} could not load the published {name!r} from {directory}: "
            f"{answer.get('error', answer)}; it goes on serving the previous one. Fix the "
            f"cause, then publish again"
        )
    after = _model_stats(base, name)
    same = after["weights"]["program"] == before["weights"]["program"]
    return {
        "model": name,
        "url": base,
        "directory": directory,
        "replaced": "weights" if same else "program",
        "program": after["weights"]["program"],
        "manifest": manifest,
        "seconds": time.perf_counter() - start,
    }
