"""Dense recommendation models: DLRM, DeepFM, DCN-v2, Wide&Deep and logistic regression.

Every model is built as ``Model(*, sparse_dims, num_dense, <arch params>)`` and called as
``model(pooled, dense) -> logits``:

- ``pooled`` is a ``dict[str, Tensor]`` with one pooled embedding ``(B, sparse_dims[name])``
  per sparse feature (tables may have different dims). The model reads features in the order
  of ``sparse_dims``; extra keys are ignored, a missing key or a wrong shape is an
  :class:`~services.common.errors.InvalidArgument`. A
  :class:`~services.worker.pooling.PooledFeatures` (what ``pool_batch`` gives) also tells
  DLRM's interaction which tensors came straight out of the pooling kernel.
- ``dense`` is ``(B, num_dense)`` float (``(B, 0)`` when there are no dense features).
- The result is ``(B,)`` logits (apply ``sigmoid`` for probabilities).

Embeddings live on the parameter server, so the models own no embedding tables. First-order
("wide", per-id scalar weight) terms of DeepFM and Wide&Deep are true per-id weights when
``id_weights`` is set (off by default: on movielens it measured no better): every table then has one column more than the
embedding (:meth:`ModelConfig.table_dim`), the id's own weight, pooled like the rest and summed
over the features; the other columns are the embedding. Without it, the first-order term is a
linear layer over the pooled vectors (``w_f · e_id``, a projection of the embedding). Models
whose interaction needs one common dimension (DLRM, DeepFM) project each table with a
different dim through a bias-free linear layer.

With ``dense_norm`` every model standardises its dense input (the loader's log1p'd counts)
with :class:`DenseNorm`: statistics of the first training samples, kept in the model's state
dict, so a checkpoint and a served version apply exactly what training applied. ``persimmon
train`` turns it on (docs/benchmarks.md#quality); the config's default stays off, so that
the figures recorded with it off still hold.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from services.common.errors import ConfigError, InvalidArgument
from services.worker.kernels import PooledFrom, dot_interaction_cpu
from services.worker.pooling import PooledFeatures

__all__ = [
    "CrossLayerV2",
    "DCNv2",
    "DLRM",
    "MODELS",
    "DeepFM",
    "DenseNorm",
    "LogisticRegression",
    "ModelConfig",
    "WideAndDeep",
    "build_model",
    "dot_interaction",
    "fm_second_order",
    "mlp",
    "pick_device",
]


def pick_device(prefer: str | None = None) -> torch.device:
    """``prefer`` if given (``"cpu"``, ``"cuda"``, ``"cuda:1"``), else CUDA when available, else CPU."""
    if prefer:
        try:
            dev = torch.device(prefer)
        except RuntimeError as exc:
            raise ConfigError(f"bad device {prefer!r}: {exc}") from exc
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"device {prefer!r} requested but CUDA is not available")
        return dev
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def mlp(in_dim: int, sizes: Sequence[int], *, out_dim: int | None = None) -> nn.Sequential:
    """Linear+ReLU layers of ``sizes``; a final plain Linear to ``out_dim`` when given."""
    layers: list[nn.Module] = []
    prev = in_dim
    for size in sizes:
        layers += [nn.Linear(prev, size), nn.ReLU()]
        prev = size
    if out_dim is not None:
        layers.append(nn.Linear(prev, out_dim))
    return nn.Sequential(*layers)


def dot_interaction(vecs: Sequence[Tensor], *, keep_first: bool = False,
                    sources: Sequence[PooledFrom | None] | None = None) -> Tensor:
    """DLRM's interaction of ``n`` vectors ``(B, D)``: ``(B, n(n-1)/2)`` pairwise dots in
    ``tril_indices(n, n, -1)`` order, after ``vecs[0]`` itself when ``keep_first``
    (``(B, D + n(n-1)/2)``). A numba kernel for CPU float32, ``bmm`` otherwise.

    ``sources[i]`` (optional): the pooling call ``vecs[i]`` came straight out of
    (:meth:`PooledFeatures.source_of`), whose rows the CPU kernel then gives the vector's
    gradient directly."""
    if all(v.device.type == "cpu" and v.dtype == torch.float32 for v in vecs):
        return dot_interaction_cpu(vecs, keep_first, sources)
    t = torch.stack(list(vecs), dim=1)  # (B, n, D)
    li, lj = torch.tril_indices(len(vecs), len(vecs), offset=-1, device=t.device)
    z = torch.bmm(t, t.transpose(1, 2))[:, li, lj]
    return torch.cat([vecs[0], z], dim=1) if keep_first else z


def _sources(pooled: Mapping[str, Tensor], names: Sequence[str], vecs: Sequence[Tensor]
             ) -> list[PooledFrom | None]:
    """Per vector of feature ``names[i]``, its pooling call where ``pooled`` knows it."""
    if not isinstance(pooled, PooledFeatures):
        return [None] * len(vecs)
    return [pooled.source_of(n, v) for n, v in zip(names, vecs, strict=True)]


def fm_second_order(v: Tensor) -> Tensor:
    """FM's ``Σ_{i<j} <v_i, v_j>`` of fields ``v`` ``(B, F, D)`` in O(F·D): ``(B,)``."""
    return 0.5 * (v.sum(1).pow(2) - v.pow(2).sum(1)).sum(1)


