"""Structured outputs on xgrammar (engine/structured_output/): on a tiny random-weight model, whose text is
garbage, every output under a grammar must still match it (jsonschema, the regex, the choices), with n > 1,
preemption, speculation (n-gram and a draft model: greedy output identical to the same request without it) and
through the server (response_format, structured_outputs, guided_*, the openai SDK's `parse`, 200 random schemas
through the SDK, streamed and not)."""

from __future__ import annotations

import asyncio
import json
import re
import threading

import httpx
import jsonschema
import openai
import pydantic
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from json_schemas import json_schemas, random_schemas
from llmctl.engine import LLM, SamplingParams
from llmctl.engine.errors import InvalidRequestError
from llmctl.engine.sampling_params import StructuredOutputsParams
from llmctl.engine.structured_output.xgrammar_backend import XgrammarBackend
from llmctl.engine.tokenizer import Tokenizer
from server_helpers import running_server

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
         "disable_by_cost": False}


@pytest.fixture(scope="module")
def llm(tiny_chat_model):
    return LLM(str(tiny_chat_model), device="cpu", dtype="float32", max_num_seqs=64)


def _sampled(structured: StructuredOutputsParams, **overrides) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 256, "temperature": 1.0, "seed": 7, "structured_outputs": structured,
                             **overrides})


def _assert_valid_json(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema)


# ---- the spec -----------------------------------------------------------------------------------
def test_a_spec_takes_exactly_one_constraint_and_names_what_is_wrong():
    with pytest.raises(InvalidRequestError, match="exactly one of .* \\(got json, regex\\)"):
        StructuredOutputsParams(json={}, regex="a")
    with pytest.raises(InvalidRequestError, match="exactly one .*got none"):
        StructuredOutputsParams()
    with pytest.raises(InvalidRequestError, match="choice must be a non-empty list of strings"):
        StructuredOutputsParams(choice=["a", 1])
    with pytest.raises(InvalidRequestError, match="json is not valid JSON"):
        StructuredOutputsParams(json="{")
    with pytest.raises(InvalidRequestError, match="min_tokens cannot be combined"):
        SamplingParams(min_tokens=2, structured_outputs=StructuredOutputsParams(regex="a+"))


def test_two_spellings_of_one_schema_share_a_key():
    one = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "string"}}})
    other = StructuredOutputsParams(json='{"properties": {"a": {"type": "string"}}, "type": "object"}')
    assert one.key == other.key and one.key != StructuredOutputsParams(json={"type": "object"}).key


# ---- the backend ----------------------------------------------------------------------------------
def test_ids_past_the_tokenizers_vocabulary_are_never_allowed(tiny_chat_model):
    tokenizer = Tokenizer.from_pretrained(tiny_chat_model)
    model_vocab = tokenizer.vocab_size + 40  # the embedding's padding rows
    backend = XgrammarBackend(tokenizer, model_vocab, tokenizer.eos_token_ids)
    matcher = backend.matcher(backend.compile(StructuredOutputsParams(json_object=True)))
    bitmask = backend.allocate_bitmask(1)
    matcher.fill_bitmask(bitmask, 0)
    import torch

    logits = torch.zeros(1, model_vocab)
    backend.apply_bitmask(logits, bitmask, [0])
    allowed = torch.isfinite(logits[0]).nonzero().flatten().tolist()
    assert allowed and max(allowed) < tokenizer.vocab_size
    assert all(tokenizer.decode([t]).lstrip().startswith("{") for t in allowed)  # an object starts with "{"
    assert not set(allowed) & tokenizer.eos_token_ids  # nothing may end an empty output


def test_length_bounded_strings_refuse_raw_control_characters(tiny_chat_model):
    """xgrammar 0.2.9's minLength/maxLength string rule admits control characters, invalid in JSON: patched."""
    tokenizer = Tokenizer.from_pretrained(tiny_chat_model)
    backend = XgrammarBackend(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)
    compiled = backend.compile(StructuredOutputsParams(json={"type": "object", "required": ["s"], "properties": {
        "s": {"type": "string", "maxLength": 4}}}))
    control = tokenizer.encode("\x17", add_special_tokens=False)
    quote_prefix = tokenizer.encode('{"s": "', add_special_tokens=False)
    matcher = backend.matcher(compiled)
    assert all(matcher.accept_token(t) for t in quote_prefix)
    assert not matcher.accept_token(control[0])
    assert all(matcher.accept_token(t) for t in tokenizer.encode('ab"}', add_special_tokens=False))


