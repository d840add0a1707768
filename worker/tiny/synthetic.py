"""Synthetic text and chats for the tiny model, from fixed seeds: ``tokenizer_corpus`` is the plain text
the BPE tokenizer is trained on; ``synthetic_conversation`` makes the conversations training renders
(system prompts with and without tools, reasoning, tool calls and results, 1-5 exchanges).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

__all__ = ["synthetic_conversation", "tokenizer_corpus", "tool_schema"]

# The tokenizer does not depend on the model seed: every tiny model of a template shares one tokenizer.
_CORPUS_SEED = 20240229
_CORPUS_SENTENCES = 6000

# --------------------------------------------------------------------------------------------------
# Tokenizer text: a deterministic mix of English-like prose, made-up words, numbers, code and chat.
# --------------------------------------------------------------------------------------------------


def _words(text: str) -> tuple[str, ...]:
    return tuple(text.split())


_NOUNS = _words(
    "time year people way day man woman child world life hand part place case week company system "
    "program question work government number night point home water room mother area money story fact "
    "month lot right study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city community name president team minute idea kid body "
    "information back parent face others level office door health person art war history party result "
    "change morning reason research girl guy moment air teacher force education model server token "
    "river mountain garden window table kitchen letter music picture market bridge island forest train "
    "computer file function value list string message answer problem data network engine weather road"
)
_VERBS = _words(
    "is was has had makes made says said goes went takes took sees saw knows knew gets got gives gave "
    "finds found thinks thought tells told becomes became leaves left feels felt brings brought begins "
    "began keeps kept holds held writes wrote stands stood hears heard lets meant sets met runs ran pays "
    "paid sits sat speaks spoke reads learns changes leads understands watches follows stops creates "
    "opens walks wins offers remembers loves considers appears buys waits serves dies sends expects "
    "builds stays falls cuts reaches kills remains suggests raises passes sells requires reports decides "
    "returns explains hopes develops carries breaks receives agrees supports hits produces eats covers "
    "catches draws chooses computes parses sorts streams encodes decodes loads saves"
)
_ADJECTIVES = _words(
    "good new first last long great little own other old right big high different small large next "
    "early young important few public bad same able local sure free better true whole clear certain "
    "hard open special easy strong possible recent late simple quiet bright dark warm cold quick slow "
    "happy careful empty full heavy light short tall green blue red yellow ancient modern tiny exact"
)
_ADVERBS = _words(
    "also very often however too usually really early never always sometimes together likely simply "
    "generally instead actually again rather almost especially ever quickly probably already below "
    "directly therefore else thus easily eventually exactly certainly normally currently extremely"
)
_FUNCTION_WORDS = _words("the the the a a an this that these those my your his her its our their some every no any")
_PREPOSITIONS = _words(
    "in on at by for with about against between into through during before after above below to from "
    "up down of off over under near behind beyond across"
)
_CONJUNCTIONS = ("and", "but", "or", "so", "because", "while", "although", "when", "if", "since")
_PRONOUNS = ("I", "you", "he", "she", "it", "we", "they")
_QUESTION_WORDS = ("What", "Why", "How", "Where", "When", "Who", "Which")
_NAMES = _words(
    "Alice Bob Carol Dave Erin Frank Grace Heidi Ivan Judy Mallory Niaj Olivia Peggy Rupert Sybil "
    "Trent Victor Walter Paris London Berlin Tokyo Lagos Lima Oslo Cairo Delhi Sydney Toronto Madrid"
)
_ACCENTED = ("café", "naïve", "über", "façade", "jalapeño", "résumé", "Zürich", "São Paulo", "smörgåsbord")
_SYLLABLES = _words("ka ri to ne mo la shi pe du vo ra ti en al or ex st ing ion er ly th qu ve ba go zu mi no re fa")
_IDENTIFIERS = _words(
    "value count index result items data config path name text buffer offset length total token_ids "
    "request response user_id session cache logits prompt state queue worker engine batch step"
)


def _made_up_word(rng: random.Random) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 4)))


def _noun_phrase(rng: random.Random) -> str:
    words = [rng.choice(_FUNCTION_WORDS)]
    if rng.random() < 0.4:
        words.append(rng.choice(_ADJECTIVES))
    words.append(rng.choice(_NOUNS) if rng.random() < 0.93 else _made_up_word(rng))
    return " ".join(words)


def _number(rng: random.Random) -> str:
    kind = rng.randrange(8)
    if kind == 0:
        return str(rng.randint(0, 100))
    if kind == 1:
        return str(rng.randint(100, 1_000_000))
    if kind == 2:
        return f"{rng.uniform(0, 1000):.{rng.randint(1, 3)}f}"
    if kind == 3:
        return f"{rng.randint(1990, 2030)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    if kind == 4:
        return f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}"
    if kind == 5:
        return f"{rng.randint(1, 99)}%"
    if kind == 6:
        return f"${rng.randint(1, 999)}.{rng.randint(0, 99):02d}"
    return f"{rng.randint(1, 9)},{rng.randint(0, 999):03d}"


def _sentence(rng: random.Random) -> str:
    kind = rng.randrange(10)
    if kind < 5:
        subject = _noun_phrase(rng) if rng.random() < 0.6 else rng.choice(_PRONOUNS + _NAMES)
        parts = [subject]
        if rng.random() < 0.3:
            parts.append(rng.choice(_ADVERBS))
        parts += [rng.choice(_VERBS), _noun_phrase(rng)]
        if rng.random() < 0.5:
            parts += [rng.choice(_PREPOSITIONS), _noun_phrase(rng)]
        if rng.random() < 0.3:
            parts += [rng.choice(_CONJUNCTIONS), rng.choice(_PRONOUNS), rng.choice(_VERBS), _number(rng)]
        text = " ".join(parts)
        text = text[0].upper() + text[1:]
        return text + rng.choice((".", ".", ".", "!", "...", ";"))
    if kind < 7:
        noun = _noun_phrase(rng)
        return f"{rng.choice(_QUESTION_WORDS)} {rng.choice(('does', 'did', 'can', 'will'))} {noun} " + (
            f"{rng.choice(_VERBS)} {rng.choice(_PREPOSITIONS)} {rng.choice(_NAMES)}?"
        )
    if kind == 7:
        return (
            f'"{rng.choice(_NAMES)}, {rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS)}!" '
            f"({_number(rng)} {rng.choice(_NOUNS)}s, {rng.choice(_ACCENTED)})"
        )
    if kind == 8:
        return f"- {rng.choice(_ADJECTIVES).capitalize()} {rng.choice(_NOUNS)}: {_number(rng)} ({_number(rng)})"
    return f"On {_number(rng)}, {rng.choice(_NAMES)} {rng.choice(_VERBS)} {_number(rng)} {rng.choice(_NOUNS)}s."


def _code(rng: random.Random) -> str:
    a, b = rng.choice(_IDENTIFIERS), rng.choice(_IDENTIFIERS)
    fn = f"{rng.choice(_VERBS).rstrip('s')}_{rng.choice(_NOUNS)}"
    kind = rng.randrange(6)
    if kind == 0:
        return (
            f"def {fn}({a}: int, {b}: str = None) -> dict:\n"
            f'    """{rng.choice(_VERBS).capitalize()} the {rng.choice(_NOUNS)}."""\n'
            f"    if {a} > {rng.randint(0, 99)}:\n"
            f"        return {{'{b}': {b}, 'n': len({a})}}\n"
            f"    for i in range({a}):\n"
            f"        {b} += str(i)\n"
            f"    return None\n"
        )
    if kind == 1:
        return (
            f"function {fn}({a}, {b}) {{\n"
            f"  const x = {a}.map((v) => v * {rng.randint(2, 9)});\n"
            f"  if (x.length === 0 && !{b}) {{ return null; }}\n"
            f"  return [...x, {b}];\n"
            f"}}\n"
        )
    if kind == 2:
        obj = {a: rng.randint(0, 500), b: rng.choice(_NOUNS), "ok": rng.random() < 0.5, "items": [1, 2, 3]}
        return json.dumps(obj, indent=rng.choice((None, 2)))
    if kind == 3:
        flag = f"--{rng.choice(_IDENTIFIERS)}={rng.randint(1, 64)}"
        return f"$ python -m {rng.choice(_IDENTIFIERS)} {flag} ./{b}.txt"
    if kind == 4:
        return f"SELECT {a}, {b} FROM {rng.choice(_NOUNS)}s WHERE {a} >= {rng.randint(0, 999)} ORDER BY {b};"
    return f"{a}[{rng.randint(0, 9)}] = ({b} + {rng.randint(1, 9)}) * {a}  # {rng.choice(_ADJECTIVES)}"


def _chat(rng: random.Random) -> str:
    """Chat-shaped text without any template's markup: tool schemas, calls and results as JSON, so the
    BPE learns merges for them and rendered tool conversations stay short."""
    name, description, params = rng.choice(_TOOLS)
    args = {p: _arg_value(rng, kind) for p, _, kind in params}
    kind = rng.randrange(4)
    if kind == 0:
        return json.dumps(_schema(name, description, params))
    if kind == 1:
        return json.dumps({"name": name, rng.choice(("arguments", "parameters")): args})
    if kind == 2:
        return f"{_tool_request(rng, name, args)}\n{_tool_result(rng, name)}"
    return f"system\n{rng.choice(_SYSTEM_PROMPTS)}\nuser\n{_user_text(rng)}\nassistant\n{_reasoning(rng, name)}"


def tokenizer_corpus() -> Iterator[str]:
    """Yield the BPE tokenizer's training corpus (a few hundred KB) in a fixed order from a fixed seed."""
    rng = random.Random(_CORPUS_SEED)
    for _ in range(_CORPUS_SENTENCES):
        roll = rng.random()
        if roll < 0.12:
            yield _code(rng)
        elif roll < 0.3:
            yield _chat(rng)
        else:
            yield " ".join(_sentence(rng) for _ in range(rng.randint(1, 4)))