def _check_sizes(name: str, sizes: Sequence[int], *, allow_empty: bool = True) -> list[int]:
    sizes = list(sizes)
    if not allow_empty and not sizes:
        raise ConfigError(f"{name} must have at least one layer")
    if any(not isinstance(s, int) or isinstance(s, bool) or s <= 0 for s in sizes):
        raise ConfigError(f"{name} must be positive layer sizes, got {sizes}")
    return sizes


class DenseNorm(nn.Module):
    """Standardises dense features ``(B, D)``: ``(x - mean) / sqrt(var + eps)`` per column,
    with the mean and variance of the first ``warmup`` training samples (whole batches,
    merged batch by batch), frozen after, as BatchNorm's running statistics are in eval
    mode. The statistics are buffers (float64), so they travel in the state dict; before any
    training sample the module is the identity, and in eval mode it never updates them."""

    count: Tensor  # samples merged so far
    mean: Tensor   # (D,)
    m2: Tensor     # (D,): sum of squared deviations from the mean

    def __init__(self, num_dense: int, *, warmup: int = 65_536, eps: float = 1e-6) -> None:
        super().__init__()
        if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 1:
            raise ConfigError(f"warmup must be an int >= 1, got {warmup!r}")
        self.warmup, self.eps = warmup, eps
        self.register_buffer("count", torch.zeros((), dtype=torch.float64))
        self.register_buffer("mean", torch.zeros(num_dense, dtype=torch.float64))
        self.register_buffer("m2", torch.zeros(num_dense, dtype=torch.float64))

    @torch.no_grad()
    def _update(self, x: Tensor) -> None:
        """Merge the batch's count, mean and sum of squared deviations into the buffers
        (Chan et al.'s pairwise update)."""
        x = x.to(torch.float64)
        n = float(x.shape[0])
        mean = x.mean(0)
        m2 = ((x - mean) ** 2).sum(0)
        total = self.count + n
        delta = mean - self.mean
        self.mean += delta * (n / total)
        self.m2 += m2 + delta ** 2 * (self.count * n / total)
        self.count.fill_(total)

    def forward(self, x: Tensor) -> Tensor:
        count = float(self.count)  # one read of the buffer (a device sync on a GPU)
        if self.training and x.shape[0] and count < self.warmup:
            self._update(x.detach())  # a non-empty batch: the count is > 0 after it
        elif not count:
            return x
        scale = torch.rsqrt(self.m2 / self.count + self.eps)
        return ((x - self.mean.to(x.dtype)) * scale.to(x.dtype))


