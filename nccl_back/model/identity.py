"""Model identity: which checkpoint bytes and config a worker holds.

``ModelSpec.version`` is the MD5 of the canonical JSON of the model config together
with every shard's name *within the model* (its path relative to the model's root),
size and CRC32C. It depends on content only: the same bytes in another directory, on
another mount point or in any bucket of any store instead of a local copy share one
version, so those workers share weights; one changed byte changes it. Hashing the bytes' checksums,
not the safetensors headers, is the point: two checkpoints with identical headers and
one differing tensor must never share a version (vLLM 0.31's header-only key did
exactly that).

Each shard's CRC32C comes from the backend of its URI's scheme
(:meth:`~nccl_back.model.storage.Storage.crc32cs`).

A diffusers pipeline folder (``model_index.json`` at the root, one folder per
component) is one spec: its version covers ``model_index.json``, every component's
JSON files and every weight file, named ``component/file``.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from nccl_back import bounded_json
from nccl_back.config import Settings
from nccl_back.errors import CheckpointFormatError, ConfigError, ShardNotFoundError
from nccl_back.model.safetensors_format import INDEX_NAME, MAX_INDEX_BYTES, parse_index
from nccl_back.model.storage import Location, ObjectInfo, Shard, Storage, parse_uri

__all__ = ["ModelSpec", "Shard"]

CONFIG_NAME = "config.json"
#: Largest config.json read (real ones are a few KiB; some embed tokenizer tables).
MAX_CONFIG_BYTES = 16 << 20
#: Largest ModelSpec JSON parsed.
_MAX_JSON_BYTES = 256 << 20


@dataclass(frozen=True)
class ModelSpec:
    """A checkpoint's identity: its config and its shards (kept sorted by name).

    Shard URIs say where this worker reads the bytes; they are not part of the version.
    For a diffusers pipeline folder ``components`` names every component of its
    ``model_index.json`` (weightless ones too), each shard's name starts with its
    component's folder (``unet/diffusion_pytorch_model.safetensors``) and ``config`` is
    ``{"model_index": ..., "components": {name: {json file name: content}}}``.
    """

    config: Mapping[str, Any]
    shards: tuple[Shard, ...] = field(default=())
    components: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if not isinstance(self.config, Mapping):
            raise ConfigError(f"ModelSpec config must be a mapping, got {type(self.config).__name__}")
        try:
            json.dumps(self.config, sort_keys=True)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"ModelSpec config is not JSON-serialisable: {e}") from e
        shards = tuple(sorted(self.shards, key=lambda s: s.name))
        names = [s.name for s in shards]
        if len(set(names)) != len(names):
            raise ConfigError(f"ModelSpec lists a shard name twice: {names}")
        object.__setattr__(self, "shards", shards)
        components = tuple(sorted(self.components))
        for c in components:
            if not _COMPONENT_RE.match(c):
                raise ConfigError(f"pipeline component name {c!r} must be a plain identifier")
        stray = [s.name for s in shards if components and s.name.split("/", 1)[0] not in components]
        if stray:
            raise ConfigError(f"ModelSpec shards outside every component: {stray}")
        object.__setattr__(self, "components", components)

    @property
    def name(self) -> str:
        """The model's folder name (the last component of its directory or bucket
        prefix), for operators; empty for a spec without shards. Never part of the
        identity."""
        if not self.shards:
            return ""
        first = self.shards[0]
        uri = first.uri.rstrip("/")
        root = uri[: -len(first.name)] if uri.endswith("/" + first.name) else uri.rsplit("/", 1)[0]
        return root.rstrip("/").rsplit("/", 1)[-1]

    @cached_property
    def version(self) -> str:
        """MD5 hex of the canonical JSON of the config and every shard's (name, size, CRC32C).

        Content only: never a URI or absolute path.
        """
        content: dict[str, Any] = {
            "config": self.config, "shards": [[s.name, s.size, s.crc32c] for s in self.shards]
        }
        if self.components:
            content["components"] = list(self.components)
        payload = json.dumps(content, sort_keys=True, separators=(",", ":"))
        return hashlib.md5(payload.encode()).hexdigest()

    @property
    def nbytes(self) -> int:
        """Total size of the shards in bytes."""
        return sum(s.size for s in self.shards)

    # -- pipelines ------------------------------------------------------------------------

    def component_of(self, shard: Shard) -> str:
        """The pipeline component a shard belongs to ("" for a single model)."""
        return shard.name.split("/", 1)[0] if self.components else ""

    def component_shards(self, name: str) -> tuple[Shard, ...]:
        """A pipeline component's weight files (empty for a weightless component)."""
        self._check_component(name)
        return tuple(s for s in self.shards if self.component_of(s) == name)

    @property
    def weighted_components(self) -> tuple[str, ...]:
        """The components that have weight files, sorted."""
        return tuple(sorted({self.component_of(s) for s in self.shards} - {""}))

    def component_config(self, name: str, filename: str = CONFIG_NAME) -> dict[str, Any]:
        """A component's JSON file (``config.json``, ``scheduler_config.json``) as read."""
        self._check_component(name)
        found = self.config["components"].get(name, {}).get(filename)
        if not isinstance(found, dict):
            raise ConfigError(f"pipeline component {name!r} has no {filename}")
        return found

    def component_class(self, name: str) -> tuple[str, str]:
        """``(library, class name)`` of a component, from ``model_index.json``."""
        self._check_component(name)
        library, class_name = self.config["model_index"][name]
        return str(library), str(class_name)

    def _check_component(self, name: str) -> None:
        if name not in self.components:
            raise ConfigError(
                f"{name!r} is not a component of this pipeline (it has {list(self.components)})"
                if self.components else f"{name!r}: this spec is a single model, not a pipeline"
            )

    # -- serialisation --------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "config": dict(self.config),
            "shards": [[s.uri, s.crc32c, s.size, s.name] for s in self.shards],
        }
        if self.components:
            data["components"] = list(self.components)
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | str | bytes) -> ModelSpec:
        """Inverse of :meth:`to_json` (also accepts the JSON text)."""
        try:
            raw = (
                bounded_json.loads(data, max_bytes=_MAX_JSON_BYTES, allow_constants=True)
                if isinstance(data, (str, bytes))
                else data
            )
            shards = tuple(_shard_from_json(item) for item in raw["shards"])
            components = tuple(str(c) for c in raw.get("components", ()))
            return cls(dict(raw["config"]), shards, components)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ConfigError(f"malformed ModelSpec JSON: {e!r}") from e

    @classmethod
    def from_dir(
        cls,
        path_or_uri: str,
        *,
        cache_dir: str | None = None,
        storage: Storage | None = None,
        settings: Settings | None = None,
    ) -> ModelSpec:
        """The spec of the checkpoint in a local directory or a bucket prefix (any URI
        :func:`~nccl_back.model.storage.parse_uri` accepts).

        Reads ``config.json`` and the ``*.safetensors`` shards; when a
        ``*.safetensors.index.json`` is present only the shards it lists count (a
        consolidated copy next to them is ignored). A folder with ``model_index.json``
        is a diffusers pipeline: every component it lists must have its folder, whose
        JSON files (configs) and weight files (chosen the same way; variants such as
        ``*.fp16.safetensors`` are ignored) the spec covers. Reads go through
        ``storage``, else a :class:`Storage` with ``settings`` (retries, workers); the
        CRC32C cache lives in ``cache_dir``, else the settings' ``cache_dir``.
        """
        storage = storage or Storage(settings)
        cache_dir = cache_dir or storage.settings.cache_dir
        root = parse_uri(path_or_uri)
        try:
            files = {i.name: i for i in storage.list_dir(root.uri)}
        except ShardNotFoundError as e:
            # A remote store says what is missing (the bucket, at which endpoint).
            why = "" if root.is_local else f" ({e})"
            raise ShardNotFoundError(
                f"checkpoint {root.uri!r} not found; give the directory (or bucket prefix)"
                " holding config.json and the *.safetensors shards (or a pipeline's"
                f" model_index.json){why}"
            ) from e
        if PIPELINE_INDEX_NAME in files:
            return cls._from_pipeline(storage, root, files, cache_dir)
        if CONFIG_NAME not in files:
            raise ShardNotFoundError(f"{root.join(CONFIG_NAME).uri!r} does not exist")
        config = _read_json(storage, files[CONFIG_NAME])
        infos = _weight_files(storage, root, files, variants=True)
        if not infos:
            raise ShardNotFoundError(f"no *.safetensors shards in {root.uri!r}")
        return cls(config, tuple(_shards(storage, infos, "", cache_dir)))

    @classmethod
    def _from_pipeline(
        cls, storage: Storage, root: Location, files: dict[str, ObjectInfo], cache_dir: str
    ) -> ModelSpec:
        index_uri = files[PIPELINE_INDEX_NAME].uri
        index = _read_json(storage, files[PIPELINE_INDEX_NAME])
        # Entries are [library, class]; [null, null] is an absent optional component and
        # other values (booleans, "_class_name") are the pipeline's own arguments.
        components = sorted(
            k for k, v in index.items()
            if not k.startswith("_") and isinstance(v, list) and len(v) == 2
            and all(isinstance(x, str) for x in v)
        )
        if not components:
            raise CheckpointFormatError(f"{index_uri}: lists no components")
        configs: dict[str, dict[str, Any]] = {}
        shards: list[Shard] = []
        for name in components:
            if not _COMPONENT_RE.match(name):
                raise CheckpointFormatError(f"{index_uri}: component name {name!r} is not a plain identifier")
            folder = root.join(name)
            try:
                sub = {i.name: i for i in storage.list_dir(folder.uri)}
            except ShardNotFoundError as e:
                raise ShardNotFoundError(
                    f"pipeline component {name!r} (listed in model_index.json) has no folder {folder.uri!r}"
                ) from e
            if not sub:
                raise ShardNotFoundError(
                    f"pipeline component {name!r} (listed in model_index.json): folder {folder.uri!r} is empty"
                )
            configs[name] = {
                n: _read_json(storage, i) for n, i in sub.items()
                if n.endswith(".json") and not n.endswith(_INDEX_SUFFIX)
            }
            weights = _weight_files(storage, folder, sub, variants=False)
            other = sorted(n for n in sub if n.endswith(_OTHER_WEIGHTS))
            if not weights and other:
                # Counted as weightless, its weights would be outside the version.
                raise CheckpointFormatError(
                    f"pipeline component {name!r}: only non-safetensors weights {other[:3]};"
                    " convert them to safetensors"
                )
            shards.extend(_shards(storage, weights, f"{name}/", cache_dir))
        config = {"model_index": index, "components": configs}
        return cls(config, tuple(shards), tuple(components))


