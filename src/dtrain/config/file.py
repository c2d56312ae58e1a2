"""`--config FILE.toml`: a subcommand's flags read from a TOML file.

The file holds flat keys named like the subcommand's long flags, with dashes or
underscores (``grad-accumulation = 2``, ``global_batch_size = 64``); switches take
``true`` or ``false``, list flags such as ``--devices`` an array or a comma-separated
string. Flags given on the command line override the file. The keys are not listed
anywhere: they come from the parser's own actions, so a flag added later can be set from a
file without touching this module.

`dtrain run`, `dtrain demo` and the demo's workers (which re-parse the launcher's command
line) all go through :func:`parse_with_config`, so every process reads the file the same way.
"""

from __future__ import annotations

import argparse
import difflib
import re
import tomllib
from pathlib import Path

from dtrain.errors import ConfigError

DEST = "config"

PLAIN: dict[object, tuple[type, ...]] = {int: (int,), float: (int, float), str: (str,)}
"""The TOML values each built-in converter takes (a whole number is a float too)."""

KINDS = {bool: "a boolean", int: "an integer", float: "a float", str: "a string", list: "an array"}
"""TOML's names of the types tomllib reads, but tables and dates, for messages."""


def add_config_arg(parser: argparse.ArgumentParser) -> None:
    """Add ``--config FILE.toml`` to `parser` (read by :func:`parse_with_config`)."""
    parser.add_argument(
        "--config",
        dest=DEST,
        type=Path,
        default=None,
        metavar="FILE.toml",
        help="Read flags from a TOML file of flat keys named like the long flags "
        "(nproc = 2, global-batch-size = 64, cpu = true, devices = [0, 1]); flags given on "
        "the command line override the file.",
    )


def parse_with_config(
    parser: argparse.ArgumentParser, argv: list[str] | None
) -> argparse.Namespace:
    """Parse `argv`; if it names ``--config FILE``, parse it again over the file's values.

    The file's values become the defaults of the parser that holds ``--config`` (the chosen
    subcommand's parser when `parser` has subcommands), so the command line overrides them.
    That parser's defaults stay changed: build a fresh parser for each command line.
    Raises ConfigError for a missing or malformed file, an unknown key or a wrong value.
    """
    args = parser.parse_args(argv)
    path = getattr(args, DEST, None)
    if path is None:
        return args
    target = chosen_parser(parser, args)
    target.set_defaults(**read_config(Path(path), target))
    return parser.parse_args(argv)


def read_config(path: Path, parser: argparse.ArgumentParser) -> dict[str, object]:
    """The values of the TOML file `path` for `parser`'s flags, keyed by their ``dest``.

    Every value is checked and converted as the flag's own type would convert it; a
    ConfigError names the key, the file, its line and what was expected.
    """
    text = _read_text(path)
    table = _parse_toml(path, text)
    flags, refused = _keys(parser)
    values: dict[str, object] = {}
    given_as: dict[str, str] = {}
    for key, value in table.items():
        where = _where(path, text, key)
        if isinstance(value, dict):
            raise ConfigError(
                f"{key!r} in {where} is a table, but a config file holds flat keys only "
                f"(nproc = 2, not [{key}] sections or dotted keys); move its keys to the top "
                "level."
            )
        if key in refused:
            raise ConfigError(f"{key!r} in {where} {refused[key]}")
        if key not in flags:
            raise ConfigError(_unknown(key, where, parser, flags))
        action = flags[key]
        if action.dest in given_as:
            raise ConfigError(
                f"{given_as[action.dest]!r} and {key!r} in {path} both set "
                f"{_long_flag(action)}; keep one of them."
            )
        given_as[action.dest] = key
        values[action.dest] = _convert(action, value, key, where)
    return values


