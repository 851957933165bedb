"""The policy registry: every module in this package registers its policy class by name.

Adding a policy = adding one file here with a `@register` dataclass; the shared test matrix
(tests/test_policies.py) and the configs pick it up by name.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil

from evictlab.cache.policies.base import Policy, StepContext, choose_victim, protect
from evictlab.errors import ConfigError

POLICIES: dict[str, type[Policy]] = {}


def register(cls: type[Policy]) -> type[Policy]:
    if not cls.name:
        raise TypeError(f"{cls.__name__} needs a `name`")
    if cls.name in POLICIES and POLICIES[cls.name] is not cls:
        raise TypeError(f"policy name {cls.name!r} registered twice")
    if not cls.label:
        cls.label = cls.name
    POLICIES[cls.name] = cls
    return cls


def make_policy(name: str, **params) -> Policy:
    """Build a registered policy from its name and parameters (validated on construction)."""
    if name not in POLICIES:
        raise ConfigError(f"unknown strategy {name!r}; known: {', '.join(sorted(POLICIES))}")
    cls = POLICIES[name]
    valid = [f.name for f in dataclasses.fields(cls) if f.init]
    unknown = sorted(set(params) - set(valid))
    if unknown:
        raise ConfigError(
            f"strategy {name!r} has no parameter {', '.join(unknown)}; its parameters: "
            f"{', '.join(f'strategy.params.{v}' for v in valid) or 'none'}"
        )
    try:
        return cls(**params)
    except TypeError as e:
        raise ConfigError(f"strategy {name!r}: {e}") from None


def full_cache() -> Policy:
    """The policy that keeps every entry: the reference every other policy is compared with."""
    (cls,) = [c for c in POLICIES.values() if not c.evicts and not c.ablation]
    return cls()


for _mod in pkgutil.iter_modules(__path__):
    if _mod.name != "base":
        importlib.import_module(f"{__name__}.{_mod.name}")

__all__ = [
    "POLICIES",
    "Policy",
    "StepContext",
    "choose_victim",
    "full_cache",
    "make_policy",
    "protect",
    "register",
]
