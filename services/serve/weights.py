"""The dense weights file of a model version: safetensors.

A version of format 2 holds ``dense.safetensors``: the model's state_dict as named tensors
(no code runs on reading, any language reads it), with the version id and step as the
file's string metadata; the manifest's sha256 covers it like every file. Writing takes a
torch state_dict (the exporter trains); reading gives NumPy arrays
(``safetensors.numpy``), so serving needs no torch. Format 1 versions hold ``dense.pt``
(``torch.save``); they still load where torch is installed, through
``torch.load(weights_only=True)``, with a logged deprecation warning.
"""

from __future__ import annotations

import io
import logging
import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file

from services.common.errors import FailedPrecondition, InvalidArgument

if TYPE_CHECKING:
    import torch

__all__ = ["DENSE", "LEGACY_DENSE", "dense_bytes", "check_dense_state", "read_dense"]

DENSE = "dense.safetensors"
LEGACY_DENSE = "dense.pt"  # format 1 (torch.save); read only

log = logging.getLogger(__name__)


def check_dense_state(state: Mapping[str, Any]) -> None:
    """Every entry of a state_dict to export must be a tensor (InvalidArgument naming the
    first one that is not: non-tensor metadata belongs in the manifest)."""
    import torch

    for name, value in state.items():
        if not isinstance(name, str) or not isinstance(value, torch.Tensor):
            raise InvalidArgument(f"dense state entry {name!r} is a {type(value).__name__}, "
                                  "not a tensor: only tensors are exported as dense weights")


def dense_bytes(state: Mapping[str, torch.Tensor], *, version_id: str, step: int) -> bytes:
    """The safetensors file of a (checked) state_dict. Each tensor is copied contiguous on
    the CPU, so tensors that share storage (tied weights) are written apart."""
    from safetensors.torch import save

    tensors = {k: v.detach().cpu().contiguous().clone() for k, v in state.items()}
    return save(tensors, metadata={"format": "persimmon-dense", "version_id": version_id,
                                   "step": str(step)})


def read_dense(version_dir: Path | str, manifest: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The dense state_dict of a version as NumPy arrays: ``dense.safetensors``, or a format
    1 version's ``dense.pt`` (deprecated, logged; needs torch). FailedPrecondition when it
    cannot be read."""
    directory = Path(version_dir)
    files = manifest["files"]
    try:
        if DENSE in files:
            return load_file(directory / DENSE)
        if LEGACY_DENSE in files:
            log.warning("model version %s stores its dense weights as %s (torch.save, format "
                        "%s): deprecated, export it again to write %s", directory.name,
                        LEGACY_DENSE, manifest.get("format"), DENSE)
            return _read_legacy(directory / LEGACY_DENSE)
    except (SafetensorError, OSError, RuntimeError, ValueError, TypeError, EOFError,
            pickle.UnpicklingError) as exc:
        raise FailedPrecondition(f"model version {directory.name}: its dense weights cannot "
                                 f"be read: {exc}") from exc
    raise FailedPrecondition(f"model version {directory.name} lists no dense weights file "
                             f"({DENSE} or {LEGACY_DENSE}) in its manifest")


def _read_legacy(path: Path) -> dict[str, np.ndarray]:
    try:
        import torch
    except ImportError as exc:
        raise FailedPrecondition(f"{path} is a torch.save pickle (format 1): reading it needs "
                                 f"torch (pip install 'persimmon[train]'), or export the "
                                 f"version again ({DENSE})") from exc
    state = torch.load(io.BytesIO(path.read_bytes()), weights_only=True)
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor)
                                              for v in state.values()):
        raise ValueError(f"{LEGACY_DENSE} holds a {type(state).__name__}, not a state_dict")
    return {k: v.detach().cpu().numpy() for k, v in state.items()}
