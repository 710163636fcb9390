"""The dense models' forward pass in NumPy, over a version's exported weights: serving needs
no torch.

:func:`dense_forward` builds, from the manifest's model entry and the dense state_dict
(``dense.safetensors`` read as NumPy arrays), the eval-mode forward of the model
:mod:`services.worker.models` trained: DLRM, DeepFM, DCN-v2, Wide&Deep and logistic
regression, with their dense normalisation (``DenseNorm``'s frozen statistics), projections
to a common dim and per-id first-order weights. Layer sizes come from the weights' shapes;
the manifest gives what shapes cannot tell (the model, DCN-v2's structure, ``id_weights``).
Every weight is taken once with its shape checked: a missing, misshapen or unexpected one is
a FailedPrecondition naming it, as torch's strict ``load_state_dict`` refuses it. The
forward computes in float32 as torch does on the CPU; tests hold it to the torch model's
output (tests/unit/serve/test_serve_forward.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from services.common.errors import FailedPrecondition, InvalidArgument

__all__ = ["DENSE_NORM_EPS", "FAMILIES", "DenseForward", "dense_forward", "sigmoid"]

# DenseNorm's eps (services/worker/models.py): a constructor default, not in the state dict
DENSE_NORM_EPS = 1e-6

# (pooled {feature: (B, dim) float32}, dense (B, num_dense) float32) -> (B,) float32 logits
DenseForward = Callable[[Mapping[str, np.ndarray], np.ndarray], np.ndarray]


def sigmoid(x: np.ndarray) -> np.ndarray:
    """``1 / (1 + exp(-x))`` in x's dtype, without overflow for large ``|x|``."""
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1 / (1 + e), e / (1 + e)).astype(x.dtype, copy=False)


class _Weights:
    """The state_dict being read: each weight taken once, shape checked; what is left over
    at the end is unexpected."""

    def __init__(self, state: Mapping[str, np.ndarray]) -> None:
        self._left = dict(state)

    def has(self, key: str) -> bool:
        return key in self._left

    def shape(self, key: str) -> tuple[int, ...] | None:
        value = self._left.get(key)
        return None if value is None else tuple(value.shape)

    def take(self, key: str, shape: tuple[int | None, ...], dtype: Any = np.float32
             ) -> np.ndarray:
        """Weight ``key`` as ``dtype`` (C-contiguous); ``None`` in ``shape`` is any size."""
        value = self._left.pop(key, None)
        if value is None:
            raise FailedPrecondition(f"the dense weights lack {key!r}")
        if value.ndim != len(shape) or any(s is not None and s != v
                                           for s, v in zip(shape, value.shape, strict=True)):
            want = tuple("*" if s is None else s for s in shape)
            raise FailedPrecondition(f"dense weight {key!r} is {value.shape}, the model "
                                     f"needs {want}")
        return np.asarray(value, dtype=dtype, order="C")

    def finish(self) -> None:
        if self._left:
            raise FailedPrecondition(f"the dense weights hold {sorted(self._left)[:10]}, which "
                                     "the model does not have")


@dataclass(frozen=True, slots=True)
class _Linear:
    weight_t: np.ndarray       # (in, out)
    bias: np.ndarray | None    # (out,)

    @property
    def out_dim(self) -> int:
        return int(self.weight_t.shape[1])

    def __call__(self, x: np.ndarray) -> np.ndarray:
        y = x @ self.weight_t
        if self.bias is not None:
            y += self.bias
        return y


def _linear(w: _Weights, prefix: str, in_dim: int, out_dim: int | None = None, *,
            bias: bool = True) -> _Linear:
    """``nn.Linear`` ``prefix``: weight (out, in), bias (out,)."""
    weight = w.take(f"{prefix}.weight", (out_dim, in_dim))
    b = w.take(f"{prefix}.bias", (weight.shape[0],)) if bias else None
    return _Linear(np.ascontiguousarray(weight.T), b)


@dataclass(frozen=True, slots=True)
class _MLP:
    """``services.worker.models.mlp``: Linear+ReLU layers, the last one plain when it is the
    output layer."""

    layers: tuple[_Linear, ...]
    relu_last: bool

    @property
    def out_dim(self) -> int | None:
        return self.layers[-1].out_dim if self.layers else None

    def __call__(self, x: np.ndarray) -> np.ndarray:
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < last or self.relu_last:
                np.maximum(x, 0, out=x)
        return x