def test_a_construct_xgrammar_cannot_compile_is_refused_naming_it(llm):
    with pytest.raises(InvalidRequestError, match="the regex is not supported: .*Lookbehind is not supported"):
        llm.generate("x", _sampled(StructuredOutputsParams(regex="(?<=a)b")))
    with pytest.raises(InvalidRequestError, match='grammar is not supported: .*Rule "foo" is not defined'):
        llm.generate("x", _sampled(StructuredOutputsParams(grammar="root ::= foo")))
    assert not llm.engine.has_unfinished_requests()


def test_each_spec_compiles_once(llm):
    manager = llm.engine.structured_output
    schema = {"type": "object", "properties": {"k": {"type": "boolean"}}, "required": ["k"]}
    before = len(manager.compile_seconds)
    llm.generate(["a", "b"], _sampled(StructuredOutputsParams(json=schema), n=2))
    llm.generate("c", _sampled(StructuredOutputsParams(json=json.dumps(schema, indent=2))))
    assert len(manager.compile_seconds) == before + 1


# ---- the engine -----------------------------------------------------------------------------------
def test_sampled_outputs_at_n_2_match_the_schema_and_end_with_the_grammar(llm):
    outputs = llm.generate(["Hello", "The question"], _sampled(StructuredOutputsParams(json=PERSON), n=2))
    texts = [c.text for out in outputs for c in out.outputs]
    assert len(texts) == 4 and len(set(texts)) > 1  # one matcher per sample: the samples differ
    for out in outputs:
        for completion in out.outputs:
            assert completion.finish_reason == "stop", completion
            _assert_valid_json(completion.text, PERSON)


def test_regex_choice_grammar_and_json_object(llm):
    cases = [
        (StructuredOutputsParams(regex=r"[a-z]{2,5}-\d{1,3}"), lambda t: re.fullmatch(r"[a-z]{2,5}-\d{1,3}", t)),
        (StructuredOutputsParams(choice=["yes", "no", "peut-être"]), lambda t: t in ("yes", "no", "peut-être")),
        (StructuredOutputsParams(grammar='root ::= "(" [0-9]{1,3} ("+" [0-9]{1,3}){0,3} ")"'),
         lambda t: re.fullmatch(r"\(\d{1,3}(\+\d{1,3}){0,3}\)", t)),
    ]
    for structured, ok in cases:
        for params in (_sampled(structured, n=2), _sampled(structured, temperature=0.0)):
            for completion in llm.generate("Romeo", params)[0].outputs:
                assert completion.finish_reason == "stop" and ok(completion.text), (structured, completion.text)
    for obj in llm.generate("{", _sampled(StructuredOutputsParams(json_object=True), n=4, max_tokens=64))[0].outputs:
        # any object: a random model closes an unbounded string only by chance, so some run into max_tokens
        assert obj.text.startswith("{") and (obj.finish_reason == "length" or isinstance(json.loads(obj.text), dict))


def test_ignore_eos_still_ends_where_the_grammar_ends(llm):
    out = llm.generate("x", _sampled(StructuredOutputsParams(choice=["alpha", "beta"]), ignore_eos=True))
    completion = out[0].outputs[0]
    assert completion.text in ("alpha", "beta") and completion.finish_reason == "stop"


@settings(max_examples=3, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.lists(json_schemas(), min_size=8, max_size=8))
def test_random_schemas_every_output_is_valid(llm, schemas):
    """8 random schemas per example (24 in all), sampled, in one batch: every output valid under jsonschema
    (benchmarks/structured_output.py --validity 200 runs more)."""
    prompts = [f"Answer {i}:" for i in range(len(schemas))]
    params = [_sampled(StructuredOutputsParams(json=schema), seed=i, max_tokens=320) for i, schema in enumerate(schemas)]
    for schema, out in zip(schemas, llm.generate(prompts, params)):
        for completion in out.outputs:
            assert completion.finish_reason == "stop", (schema, completion.text)
            _assert_valid_json(completion.text, schema)


def test_preempted_sequences_keep_their_grammar(tiny_chat_model):
    """A pool too small for the batch preempts and recomputes sequences; their matchers still match their
    tokens, so greedy outputs equal those of a pool with room for all."""
    prompts = [f"Prompt number {i} says" for i in range(6)]
    params = SamplingParams(max_tokens=120, temperature=0.0, structured_outputs=StructuredOutputsParams(json=PERSON))
    roomy = LLM(str(tiny_chat_model), device="cpu", dtype="float32")
    expected = [o.outputs[0].text for o in roomy.generate(prompts, params)]
    tight = LLM(str(tiny_chat_model), device="cpu", dtype="float32", block_size=16, num_kv_blocks=13,
                max_model_len=192, enable_prefix_caching=True)
    outputs = tight.generate(prompts, params)
    assert sum(o.metrics.num_preemptions for o in outputs) > 0
    assert [o.outputs[0].text for o in outputs] == expected
    for text in expected:
        _assert_valid_json(text, PERSON)


