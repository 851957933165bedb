"""Per-layer budget allocation: how a total budget (layers x budget entries) is spread over layers."""

from __future__ import annotations

from enum import Enum

from evictlab.errors import ConfigError


class Allocation(str, Enum):
    uniform = "uniform"  # every layer keeps `budget` entries
    pyramid = "pyramid"  # more in lower layers, fewer in upper ones, same total (PyramidKV-like)


def allocate(
    budget: int, n_layer: int, scheme: Allocation | str = Allocation.uniform, spread: float = 0.5
) -> list[int]:
    """Per-layer budgets summing to n_layer * budget.

    pyramid: layer l gets budget * (1 + spread * (1 - 2 l / (L - 1))), i.e. (1 + spread) x budget at the
    bottom falling linearly to (1 - spread) x budget at the top, rounded so the total is exact.
    """
    scheme = Allocation(scheme)
    if budget < 1:
        raise ConfigError(f"budget={budget} must be >= 1")
    if scheme is Allocation.uniform or n_layer == 1:
        return [budget] * n_layer
    if not 0 <= spread < 1:
        raise ConfigError(f"pyramid spread={spread} must be in [0, 1)")
    raw = [budget * (1 + spread * (1 - 2 * l / (n_layer - 1))) for l in range(n_layer)]
    out = [max(1, int(r)) for r in raw]
    # hand out what flooring lost, largest remainders first (lower layers win ties)
    order = sorted(range(n_layer), key=lambda l: (-(raw[l] - int(raw[l])), l))
    i = 0
    while sum(out) < budget * n_layer:
        out[order[i % n_layer]] += 1
        i += 1
    while sum(out) > budget * n_layer:  # only when max(1, .) lifted a layer
        top = max(range(n_layer), key=lambda l: (out[l], l))
        out[top] -= 1
    return out


def budgets_for(n_layer: int, policy, budget: int, allocation: Allocation | str, n: int) -> list[int]:
    """Per-layer budgets for `policy` on a stream of n predictions, each checked by `policy.validate`
    (a policy that keeps everything holds all n entries)."""
    if not policy.evicts:
        return [n] * n_layer
    budgets = allocate(budget, n_layer, allocation)
    for l, b in enumerate(budgets):
        try:
            policy.validate(b)
        except ConfigError as e:
            where = (
                ""
                if len(set(budgets)) == 1
                else f" (layer {l} of the {Allocation(allocation).value} allocation)"
            )
            raise ConfigError(f"{e}{where}") from None
    return budgets