#: The file that makes a folder a diffusers pipeline.
PIPELINE_INDEX_NAME = "model_index.json"
_INDEX_SUFFIX = ".safetensors.index.json"
_OTHER_WEIGHTS = (".bin", ".pt", ".pth", ".ckpt", ".msgpack", ".h5", ".onnx")
_COMPONENT_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _read_json(storage: Storage, info: ObjectInfo) -> dict[str, Any]:
    """A config file (``config.json``, ``model_index.json``), bounded like any outside input."""
    uri = info.uri
    raw = storage.read_bytes(uri, max_bytes=MAX_CONFIG_BYTES)
    try:
        data = bounded_json.loads(raw, max_bytes=MAX_CONFIG_BYTES, allow_constants=True)
    except ValueError as e:
        raise CheckpointFormatError(f"{uri}: malformed JSON: {e}") from e
    if not isinstance(data, dict):
        raise CheckpointFormatError(f"{uri}: expected a JSON object")
    return data


def _weight_files(
    storage: Storage, folder: Location, files: dict[str, ObjectInfo], *, variants: bool
) -> list[ObjectInfo]:
    """The safetensors files that make up the weights in ``folder``.

    With an index (``model.safetensors.index.json``,
    ``diffusion_pytorch_model.safetensors.index.json``) exactly the files it lists;
    else every ``*.safetensors``. Without ``variants``, files named like
    ``name.fp16.safetensors`` (and their indexes) are left out.
    """
    def plain(n: str, suffix: str) -> bool:
        return variants or "." not in n[: -len(suffix)]

    indexes = sorted(n for n in files if n.endswith(_INDEX_SUFFIX) and plain(n, _INDEX_SUFFIX))
    if INDEX_NAME in indexes:
        indexes = [INDEX_NAME]
    if len(indexes) > 1:
        raise CheckpointFormatError(f"{folder.uri}: several safetensors indexes {indexes}; keep one")
    if indexes:
        index_uri = files[indexes[0]].uri
        raw = storage.read_bytes(index_uri, max_bytes=MAX_INDEX_BYTES)
        names = sorted(set(parse_index(raw, index_uri).values()))
        missing = [n for n in names if n not in files]
        if missing:
            raise ShardNotFoundError(
                f"{index_uri} lists shards that do not exist: {[folder.join(n).uri for n in missing]}"
            )
    else:
        names = [n for n in files if n.endswith(".safetensors") and plain(n, ".safetensors")]
    return [files[n] for n in names]


def _shards(storage: Storage, infos: list[ObjectInfo], prefix: str, cache_dir: str) -> list[Shard]:
    """Shards named ``prefix + file name``, with the CRC32C their backend gives."""
    crcs = storage.crc32cs(infos, cache_dir)
    return [Shard(i.uri, c, i.size, prefix + i.name) for i, c in zip(infos, crcs, strict=True)]


def _shard_from_json(item: Any) -> Shard:
    """``[uri, crc32c, size]`` or ``[uri, crc32c, size, name]`` (name: the URI's last part)."""
    if not isinstance(item, (list, tuple)) or len(item) not in (3, 4):
        raise ValueError(f"shard entry {item!r} is not [uri, crc32c, size(, name)]")
    uri, crc, size = str(item[0]), str(item[1]), int(item[2])
    return Shard(uri, crc, size, str(item[3]) if len(item) == 4 else "")

