"""Model architectures that a model artifact can name, and the registry of them.

A model artifact stores an architecture *name* and its constructor keyword
arguments, never pickled code; :func:`build_model` rebuilds the module from
this registry.  Register your own with::

    @hf.ml.register_architecture("my-net")
    class MyNet(torch.nn.Module):
        def __init__(self, width: int = 32): ...

The keyword arguments a registered class is built with are recorded on the
instance (they must be JSON values).
"""

from __future__ import annotations

import functools
import inspect
import json
from typing import Any, Callable, Sequence, TypeVar

import torch
from torch import nn

from hetflow.ml.errors import ModelArtifactError, UnknownArchitectureError

_REGISTRY: dict[str, type[nn.Module]] = {}
_KWARGS_ATTR = "_hetflow_kwargs"
_NAME_ATTR = "hetflow_architecture"
M = TypeVar("M", bound=type[nn.Module])


def register_architecture(name: str) -> Callable[[M], M]:
    """Class decorator: make ``cls`` buildable from a model artifact under ``name``."""
    if not name or not isinstance(name, str):
        raise ValueError(f"architecture name must be a non-empty string, got {name!r}")

    def decorate(cls: M) -> M:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"architecture {name!r} is already registered to {_REGISTRY[name].__qualname__}")
        init = cls.__init__
        signature = inspect.signature(init)

        @functools.wraps(init)
        def recording_init(self: nn.Module, *args: Any, **kwargs: Any) -> None:
            bound = signature.bind(self, *args, **kwargs)
            init(self, *args, **kwargs)
            recorded = {k: v for k, v in list(bound.arguments.items())[1:]}
            try:
                json.dumps(recorded)
            except TypeError as exc:
                raise TypeError(f"{cls.__qualname__} arguments must be JSON values to be saved: {exc}") from None
            object.__setattr__(self, _KWARGS_ATTR, recorded)

        cls.__init__ = recording_init  # type: ignore[method-assign]
        setattr(cls, _NAME_ATTR, name)
        _REGISTRY[name] = cls
        return cls

    return decorate


def architectures() -> list[str]:
    """Names of the registered architectures."""
    return sorted(_REGISTRY)


def architecture_of(model: nn.Module) -> tuple[str, dict[str, Any]]:
    """The registered name and constructor arguments of ``model`` (unwrapping DDP)."""
    inner = getattr(model, "module", model)
    name = getattr(type(inner), _NAME_ATTR, None)
    if name is None or _REGISTRY.get(name) is not type(inner):
        raise UnknownArchitectureError(
            f"{type(inner).__qualname__} is not a registered architecture (registered: {architectures()}); "
            "decorate it with @hetflow.ml.register_architecture(name)")
    return name, dict(getattr(inner, _KWARGS_ATTR))


def build_model(name: str, kwargs: dict[str, Any]) -> nn.Module:
    """Construct a registered architecture."""
    if name not in _REGISTRY:
        raise UnknownArchitectureError(f"unknown architecture {name!r} (registered: {architectures()})")
    try:
        return _REGISTRY[name](**kwargs)
    except TypeError as exc:
        raise ModelArtifactError(f"cannot build architecture {name!r} from {kwargs!r}: {exc}") from exc


_ACTIVATIONS: dict[str, type[nn.Module]] = {"relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh, "silu": nn.SiLU}


@register_architecture("mlp")
class MLP(nn.Module):
    """A fully connected network; with ``out_features=1`` it returns shape ``(batch,)``."""

    def __init__(self, in_features: int, hidden: Sequence[int] = (64, 64), out_features: int = 1,
                 activation: str = "relu", dropout: float = 0.0) -> None:
        super().__init__()
        if in_features < 1 or out_features < 1 or any(h < 1 for h in hidden):
            raise ValueError(f"layer widths must be >= 1: in_features={in_features!r}, "
                             f"hidden={list(hidden)!r}, out_features={out_features!r}")
        if activation not in _ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r} (known: {sorted(_ACTIVATIONS)})")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
        layers: list[nn.Module] = []
        width = in_features
        for h in hidden:
            layers += [nn.Linear(width, h), _ACTIVATIONS[activation]()]
            if dropout:
                layers.append(nn.Dropout(dropout))
            width = h
        layers.append(nn.Linear(width, out_features))
        self.net = nn.Sequential(*layers)
        self.out_features = out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The network's output for a batch ``x``; one output feature is returned as shape ``(batch,)``."""
        y: torch.Tensor = self.net(x)
        return y.squeeze(-1) if self.out_features == 1 else y
