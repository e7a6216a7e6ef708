"""Hydra's errors about the command line as one line each: an override it cannot parse, or one
whose value does not fit its key's type.

Owns: `one_line` (either, for what Hydra raised), `bad_override` (which override of a command
Hydra's grammar rejects, and why) and `typed_line` (a composition error -- a value of the wrong
type, a key that is not there -- as `KEY: allowed TYPE, got VALUE`). Does not own: catching them
(harness.cli, harness.sweep), the line for any other config error (`harness.config`'s
`config_error_line`, which asks `typed_line` first), or the schema that gives the types.

    bad_override(["placement=[resident", "run.quiet=true"])
    # "cannot parse the override 'placement=[resident': no viable alternative at input '[resident' (...)"
"""
from __future__ import annotations

import dataclasses
import enum
import typing
from collections.abc import Sequence
from typing import Any

GRAMMAR = ("key=value; a sweep key=a,b or key=range(1,4); a list key=[a,b]: "
           "https://hydra.cc/docs/advanced/override_grammar/basic")
_TYPE_WORDS = {float: "a number (float)", int: "an integer", bool: "true or false", str: "a string"}


def one_line(exc: BaseException, overrides: Sequence[str]) -> str | None:
    """What Hydra raised about a command with these overrides, in one line; None when it is not a
    parse or composition error this knows (then Hydra's own words stand)."""
    from hydra.errors import MissingConfigException, OverrideParseException

    if isinstance(exc, OverrideParseException):
        return bad_override(overrides) or f"cannot parse the overrides: {_first_line(exc)} ({GRAMMAR})"
    if isinstance(exc, MissingConfigException) and exc.missing_cfg_file and exc.options is not None:
        group, _, name = exc.missing_cfg_file.rpartition("/")       # a group option that is not there
        return f"{group}={name}: no such option; allowed: {', '.join(sorted(exc.options))}"
    return typed_line(exc)


def bad_override(overrides: Sequence[str]) -> str | None:
    """The first override Hydra's override grammar rejects, with its reason, in one line; None
    when every one parses."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser = OverridesParser.create()
    for override in overrides:
        try:
            parser.parse_overrides([override])
        except OverrideParseException as exc:
            return f"cannot parse the override {override!r}: {_first_line(exc)} ({GRAMMAR})"
    return None


def typed_line(exc: BaseException) -> str | None:
    """A Hydra composition error as one line naming the key, what it allows and the value given;
    None when `exc` is not one this knows."""
    from omegaconf.errors import ConfigAttributeError, ValidationError

    cause = exc.__cause__
    key = getattr(cause, "full_key", None)
    if isinstance(cause, ValidationError) and key:
        allowed = _allowed(getattr(cause, "object_type", None), getattr(cause, "key", None))
        said = f"allowed {allowed}" if allowed else _first_line(cause)
        return f"{key}: {said}, got {_shown(getattr(cause, 'value', None))}"
    if isinstance(cause, ConfigAttributeError) and key:
        return f"{key}: no such key ({_first_line(cause)}; to add a key: +{key}=VALUE)"
    return None


def _allowed(owner: Any, key: Any) -> str | None:
    """What the schema dataclass `owner` allows for field `key` ("a number", "an integer or null",
    "one of ['a', 'b']"); None when it cannot tell."""
    if not (dataclasses.is_dataclass(owner) and isinstance(key, str)):
        return None
    try:
        hint = typing.get_type_hints(owner).get(key)
    except Exception:  # noqa: BLE001 -- a schema whose annotations do not resolve: say what OmegaConf said
        return None
    args = typing.get_args(hint)
    nullable = type(None) in args
    if nullable:
        hint = next((a for a in args if a is not type(None)), None)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        word = f"one of {[m.name for m in hint]}"
    else:
        word = _TYPE_WORDS.get(hint)
    return None if word is None else word + (" or null" if nullable else "")


def _shown(value: Any) -> str:
    return repr(value) if isinstance(value, str) else str(value)


def _first_line(exc: BaseException) -> str:
    text = str(getattr(exc, "msg", None) or exc)
    return text.strip().splitlines()[0] if text.strip() else type(exc).__name__