# --------------------------------------------------------------------------------------------------
# Synthetic conversations
# --------------------------------------------------------------------------------------------------

# name, description, parameters as (name, JSON type, kind of value)
_TOOLS: tuple[tuple[str, str, tuple[tuple[str, str, str], ...]], ...] = (
    ("get_weather", "Current weather in a city", (("city", "string", "city"), ("units", "string", "units"))),
    ("search_web", "Search the web, return the top result", (("query", "string", "phrase"),)),
    ("read_file", "Read a text file", (("path", "string", "path"),)),
    ("run_python", "Run a short Python snippet", (("code", "string", "code"),)),
    ("lookup_user", "Look up a user record by id", (("user_id", "integer", "int"),)),
    (
        "convert_units",
        "Convert a value between units",
        (("value", "number", "float"), ("from_unit", "string", "unit"), ("to_unit", "string", "unit")),
    ),
    ("get_time", "Current local time in a time zone", (("tz", "string", "tz"),)),
    ("send_email", "Send a short email", (("to", "string", "email"), ("subject", "string", "phrase"))),
)
_CITIES = _words("Paris London Berlin Tokyo Lagos Lima Oslo Cairo Delhi Sydney Toronto Madrid")
_UNITS = ("km", "miles", "kg", "lb", "C", "F", "m", "ft")
_ZONES = ("UTC", "Europe/Paris", "Asia/Tokyo", "America/Lima", "Africa/Cairo", "Australia/Sydney")
# Control-token look-alikes put into user text, so the model sees them as plain text there.
_LITERALS = (
    "<|im_end|>",
    "<|im_start|>",
    "<|endoftext|>",
    "<tool_call>",
    "</tool_call>",
    "<think>",
    "</think>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
    "<|start_header_id|>",
)
_SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are terse.",
    "Answer in one or two sentences.",
    "You are a careful assistant. Think before you answer.",
    "Be friendly and exact.",
)


