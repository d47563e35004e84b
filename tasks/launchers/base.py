"""Launchers: pure functions from a request to an argv list (never a shell string)."""

from __future__ import annotations

import abc
from typing import Sequence

from ..scheduler import RankSlot


class Launcher(abc.ABC):
    """Turns a per-rank command and its slots into the argv that starts all ranks."""

    @abc.abstractmethod
    def argv(self, command: Sequence[str], slots: Sequence[RankSlot], hosts: Sequence[str]) -> list[str]:
        """``command`` for every rank in ``slots``; ``hosts[slot.node]`` names each node."""
