"""A hypothesis strategy of random JSON schemas that xgrammar compiles, for structured-output tests and
benchmarks/structured_output.py: objects, arrays, anyOf, enums, ranged integers and numbers, strings (plain,
pattern, format), booleans and null, nested a few levels.

Every string has a maxLength and every array a maxItems: a random-weight model (the tests' tiny one) closes an
unbounded string only by chance (one allowed token in hundreds ends it), so without a bound its outputs run into
max_tokens, which says nothing about the grammar.
"""

from __future__ import annotations

import json
import string

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

NAMES = st.text(alphabet=string.ascii_lowercase + "_", min_size=1, max_size=6)


def _leaf_schemas() -> st.SearchStrategy[dict]:
    return st.one_of(
        st.integers(0, 8).map(lambda n: {"type": "string", "maxLength": n}),
        st.integers(1, 6).map(lambda n: {"type": "string", "pattern": f"^[a-z0-9]{{1,{n}}}$"}),
        st.just({"type": "string", "format": "date"}),
        st.tuples(st.integers(-1000, 1000), st.integers(0, 5000)).map(
            lambda r: {"type": "integer", "minimum": r[0], "maximum": r[0] + r[1]}),
        st.tuples(st.integers(-50, 50), st.integers(1, 100)).map(
            lambda r: {"type": "number", "minimum": r[0], "maximum": r[0] + r[1]}),
        st.just({"type": "boolean"}),
        st.just({"type": "null"}),
        st.lists(st.one_of(NAMES, st.integers(-9, 99), st.booleans()), min_size=1, max_size=4, unique=True).map(
            lambda values: {"enum": values}),
    )


def _object_schema(children: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
    def build(properties: dict, required_flags: list[bool]) -> dict:
        required = [name for name, flag in zip(properties, required_flags) if flag]
        return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}

    return st.dictionaries(NAMES, children, min_size=1, max_size=4).flatmap(
        lambda props: st.lists(st.booleans(), min_size=len(props), max_size=len(props)).map(
            lambda flags: build(props, flags)))


def _array_schema(children: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
    return st.tuples(children, st.integers(0, 2), st.integers(0, 2)).map(
        lambda t: {"type": "array", "items": t[0], "minItems": t[1], "maxItems": t[1] + t[2]})


def json_schemas() -> st.SearchStrategy[dict]:
    """A random schema, an object at the top (what response_format json_schema asks for)."""
    nested = st.recursive(_leaf_schemas(), lambda children: st.one_of(
        _object_schema(children), _array_schema(children),
        st.lists(children, min_size=2, max_size=3).map(lambda options: {"anyOf": options})), max_leaves=5)
    return _object_schema(nested)


def random_schemas(count: int) -> list[dict]:
    """The first `count` distinct schemas of one derandomized hypothesis stream (the same in every run)."""
    drawn: dict[str, dict] = {}

    @settings(max_examples=4 * count, database=None, derandomize=True, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(json_schemas())
    def draw(schema: dict) -> None:
        if len(drawn) < count:
            drawn.setdefault(json.dumps(schema, sort_keys=True), schema)

    draw()
    return list(drawn.values())
