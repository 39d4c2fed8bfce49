"""The one way diffbatch changes what a module's `forward` does: a diffusers hook.

`route_forward(module, name, forward)` registers a `ModelHook` (diffusers'
`HookRegistry`, the mechanism its own caches use) whose forward is
`forward(original, args, kwargs)`, `original` being the module's forward before the
hook. Each name is registered once per module; hooks of other names (diffusers'
caches, another of diffbatch's) stack around it as diffusers stacks its own.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, cast

import torch

# forward(original forward, args, kwargs) -> the module's output
RoutedForward = Callable[[Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any]


def route_forward(module: torch.nn.Module, name: str, forward: RoutedForward) -> bool:
    """Route `module.forward` through `forward` under hook `name`; False if it already is."""
    from diffusers.hooks import HookRegistry

    registry = HookRegistry.check_if_exists_or_initialize(module)
    if registry.get_hook(name) is not None:
        return False
    registry.register_hook(_hook_class()(forward), name)
    return True


@functools.cache
def _hook_class() -> type:
    from diffusers.hooks import ModelHook  # (diffusers is imported where it is used)

    class RoutedHook(ModelHook):  # type: ignore[misc]
        def __init__(self, forward: RoutedForward) -> None:
            super().__init__()
            self.forward = forward

        def new_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            original = cast("Callable[..., Any]", self.fn_ref.original_forward)
            return self.forward(original, args, kwargs)

    return RoutedHook
