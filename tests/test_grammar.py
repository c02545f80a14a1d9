"""Grammar-constrained decoding in the engine (xgrammar on the bundled SmolLM2, fp32), and the
tool-call grammars: each format's grammar accepts exactly what its parser reads back."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from conftest import assert_drained, collect, drain
from ketch import LLM, SamplingParams
from ketch.parsers import ChatOutputParser
from ketch.parsers.tool_grammar import CALL_FORMATS, after_reasoning, answer_format, forced_calls, structural_tag
from ketch.sampling.grammar import GrammarSpec
from ketch.scheduler.request import RequestState

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
PERSON = [{"role": "user", "content": "Describe a person as JSON."}]


@pytest.fixture(scope="module")
def llm(smollm_path) -> LLM:
    threads = torch.get_num_threads()
    yield LLM(smollm_path, dtype="float32", num_threads=1)
    torch.set_num_threads(threads)


def _drained(llm: LLM) -> None:
    assert_drained(llm.engine)
    assert not llm.engine.grammars.parked


def test_json_schema_output_validates_for_many_seeds(llm):
    outs = llm.chat([PERSON] * 4, SamplingParams(temperature=1.0, seed=7, n=2, max_tokens=60,
                                                 grammar=GrammarSpec.json_schema(SCHEMA)))
    texts = [c.text for o in outs for c in o.outputs]
    assert len(set(texts)) > 1  # sampled, not one forced string
    for o in outs:
        for c in o.outputs:
            assert c.finish_reason == "stop"
            jsonschema.validate(json.loads(c.text), SCHEMA)
    _drained(llm)


def test_regex_and_ebnf(llm):
    out = llm.generate("My phone number is", SamplingParams(temperature=0.8, seed=1, max_tokens=30,
                                                            grammar=GrammarSpec("regex", r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}")))
    assert re.fullmatch(r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}", out[0].text), out[0].text
    ebnf = 'root ::= answer " because " reason "."\nanswer ::= "yes" | "no"\nreason ::= [a-z ]{1,40}'
    out = llm.generate("Is the sky blue?", SamplingParams(temperature=0.8, seed=2, max_tokens=40,
                                                          grammar=GrammarSpec("ebnf", ebnf)))
    assert re.fullmatch(r"(yes|no) because [a-z ]{1,40}\.", out[0].text), out[0].text
    _drained(llm)


def test_constrained_rows_do_not_touch_their_batch_mates(llm):
    """A batch mixing constrained and free rows: the free rows' greedy output is what it is alone."""
    free = SamplingParams(temperature=0.0, max_tokens=12)
    alone = [o.text for o in llm.generate(["The capital of France is", "Water boils at"], free)]
    engine = llm.engine
    tok = llm.tokenizer
    engine.add_request("free-0", tok.encode("The capital of France is"), free)
    engine.add_request("json", tok.encode("A person:"), SamplingParams(temperature=0.0, max_tokens=40,
                                                                       grammar=GrammarSpec("json_object")))
    engine.add_request("free-1", tok.encode("Water boils at"), free)
    res = collect(drain(engine))
    assert [tok.decode(res[(f"free-{i}", 0)]["ids"]) for i in range(2)] == alone
    json.loads(tok.decode(res[("json", 0)]["ids"][:-1]))  # the last token is the stop token
    assert res[("json", 0)]["reason"] == "stop"
    _drained(llm)


def test_grammar_request_waits_only_for_itself_and_aborts_cleanly(llm):
    engine, tok = llm.engine, llm.tokenizer
    # a schema nobody compiled yet: the request is PENDING while others keep stepping
    schema = {"type": "object", "properties": {"k": {"type": "string", "pattern": "^[a-z]{3}$"}}, "required": ["k"]}
    engine.add_request("g", tok.encode("Hi"), SamplingParams(max_tokens=20, grammar=GrammarSpec.json_schema(schema)))
    engine.add_request("plain", tok.encode("Hello"), SamplingParams(temperature=0.0, max_tokens=3))
    assert engine.requests["g"][0].state is RequestState.PENDING
    engine.abort("g")
    outs = collect(drain(engine))
    assert outs[("g", 0)]["reason"] == "abort" and outs[("g", 0)]["ids"] == []
    assert len(outs[("plain", 0)]["ids"]) == 3
    _drained(llm)
    # n samples parked together: one abort ends every one of them, and the id is free again
    engine.add_request("g2", tok.encode("Hi"), SamplingParams(max_tokens=20, n=3, grammar=GrammarSpec.json_schema(schema)))
    assert [r.state for r in engine.requests["g2"]] == [RequestState.PENDING] * 3
    engine.abort("g2")
    outs = collect(drain(engine))
    assert {k: (v["reason"], v["ids"]) for k, v in outs.items()} == {("g2", i): ("abort", []) for i in range(3)}
    _drained(llm)


