"""Which adapters the cluster may serve, by name: a list of NAME=PATH and/or an adapter root whose
subdirectories are PEFT adapters named by their directory. The root is read at each lookup, so an adapter
copied in later is found without a restart. Owns no sockets; imports no Ray."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from runtime.common.names import adapter_name_problem


class CatalogError(ValueError):
    """The adapter list or root is unusable; the message names the entry."""


@dataclass(frozen=True)
class AdapterCatalog:
    listed: tuple[tuple[str, str], ...] = ()  # (name, absolute path), in the order given
    root: str | None = None  # absolute path of the adapter root

    @classmethod
    def build(cls, listed: Sequence[str] = (), root: str | Path | None = None) -> AdapterCatalog:
        """From `NAME=PATH` strings and an optional root; raises CatalogError naming what is wrong."""
        pairs: dict[str, str] = {}
        for item in listed:
            name, sep, path = item.partition("=")
            if not sep or not path:
                raise CatalogError(f"--adapter {item!r}: expected NAME=PATH")
            if (problem := adapter_name_problem(name)) is not None:
                raise CatalogError(f"--adapter {item!r}: {problem}")
            if name in pairs:
                raise CatalogError(f"--adapter {name!r} is given twice")
            if not (Path(path) / "adapter_config.json").is_file():
                raise CatalogError(f"--adapter {item!r}: {path}/adapter_config.json does not exist")
            pairs[name] = str(Path(path).resolve())
        if root is not None and not Path(root).is_dir():
            raise CatalogError(f"--adapter-root {root}: not a directory")
        if root is None and not pairs:
            raise CatalogError("no adapters: give --adapter-root DIR or --adapter NAME=PATH")
        return cls(tuple(pairs.items()), str(Path(root).resolve()) if root is not None else None)

    def path_of(self, name: str) -> str | None:
        """The adapter directory serving `name`, or None when the catalog has no such adapter. A listed
        name wins over the root; under the root only a direct subdirectory with adapter_config.json
        counts (the name rule already excludes '/', '..' and hidden entries)."""
        for listed_name, path in self.listed:
            if listed_name == name:
                return path
        if self.root is None or adapter_name_problem(name) is not None:
            return None
        candidate = Path(self.root) / name
        return str(candidate) if (candidate / "adapter_config.json").is_file() else None

    def names(self) -> list[str]:
        """Every adapter name, listed ones first, then the root's, sorted."""
        out = [name for name, _ in self.listed]
        if self.root is not None:
            seen = set(out)
            for entry in sorted(Path(self.root).iterdir()):
                if entry.name not in seen and self.path_of(entry.name) is not None:
                    out.append(entry.name)
        return out
