"""``persimmon token``: a fresh valid token printed, or written into an env file (0600) that
keeps its token unless rotated."""

from __future__ import annotations

import stat

from services.cli import main
from services.common.auth import load_token


def test_token_prints_a_valid_fresh_token(capsys):
    assert main(["token"]) == 0
    first = capsys.readouterr().out.strip()
    assert main(["token"]) == 0
    second = capsys.readouterr().out.strip()
    assert load_token(first) == first and len(first) >= 40 and first != second


def test_token_writes_an_env_file_and_keeps_its_token(tmp_path, capsys):
    env = tmp_path / ".env"
    env.write_text("OTHER=1\n")
    assert main(["token", "--env-file", str(env)]) == 0
    lines = env.read_text().splitlines()
    assert lines[0] == "OTHER=1" and lines[1].startswith("PERSIMMON_TOKEN=")
    assert stat.S_IMODE(env.stat().st_mode) == 0o600
    token = lines[1].split("=", 1)[1]
    assert load_token(environ={"PERSIMMON_TOKEN": token}) == token
    assert main(["token", "--env-file", str(env)]) == 0
    assert "already set" in capsys.readouterr().out and env.read_text().splitlines() == lines
    assert main(["token", "--env-file", str(env), "--rotate"]) == 0
    rotated = env.read_text().splitlines()
    assert rotated[0] == "OTHER=1" and len(rotated) == 2 and rotated[1] != lines[1]
