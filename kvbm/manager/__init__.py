"""The block manager: decides where blocks live and moves them (:class:`BlockManager` and its parts)."""

from kvbm.manager.core import BlockManager, ManagerStats

__all__ = ["BlockManager", "ManagerStats"]
