"""Which tenant the request being handled is for, as transports found it (``api.tenants``):
the scheduling identity that travels to the engine and the label of its metrics series.

Transports set ``current`` in the task that handles a request, before they call
``Frontend.run``; the frontend and the metrics read it there, so no route has to pass it
along by hand."""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass

from radixserve.core.request import DEFAULT_TENANT, Tenant


@dataclass(frozen=True)
class TenantTag:
    """A request's tenant (scheduled as such) and its metrics label. Invariant: ``label``
    is ``"default"`` or the name of a key of the keys file, so the label set is bounded
    by the file whatever clients send (sub-tenants are labelled with their key's name)."""

    tenant: Tenant
    label: str


DEFAULT_TAG = TenantTag(DEFAULT_TENANT, "default")

current: ContextVar[TenantTag] = ContextVar("radixserve_tenant", default=DEFAULT_TAG)