def _mlp(w: _Weights, prefix: str, in_dim: int, *, out_layer: bool) -> _MLP:
    """The Linear layers ``prefix.0``, ``prefix.2``, ... (ReLUs between); with ``out_layer``
    the last one is the output layer of width 1 (no ReLU after it)."""
    layers: list[_Linear] = []
    while w.has(f"{prefix}.{2 * len(layers)}.weight"):
        layers.append(_linear(w, f"{prefix}.{2 * len(layers)}", in_dim))
        in_dim = layers[-1].out_dim
    if out_layer and (not layers or layers[-1].out_dim != 1):
        raise FailedPrecondition(f"the dense weights lack {prefix}'s output layer (width 1): "
                                 f"'{prefix}.{2 * len(layers)}.weight'")
    return _MLP(tuple(layers), relu_last=not out_layer)


@dataclass(frozen=True, slots=True)
class _DenseNorm:
    """``DenseNorm`` in eval mode: ``(x - mean) / sqrt(var + eps)``, identity before any
    statistics (count 0)."""

    mean: np.ndarray    # float32 (D,)
    scale: np.ndarray   # float32 (D,)

    @classmethod
    def read(cls, w: _Weights, num_dense: int) -> _DenseNorm | None:
        if not w.has("dense_norm.count"):
            return None
        count = float(w.take("dense_norm.count", (), np.float64))
        mean = w.take("dense_norm.mean", (num_dense,), np.float64)
        m2 = w.take("dense_norm.m2", (num_dense,), np.float64)
        if not count:
            return None
        scale = 1.0 / np.sqrt(m2 / count + DENSE_NORM_EPS)
        return cls(mean.astype(np.float32), scale.astype(np.float32))

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return (x - self.mean) * self.scale


class _Inputs:
    """What every model does first (``_RecModel``): the pooled vectors in feature order,
    checked; the dense input normalised; the ids' first-order weights split off."""

    def __init__(self, w: _Weights, sparse_dims: Mapping[str, int], num_dense: int,
                 id_weights: bool) -> None:
        self.features = list(sparse_dims)
        self.sparse_dims = dict(sparse_dims)
        self.num_dense = num_dense
        self.id_weights = id_weights
        self.embedding_dims = [d - 1 if id_weights else d for d in sparse_dims.values()]
        self.flat_dim = sum(self.embedding_dims) + num_dense
        self.norm = _DenseNorm.read(w, num_dense)

    def __call__(self, pooled: Mapping[str, np.ndarray], dense: np.ndarray
                 ) -> tuple[list[np.ndarray], np.ndarray | None, np.ndarray]:
        """(embeddings in feature order, summed id weights ``(B,)`` or None, dense input)."""
        if dense.ndim != 2 or dense.shape[1] != self.num_dense:
            raise InvalidArgument(f"dense must be (B, {self.num_dense}), got {dense.shape}")
        batch = dense.shape[0]
        feats = []
        for name in self.features:
            t = pooled.get(name)
            if t is None:
                raise InvalidArgument(f"pooled embedding of feature {name!r} is missing; "
                                      f"expected {self.features}")
            if t.shape != (batch, self.sparse_dims[name]):
                raise InvalidArgument(f"pooled[{name!r}] must be ({batch}, "
                                      f"{self.sparse_dims[name]}), got {t.shape}")
            feats.append(np.asarray(t, dtype=np.float32))
        dense = np.asarray(dense, dtype=np.float32)
        if self.norm is not None:
            dense = self.norm(dense)
        if not self.id_weights:
            return feats, None, dense
        weights = np.stack([t[:, -1] for t in feats], 1).sum(1)
        return [t[:, :-1] for t in feats], weights, dense

    def projections(self, w: _Weights, dim: int | None) -> tuple[int, list[_Linear | None]]:
        """(the common dim, each feature's bias-free projection ``proj.p<i>`` to it, None
        where its dim is already it). ``dim`` None: the projections' dim, or the features'
        when none is projected."""
        if dim is None:
            shapes = [w.shape(f"proj.p{i}.weight") for i in range(len(self.embedding_dims))]
            dim = next((s[0] for s in shapes if s), self.embedding_dims[0])
        return dim, [_linear(w, f"proj.p{i}", d, dim, bias=False) if d != dim else None
                     for i, d in enumerate(self.embedding_dims)]


