"""Publishing a handle's weights to a running `nitro serve` (`Nitro.publish`).

```
GET  /v2/models/NAME/stats            the served bundle's directory, inputs, platforms, echoed
                                      inputs and batch sizes
export into that directory            with the same echo and batch sizes; refused before
                                      writing if the inputs differ
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


def publish(
    handle: Any, url: str, name: str, *, variables: Any = None, dtype: str | None = None
) -> dict[str, Any]:
    """Export `handle` into the directory the server at `url` serves `name` from and have the
    server load it. Returns what it did: `replaced` is "weights" (the program digest was
    unchanged, nothing compiled) or "program" (a full reload).

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

    def accept(manifest: dict[str, Any]) -> None:
        new, old = (
            ", ".join(str(bundle.TensorSpec.from_json(e)) for e in entries)
            for entries in (manifest["inputs"], served["inputs"])
        )
        if new != old:  # by name, dtype, shape and axes (a bundle from before axes: the default)
            raise PublishError(
                f"the export's inputs ({new}) do not fit the inputs {name!r} is served with "
                f"at {base} ({old}); nothing was written. Serve it "
                f"as a new model (n.export('exports/NEW', name='NEW'), then `nitro serve` it), "
                f"or give the experiment the served inputs (export_inputs)"
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
