"""Settings of model exports from a running job: every bad combination is a clear
ConfigError before anything starts."""

from __future__ import annotations

import argparse
import math
from typing import Any

import pytest
from serve_versions import MODEL, SPEC

from services.common.errors import ConfigError
from services.serve.online import OnlineExport
from services.worker.config import TrainerConfig
from services.worker.service import check_worker_args


@pytest.mark.parametrize(("settings", "message"), [
    ({"export_dir": "m"}, "both export_dir and a cadence"),
    ({"export_every_steps": 5}, "both export_dir and a cadence"),
    ({"export_every_s": 2.0}, "both export_dir and a cadence"),
    ({"export_dir": "m", "export_every_steps": -1}, ">= 0"),
    ({"export_dir": "m", "export_every_s": math.nan}, ">= 0"),
    ({"export_dir": "m", "export_every_steps": 5, "export_keep": -1}, "export_keep"),
    ({"export_dir": "m", "export_every_steps": 5, "export_full_every": 0}, "export_full_every"),
])
def test_bad_export_settings_are_refused(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        TrainerConfig(**settings)


def test_export_settings_carry_over() -> None:
    config = TrainerConfig(export_dir="m", export_every_s=30.0, export_keep=3,
                           export_full_every=4)
    export = OnlineExport.from_config(config, checkpoint_dir="c", ps_admin_urls=["http://x"],
                                      spec=SPEC, model=MODEL, read_shards=lambda r, c: {})
    assert (export.model_dir, export.every_steps, export.every_s, export.keep,
            export.full_every) == ("m", 0, 30.0, 3, 4)
    with pytest.raises(ConfigError, match="admin URLs"):
        OnlineExport(model_dir="m", checkpoint_dir="c", ps_admin_urls=[], spec=SPEC,
                     model=MODEL, read_shards=lambda r, c: {}, every_steps=2)
    with pytest.raises(ConfigError, match="every_steps or every_s"):
        OnlineExport(model_dir="m", checkpoint_dir="c", ps_admin_urls=["http://x"],
                     spec=SPEC, model=MODEL, read_shards=lambda r, c: {})


def test_a_worker_refuses_export_settings() -> None:
    args = argparse.Namespace(ps="h:1", loader="h:2", checkpoint_dir=None, ps_admin=None,
                              resume=False)
    config = TrainerConfig(export_dir="m", export_every_steps=5)
    with pytest.raises(ConfigError, match="persimmon train --export-dir"):
        check_worker_args(args, config, None)