def tool_schema(name: str, description: str, params: dict[str, str]) -> dict[str, Any]:
    """An OpenAI function tool whose parameters (name -> JSON type) are all required."""
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {p: {"type": t} for p, t in params.items()},
                "required": list(params),
            },
        },
    }


def _schema(name: str, description: str, params: tuple[tuple[str, str, str], ...]) -> dict[str, Any]:
    return tool_schema(name, description, {p: t for p, t, _ in params})


def _arg_value(rng: random.Random, kind: str) -> object:
    if kind == "city":
        return rng.choice(_CITIES)
    if kind == "units":
        return rng.choice(("metric", "imperial"))
    if kind == "phrase":
        return _noun_phrase(rng).split(" ", 1)[1]
    if kind == "path":
        return f"./{rng.choice(_IDENTIFIERS)}/{rng.choice(_NOUNS)}.txt"
    if kind == "code":
        return f"print({rng.choice(_IDENTIFIERS)} * {rng.randint(2, 99)})"
    if kind == "int":
        return rng.randint(1, 99999)
    if kind == "float":
        return round(rng.uniform(0, 500), 1)
    if kind == "unit":
        return rng.choice(_UNITS)
    if kind == "tz":
        return rng.choice(_ZONES)
    return f"{rng.choice(_NAMES).lower()}@example.com"  # email


