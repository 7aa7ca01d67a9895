"""YAML as the exporter toolkit reads a web config: strict keys, plain scalars left as text.

Its own module so that PyYAML (a sizeable import) is imported only by a daemon that
has a web config to read (:func:`gpuwatchd.serve.web.config.load_web_config`).
"""

from __future__ import annotations

from typing import Any

import yaml

from gpuwatchd.validate import one_line

#: Implicit types the loader still resolves: null (an unset field) and merge keys.
_KEPT_IMPLICIT_TAGS = ("tag:yaml.org,2002:null", "tag:yaml.org,2002:merge")


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys, as Go's ``yaml.UnmarshalStrict`` does.

    Plain scalars stay text (no implicit int, float, bool or timestamp): Go decides a
    scalar's type from the field it lands in, and so do the ``_str``/``_bool``/``_int``
    readers of the web config.
    """

    yaml_implicit_resolvers = {  # noqa: RUF012  (PyYAML's own class attribute)
        first: [(tag, rx) for tag, rx in resolvers if tag in _KEPT_IMPLICIT_TAGS]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }


def _construct_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    loader.flatten_mapping(node)
    seen: set[object] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        try:
            duplicate = key in seen
        except TypeError:
            raise yaml.constructor.ConstructorError(
                None, None, "a mapping key must be a plain value", key_node.start_mark
            ) from None
        if duplicate:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark
            )
        seen.add(key)
    return loader.construct_mapping(node, deep=True)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load_strict(text: str) -> object:
    """The document in ``text``; ValueError (one line, with the position) if it is bad YAML."""
    try:
        return yaml.load(text, Loader=_StrictLoader)  # a SafeLoader subclass
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ValueError(f"invalid YAML{where}: {exc.problem}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"invalid YAML: {one_line(exc)}") from None