class _RecModel(nn.Module):
    """Shared input handling: feature order, validation, dense normalisation, projection to a
    common dim."""

    def __init__(self, *, sparse_dims: Mapping[str, int], num_dense: int,
                 id_weights: bool = False, dense_norm: bool = False) -> None:
        super().__init__()
        if not sparse_dims:
            raise ConfigError("sparse_dims must name at least one sparse feature")
        low = 2 if id_weights else 1
        for fname, dim in sparse_dims.items():
            if not isinstance(dim, int) or isinstance(dim, bool) or dim < low:
                raise ConfigError(f"sparse_dims[{fname!r}] must be an int >= {low}, got {dim!r}")
        if not isinstance(num_dense, int) or isinstance(num_dense, bool) or num_dense < 0:
            raise ConfigError(f"num_dense must be an int >= 0, got {num_dense!r}")
        self.feature_names: list[str] = list(sparse_dims)
        self.sparse_dims: dict[str, int] = dict(sparse_dims)
        self.id_weights = id_weights
        # the embedding part of each table (the last column is the id's weight, if any)
        self.embedding_dims = {f: d - 1 if id_weights else d for f, d in sparse_dims.items()}
        self.num_dense = num_dense
        self.flat_dim = sum(self.embedding_dims.values()) + num_dense
        self.dense_norm = DenseNorm(num_dense) if dense_norm and num_dense else None

    def _inputs(self, pooled: Mapping[str, Tensor], dense: Tensor
                ) -> tuple[list[Tensor], Tensor]:
        """The pooled tensors in feature order and the dense input, normalised if so built."""
        feats = self._features(pooled, dense)
        return feats, self.dense_norm(dense) if self.dense_norm is not None else dense

    def _features(self, pooled: Mapping[str, Tensor], dense: Tensor) -> list[Tensor]:
        """The pooled tensors in feature order, checked against ``dense``'s batch size."""
        if dense.dim() != 2 or dense.shape[1] != self.num_dense:
            raise InvalidArgument(
                f"dense must be (B, {self.num_dense}), got {tuple(dense.shape)}")
        batch = dense.shape[0]
        out = []
        for fname in self.feature_names:
            t = pooled.get(fname)
            if t is None:
                raise InvalidArgument(f"pooled embedding of feature {fname!r} is missing; "
                                      f"expected {self.feature_names}")
            if t.shape != (batch, self.sparse_dims[fname]):
                raise InvalidArgument(f"pooled[{fname!r}] must be ({batch}, "
                                      f"{self.sparse_dims[fname]}), got {tuple(t.shape)}")
            out.append(t)
        return out

    def _split(self, feats: list[Tensor]) -> tuple[list[Tensor], Tensor | None]:
        """(the embeddings, the sum of the ids' first-order weights ``(B,)``) of the pooled
        tensors; no weights without ``id_weights``."""
        if not self.id_weights:
            return feats, None
        return [t[:, :-1] for t in feats], torch.stack([t[:, -1] for t in feats], 1).sum(1)

    def _projections(self, dim: int) -> nn.ModuleDict:
        """Bias-free projections to ``dim`` for the tables whose dim differs."""
        return nn.ModuleDict({
            f"p{i}": nn.Linear(d, dim, bias=False)
            for i, d in enumerate(self.embedding_dims.values()) if d != dim})

    def _project(self, proj: nn.ModuleDict, feats: list[Tensor]) -> list[Tensor]:
        return [proj[f"p{i}"](t) if f"p{i}" in proj else t for i, t in enumerate(feats)]


class DLRM(_RecModel):
    """DLRM: bottom MLP over dense, pairwise dot interaction, top MLP.

    The interaction dim is ``bottom_mlp[-1]``; tables of another dim are projected to it.
    With ``num_dense == 0`` the bottom MLP is skipped and only embeddings interact.
    """

    def __init__(self, *, sparse_dims: Mapping[str, int], num_dense: int,
                 bottom_mlp: Sequence[int] = (64, 16), top_mlp: Sequence[int] = (64, 32),
                 dense_norm: bool = False) -> None:
        super().__init__(sparse_dims=sparse_dims, num_dense=num_dense, dense_norm=dense_norm)
        bottom = _check_sizes("bottom_mlp", bottom_mlp, allow_empty=False)
        top = _check_sizes("top_mlp", top_mlp)
        dim = bottom[-1]
        self.bottom = mlp(num_dense, bottom) if num_dense else None
        self.proj = self._projections(dim)
        n_vec = len(self.feature_names) + (1 if num_dense else 0)
        n_pairs = n_vec * (n_vec - 1) // 2
        self.top = mlp(n_pairs + (dim if num_dense else 0), top, out_dim=1)

    def forward(self, pooled: Mapping[str, Tensor], dense: Tensor) -> Tensor:
        feats, dense = self._inputs(pooled, dense)
        vecs = self._project(self.proj, feats)
        sources = _sources(pooled, self.feature_names, vecs)
        if self.bottom is not None:
            vecs, sources = [self.bottom(dense), *vecs], [None, *sources]
        top_in = dot_interaction(vecs, keep_first=self.bottom is not None, sources=sources)
        return self.top(top_in).squeeze(1)


