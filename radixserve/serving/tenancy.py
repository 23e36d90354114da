"""Who a request is for and how its KV is keyed, as its transport found them
(``api.tenants``): the scheduling identity that travels to the engine, the label of its
metrics series, its cache salt and priority. Transports build one ``Routing`` per request
and hand it to the frontend explicitly."""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.core.request import DEFAULT_TENANT, EngineRequest, Tenant
from radixserve.core.sampling_params import SamplingParams


@dataclass(frozen=True)
class TenantTag:
    """A request's tenant (scheduled as such) and its metrics label. Invariant: ``label``
    is ``"default"`` or the name of a key of the keys file, so the label set is bounded
    by the file whatever clients send (sub-tenants are labelled with their key's name).
    ``loras``: the LoRA adapters its key may use (None: every one)."""

    tenant: Tenant
    label: str
    loras: frozenset[str] | None = None

    def may_use(self, adapter: str) -> bool:
        return self.loras is None or adapter in self.loras


DEFAULT_TAG = TenantTag(DEFAULT_TENANT, "default")


@dataclass(frozen=True)
class Routing:
    """A request's tenant (``tag``), ``cache_salt`` (a prefix-cache partition within the
    tenant's), ``priority`` (lower first under the ``priority`` policy), ``lora`` (the
    LoRA adapter its ``model`` named; None: the base model) and ``model`` (the served model
    it runs on, ``model_set``; None: the server's only or first), as the transport found
    them; the same for every prompt and sample of the request."""

    tag: TenantTag = DEFAULT_TAG
    cache_salt: str | None = None
    priority: int = 0
    lora: str | None = None
    model: str | None = None

    @property
    def tenant(self) -> Tenant | None:
        """The tenant the engine is told (None: ``default``)."""
        return None if self.tag is DEFAULT_TAG else self.tag.tenant

    def request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        pooling: str | None = None,
    ) -> EngineRequest:
        """The engine request of one checked prompt (``engine.inputs``), routed so."""
        return EngineRequest(
            request_id,
            prompt_token_ids,
            params,
            self.cache_salt,
            self.priority,
            self.tenant,
            pooling,
            self.lora,
        )


DEFAULT_ROUTING = Routing()