def _project(proj: list[_Linear | None], feats: list[np.ndarray]) -> list[np.ndarray]:
    return [t if p is None else p(t) for p, t in zip(proj, feats, strict=True)]


def _dot_interaction(vecs: list[np.ndarray], keep_first: bool) -> np.ndarray:
    """DLRM's pairwise dots of ``n`` vectors ``(B, D)`` in ``tril_indices(n, -1)`` order,
    after ``vecs[0]`` when ``keep_first``."""
    t = np.stack(vecs, axis=1)                      # (B, n, D)
    li, lj = np.tril_indices(len(vecs), -1)
    z = np.matmul(t, t.transpose(0, 2, 1))[:, li, lj]
    return np.concatenate([vecs[0], z], axis=1) if keep_first else z


class _DLRM:
    def __init__(self, w: _Weights, inputs: _Inputs, config: Mapping[str, Any]) -> None:
        self.inputs = inputs
        num_dense = inputs.num_dense
        self.bottom = _mlp(w, "bottom", num_dense, out_layer=False) if num_dense else None
        if self.bottom is not None and self.bottom.out_dim is None:
            raise FailedPrecondition("the dense weights lack the bottom MLP")
        dim, self.proj = inputs.projections(
            w, self.bottom.out_dim if self.bottom is not None else None)
        n = len(inputs.features) + (1 if num_dense else 0)
        self.top = _mlp(w, "top", n * (n - 1) // 2 + (dim if num_dense else 0),
                        out_layer=True)

    def __call__(self, pooled: Mapping[str, np.ndarray], dense: np.ndarray) -> np.ndarray:
        feats, _, dense = self.inputs(pooled, dense)
        vecs = _project(self.proj, feats)
        if self.bottom is not None:
            vecs = [self.bottom(dense), *vecs]
        return self.top(_dot_interaction(vecs, self.bottom is not None))[:, 0]


class _DeepFM:
    def __init__(self, w: _Weights, inputs: _Inputs, config: Mapping[str, Any]) -> None:
        self.inputs = inputs
        num_dense = inputs.num_dense
        dim, self.proj = inputs.projections(w, None)
        self.dense_field = _linear(w, "dense_field", num_dense, dim) if num_dense else None
        self.linear = _linear(w, "linear", num_dense if inputs.id_weights else inputs.flat_dim,
                              1)
        fields = len(inputs.features) + (1 if num_dense else 0)
        self.deep = _mlp(w, "deep", fields * dim, out_layer=True)

    def __call__(self, pooled: Mapping[str, np.ndarray], dense: np.ndarray) -> np.ndarray:
        feats, id_weights, dense = self.inputs(pooled, dense)
        if id_weights is None:
            first = self.linear(np.concatenate([*feats, dense], axis=1))[:, 0]
        else:
            first = id_weights + self.linear(dense)[:, 0]
        fields = _project(self.proj, feats)
        if self.dense_field is not None:
            fields.append(self.dense_field(dense))
        v = np.stack(fields, axis=1)                  # (B, F, D)
        fm = 0.5 * (np.square(v.sum(1)) - np.square(v).sum(1)).sum(1)
        deep = self.deep(v.reshape(v.shape[0], -1))[:, 0]
        return first + fm + deep


@dataclass(frozen=True, slots=True)
class _Cross:
    """A DCN-v2 cross layer: ``x0 * (W x + b) + x``, ``W = U V`` when low-rank."""

    w: tuple[_Linear, ...]

    def __call__(self, x0: np.ndarray, x: np.ndarray) -> np.ndarray:
        y = x
        for layer in self.w:
            y = layer(y)
        return x0 * y + x


def _cross(w: _Weights, prefix: str, dim: int) -> _Cross:
    if w.has(f"{prefix}.w.weight"):
        return _Cross((_linear(w, f"{prefix}.w", dim, dim),))
    low = _linear(w, f"{prefix}.w.0", dim, bias=False)
    return _Cross((low, _linear(w, f"{prefix}.w.1", low.out_dim, dim)))