def test_bad_grammars_are_value_errors_naming_the_kind(llm):
    tok = llm.tokenizer
    for spec, kind in [(GrammarSpec("regex", "a(b"), "regex"), (GrammarSpec("ebnf", "root ::= nothing"), "ebnf"),
                       (GrammarSpec.json_schema({"type": "objectx"}), "json_schema")]:
        with pytest.raises(ValueError, match=f"^{kind}: invalid"):
            llm.engine.add_request("bad", tok.encode("x"), SamplingParams(grammar=spec))
    with pytest.raises(ValueError, match="^grammar: kind"):
        GrammarSpec("yaml", "x")
    with pytest.raises(ValueError, match="^json_schema: not valid JSON"):
        GrammarSpec.json_schema("{oops")
    _drained(llm)


def test_a_grammar_that_matches_nothing_is_an_error_not_an_abort(llm):
    """`root ::= root` builds and compiles but no text can begin it: refused when compiled, naming
    the kind. `root ::= "a" x  x ::= x` allows "a" and then nothing: the sample ends there with an
    error naming the kind, not with the sampler's fallback token and finish_reason "abort". The
    engine serves on and every page comes back."""
    params = dict(temperature=0.0, max_tokens=10)
    with pytest.raises(ValueError, match="^ebnf: invalid: the grammar matches no text"):
        llm.generate("Say:", SamplingParams(**params, grammar=GrammarSpec("ebnf", "root ::= root")))
    eng = llm.engine
    eng.add_request("dead-end", llm.tokenizer.encode("Say:"),
                    SamplingParams(**params, logprobs=True, grammar=GrammarSpec("ebnf", 'root ::= "a" x\nx ::= x')))
    outs = drain(eng)
    [out] = collect(outs).values()
    assert out["ids"] == llm.tokenizer.encode("a") and len(out["logprobs"]) == 1  # "a", not the refused token
    [error] = [o.error for o in outs if o.error is not None]
    assert error.startswith("ebnf: the grammar allows no token after 1 generated tokens"), error
    assert llm.generate("Say:", SamplingParams(**params, grammar=GrammarSpec("regex", "(yes|no)")))[0].text in (
        "yes", "no")
    _drained(llm)


def test_min_tokens_does_not_fight_the_grammar(llm):
    """min_tokens bans the stop token; a grammar that is complete allows only the stop token. The
    grammar wins (no all -inf row, no NaN)."""
    out = llm.generate("Answer:", SamplingParams(temperature=0.0, max_tokens=10, min_tokens=8,
                                                 grammar=GrammarSpec("regex", "(yes|no)")))
    assert out[0].text in ("yes", "no") and out[0].finish_reason == "stop"


def test_greedy_constrained_output_survives_preemption(llm, smollm_path):
    """Preemption recomputes the KV; the matcher's state is kept, so the output is the same."""
    params = SamplingParams(temperature=0.0, max_tokens=40, grammar=GrammarSpec.json_schema(SCHEMA))
    prompts = [[{"role": "user", "content": f"Person number {i} as JSON."}] for i in range(4)]
    want = [o.text for o in llm.chat(prompts, params)]
    page_bytes = 30 * 2 * 16 * 3 * 64 * 4  # layers × (K, V) × page × kv heads × head dim × fp32
    tight = LLM(smollm_path, dtype="float32", num_threads=1, kv_cache_memory=9 * page_bytes)
    got = [o.text for o in tight.chat(prompts, params)]
    assert tight.engine.scheduler.stats.preemptions > 0
    assert got == want
    for text in got:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert_drained(tight.engine)


# ---------------------------------------------------------------- tool-call grammars ↔ parsers
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}]


def _matcher(fmt: dict, llm: LLM):
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(llm.tokenizer.hf, vocab_size=llm.engine.vocab_size)
    compiled = xgr.GrammarCompiler(info).compile_grammar(xgr.Grammar.from_structural_tag(structural_tag(fmt)))
    return xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)


