"""Tenant-fair shares of each engine step: the token budget and the running seats.

A request's tenant (Request.tenant, from RequestOptions.tenant: the gateway's tenant, or
the direct client's address) names whose share it takes; requests without one share
the tenant None. Each tenant has a weight (--tenant-weight, default 1).

The rule, every step: the step's token budget (--max-num-batched-tokens) and the seats
(--max-num-seqs) are divided between the tenants that have work by weighted max-min
fairness (`water_fill`): a tenant that needs less than its weighted share gets what it
needs, and what it leaves is divided between the others by weight. The scheduler then
gives a tenant's requests tokens only within its allowance: with chunked prefill a chunk
is cut to it; without, a prompt goes whole once the allowance is positive, and the
overdraft is repaid from the tenant's next allowances while the steps are contended
(what it cannot take meanwhile goes to the others). A tenant holding its share of the
seats is not admitted more while it holds them.

The bound that follows: with tenants of weights w_1..w_k having work, tenant i gets at
least S_i = floor(budget * w_i / sum(w)) tokens of every step it needs them, however much
the others send. So a request of P uncached prompt tokens, queued while its tenant has
nothing else in flight, is scheduled in the first step after it is queued (a seat and
blocks being free) and has its first token after ceil(P / S_i) steps: one step when
P <= S_i. A tenant sending ten times its share does not change S_i; it only fills the
steps (their duration is bounded by the budget).
"""

from __future__ import annotations

from collections.abc import Mapping

Tenant = str | None


def water_fill(capacity: int, demands: Mapping[Tenant, int], weights: Mapping[Tenant, float]) -> dict[Tenant, int]:
    """Weighted max-min fair integer split of `capacity` between `demands` (tenant ->
    units wanted): every tenant gets min(demand, its weighted share of what the tenants
    that want more leave), all capacity is given while demand remains, and each tenant
    gets at least floor(capacity * w / sum(w)) when it wants that much. Pure."""
    alloc = {t: 0 for t in demands}
    wanting = {t: d for t, d in demands.items() if d > 0}
    left = capacity
    while wanting:
        total = sum(weights[t] for t in wanting)
        met = {t: d for t, d in wanting.items() if d * total <= left * weights[t]}
        if not met:
            break
        for t, d in met.items():
            alloc[t], left = d, left - d
            del wanting[t]
    if wanting:
        total = sum(weights[t] for t in wanting)
        exact = {t: left * weights[t] / total for t in wanting}
        for t, x in exact.items():
            alloc[t] = int(x)
        rest = left - sum(alloc[t] for t in wanting)  # < len(wanting): one more each, largest remainder first
        for t in sorted(wanting, key=lambda t: (alloc[t] - exact[t], str(t)))[:rest]:
            alloc[t] += 1
    return alloc


class FairShares:
    """The tenants' allowances for the step being scheduled (engine thread only).
    `plan` sets them once per step; `take` spends tokens and seats as requests are
    scheduled; `end_step` keeps what a tenant overdrew (prompts that cannot be chunked)."""

    def __init__(self, weights: Mapping[str, float]) -> None:
        self.weights = dict(weights)
        self.tokens: dict[Tenant, int] = {}
        self.seats: dict[Tenant, int] = {}
        self.held: dict[Tenant, int] = {}
        self.spare = 0
        self.spare_seats = 0
        self._debt: dict[Tenant, int] = {}

    def weight(self, tenant: Tenant) -> float:
        return self.weights.get(tenant, 1.0) if tenant is not None else 1.0

    def plan(self, budget: int, max_seqs: int, token_demand: Mapping[Tenant, int],
             seat_demand: Mapping[Tenant, int], held: Mapping[Tenant, int]) -> None:
        """This step's allowances from each tenant's demand (tokens it could compute,
        seats it could fill) and the seats it holds; a tenant with no work forgets its debt."""
        tenants = set(token_demand) | set(seat_demand)
        w = {t: self.weight(t) for t in tenants}
        fill = water_fill(budget, token_demand, w)
        debt = {t: d for t, d in self._debt.items() if t in tenants}
        if sum(token_demand.values()) <= budget:
            debt = {}  # the step holds everyone's work: an overdraft delays nobody
        self.tokens = {t: fill.get(t, 0) + debt.get(t, 0) for t in tenants}
        freed = sum(fill.get(t, 0) - max(0, self.tokens[t]) for t in debt)  # what repaying leaves to the others
        if freed > 0:
            more = water_fill(freed, {t: token_demand.get(t, 0) - fill.get(t, 0) for t in tenants if t not in debt}, w)
            for t, n in more.items():
                self.tokens[t] += n
        self.spare = budget - sum(fill.values())  # beyond every tenant's demand: anyone's, first come
        self.seats = water_fill(max_seqs, seat_demand, w)
        self.spare_seats = max_seqs - sum(self.seats.values())
        self.held = dict(held)

    def left(self, tenant: Tenant) -> int:
        """Tokens the tenant may still take this step (<= 0: none): its allowance, and the
        spare tokens (a step whose budget exceeds everyone's demand)."""
        return self.tokens.get(tenant, 0) + self.spare

    def may_seat(self, tenant: Tenant) -> bool:
        """Whether one more of the tenant's requests may start running: within its seats,
        or on a seat no tenant's demand counted on."""
        return self.held.get(tenant, 0) < self.seats.get(tenant, 0) or self.spare_seats > 0

    def take(self, tenant: Tenant, tokens: int, seated: bool) -> None:
        """The tenant's request was scheduled for `tokens` (and took a seat if `seated`):
        from its allowance, then from the spare tokens, then as an overdraft."""
        own = min(tokens, max(0, self.tokens.get(tenant, 0)))
        spare = min(tokens - own, self.spare)
        self.spare -= spare
        self.tokens[tenant] = self.tokens.get(tenant, 0) - (tokens - spare)
        if seated:
            if self.held.get(tenant, 0) >= self.seats.get(tenant, 0):
                self.spare_seats -= 1
            self.held[tenant] = self.held.get(tenant, 0) + 1

    def end_step(self) -> None:
        """Carry each tenant's overdraft to its next allowance."""
        self._debt = {t: v for t, v in self.tokens.items() if v < 0}