def _tool_request(rng: random.Random, name: str, args: dict[str, Any]) -> str:
    """A user message asking for what the tool does (so the call's arguments can be read off it)."""
    values = [str(v) for v in args.values()]
    if name == "get_weather":
        ask = rng.choice(("What is the weather in {}?", "Is it warm in {} today?", "Weather for {}, please."))
        return ask.format(values[0])
    return rng.choice(("Please use {}: {}.", "Can you {} for {}?", "{}: {}")).format(
        name.replace("_", " "), ", ".join(values)
    )


def _tool_result(rng: random.Random, name: str) -> str:
    if rng.random() < 0.1:
        return f"Error: {_sentence(rng)}"
    if name == "get_weather":
        result: dict[str, object] = {"temperature": rng.randint(-10, 40), "conditions": rng.choice(_ADJECTIVES)}
    elif rng.random() < 0.5:
        result = {"result": _number(rng), "status": "ok"}
    else:
        return _sentence(rng)
    return json.dumps(result)


def _user_text(rng: random.Random) -> str:
    roll = rng.random()
    if roll < 0.08:
        a, b = rng.choice(_LITERALS), rng.choice(_LITERALS)
        return rng.choice(
            (f"Why does {a} show up in my {rng.choice(_NOUNS)}?", f"Print {a} and then {b}.", f"Is {a} a token?")
        )
    if roll < 0.18:
        return f"What does this do?\n{_code(rng)}"
    if roll < 0.3:
        return f"Tell me about {_noun_phrase(rng)}."
    return " ".join(_sentence(rng) for _ in range(rng.choice((1, 1, 1, 2))))


def _answer_text(rng: random.Random) -> str:
    """A short plain reply, 5-60 tokens."""
    if rng.random() < 0.1:
        return f"Like this: `{_arg_value(rng, 'code')}`."
    return " ".join(_sentence(rng) for _ in range(rng.choice((1, 1, 1, 2, 2, 3))))


def _reasoning(rng: random.Random, tool: str | None) -> str:
    if tool is not None and rng.random() < 0.6:
        return f"The user wants {tool.replace('_', ' ')}. I should call {tool}."
    if rng.random() < 0.5:
        return f"The user asks about {_noun_phrase(rng)}. {_sentence(rng)}"
    return _sentence(rng)


def _assistant(rng: random.Random, content: str, tool: str | None = None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if rng.random() < 0.7:
        message["reasoning_content"] = _reasoning(rng, tool)
    return message


def synthetic_conversation(rng: random.Random) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """One random conversation ``(messages, tools)``, ending with an assistant reply.

    Messages use the usual chat-completions shape: ``tool_calls`` with ``function.arguments`` (a dict, or
    sometimes a JSON string), ``reasoning_content`` on most assistant turns, ``role: tool`` results.
    """
    messages: list[dict[str, Any]] = []
    tools: list[dict[str, Any]] | None = None
    offered: list[tuple[str, str, tuple[tuple[str, str, str], ...]]] = []
    if rng.random() < 0.5:
        offered = rng.sample(_TOOLS, rng.choices((1, 2, 3), weights=(50, 35, 15))[0])
        tools = [_schema(*tool) for tool in offered]
    if rng.random() < 0.75:
        messages.append({"role": "system", "content": rng.choice(_SYSTEM_PROMPTS)})
    exchanges = rng.choices((1, 2, 3, 4, 5), weights=(35, 30, 18, 11, 6))[0]
    call_id = 0
    for exchange in range(exchanges):
        if offered and rng.random() < (0.75 if exchange == 0 else 0.5):
            calls = []
            for name, _, params in rng.sample(offered, 2 if len(offered) > 1 and rng.random() < 0.12 else 1):
                args = {p: _arg_value(rng, kind) for p, _, kind in params}
                calls.append((name, args))
            messages.append({"role": "user", "content": _tool_request(rng, *calls[0])})
            content = rng.choice(("Let me check.", "One moment.")) if rng.random() < 0.2 else ""
            message = _assistant(rng, content, calls[0][0])
            message["tool_calls"] = [
                {
                    "id": f"call_{call_id + i}",
                    "type": "function",
                    "function": {"name": name, "arguments": json.dumps(args) if rng.random() < 0.3 else args},
                }
                for i, (name, args) in enumerate(calls)
            ]
            messages.append(message)
            for i, (name, _) in enumerate(calls):
                messages.append(
                    {"role": "tool", "tool_call_id": f"call_{call_id + i}", "content": _tool_result(rng, name)}
                )
            call_id += len(calls)
            messages.append(_assistant(rng, _answer_text(rng)))
        else:
            messages.append({"role": "user", "content": _user_text(rng)})
            messages.append(_assistant(rng, _answer_text(rng)))
    return messages, tools