class DeepFM(_RecModel):
    """DeepFM: first-order part + FM second-order part + deep MLP, summed.

    Fields are the sparse features plus (when ``num_dense > 0``) one field made from the dense
    vector by a linear layer. The FM dim is ``fm_dim`` or, when None, the largest embedding
    dim. The first-order part is the ids' own weights and a linear layer over the dense
    features with ``id_weights``, else a linear layer over every pooled vector and the dense.
    """

    def __init__(self, *, sparse_dims: Mapping[str, int], num_dense: int,
                 deep_mlp: Sequence[int] = (128, 64), fm_dim: int | None = None,
                 id_weights: bool = False, dense_norm: bool = False) -> None:
        super().__init__(sparse_dims=sparse_dims, num_dense=num_dense, id_weights=id_weights,
                         dense_norm=dense_norm)
        deep = _check_sizes("deep_mlp", deep_mlp)
        if fm_dim is not None and (not isinstance(fm_dim, int) or fm_dim <= 0):
            raise ConfigError(f"fm_dim must be a positive int or None, got {fm_dim!r}")
        dim = fm_dim or max(self.embedding_dims.values())
        self.proj = self._projections(dim)
        self.dense_field = nn.Linear(num_dense, dim) if num_dense else None
        n_fields = len(self.feature_names) + (1 if num_dense else 0)
        self.linear = nn.Linear(num_dense if id_weights else self.flat_dim, 1)
        self.deep = mlp(n_fields * dim, deep, out_dim=1)

    def forward(self, pooled: Mapping[str, Tensor], dense: Tensor) -> Tensor:
        feats, dense = self._inputs(pooled, dense)
        feats, id_weights = self._split(feats)
        if id_weights is None:
            first = self.linear(torch.cat([*feats, dense], dim=1)).squeeze(1)
        else:
            first = id_weights + self.linear(dense).squeeze(1)
        fields = self._project(self.proj, feats)
        if self.dense_field is not None:
            fields.append(self.dense_field(dense))
        v = torch.stack(fields, dim=1)                  # (B, F, D)
        fm = fm_second_order(v)
        deep = self.deep(v.flatten(1)).squeeze(1)
        return first + fm + deep


class CrossLayerV2(nn.Module):
    """One DCN-v2 cross layer: ``x_{l+1} = x0 * (W x_l + b) + x_l``; ``W = U V`` when low-rank."""

    def __init__(self, dim: int, rank: int | None = None) -> None:
        super().__init__()
        if rank is None:
            self.w: nn.Module = nn.Linear(dim, dim)
        else:
            self.w = nn.Sequential(nn.Linear(dim, rank, bias=False), nn.Linear(rank, dim))

    def forward(self, x0: Tensor, x: Tensor) -> Tensor:
        return x0 * self.w(x) + x


