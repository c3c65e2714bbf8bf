"""Every environment variable the package reads, parsed in one place.

Each reader takes the variable's name and its default (returned where the variable is unset)
and raises ValueError naming the variable, its value and what is allowed for anything else,
so a misspelt value never falls back to the default silently. An empty value is refused too:
unset the variable to get its default. The README lists the variables the package reads.
"""

from __future__ import annotations

import importlib
import math
import os
from typing import Callable, TypeVar

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
    raise _fail(name, raw, f"allowed values are {'/'.join(TRUE_SPELLINGS)} (on) or "
                           f"{'/'.join(FALSE_SPELLINGS)} (off), case-insensitive")


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


def env_float(name: str, default: _Default, *, above: float | None = None) -> float | _Default:
    """A finite number, greater than `above` where given (`above=0`: a factor that must be
    positive)."""
    raw = _raw(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or (above is not None and value <= above):
        raise _fail(name, raw, "expected a finite number" + ("" if above is None else f" > {above}"))
    return value



def _read(module: str, attribute: str, *args) -> Callable[[], object]:
    """A reader that calls `megatron_moe_ext.<module>.<attribute>(*args)`, imported when it runs."""
    return lambda: getattr(importlib.import_module(f"megatron_moe_ext.{module}"), attribute)(*args)


def _expert_mlp_impl():
    from megatron_moe_ext.megatron import experts

    return env_choice(experts.EXPERT_MLP_IMPL_ENV, experts.EXPERT_MLP_IMPLS, "auto")


_budget = _read("dispatcher.config", "budget_from_environment", None)
_pad_pin = _read("dispatcher.hybridep.manager", "static_routing_pad_pin")

#: Every variable the package reads -> the function that reads it as the package does. A layer's
#: build runs all of them (`read_every_variable`), so a bad value fails there, whatever code the
#: layer's settings import later (HybridEP's variables with another backend, say).
VARIABLES: dict[str, Callable[[], object]] = {
    "MOE_EXT_INPUT_CHECKS": _read("dispatcher.common.checks", "check_mode"),
    "MOE_EXT_STATIC_ROUTING_PAD_PIN": _pad_pin,
    "NEMO_STATIC_ROUTING_PAD_PIN": _pad_pin,
    "NUM_OF_TOKENS_PER_CHUNK_COMBINE_API": _read("dispatcher.hybridep.runtime", "combine_chunk"),
    "MOE_EXT_EXPERT_RANK_CAPACITY_FACTOR": _budget,
    "MOE_EXT_EXPERT_RANK_OVERFLOW_POLICY": _budget,
    "MOE_EXT_EXPERT_MLP_IMPL": _expert_mlp_impl,
    "MOE_EXT_QUACK_TUNED": lambda: env_flag("MOE_EXT_QUACK_TUNED", False),
}


def read_every_variable() -> dict[str, str | None]:
    """Read every variable in `VARIABLES` as the package does (ValueError naming the first one
    it refuses); returns each one's value as set (None: unset), for comparing ranks."""
    for read in dict.fromkeys(VARIABLES.values()):
        read()
    return {name: _raw(name) for name in VARIABLES}
