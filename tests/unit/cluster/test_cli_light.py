"""``persimmon ps``/``loader`` parse with only their own module (fast restarts)."""

from __future__ import annotations

import pytest

from services.cli import _command_of, build_parser


def test_command_of_skips_the_log_level() -> None:
    assert _command_of(["--log-level", "WARNING", "ps", "--shard-id", "1"]) == "ps"
    assert _command_of(["bench", "recovery"]) == "bench"
    assert _command_of(["--help"]) is None


def test_light_parser_has_only_its_command() -> None:
    args = build_parser("ps").parse_args(["ps", "--shard-id", "1", "--num-shards", "2"])
    assert args.command == "ps"
    with pytest.raises(SystemExit):
        build_parser("ps").parse_args(["worker", "--ps", "a:1"])
    assert build_parser().parse_args(["worker", "--ps", "a:1"]).command == "worker"


def test_bench_without_a_checkout_is_a_clear_error(monkeypatch, capsys) -> None:
    import services.cli as cli

    monkeypatch.setattr(cli, "_import_bench", lambda: None)
    assert cli.main(["bench", "train", "--rows", "8"]) == 2
    err = capsys.readouterr().err
    assert "persimmon: error:" in err and "python -m bench train" in err


def test_services_run_as_modules_without_the_cli() -> None:
    """``python -m services.ps|loader|worker`` run their own command; none imports the CLI
    (nor the benchmarks). The three run in one interpreter: the check after each catches the
    one that pulled the CLI in."""
    import subprocess
    import sys

    runs = (("services.ps", ["--log-level", "WARNING", "--check-config"]),
            ("services.loader", ["loader", "--source", "synthetic:8", "--check-config"]),
            ("services.worker", ["--ps", "a:1", "--loader", "l:1", "--check-config"]))
    code = "import sys\n" + "".join(
        f"from {module}.__main__ import main\n"
        f"assert main({argv!r}) == 0, {module!r}\n"
        f"assert 'services.cli' not in sys.modules and 'bench' not in sys.modules, {module!r}\n"
        for module, argv in runs)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    proc = subprocess.run([sys.executable, "-m", "services.worker", "--ps", "a:1",
                           "--check-config"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "give --loader" in proc.stderr