class DCNv2(_RecModel):
    """DCN-v2: a cross network over ``[pooled..., dense]`` plus a deep MLP.

    ``structure="stacked"`` feeds the cross output to the deep MLP; ``"parallel"`` runs both on
    the input and concatenates their outputs. ``cross_rank`` makes the cross weights low-rank.
    """

    def __init__(self, *, sparse_dims: Mapping[str, int], num_dense: int,
                 cross_layers: int = 3, cross_rank: int | None = None,
                 deep_mlp: Sequence[int] = (128, 64), structure: str = "stacked",
                 dense_norm: bool = False) -> None:
        super().__init__(sparse_dims=sparse_dims, num_dense=num_dense, dense_norm=dense_norm)
        if not isinstance(cross_layers, int) or cross_layers < 1:
            raise ConfigError(f"cross_layers must be an int >= 1, got {cross_layers!r}")
        if cross_rank is not None and (not isinstance(cross_rank, int) or cross_rank <= 0):
            raise ConfigError(f"cross_rank must be a positive int or None, got {cross_rank!r}")
        if structure not in ("stacked", "parallel"):
            raise ConfigError(f"structure must be 'stacked' or 'parallel', got {structure!r}")
        deep = _check_sizes("deep_mlp", deep_mlp)
        d0 = self.flat_dim
        self.structure = structure
        self.cross = nn.ModuleList(CrossLayerV2(d0, cross_rank) for _ in range(cross_layers))
        self.deep = mlp(d0, deep)
        deep_out = deep[-1] if deep else d0
        head_in = deep_out if structure == "stacked" else d0 + deep_out
        self.head = nn.Linear(head_in, 1)

    def forward(self, pooled: Mapping[str, Tensor], dense: Tensor) -> Tensor:
        feats, dense = self._inputs(pooled, dense)
        x0 = torch.cat([*feats, dense], dim=1)
        x = x0
        for layer in self.cross:
            x = layer(x0, x)
        if self.structure == "stacked":
            out = self.deep(x)
        else:
            out = torch.cat([x, self.deep(x0)], dim=1)
        return self.head(out).squeeze(1)


class WideAndDeep(_RecModel):
    """Wide&Deep: a linear (wide) part and a deep MLP over ``[embeddings..., dense]``, summed;
    with ``id_weights`` the wide part is the ids' own weights and a linear layer over dense."""

    def __init__(self, *, sparse_dims: Mapping[str, int], num_dense: int,
                 deep_mlp: Sequence[int] = (128, 64), id_weights: bool = False,
                 dense_norm: bool = False) -> None:
        super().__init__(sparse_dims=sparse_dims, num_dense=num_dense, id_weights=id_weights,
                         dense_norm=dense_norm)
        deep = _check_sizes("deep_mlp", deep_mlp)
        self.wide = nn.Linear(num_dense if id_weights else self.flat_dim, 1)
        self.deep = mlp(self.flat_dim, deep, out_dim=1)

    def forward(self, pooled: Mapping[str, Tensor], dense: Tensor) -> Tensor:
        feats, dense = self._inputs(pooled, dense)
        feats, id_weights = self._split(feats)
        x = torch.cat([*feats, dense], dim=1)
        wide = self.wide(x if id_weights is None else dense).squeeze(1)
        if id_weights is not None:
            wide = wide + id_weights
        return wide + self.deep(x).squeeze(1)


class LogisticRegression(_RecModel):
    """Logistic regression: one linear layer over ``[embeddings..., dense]`` (a convex model
    in its dense weights, for ``--sync gadmm``)."""

    def __init__(self, *, sparse_dims: Mapping[str, int], num_dense: int,
                 dense_norm: bool = False) -> None:
        super().__init__(sparse_dims=sparse_dims, num_dense=num_dense, dense_norm=dense_norm)
        self.linear = nn.Linear(self.flat_dim, 1)

    def forward(self, pooled: Mapping[str, Tensor], dense: Tensor) -> Tensor:
        feats, dense = self._inputs(pooled, dense)
        return self.linear(torch.cat([*feats, dense], dim=1)).squeeze(1)


MODELS: dict[str, type[_RecModel]] = {
    "dlrm": DLRM,
    "deepfm": DeepFM,
    "dcnv2": DCNv2,
    "wide_deep": WideAndDeep,
    "lr": LogisticRegression,
}

# The architecture keywords each model accepts (besides sparse_dims and num_dense).
_ARCH_PARAMS: dict[str, tuple[str, ...]] = {
    "dlrm": ("bottom_mlp", "top_mlp", "dense_norm"),
    "deepfm": ("deep_mlp", "fm_dim", "id_weights", "dense_norm"),
    "dcnv2": ("cross_layers", "cross_rank", "deep_mlp", "structure", "dense_norm"),
    "wide_deep": ("deep_mlp", "id_weights", "dense_norm"),
    "lr": ("dense_norm",),
}


