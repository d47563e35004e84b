"""Stage functions of a module that imports torch at its top: the fork server loads torch before it forks them."""

from __future__ import annotations

import _warm_stages as W
import torch  # noqa: F401 - what the test is about: a module-level import of torch


def environment(ctx):
    """:func:`_warm_stages.environment`, from a module that imported torch."""
    return W.environment(ctx)
