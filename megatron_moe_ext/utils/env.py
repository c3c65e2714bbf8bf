"""Every environment variable the package reads, parsed in one place.

Each reader takes the variable's name and its default (returned where the variable is unset)
and raises ValueError naming the variable, its value and what is allowed for anything else,
so a misspelt value never falls back to the default silently. An empty value is refused too:
unset the variable to get its default. The README lists the variables the package reads.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import TypeVar

#: The spellings of a flag, case-insensitive.
TRUE_SPELLINGS = ("1", "true", "on", "yes")
FALSE_SPELLINGS = ("0", "false", "off", "no")

_Default = TypeVar("_Default")


def _fail(name: str, raw: str, allowed: str) -> ValueError:
    return ValueError(f"environment variable {name}={raw!r} is invalid: {allowed}")


def _raw(name: str) -> str | None:
    """The variable's value without surrounding blanks, or None where it is unset."""
    raw = os.environ.get(name)
    return None if raw is None else raw.strip()


def env_flag(name: str, default: bool, *, fallback: str | None = None) -> bool:
    """A boolean: 1/true/on/yes or 0/false/off/no, case-insensitive. `fallback` names an older
    variable read (with the same rules) only where `name` is unset."""
    raw = _raw(name)
    if raw is None:
        return default if fallback is None else env_flag(fallback, default)
    if raw.lower() in TRUE_SPELLINGS:
        return True
    if raw.lower() in FALSE_SPELLINGS:
        return False
    raise _fail(
        name,
        raw,
        f"allowed values are {'/'.join(TRUE_SPELLINGS)} (on) or {'/'.join(FALSE_SPELLINGS)} (off), case-insensitive",
    )


def env_choice(name: str, choices: tuple[str, ...], default: _Default) -> str | _Default:
    """One of `choices` (lower-case names, matched case-insensitively), returned as written there."""
    raw = _raw(name)
    if raw is None:
        return default
    if raw.lower() in choices:
        return raw.lower()
    raise _fail(name, raw, f"allowed values are {choices}, case-insensitive")


def env_int(name: str, default: _Default, *, minimum: int | None = None) -> int | _Default:
    """A decimal integer, at least `minimum` where given."""
    raw = _raw(name)
    if raw is None:
        return default
    try:
        value = int(raw, 10)
    except ValueError:
        value = None
    if value is None or (minimum is not None and value < minimum):
        raise _fail(name, raw, "expected an integer" + ("" if minimum is None else f" >= {minimum}"))
    return value


def env_float(
    name: str, default: _Default, *, above: float | None = None, words: tuple[str, ...] = ()
) -> float | str | _Default:
    """A finite number, greater than `above` where given (`above=0`: a factor that must be
    positive), or one of `words` (lower-case, matched case-insensitively)."""
    raw = _raw(name)
    if raw is None:
        return default
    if raw.lower() in words:
        return raw.lower()
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or (above is not None and value <= above):
        raise _fail(
            name,
            raw,
            "expected a finite number"
            + ("" if above is None else f" > {above}")
            + "".join(f" or {word!r}" for word in words),
        )
    return value


#: How the dispatcher checks routing values (dispatcher/common/checks.py), and the values.
INPUT_CHECKS_ENV = "MOE_EXT_INPUT_CHECKS"
INPUT_CHECK_MODES = ("auto", "sync", "deferred")


def input_check_mode() -> str:
    """`INPUT_CHECKS_ENV`: one of `INPUT_CHECK_MODES`."""
    return env_choice(INPUT_CHECKS_ENV, INPUT_CHECK_MODES, "auto")


def static_routing_pad_pin() -> bool:
    """HybridEP's static-routing pin: MOE_EXT_STATIC_ROUTING_PAD_PIN=0 (false, off, no) keeps the
    per-dispatch all-reduce under static routing (NeMo's NEMO_STATIC_ROUTING_PAD_PIN is read
    where the new one is unset)."""
    return env_flag("MOE_EXT_STATIC_ROUTING_PAD_PIN", True, fallback="NEMO_STATIC_ROUTING_PAD_PIN")


def hybridep_combine_chunk() -> int:
    """HybridEP's combine chunk, from the variable HybridEP itself reads (64 where unset)."""
    return env_int("NUM_OF_TOKENS_PER_CHUNK_COMBINE_API", 64, minimum=1)


def quack_tuned() -> bool:
    """MOE_EXT_QUACK_TUNED: QuACK's GEMMs autotune (fixed-shape benchmarks; `experts/fused_mlp.py`)."""
    return env_flag("MOE_EXT_QUACK_TUNED", False)


#: Every variable the package reads -> the function that reads it as the package does. A layer's
#: build runs them all (`read_every_variable`), the dispatcher's whatever its backend imports;
#: a module that reads a variable of its own adds its reader on import (`register`).
VARIABLES: dict[str, Callable[[], object]] = {
    INPUT_CHECKS_ENV: input_check_mode,
    "MOE_EXT_STATIC_ROUTING_PAD_PIN": static_routing_pad_pin,
    "NEMO_STATIC_ROUTING_PAD_PIN": static_routing_pad_pin,
    "NUM_OF_TOKENS_PER_CHUNK_COMBINE_API": hybridep_combine_chunk,
    "MOE_EXT_QUACK_TUNED": quack_tuned,
}


def register(names: tuple[str, ...], read: Callable[[], object]) -> None:
    """Add `read`, which reads the variables `names`, to `VARIABLES`."""
    VARIABLES.update(dict.fromkeys(names, read))


def read_every_variable() -> dict[str, str | None]:
    """Read every variable in `VARIABLES` as the package does (ValueError naming the first one
    it refuses); returns each one's value as set (None: unset), for comparing ranks."""
    for read in dict.fromkeys(VARIABLES.values()):
        read()
    return {name: _raw(name) for name in VARIABLES}