def _read_text(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(
            f"The config file {path} does not exist; check the path (a relative path starts "
            f"from the current directory, {Path.cwd()})."
        ) from None
    except OSError as e:
        raise ConfigError(
            f"The config file {path} cannot be read ({e.strerror}); give a readable TOML file."
        ) from None
    except UnicodeDecodeError:
        raise ConfigError(
            f"The config file {path} is not UTF-8 text; save it as UTF-8, as TOML requires."
        ) from None


def _parse_toml(path: Path, text: str) -> dict[str, object]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        # tomllib's message ends with "(at line L, column C)"
        raise ConfigError(
            f"The config file {path} is not valid TOML: {e}. Fix that line; a config file "
            'holds lines such as nproc = 2 or strategy = "ddp".'
        ) from None


def _where(path: Path, text: str, key: str) -> str:
    """'FILE, line N' for `key`: tomllib does not keep line numbers, so look for the key
    at the start of a line (bare or quoted, before '=', a dot, or as a [table] name)."""
    name = re.escape(key)
    pattern = rf"""^[ \t]*\[*[ \t]*(?:{name}|"{name}"|'{name}')[ \t]*[=.\]]"""
    match = re.search(pattern, text, re.MULTILINE)
    if match is None:
        return str(path)
    return f"{path}, line {text.count(chr(10), 0, match.start()) + 1}"


def parser_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The flags and arguments of `parser` (not those of its subcommands' parsers)."""
    # argparse has no public list of a parser's actions; `_actions` is the one it iterates.
    # This is the one place dtrain reads it.
    return list(parser._actions)


def chosen_parser(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> argparse.ArgumentParser:
    """The innermost parser `args` went through (the chosen subcommand's, if any)."""
    for action in parser_actions(parser):
        if isinstance(action, argparse._SubParsersAction):
            chosen = getattr(args, action.dest, None)
            if chosen is not None:
                return chosen_parser(action.choices[chosen], args)
    return parser


def _long_flag(action: argparse.Action) -> str | None:
    return next((s for s in action.option_strings if s.startswith("--")), None)


def _keys(
    parser: argparse.ArgumentParser,
) -> tuple[dict[str, argparse.Action], dict[str, str]]:
    """The keys that set a flag (each long option without its dashes, with '-' or '_': a
    flag holding a value, or a true/false switch), and the names a file might try but may
    not set, with the end of the sentence saying why (--help, --version and a subcommand
    are neither)."""
    flags: dict[str, argparse.Action] = {}
    refused = {
        DEST: "would name another config file; merge the two files into one, or give the "
        "other file's flags on the command line."
    }
    for action in parser_actions(parser):
        if action.dest in (DEST, argparse.SUPPRESS) or isinstance(
            action, argparse._SubParsersAction
        ):
            continue
        if not action.option_strings:
            name = action.metavar or action.dest
            refused[action.dest.replace("_", "-")] = refused[action.dest] = (
                f"is not a flag but the command line's {name}; give it on the command line "
                f"after the flags ({parser.prog} [flags] {name} ...)."
            )
        elif not _long_flag(action):
            switch = "/".join(action.option_strings)
            refused[action.dest] = (
                f"is the short switch {switch}, which a config file cannot set; give {switch} "
                "on the command line."
            )
        elif action.nargs != 0 or isinstance(action.const, bool):
            for option in action.option_strings:
                if option.startswith("--"):
                    flags[option[2:]] = flags[option[2:].replace("-", "_")] = action
    return flags, refused


def _unknown(
    key: str, where: str, parser: argparse.ArgumentParser, flags: dict[str, argparse.Action]
) -> str:
    known = sorted({_long_flag(action)[2:] for action in flags.values()})
    close = difflib.get_close_matches(key.replace("_", "-"), known, n=3)
    hint = (
        f"Did you mean {' or '.join(close)}?"
        if close
        else f"The known keys are: {', '.join(known)}."
    )
    return (
        f"Unknown key {key!r} in {where}: {parser.prog} has no flag --{key}. {hint} "
        f"Keys are the long flags without their dashes (see {parser.prog} --help)."
    )


def _kind(value: object) -> str:
    """How TOML would name `value`'s type, for messages."""
    name = KINDS.get(type(value))
    return f"{name} ({value!r})" if name else f"a date or time ({value})"


def _is_list_flag(action: argparse.Action) -> bool:
    """Whether the flag's converter turns comma-separated text into a list (--devices,
    --blocks, ...). argparse keeps only the converter, so ask it: such converters read
    the empty text as an empty list, and any other converter gives something else."""
    convert = action.type
    if convert in (None, str, int, float) or not callable(convert):
        return False
    try:
        return isinstance(convert(""), list)
    except Exception:  # a converter refusing the empty text is not a list converter
        return False


def _convert(action: argparse.Action, value: object, key: str, where: str) -> object:
    """`value` converted as the command line would convert the flag's text."""
    if action.nargs == 0:  # a switch such as --cpu
        if not isinstance(value, bool):
            raise _wrong(key, where, "true or false", value)
        return action.const if value else action.default
    if action.nargs in ("*", "+") or isinstance(action.nargs, int):
        if not isinstance(value, list):
            raise _wrong(key, where, "an array", value)
        return [_convert_one(action, item, key, where) for item in value]
    return _convert_one(action, value, key, where)


def _convert_one(action: argparse.Action, value: object, key: str, where: str) -> object:
    convert = action.type or str
    # TOML's true is no number, name or path (switches came first); the value a custom
    # converter takes is checked by _text_for
    if isinstance(value, bool) or not isinstance(value, PLAIN.get(convert, object)):
        raise _wrong(key, where, _expected(action), value)
    if convert in PLAIN:
        result = convert(value)
    else:
        text = _text_for(action, value, key, where)
        try:
            result = convert(text)
        except (argparse.ArgumentTypeError, TypeError, ValueError) as e:
            raise ConfigError(f"{key!r} in {where}: {e}; fix the value in the file.") from None
    if action.choices is not None and result not in action.choices:
        raise _wrong(key, where, _expected(action), value)
    if isinstance(result, str) and convert is not str:
        # argparse converts a string default itself; hand it the text, so it is converted once
        return text
    return result


def _text_for(action: argparse.Action, value: object, key: str, where: str) -> str:
    """The command-line text a custom converter reads: a string, or an array's items
    joined by commas for a list flag."""
    if isinstance(value, str):
        return value
    if isinstance(value, int):  # a count for a flag that also takes text (--nnodes 2 or 2:4)
        return str(value)
    items_ok = isinstance(value, list) and all(
        isinstance(item, (str, int)) and not isinstance(item, bool) for item in value
    )
    if not (items_ok and _is_list_flag(action)):
        raise _wrong(key, where, _expected(action), value)
    return ",".join(str(item) for item in value)


def _expected(action: argparse.Action) -> str:
    if action.choices is not None:
        return "one of " + ", ".join(str(c) for c in action.choices)
    if _is_list_flag(action):
        return "an array of names or integers, or a comma-separated string"
    return {int: "an integer", float: "a number"}.get(action.type, "a string")


def _wrong(key: str, where: str, expected: str, value: object) -> ConfigError:
    return ConfigError(
        f"{key!r} in {where} must be {expected}, but it is {_kind(value)}; fix the value in "
        "the file."
    )