class _DCNv2:
    def __init__(self, w: _Weights, inputs: _Inputs, config: Mapping[str, Any]) -> None:
        self.inputs = inputs
        self.stacked = _choice(config, "structure", ("stacked", "parallel")) == "stacked"
        d0 = inputs.flat_dim
        self.cross: list[_Cross] = []
        while w.has(f"cross.{len(self.cross)}.w.weight") \
                or w.has(f"cross.{len(self.cross)}.w.0.weight"):
            self.cross.append(_cross(w, f"cross.{len(self.cross)}", d0))
        if not self.cross:
            raise FailedPrecondition("the dense weights lack the cross layers (cross.0)")
        self.deep = _mlp(w, "deep", d0, out_layer=False)
        deep_out = self.deep.out_dim or d0
        self.head = _linear(w, "head", deep_out if self.stacked else d0 + deep_out, 1)

    def __call__(self, pooled: Mapping[str, np.ndarray], dense: np.ndarray) -> np.ndarray:
        feats, _, dense = self.inputs(pooled, dense)
        x0 = np.concatenate([*feats, dense], axis=1)
        x = x0
        for layer in self.cross:
            x = layer(x0, x)
        out = self.deep(x) if self.stacked else np.concatenate([x, self.deep(x0)], axis=1)
        return self.head(out)[:, 0]


class _WideAndDeep:
    def __init__(self, w: _Weights, inputs: _Inputs, config: Mapping[str, Any]) -> None:
        self.inputs = inputs
        self.wide = _linear(w, "wide", inputs.num_dense if inputs.id_weights
                            else inputs.flat_dim, 1)
        self.deep = _mlp(w, "deep", inputs.flat_dim, out_layer=True)

    def __call__(self, pooled: Mapping[str, np.ndarray], dense: np.ndarray) -> np.ndarray:
        feats, id_weights, dense = self.inputs(pooled, dense)
        x = np.concatenate([*feats, dense], axis=1)
        wide = self.wide(x if id_weights is None else dense)[:, 0]
        if id_weights is not None:
            wide = wide + id_weights
        return wide + self.deep(x)[:, 0]


class _LogisticRegression:
    def __init__(self, w: _Weights, inputs: _Inputs, config: Mapping[str, Any]) -> None:
        self.inputs = inputs
        self.linear = _linear(w, "linear", inputs.flat_dim, 1)

    def __call__(self, pooled: Mapping[str, np.ndarray], dense: np.ndarray) -> np.ndarray:
        feats, _, dense = self.inputs(pooled, dense)
        return self.linear(np.concatenate([*feats, dense], axis=1))[:, 0]


# model name -> (its forward, whether it takes per-id first-order weights)
FAMILIES: dict[str, tuple[type, bool]] = {
    "dlrm": (_DLRM, False),
    "deepfm": (_DeepFM, True),
    "dcnv2": (_DCNv2, False),
    "wide_deep": (_WideAndDeep, True),
    "lr": (_LogisticRegression, False),
}


def _choice(config: Mapping[str, Any], key: str, allowed: tuple[Any, ...]) -> Any:
    value = config.get(key, allowed[0])
    if value not in allowed:
        raise FailedPrecondition(f"the manifest's model {key} must be one of {allowed}, "
                                 f"got {value!r}")
    return value


def dense_forward(config: Mapping[str, Any], *, sparse_dims: Mapping[str, int],
                  num_dense: int, state: Mapping[str, np.ndarray]) -> DenseForward:
    """The forward of the model ``config`` (the manifest's model entry) with the weights
    ``state``; FailedPrecondition when they do not fit."""
    name = _choice(config, "name", tuple(FAMILIES))
    family, takes_id_weights = FAMILIES[name]
    id_weights = takes_id_weights and _choice(config, "id_weights", (False, True))
    low = 2 if id_weights else 1
    if not sparse_dims or any(isinstance(d, bool) or not isinstance(d, int) or d < low
                              for d in sparse_dims.values()):
        raise FailedPrecondition(f"sparse dims must be ints >= {low}, got {dict(sparse_dims)}")
    w = _Weights(state)
    model: DenseForward = family(w, _Inputs(w, sparse_dims, num_dense, id_weights), config)
    w.finish()
    return model