@pytest.mark.parametrize("parser", sorted(CALL_FORMATS))
def test_forced_call_grammar_accepts_what_the_parser_reads(llm, parser):
    fmt = CALL_FORMATS[parser]
    calls = [("get_weather", '{"city": "Paris"}'), ("add", '{"a": 1, "b": 2}')]
    text = fmt.prefix + fmt.separator.join(f"{fmt.begin}{n}{fmt.infix}{a}{fmt.end}" for n, a in calls) + fmt.suffix
    grammar = forced_calls(parser, [t["function"] for t in TOOLS], parallel=True)
    m = _matcher(grammar, llm)
    assert m.accept_string(text) and m.is_completed(), text
    assert not _matcher(grammar, llm).accept_string(text.replace('"Paris"', "Paris"))  # arguments must fit
    single = _matcher(forced_calls(parser, [t["function"] for t in TOOLS], parallel=False), llm)
    assert not (single.accept_string(text) and single.is_completed())  # one call only
    msg = ChatOutputParser.parse(text, tool_parser=parser, tools=TOOLS)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == [
        (n, json.loads(a)) for n, a in calls]


def test_answer_grammar_after_reasoning(llm):
    fmt = after_reasoning(answer_format("json_schema", json.dumps(SCHEMA)), opens_think=True)
    text = '<think>The user wants JSON. {not json here}</think>{"name": "Ann", "age": 30}'
    assert _matcher(fmt, llm).accept_string(text)
    assert not _matcher(fmt, llm).accept_string('<think>x</think>{"name": 3}')
    inside = after_reasoning(answer_format("regex", "(yes|no)"), opens_think=False)
    assert _matcher(inside, llm).accept_string("hmm, thinking</think>yes")
    msg = ChatOutputParser.parse(text, reasoning_parser="qwen3")
    assert msg["reasoning_content"] == "The user wants JSON. {not json here}"
    assert json.loads(msg["content"]) == {"name": "Ann", "age": 30}


@pytest.mark.parametrize("vocab", [49152, 1000])
def test_cpu_mask_kernel_equals_xgrammars(vocab):
    import xgrammar as xgr

    from ketch.sampling.grammar.xgrammar_backend import _apply_mask_cpu

    gen = torch.Generator().manual_seed(0)
    mask = xgr.allocate_token_bitmask(5, vocab)
    mask.copy_(torch.randint(-2**31, 2**31 - 1, mask.shape, generator=gen, dtype=torch.int64).to(torch.int32))
    mask[0] = -1  # a row that allows everything
    logits = torch.randn(5, vocab, generator=gen)
    want, got = logits.clone(), logits.clone()
    xgr.apply_token_bitmask_inplace(want, mask, vocab_size=vocab)
    _apply_mask_cpu(got, mask, vocab)
    assert torch.equal(got, want) and torch.equal(got[0], logits[0])
    assert torch.isinf(got[1:]).any()


def test_overlap_schedule_with_constrained_rows(llm, smollm_path):
    """Overlap scheduling processes a step one call late, but a grammar row needs its previous
    token accepted before its next mask: such a step first takes the one in flight. Constrained,
    penalized and free rows in one batch come out as without overlap, and valid."""
    prompts = [PERSON, [{"role": "user", "content": "Name three colours."}], [{"role": "user", "content": "Say hi."}]]
    params = [SamplingParams(temperature=0.0, max_tokens=60, grammar=GrammarSpec.json_schema(SCHEMA)),
              SamplingParams(temperature=0.0, max_tokens=24, repetition_penalty=1.3),
              SamplingParams(temperature=0.0, max_tokens=24)]
    overlapped = LLM(smollm_path, dtype="float32", num_threads=1, overlap_schedule=True)
    assert overlapped.engine.overlap and not llm.engine.overlap
    runs = []
    for engine_llm in (llm, overlapped):
        engine = engine_llm.engine
        for i, (messages, p) in enumerate(zip(prompts, params, strict=True)):
            engine.add_request(f"r{i}", engine_llm.encode_chat(messages), p)
        res = collect(drain(engine))
        runs.append([(res[(f"r{i}", 0)]["ids"], res[(f"r{i}", 0)]["reason"]) for i in range(3)])
        _drained(engine_llm)
    assert runs[0] == runs[1]
    ids, reason = runs[1][0]
    assert reason == "stop"
    jsonschema.validate(json.loads(overlapped.tokenizer.decode(ids[:-1])), SCHEMA)
