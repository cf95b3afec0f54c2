"""The weights epoch: which model weights an engine's KV namespace stands for.

Blocks are named by a chained hash of their tokens in a namespace that fingerprints the model, dtype and
layout, but not the weights' values: after an RL weight update (vLLM's ``pause_generation(clear_cache=True)``,
``reset_prefix_cache(reset_connector=True)``, the OpenAI server's ``/reset_prefix_cache?reset_external=true``)
the same tokens have other KV. So the connector's ``reset_cache`` starts a new epoch, folded into every
layout's ``revision`` and so into the namespace: blocks of an earlier epoch can never match again.

The tag of an epoch is ``weights=<weights_version>`` (``kv_connector_extra_config.weights_version``) and, after
``n`` resets, ``#reset<n>``: engines that start from the same weights version and reset together share one
namespace (a fleet syncing weights keeps sharing). Without a ``weights_version`` a reset takes a random tag, so
it matches nothing before it and no other engine. The scheduler side owns the epoch; each step's metadata
carries its tag to the workers, which follow it before they load or save anything of that step.
"""

from __future__ import annotations

import secrets

import msgspec

from kvbm.blocks.layout import KVLayout


class WeightsEpoch:
    """The current epoch of one process's links; ``gen`` counts its changes (a link re-registers on a change).

    The scheduler's or worker's main thread changes it while the links' threads (saves, loads, lookups) read it, so
    an epoch's ``gen`` and ``tag`` are one tuple, replaced whole: a reader takes :meth:`snapshot` once and never
    pairs one epoch's generation with the next one's tag (a saver that did registered under the new namespace as
    the old generation, and stored the old weights' KV there)."""

    def __init__(self, weights_version: str | None) -> None:
        self.version = weights_version or ""
        self.resets = 0
        self._state = (0, self._tag())

    @property
    def gen(self) -> int:
        return self._state[0]

    @property
    def tag(self) -> str:
        return self._state[1]

    def snapshot(self) -> tuple[int, str]:
        """``(gen, tag)`` of one epoch, read at once."""
        return self._state

    def _tag(self) -> str:
        if self.resets == 0:
            return f"weights={self.version}" if self.version else ""
        if self.version:
            return f"weights={self.version}#reset{self.resets}"
        return f"reset={secrets.token_hex(8)}"  # nothing to agree on: matches no earlier block, no other engine

    def reset(self) -> str:
        """A new epoch (the scheduler side, on ``reset_cache``); its tag."""
        self.resets += 1
        tag = self._tag()
        self._state = (self._state[0] + 1, tag)
        return tag

    def follow(self, tag: str) -> bool:
        """Take the scheduler's epoch (a worker, from the step's metadata); whether it changed."""
        gen, current = self._state
        if tag == current:
            return False
        self._state = (gen + 1, tag)
        return True

    @staticmethod
    def apply(layout: KVLayout, tag: str) -> KVLayout:
        """``layout`` named for the epoch of ``tag`` (its revision carries the tag; the fingerprint covers the
        revision)."""
        if not tag:
            return layout
        revision = f"{layout.revision}+{tag}" if layout.revision else tag
        return msgspec.structs.replace(layout, revision=revision)