SPEC_REGEX = r"(ab|ba|abc){3,40}"
SPEC_PROMPTS = ["ab ba abc ab ba abc ab ba abc ab ba", '{"name": "ab", "age": 3, "tags": ["a", "b", "a"]}']
SPEC_PARAMS = [SamplingParams(max_tokens=80, temperature=0.0, structured_outputs=StructuredOutputsParams(**spec))
               for spec in ({"regex": SPEC_REGEX}, {"json": PERSON})]


@pytest.fixture(scope="module")
def greedy_without_speculation(tiny_chat_model) -> list[str]:
    plain = LLM(str(tiny_chat_model), device="cpu", dtype="float32")
    expected = [o.outputs[0].text for o in plain.generate(SPEC_PROMPTS, SPEC_PARAMS)]
    assert re.fullmatch(SPEC_REGEX, expected[0]) and json.loads(expected[1])
    return expected


@pytest.mark.parametrize("speculative_config", [NGRAM, "draft"], ids=["ngram", "draft_model"])
def test_speculation_with_a_grammar_gives_the_greedy_output_without_it(tiny_chat_model, speculative_config,
                                                                      greedy_without_speculation):
    """Each draft position is masked by a matcher advanced through the drafts before it (then rolled back):
    greedy output identical to decoding without drafts, with drafts proposed (n-gram, or a draft model: the
    model as its own, which drafts without the grammar)."""
    if speculative_config == "draft":
        speculative_config = {"model": str(tiny_chat_model), "num_speculative_tokens": 3, "disable_by_cost": False}
    spec = LLM(str(tiny_chat_model), device="cpu", dtype="float32", speculative_config=speculative_config)
    outputs = spec.generate(SPEC_PROMPTS, SPEC_PARAMS)
    assert [o.outputs[0].text for o in outputs] == greedy_without_speculation
    assert sum(o.metrics.spec_decode.num_draft_tokens for o in outputs) > 0


# ---- the server -----------------------------------------------------------------------------------
class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=10)
    age: int = pydantic.Field(ge=0, le=120)
    good: bool


@pytest.fixture(scope="module")
def server(tiny_chat_model):
    with running_server(str(tiny_chat_model), served_model_name="m", max_output_tokens=400) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)


USER = [{"role": "user", "content": "Who are you?"}]


def test_openai_sdk_parse_with_a_pydantic_model(client):
    for parse in (client.chat.completions.parse, client.beta.chat.completions.parse):
        response = parse(model="m", messages=USER, response_format=Person, n=2, seed=3, max_tokens=300)
        assert len(response.choices) == 2
        for choice in response.choices:
            assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Person)


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_json_schema_at_n_2(server, stream):
    body = {"model": "m", "messages": USER, "n": 2, "max_tokens": 300, "stream": stream, "seed": 5,
            "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                                       "strict": True}}}
    texts = _chat_texts(server, body)
    assert len(texts) == 2
    for text, finish in texts.values():
        assert finish == "stop"
        _assert_valid_json(text, PERSON)


async def _sdk_chat_texts(client: openai.AsyncOpenAI, schema: dict, stream: bool) -> list[tuple[str, str]]:
    """(content, finish_reason) of each of the n = 2 choices of a json_schema chat request, streamed or not."""
    body = {"model": "m", "messages": USER, "n": 2, "max_tokens": 300, "temperature": 1.0, "seed": 11,
            "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": schema, "strict": True}}}
    if not stream:
        response = await client.chat.completions.create(**body)
        return [(c.message.content, c.finish_reason) for c in sorted(response.choices, key=lambda c: c.index)]
    texts: dict[int, list] = {}
    async for chunk in await client.chat.completions.create(**body, stream=True):
        for choice in chunk.choices:
            entry = texts.setdefault(choice.index, ["", None])
            entry[0] += choice.delta.content or ""
            entry[1] = choice.finish_reason or entry[1]
    return [tuple(texts[index]) for index in sorted(texts)]


def test_response_format_json_schema_over_200_random_schemas(server):
    """200 random schemas (bounded sizes: the grammar ends every output), each asked through the openai SDK at
    n = 2, every other one streamed, concurrently on one server: all 400 outputs valid under jsonschema and ended
    by the grammar (an output cut by max_tokens fails)."""
    schemas = random_schemas(200)
    assert len(schemas) == 200

    async def ask_all() -> list[list[tuple[str, str]]]:
        limit = asyncio.Semaphore(32)
        async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0,
                                      timeout=600) as client:
            async def ask(schema: dict, stream: bool) -> list[tuple[str, str]]:
                async with limit:
                    return await _sdk_chat_texts(client, schema, stream)

            return await asyncio.gather(*(ask(schema, index % 2 == 1) for index, schema in enumerate(schemas)))

    for schema, choices in zip(schemas, asyncio.run(ask_all())):
        assert len(choices) == 2, (schema, choices)
        for text, finish in choices:
            assert finish == "stop", (schema, text)
            _assert_valid_json(text, schema)


