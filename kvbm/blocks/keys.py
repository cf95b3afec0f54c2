"""Block key syntax: the model slug, the namespace, and the disk-path and object-key schemes.

This module is the one definition of what a kvbm storage name looks like. A namespace is
``<slug>-<16 hex layout fingerprint>``; the slug is ``[a-z0-9][a-z0-9._-]{0,47}`` (ASCII, starts with a
letter or digit), so a namespace is always a valid single path component and S3 key segment: never
empty, never ``.``/``..``, never hidden, no ``/``, no NUL, no non-ASCII. :func:`model_slug` maps *any*
model name onto that syntax (``./m`` -> ``m``, ``/abs/path/Model`` -> ``abs-path-model``); the full
model name goes into the fingerprint, so two models with the same slug still get different namespaces.

Stored names built from a :class:`~kvbm.blocks.BlockKey`:

* disk: ``<namespace>/<hash_hex[:2]>/<hash_hex>.kvb`` under the disk tier's directory;
* S3: ``[<prefix>/]<namespace>/[<hash_hex[:shard_chars]>/]<hash_hex>``.

Every tier and maintenance command validates and parses through the functions here; a name that does
not parse is not a kvbm block and is never served or selected.
"""

from __future__ import annotations

import re
import unicodedata

from kvbm.blocks.format import MAX_HASH_LEN, BlockKey
from kvbm.errors import ConfigError

SLUG_MAX = 48
FINGERPRINT_HEX = 16
DISK_SUFFIX = ".kvb"
DISK_SHARD_CHARS = 2

NAMESPACE_RE = re.compile(rf"^[a-z0-9][a-z0-9._-]{{0,{SLUG_MAX - 1}}}-[0-9a-f]{{{FINGERPRINT_HEX}}}$")
HASH_HEX_RE = re.compile(rf"^(?:[0-9a-f]{{2}}){{1,{MAX_HASH_LEN}}}$")
_NOT_SLUG = re.compile(r"[^a-z0-9._-]+")
_EDGE = "._-"

__all__ = [
    "DISK_SUFFIX", "FINGERPRINT_HEX", "HASH_HEX_RE", "NAMESPACE_RE", "SLUG_MAX", "InvalidNamespace",
    "check_namespace", "disk_relpath", "is_hash_hex", "is_namespace", "make_namespace", "model_slug",
    "object_relkey", "parse_disk_relpath", "parse_object_relkey",
]


class InvalidNamespace(ConfigError, ValueError):
    """A string that is not a kvbm namespace (``<slug>-<16 hex fingerprint>``)."""


def model_slug(model: str) -> str:
    """The readable part of a namespace: ASCII-folded, lower case, runs of other characters -> ``-``,
    trimmed of ``._-`` at both ends, at most 48 characters; ``model`` when nothing is left."""
    folded = unicodedata.normalize("NFKD", model).encode("ascii", "ignore").decode("ascii").lower()
    slug = _NOT_SLUG.sub("-", folded).strip(_EDGE)[:SLUG_MAX].rstrip(_EDGE)
    return slug or "model"


def make_namespace(model: str, fingerprint: str) -> str:
    """``<model_slug(model)>-<fingerprint>``, validated."""
    return check_namespace(f"{model_slug(model)}-{fingerprint}")


def is_namespace(ns: str) -> bool:
    return NAMESPACE_RE.match(ns) is not None


def check_namespace(ns: str) -> str:
    """``ns`` if it is a kvbm namespace, else :class:`InvalidNamespace` naming the syntax."""
    if not isinstance(ns, str) or not is_namespace(ns):
        raise InvalidNamespace(
            f"{ns!r} is not a kvbm namespace (<model-slug>-<16 hex fingerprint>, the slug being "
            f"[a-z0-9][a-z0-9._-]{{0,{SLUG_MAX - 1}}})"
        )
    return ns


def is_hash_hex(h: str) -> bool:
    """Whether ``h`` is a block hash in lower-case hex (1 to 32 bytes)."""
    return HASH_HEX_RE.match(h) is not None


def disk_relpath(key: BlockKey) -> str:
    """``<namespace>/<hh>/<hash>.kvb``: where the disk tier keeps ``key``, relative to its directory."""
    h = key.hash.hex()
    if not h:
        raise ValueError(f"block key {key} has an empty hash")
    return f"{check_namespace(key.namespace)}/{h[:DISK_SHARD_CHARS]}/{h}{DISK_SUFFIX}"


def parse_disk_relpath(parts: tuple[str, ...] | list[str]) -> BlockKey | None:
    """The key a ``(namespace, shard, file name)`` path names, or None if it is not a kvbm block file."""
    if len(parts) != 3:
        return None
    ns, shard, name = parts
    if not name.endswith(DISK_SUFFIX):
        return None
    h = name[: -len(DISK_SUFFIX)]
    if not is_namespace(ns) or not is_hash_hex(h) or shard != h[:DISK_SHARD_CHARS]:
        return None
    return BlockKey(ns, bytes.fromhex(h))


def object_relkey(key: BlockKey, shard_chars: int) -> str:
    """``<namespace>/[<shard>/]<hash>``: the object key of ``key`` relative to the configured prefix."""
    h = key.hash.hex()
    if not h:
        raise ValueError(f"block key {key} has an empty hash")
    shard = f"{h[:shard_chars]}/" if shard_chars else ""
    return f"{check_namespace(key.namespace)}/{shard}{h}"


def parse_object_relkey(rel: str, shard_chars: int) -> BlockKey | None:
    """The key an object key (relative to the prefix) names, or None for a key kvbm did not write."""
    parts = rel.split("/")
    if len(parts) != (3 if shard_chars else 2):
        return None
    ns, h = parts[0], parts[-1]
    if not is_namespace(ns) or not is_hash_hex(h):
        return None
    if shard_chars and parts[1] != h[:shard_chars]:
        return None
    return BlockKey(ns, bytes.fromhex(h))
