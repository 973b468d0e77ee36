"""The ``bootseer`` command line: each subcommand comes from the module the table names,
and running one command loads only that command's module."""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys

import pytest

from bootseer import cli


@pytest.mark.parametrize("command", sorted(cli.SUBCOMMANDS))
def test_each_command_is_registered_by_the_module_the_table_names(command: str) -> None:
    parser = argparse.ArgumentParser()
    subparsers = parser.add_subparsers(dest="command")
    importlib.import_module(cli.SUBCOMMANDS[command]).register(subparsers)
    assert command in subparsers.choices


def test_every_command_module_is_in_the_table() -> None:
    parser = cli.build_parser()
    (subparsers,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert sorted(subparsers.choices) == sorted(cli.SUBCOMMANDS)


@pytest.mark.parametrize(
    "argv, command",
    [
        (["rpull", "x"], "rpull"),
        (["--log-level", "debug", "ckpt", "mount"], "ckpt"),
        (["--log-format=json", "deps", "ls"], "deps"),
        (["--version"], None),
        ([], None),
    ],
)
def test_the_command_is_found_past_the_global_options(argv: list[str], command: str | None) -> None:
    assert cli._command_of(argv) == command


def test_running_one_command_does_not_import_the_others() -> None:
    # rpull runs in a job's start-up path: it must not pay for pyfuse3 or boto3.
    probe = (
        "import sys; from bootseer import cli\n"
        "try:\n    cli.main(['rpull', '--help'])\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in ('pyfuse3', 'boto3', 'bootseer.ckptmount.cli', 'bootseer.depsnap.cli') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.strip().splitlines()[-1] == "[]"