def _chat_texts(server, body: dict) -> dict[int, tuple[str, str]]:
    """index -> (content, finish_reason) of a chat completion, streamed or not."""
    if not body.get("stream"):
        response = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        return {c["index"]: (c["message"]["content"], c["finish_reason"]) for c in response.json()["choices"]}
    texts: dict[int, list] = {}
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[6:])["choices"]:
                entry = texts.setdefault(choice["index"], ["", None])
                entry[0] += choice["delta"].get("content") or ""
                entry[1] = choice["finish_reason"] or entry[1]
    return {index: (text, finish) for index, (text, finish) in texts.items()}


@pytest.mark.parametrize("field, value, check", [
    ("structured_outputs", {"regex": "[0-9]{3}-[a-z]{2}"}, lambda t: re.fullmatch("[0-9]{3}-[a-z]{2}", t)),
    ("structured_outputs", {"choice": ["red", "green"]}, lambda t: t in ("red", "green")),
    ("guided_choice", ["up", "down"], lambda t: t in ("up", "down")),
    ("guided_regex", "x+y", lambda t: re.fullmatch("x+y", t)),
    ("guided_json", PERSON, lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
    ("guided_grammar", 'root ::= "a" | "bb"', lambda t: t in ("a", "bb")),
])
def test_completions_fields(server, field, value, check):
    body = {"model": "m", "prompt": "Say:", "max_tokens": 300, "n": 2, "seed": 1, field: value}
    response = httpx.post(server.base_url + "/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    for choice in response.json()["choices"]:
        assert choice["finish_reason"] == "stop" and check(choice["text"]), choice


@pytest.mark.parametrize("body, message", [
    ({"structured_outputs": {"regex": "(?<=a)b"}}, "the regex is not supported: .*Lookbehind"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "JSON schema is not supported"),
    ({"guided_choice": ["a"], "response_format": {"type": "json_object"}}, "one output constraint, not several"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "needs json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format 'yaml' is not supported"),
])
def test_refused_constraints_are_400s_naming_the_problem(server, body, message):
    response = httpx.post(server.base_url + "/v1/chat/completions",
                          json={"model": "m", "messages": USER, "max_tokens": 5, **body}, timeout=60)
    assert response.status_code == 400, response.text
    assert re.search(message, response.json()["error"]["message"]), response.text


def test_the_server_compiles_off_its_event_loop_and_the_step_loop(server):
    manager = server.engine.engine.structured_output
    compile_threads: list[str] = []
    original = manager.compile

    def recording(spec):
        compile_threads.append(threading.current_thread().name)
        return original(spec)

    manager.compile = recording
    try:
        body = {"model": "m", "prompt": "x", "max_tokens": 20, "structured_outputs": {"regex": "q{1,4}z"}}
        assert httpx.post(server.base_url + "/v1/completions", json=body, timeout=60).status_code == 200
    finally:
        del manager.compile
    assert compile_threads and compile_threads[0] not in ("llmctl-engine", threading.main_thread().name)
    assert compile_threads[0] != server.thread.name


def test_response_format_json_object(server):
    body = {"model": "m", "messages": USER, "n": 2, "max_tokens": 48, "seed": 2,
            "response_format": {"type": "json_object"}}
    for text, finish in _chat_texts(server, body).values():
        # any object: a random model closes an unbounded string only by chance, so some run into max_tokens
        assert text.startswith("{") and (finish == "length" or isinstance(json.loads(text), dict)), text


def test_langchain_with_structured_output_returns_the_pydantic_model(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    chat = langchain_openai.ChatOpenAI(base_url=server.base_url + "/v1", api_key="none", model="m", max_tokens=300,
                                       seed=3, max_retries=0)
    person = chat.with_structured_output(Person, method="json_schema", strict=True).invoke("Who are you?")
    assert isinstance(person, Person)


def test_instructor_json_schema_mode_returns_the_pydantic_model(client):
    instructor = pytest.importorskip("instructor", reason="instructor is in the test extra; not installed here")
    person = instructor.from_openai(client, mode=instructor.Mode.JSON_SCHEMA).chat.completions.create(
        model="m", messages=USER, response_model=Person, max_tokens=300, seed=3, max_retries=0)
    assert isinstance(person, Person)
