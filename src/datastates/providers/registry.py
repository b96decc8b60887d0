"""The registry of state providers: an ordered set, asked in order, passed explicitly."""

from __future__ import annotations

from typing import Any, Iterable

from .base import StateProvider
from .builtin import builtin_providers


class ProviderRegistry:
    """An ordered set of providers, asked in order; passed explicitly (no global registry)."""

    def __init__(self, providers: Iterable[StateProvider] = ()):
        self._providers: list[StateProvider] = []
        for provider in providers:
            self.register(provider, first=False)

    @classmethod
    def default(cls) -> "ProviderRegistry":
        """A new registry with the built-in providers."""
        return cls(builtin_providers())

    def register(self, provider: StateProvider, *, first: bool = True) -> "ProviderRegistry":
        """Add ``provider``; by default ahead of the others so user providers win."""
        if not isinstance(provider, StateProvider):
            raise TypeError(f"expected a StateProvider, found {type(provider).__qualname__}")
        if not provider.name:
            raise ValueError(f"{type(provider).__qualname__} has no name")
        if any(p.name == provider.name for p in self._providers):
            raise ValueError(f"a provider named {provider.name!r} is already registered")
        if first:
            self._providers.insert(0, provider)
        else:
            self._providers.append(provider)
        return self

    def find(self, obj: Any) -> StateProvider | None:
        for provider in self._providers:
            if provider.can_handle(obj):
                return provider
        return None

    def get(self, name: str) -> StateProvider | None:
        for provider in self._providers:
            if provider.name == name:
                return provider
        return None

    def __iter__(self):
        return iter(list(self._providers))
