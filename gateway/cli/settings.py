"""Option values from a TOML file and the environment, below the command line.

Precedence: command line, then ``TAP_UPR_GATEWAY_<OPTION>`` environment
variables (``--state-dir`` is ``TAP_UPR_GATEWAY_STATE_DIR``), then the
``--config`` file, then the built-in defaults. The file (read with the
standard library's ``tomllib``) holds options by their long names, with
dashes or underscores: top-level keys apply to every command that has the
option, a ``[serve]`` (or ``[node]``, ...) table to that command only::

    log-format = "json"

    [serve]
    tap-upstream = "node1:11210"
    state-dir = "/var/lib/tap-upr-gateway"
    users = "/etc/tap-upr-gateway/users"

Values go through the option's own parser, so a bad one is refused with
the same one-line message as on the command line, naming where it came
from. A secret (a password) therefore never needs the command line.
"""

from __future__ import annotations

import argparse
import os
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from gateway.cli.args import DEPRECATION_NOTES, RenamedOption

ENV_PREFIX = "TAP_UPR_GATEWAY_"
_NOT_SETTABLE = {"help", "config", "version"}


class SettingsError(Exception):
    """A value from the file or the environment that cannot be used."""


def find_config(argv: Sequence[str]) -> Path | None:
    """``--config FILE`` anywhere on the command line (or ``--config=FILE``)."""
    for index, word in enumerate(argv):
        if word == "--config" and index + 1 < len(argv):
            return Path(argv[index + 1])
        if word.startswith("--config="):
            return Path(word.partition("=")[2])
    return None


def find_command(argv: Sequence[str], commands: Mapping[str, Any]) -> str | None:
    skip = False
    for word in argv:
        if skip:
            skip = False
            continue
        if word == "--config":
            skip = True
        elif word in commands:
            return word
    return None


def read_config(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as handle:
            return tomllib.load(handle)
    except OSError as exc:
        raise SettingsError(f"--config {path}: cannot read it: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"--config {path}: not valid TOML: {exc}") from None


def _settable(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Long option name (without dashes) -> action, for options a setting may fill."""
    out: dict[str, argparse.Action] = {}
    for action in parser._actions:
        longs = [o for o in action.option_strings if o.startswith("--")]
        if longs and action.dest not in _NOT_SETTABLE:
            out[longs[0][2:]] = action
    return out


def _convert(action: argparse.Action, value: Any, where: str) -> Any:
    option = next(o for o in action.option_strings if o.startswith("--"))
    if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
        if isinstance(value, bool):
            truth = value
        elif str(value).lower() in ("1", "true", "yes", "on"):
            truth = True
        elif str(value).lower() in ("0", "false", "no", "off", ""):
            truth = False
        else:
            raise SettingsError(f"{where}: {option} is true or false, not {value!r}")
        return truth if isinstance(action, argparse._StoreTrueAction) else not truth
    if isinstance(action, argparse._CountAction):
        try:
            return int(value)
        except (TypeError, ValueError):
            raise SettingsError(f"{where}: {option} is a count, not {value!r}") from None
    if isinstance(value, list):
        value = ",".join(str(v) for v in value)
    text = str(value).lower() if isinstance(value, bool) else str(value)
    try:
        converted = action.type(text) if callable(action.type) else text
    except (argparse.ArgumentTypeError, ValueError) as exc:
        raise SettingsError(f"{where}: {option}: {exc}") from None
    if action.choices is not None and converted not in action.choices:
        choices = ", ".join(map(str, action.choices))
        raise SettingsError(f"{where}: {option}: {text!r} is not one of {choices}")
    return converted


def _key(name: str) -> str:
    return name.replace("_", "-")


def apply_settings(
    command: str,
    parser: argparse.ArgumentParser,
    config: Mapping[str, Any] | None,
    config_path: Path | None,
    environ: Mapping[str, str],
    known_anywhere: set[str],
) -> None:
    """Make file and environment values the defaults of ``parser`` (``command``'s)."""
    settable = _settable(parser)
    values: dict[str, tuple[argparse.Action, Any, str]] = {}
    if config is not None:
        for key, value in config.items():
            if isinstance(value, dict):
                continue  # another command's table
            name = _key(key)
            if name in settable:
                values[name] = (settable[name], value, f"--config {config_path}: {key}")
            elif name not in known_anywhere:
                raise SettingsError(f"--config {config_path}: {key!r} is no option of any command")
        table = config.get(command, {})
        if not isinstance(table, dict):
            raise SettingsError(f"--config {config_path}: [{command}] must be a table")
        for key, value in table.items():
            name = _key(key)
            if name not in settable:
                raise SettingsError(
                    f"--config {config_path}: [{command}] {key!r} is no option of {command}"
                )
            values[name] = (settable[name], value, f"--config {config_path}: [{command}] {key}")
    for name, action in settable.items():
        variable = ENV_PREFIX + name.upper().replace("-", "_")
        if variable in environ:
            values[name] = (action, environ[variable], f"${variable}")
    defaults: dict[str, Any] = {}
    notes: list[str] = []
    for action, value, where in values.values():
        defaults[action.dest] = _convert(action, value, where)
        action.required = False  # the setting provides it
        if isinstance(action, RenamedOption):
            notes.append(action.notice(command, defaults[action.dest], where))
    if notes:
        defaults[DEPRECATION_NOTES] = notes
    parser.set_defaults(**defaults)


def known_options(commands: Mapping[str, argparse.ArgumentParser]) -> set[str]:
    return {name for parser in commands.values() for name in _settable(parser)}


def load(
    argv: Sequence[str],
    commands: Mapping[str, argparse.ArgumentParser],
    environ: Mapping[str, str] | None = None,
) -> None:
    """Apply the config file and environment to the command ``argv`` names, if any."""
    command = find_command(argv, commands)
    if command is None:
        return
    path = find_config(argv)
    config = read_config(path) if path is not None else None
    apply_settings(
        command,
        commands[command],
        config,
        path,
        os.environ if environ is None else environ,
        known_options(commands),
    )