def build_model(name: str, *, sparse_dims: Mapping[str, int], num_dense: int,
                **arch: Any) -> nn.Module:
    """Build the model ``name`` (dlrm, deepfm, dcnv2, wide_deep, lr) with its arch keywords."""
    cls = MODELS.get(name)
    if cls is None:
        raise ConfigError(f"unknown model {name!r}; available: {sorted(MODELS)}")
    unknown = sorted(set(arch) - set(_ARCH_PARAMS[name]))
    if unknown:
        raise ConfigError(f"model {name!r} does not take {unknown}; "
                          f"it takes {list(_ARCH_PARAMS[name])}")
    return cls(sparse_dims=sparse_dims, num_dense=num_dense, **arch)

# (lr, initial accumulator) of the PS tables' optimizer; per model for Adagrad, measured with
# `bench quality` and `persimmon train` on the Criteo-shaped profile: an accumulator of 1e-4
# gains DeepFM and costs DLRM, DCN-v2 and Wide&Deep 0.011-0.014 on the Criteo-shaped data;
# DeepFM's lr 0.02 (was 0.2) gains +0.017 mean AUC over bench quality's seven data sets
# (six split by time; both paired seeds, every set but one) and +0.001/+0.003 on the
# Criteo-shaped profile (docs/benchmarks.md#quality)
_PS_OPTIMIZER_DEFAULT = (0.05, 0.0)
_PS_ADAGRAD = {"deepfm": (0.02, 1e-4)}


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """Which model and its architecture; fields a model does not use are ignored by it."""

    name: str = "dlrm"
    bottom_mlp: list[int] = field(default_factory=lambda: [64, 16])
    top_mlp: list[int] = field(default_factory=lambda: [64, 32])
    deep_mlp: list[int] = field(default_factory=lambda: [128, 64])
    cross_layers: int = 3
    cross_rank: int | None = None
    structure: str = "stacked"
    fm_dim: int | None = None
    id_weights: bool = False  # deepfm, wide_deep: a per-id weight column in every table
    dense_norm: bool = False  # standardise the dense input with statistics in the state dict

    def __post_init__(self) -> None:
        if self.name not in MODELS:
            raise ConfigError(f"unknown model {self.name!r}; available: {sorted(MODELS)}")
        _check_sizes("bottom_mlp", self.bottom_mlp, allow_empty=False)
        _check_sizes("top_mlp", self.top_mlp)
        _check_sizes("deep_mlp", self.deep_mlp)
        if self.cross_layers < 1:
            raise ConfigError(f"cross_layers must be >= 1, got {self.cross_layers}")
        if self.cross_rank is not None and self.cross_rank <= 0:
            raise ConfigError(f"cross_rank must be positive or None, got {self.cross_rank}")
        if self.structure not in ("stacked", "parallel"):
            raise ConfigError(f"structure must be 'stacked' or 'parallel', got {self.structure!r}")
        if self.fm_dim is not None and self.fm_dim <= 0:
            raise ConfigError(f"fm_dim must be positive or None, got {self.fm_dim}")

    def arch(self) -> dict[str, Any]:
        """The keywords of this config that the named model takes."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {k: values[k] for k in _ARCH_PARAMS[self.name]}

    def table_dim(self, embedding_dim: int) -> int:
        """The PS table dim this model needs for embeddings of ``embedding_dim``: one more
        when its tables hold each id's first-order weight."""
        return embedding_dim + 1 if self.uses_id_weights else embedding_dim

    def ps_optimizer_defaults(self, kind: str) -> tuple[float, float]:
        """(lr, initial accumulator) of the PS tables' optimizer ``kind`` that ``persimmon
        train`` uses for this model unless told (docs/benchmarks.md#quality): with Adagrad
        DeepFM learns better from a small starting accumulator and a larger lr, the other
        models from none; the other optimizers were not measured per model."""
        return _PS_ADAGRAD.get(self.name, _PS_OPTIMIZER_DEFAULT) if kind == "adagrad" \
            else _PS_OPTIMIZER_DEFAULT

    @property
    def uses_id_weights(self) -> bool:
        return self.id_weights and "id_weights" in _ARCH_PARAMS[self.name]

    def build(self, *, sparse_dims: Mapping[str, int], num_dense: int) -> nn.Module:
        return build_model(self.name, sparse_dims=sparse_dims, num_dense=num_dense, **self.arch())
