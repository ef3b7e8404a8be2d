"""Pretrained weights for `nitro.models.create(pretrained=...)`: a local path or a Hugging Face
Hub id, read in PyTorch layout, fitted to the model built (timm's rules: a classifier of
another size is left at its initial values, a first convolution of another input width is
summed or repeated), and loaded by `nitro.weights.load`.

A Hub id (`"timm/convnextv2_atto.fcmae_ft_in1k"`, or `"hf-hub:org/name"`) is read as its
`model.safetensors` through `huggingface_hub`: its cache (`cache_dir=`, else `HF_HUB_CACHE`),
`revision=` (a branch, tag or commit), and offline mode (`HF_HUB_OFFLINE=1`: the cache only).
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from nitro.errors import WeightsError
from nitro.models.convnext import ConvNeXt
from nitro.models.resnet import ResNet
from nitro.weights import LoadReport, load, read
from nitro.weights.partial import note_origin
from nitro.weights.weight_files import describe_source

__all__ = ["hub_file", "load_pretrained"]

HUB_FILE = "model.safetensors"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_FILE_SUFFIXES = (".safetensors", ".npz", ".json", ".bin", ".pt", ".pth")


def _is_hub_id(source: str) -> bool:
    if source.startswith("hf-hub:"):
        return True
    return (
        not Path(source).exists()
        and _HUB_ID.match(source) is not None
        and not source.endswith(_FILE_SUFFIXES)
    )


def _offline() -> bool:
    import huggingface_hub.constants

    flag = os.environ.get("HF_HUB_OFFLINE", "").strip().upper()
    return huggingface_hub.constants.HF_HUB_OFFLINE or flag in ("1", "ON", "YES", "TRUE")


def hub_file(
    repo_id: str, *, revision: str | None = None, cache_dir: str | os.PathLike | None = None
) -> Path:
    """The local path of `repo_id`'s `model.safetensors` at `revision`, downloaded into the
    Hugging Face cache unless it is there (offline: from the cache or a `WeightsError`)."""
    try:
        import huggingface_hub
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError as error:
        raise WeightsError(
            f"pretrained={repo_id!r} is a Hugging Face Hub id, which needs huggingface_hub: "
            f"pip install 'nitro[hub]' (or give a local .safetensors file)"
        ) from error
    offline = _offline()
    at = f" at revision {revision!r}" if revision else ""
    try:
        path = huggingface_hub.hf_hub_download(
            repo_id,
            HUB_FILE,
            revision=revision,
            cache_dir=None if cache_dir is None else str(cache_dir),
            local_files_only=offline,
        )
    except LocalEntryNotFoundError as error:
        cache = cache_dir or huggingface_hub.constants.HF_HUB_CACHE
        why = "offline mode (HF_HUB_OFFLINE) is on and it" if offline else "it"
        raise WeightsError(
            f"pretrained={repo_id!r}: {why} is not in the Hugging Face cache {str(cache)!r}"
            f"{at} (no {HUB_FILE} there). Download it once with network access "
            f"(`hf download {repo_id} {HUB_FILE}`"
            + (f" --revision {revision}" if revision else "")
            + "), point cache_dir= or HF_HUB_CACHE at a cache holding it, or pass "
            "pretrained= a local .safetensors file"
        ) from error
    except Exception as error:  # the Hub's own errors: unknown repo, revision or file, network
        raise WeightsError(
            f"pretrained={repo_id!r}: could not fetch {HUB_FILE}{at} from the Hugging Face "
            f"Hub ({type(error).__name__}: {error}). Check the id and revision, or pass "
            f"pretrained= a local .safetensors file"
        ) from error
    return Path(path)


def _fit_first_conv(weight: np.ndarray, in_chans: int) -> np.ndarray:
    """timm's `adapt_input_conv`: an RGB convolution (O, 3, k, k) for `in_chans` inputs."""
    channels = weight.shape[1]
    if in_chans == channels:
        return weight
    if in_chans == 1:
        return weight.sum(axis=1, keepdims=True)
    repeats = math.ceil(in_chans / channels)
    return np.tile(weight, (1, repeats, 1, 1))[:, :in_chans] * (channels / in_chans)


def load_pretrained(
    model: ResNet | ConvNeXt,
    source: str | os.PathLike,
    *,
    in_chans: int,
    revision: str | None = None,
    cache_dir: str | os.PathLike | None = None,
) -> LoadReport:
    """Fill `model`, just built, from `source` (a path or a Hub id) in place. Every leaf but
    a new classifier's must come from `source`, and every array of it must fill one; else a
    `WeightsError` names them (the model may then hold some of the weights: drop it). A run
    whose model holds it names where its weights came from in `weights_origin`."""
    if revision is not None and not _is_hub_id(str(source)):
        raise WeightsError(
            f"revision={revision!r} pins a Hugging Face Hub id, but pretrained={str(source)!r} "
            f"is a local path: drop revision="
        )
    where = describe_source(source)
    if _is_hub_id(str(source)):
        hub_id = str(source).removeprefix("hf-hub:")
        source = hub_file(hub_id, revision=revision, cache_dir=cache_dir)
        where = f"{hub_id}" + (f"@{revision}" if revision else "") + f" ({source})"
    arrays: dict[str, Any] = read(source)
    first, classifier = f"{model.first_conv}.weight", f"{model.classifier}."
    if first in arrays:
        arrays[first] = _fit_first_conv(arrays[first], in_chans)
    head = arrays.get(f"{classifier}weight")
    if head is not None and head.shape[0] != model.num_classes:  # a new classifier
        arrays = {k: v for k, v in arrays.items() if not k.startswith(classifier)}
    report = load(arrays, model, strict=False)
    if report.unused or any(not path.startswith(classifier) for path in report.left):
        load(arrays, model)  # strict: refuses, naming the keys and leaves that do not fit
    origin = f"pretrained from {where} ({len(report.loaded)} leaves, "
    origin += f"{len(report.converted)} converted from PyTorch layout"
    origin += f"; {', '.join(report.left)} at initial values)" if report.left else ")"
    note_origin(model, origin)  # the run's `weights_origin` names it
    return report
