"""The API keys file (``--api-keys-file``): one key a line, each naming its tenant.

Format (see docs/many-users.md)::

    # comment lines and blank lines are ignored
    NAME:KEY [weight=W] [max_concurrency=N] [subtenants=true|false] [loras=A,B,...]

``NAME``: 1-64 of ``A-Z a-z 0-9 _ . -``, starting with a letter or digit, unique, not
``default`` (the tenant of requests without a named key). ``KEY``: everything after the
first ``:`` up to the first space (no spaces), unique, at least 8 characters. ``weight``
(> 0, default 1): the tenant's share under ``--schedule-policy fair``. ``max_concurrency``
(>= 1, default none): its requests running in the engine at once, at most (per engine).
``subtenants=true``: the key may split its traffic into sub-tenants ``NAME/SUB`` with the
``X-Tenant`` header or the request's ``user`` field (each scheduled as a tenant of its own
with the key's weight and cap, counted in metrics under ``NAME``); without it both are
ignored. ``loras``: the LoRA adapters the key may name as its ``model`` (default: every
one; ``loras=`` with nothing after it: none); another adapter is a 404 to it, as if it did
not exist. A bad line is an error naming the file and line.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from radixserve.core.request import Tenant
from radixserve.serving.tenancy import DEFAULT_TAG, TenantTag

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}")
_SUB = re.compile(r"[A-Za-z0-9_.@:\-]{1,128}")
MIN_KEY_LENGTH = 8
_FIELDS = ("weight", "max_concurrency", "subtenants", "loras")


class KeysFileError(ValueError):
    """A keys file that cannot be used; the message names the file and line."""


@dataclass(frozen=True)
class KeyEntry:
    """One accepted key. Invariant: ``tenant`` is None exactly for keys given with
    ``--api-key`` (their requests are tenant ``default``); file keys name their tenant."""

    key: bytes
    tenant: Tenant | None = None
    subtenants: bool = False
    loras: frozenset[str] | None = None  # the adapters it may use (None: every one)


def parse_keys_file(text: str, source: str = "<keys>") -> list[KeyEntry]:
    """The entries of a keys file's ``text``; ``KeysFileError`` on the first bad line, or
    when there is no key at all (an empty file would leave the server open)."""
    entries: list[KeyEntry] = []
    names: set[str] = set()
    keys: set[str] = set()
    for line_no, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue

        def bad(why: str, line_no: int = line_no) -> KeysFileError:
            return KeysFileError(f"{source}:{line_no}: {why}")

        head, *fields = line.split()
        name, colon, key = head.partition(":")
        if not colon:
            raise bad("expected NAME:KEY first")
        if not _NAME.fullmatch(name):
            raise bad(f"bad tenant name {name!r} (1-64 of A-Z a-z 0-9 _ . -)")
        if name == "default":
            raise bad("the name 'default' is reserved (requests without a named key)")
        if len(key) < MIN_KEY_LENGTH:
            raise bad(f"the key of {name!r} is shorter than {MIN_KEY_LENGTH} characters")
        if name in names:
            raise bad(f"tenant {name!r} appears twice")
        if key in keys:
            raise bad("this key appears twice")
        values: dict[str, str] = {}
        for field in fields:
            field_name, eq, value = field.partition("=")
            if not eq or field_name not in _FIELDS:
                raise bad(f"unknown field {field!r} (fields: {', '.join(_FIELDS)}, as F=V)")
            if field_name in values:
                raise bad(f"{field_name} given twice")
            values[field_name] = value
        try:
            weight = float(values.get("weight", "1"))
        except ValueError:
            raise bad(f"weight must be a number > 0; got {values['weight']!r}") from None
        if not (weight > 0 and math.isfinite(weight)):
            raise bad(f"weight must be a number > 0; got {values['weight']!r}")
        cap = None
        if "max_concurrency" in values:
            text_cap = values["max_concurrency"]
            if not text_cap.isdigit() or int(text_cap) < 1:
                raise bad(f"max_concurrency must be an integer >= 1; got {text_cap!r}")
            cap = int(text_cap)
        sub = values.get("subtenants", "false").lower()
        if sub not in ("true", "false"):
            raise bad(f"subtenants must be true or false; got {values['subtenants']!r}")
        loras = None
        if "loras" in values:
            loras = frozenset(n for n in values["loras"].split(",") if n)
        names.add(name)
        keys.add(key)
        entries.append(KeyEntry(key.encode(), Tenant(name, weight, cap), sub == "true", loras))
    if not entries:
        raise KeysFileError(f"{source}: no keys (a keys file must hold at least one)")
    return entries


def load_keys_file(path: str | Path) -> list[KeyEntry]:
    """``parse_keys_file`` of the file at ``path`` (``KeysFileError`` if unreadable)."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise KeysFileError(f"{path}: cannot read the keys file ({exc})") from None
    return parse_keys_file(text, str(path))


def tenant_tag(
    entry: KeyEntry | None, headers: Mapping[str, str], user: str | None
) -> TenantTag | str:
    """The tenant of a request made with ``entry`` (None: no key needed or given), or the
    error message of a 400: an ``X-Tenant`` header (first) or ``user`` refines a
    ``subtenants=true`` key's tenant into ``NAME/SUB``; both are ignored otherwise."""
    if entry is None or entry.tenant is None:
        return DEFAULT_TAG
    tenant = entry.tenant
    if entry.subtenants:
        header = headers.get("x-tenant")
        sub = header if header is not None else user
        if sub:
            if not _SUB.fullmatch(sub):
                what = "the X-Tenant header" if header is not None else "user"
                return f"{what} must be 1-128 of A-Z a-z 0-9 _ . @ : -"
            tenant = Tenant(f"{tenant.name}/{sub}", tenant.weight, tenant.max_running)
    return TenantTag(tenant, entry.tenant.name, entry.loras)
