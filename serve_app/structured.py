"""Structured output and tools for the chat API: ``response_format``,
``structured_outputs``, ``tools``/``tool_choice``, and the agent loop's messages.

- ``response_format``: ``{"type": "text"}`` (none), ``{"type": "json_object"}``,
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`` (the
  schema is always enforced, strict or not).
- ``structured_outputs`` (vLLM's): exactly one of ``json`` (a schema),
  ``regex``, ``choice`` (a list of strings) or ``grammar`` (Lark).
- ``tools``: functions with JSON-schema ``parameters``. The model is told about
  them through its chat template when the template takes tools, otherwise by a
  system text of this module's (``TOOLS_PROMPT``); either way it answers a call
  as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``. With
  ``tool_choice`` ``required`` or a named function the answer is constrained
  to exactly that (one call, or several with ``parallel_tool_calls``) by a
  grammar, so it always parses; with ``auto`` the answer is parsed, and what is
  not a well-formed call of a known function stays content; ``none`` leaves the
  tools out of the answer.
- The agent loop: an assistant message with ``tool_calls`` is rendered as the
  ``<tool_call>`` text the model wrote (so its generated ids are found again and
  the next turn reuses its KV like any reply), a ``tool`` message as a turn of
  the ``tool`` role.

Every error is a 400 naming the parameter.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from cluster.engine.grammar import JSON_OPTIONS, GrammarSpec, choice_spec
from cluster.errors import InvalidInputError
from serve_app.errors import APIError

TOOLS_PROMPT = ("You can call these functions:\n{tools}\n"
                "To call a function, answer with only <tool_call>{{\"name\": <function name>, \"arguments\": "
                "<its arguments as a JSON object>}}</tool_call>, one per call. Otherwise answer normally.")
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}\Z")
_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)
MAX_TOOLS = 128


def _check(spec: GrammarSpec, param: str) -> GrammarSpec:
    try:
        spec.check()
    except InvalidInputError as exc:
        raise APIError(400, f"'{param}': {exc}", param=param) from None
    return spec


def parse_constraint(body: dict) -> GrammarSpec | None:
    """The output constraint of ``response_format`` or ``structured_outputs`` (not both)."""
    fmt = body.get("response_format")
    structured = body.get("structured_outputs")
    if fmt is not None and structured is not None:
        raise APIError(400, "give 'response_format' or 'structured_outputs', not both", param="structured_outputs")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
            raise APIError(400, "'response_format.type' must be 'text', 'json_object' or 'json_schema'",
                           param="response_format")
        if fmt["type"] == "text":
            return None
        if fmt["type"] == "json_object":
            return _check(GrammarSpec("json_object"), "response_format")
        js = fmt.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
            raise APIError(400, "'response_format.json_schema' must be an object with a 'schema' object",
                           param="response_format.json_schema")
        if "name" in js and (not isinstance(js["name"], str) or not _NAME.match(js["name"])):
            raise APIError(400, "'response_format.json_schema.name' must be 1-64 letters, digits, _ or -",
                           param="response_format.json_schema.name")
        return _check(GrammarSpec("json_schema", json.dumps(js.get("schema", {}))), "response_format.json_schema")
    if structured is None:
        return None
    if not isinstance(structured, dict) or len([k for k in ("json", "regex", "choice", "grammar") if k in structured]) != 1 \
            or set(structured) - {"json", "regex", "choice", "grammar"}:
        raise APIError(400, "'structured_outputs' takes exactly one of 'json', 'regex', 'choice', 'grammar'",
                       param="structured_outputs")
    if "json" in structured:
        schema = structured["json"]
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise APIError(400, f"'structured_outputs.json' is not JSON: {exc}", param="structured_outputs.json")
        if not isinstance(schema, dict):
            raise APIError(400, "'structured_outputs.json' must be a JSON schema object", param="structured_outputs.json")
        return _check(GrammarSpec("json_schema", json.dumps(schema)), "structured_outputs.json")
    if "regex" in structured:
        if not isinstance(structured["regex"], str) or not structured["regex"]:
            raise APIError(400, "'structured_outputs.regex' must be a non-empty string", param="structured_outputs.regex")
        return _check(GrammarSpec("regex", structured["regex"]), "structured_outputs.regex")
    if "choice" in structured:
        choices = structured["choice"]
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise APIError(400, "'structured_outputs.choice' must be a non-empty list of non-empty strings",
                           param="structured_outputs.choice")
        return _check(choice_spec(choices), "structured_outputs.choice")
    if not isinstance(structured["grammar"], str) or not structured["grammar"]:
        raise APIError(400, "'structured_outputs.grammar' must be a Lark grammar", param="structured_outputs.grammar")
    return _check(GrammarSpec("lark", structured["grammar"]), "structured_outputs.grammar")


@dataclass
class Tools:
    """What a chat request said about tools, validated."""
    functions: list[dict]          # each {"name", "description", "parameters"}
    choice: str                    # "auto", "none", "required" or "function"
    named: str | None = None       # the function tool_choice names
    parallel: bool = True

    @property
    def active(self) -> bool:
        return self.choice != "none"

    def prompt_text(self) -> str:
        listed = [{"name": f["name"], "description": f.get("description", ""), "parameters": f["parameters"]}
                  for f in self.functions]
        return TOOLS_PROMPT.format(tools=json.dumps(listed, ensure_ascii=False))

    def template_tools(self) -> list[dict]:
        return [{"type": "function", "function": f} for f in self.functions]

    def constraint(self) -> GrammarSpec | None:
        """The grammar that forces a call (``required`` or a named function), else None."""
        if self.choice not in ("required", "function"):
            return None
        allowed = [f for f in self.functions if self.choice == "required" or f["name"] == self.named]
        schema = {"anyOf": [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                              "arguments": f["parameters"]},
                             "required": ["name", "arguments"], "additionalProperties": False} for f in allowed],
                  "x-guidance": JSON_OPTIONS}
        calls = 'call ("\\n" call)*' if self.parallel and self.choice == "required" else "call"
        lark = (f"start: {calls}\n"
                'call: "<tool_call>" body "</tool_call>"\n'
                f"body: %json {json.dumps(schema)}")
        return _check(GrammarSpec("lark", lark), "tool_choice")

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, tool_calls) of an answer: every well-formed call of a known function
        becomes a tool call; the text around them is the content (None when empty)."""
        names = {f["name"] for f in self.functions}
        calls, spans = [], []
        for m in _CALL.finditer(text):
            try:
                obj = json.loads(m.group(1))
            except json.JSONDecodeError:
                continue
            if not isinstance(obj, dict) or obj.get("name") not in names or not isinstance(obj.get("arguments", {}), dict):
                continue
            calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                          "function": {"name": obj["name"],
                                       "arguments": json.dumps(obj.get("arguments", {}), ensure_ascii=False)}})
            spans.append(m.span())
            if not self.parallel:
                break
        if not calls:
            return text, []
        rest = text
        for start, end in reversed(spans):
            rest = rest[:start] + rest[end:]
        rest = rest.strip()
        return (rest or None), calls


def parse_tools(body: dict) -> Tools | None:
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if tools is None:
        if choice not in (None, "none"):
            raise APIError(400, "'tool_choice' needs 'tools'", param="tool_choice")
        return None
    if not isinstance(tools, list) or not tools or len(tools) > MAX_TOOLS:
        raise APIError(400, f"'tools' must be a list of 1 to {MAX_TOOLS} tools", param="tools")
    functions, seen = [], set()
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise APIError(400, f"'tools[{i}]' must be {{\"type\": \"function\", \"function\": {{...}}}}",
                           param=f"tools[{i}]")
        f = tool["function"]
        name = f.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise APIError(400, f"'tools[{i}].function.name' must be 1-64 letters, digits, _ or -",
                           param=f"tools[{i}].function.name")
        if name in seen:
            raise APIError(400, f"'tools' names the function '{name}' twice", param=f"tools[{i}].function.name")
        seen.add(name)
        params = f.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise APIError(400, f"'tools[{i}].function.parameters' must be a JSON schema object",
                           param=f"tools[{i}].function.parameters")
        description = f.get("description", "")
        if not isinstance(description, str):
            raise APIError(400, f"'tools[{i}].function.description' must be a string",
                           param=f"tools[{i}].function.description")
        _check(GrammarSpec("json_schema", json.dumps(params)), f"tools[{i}].function.parameters")
        functions.append({"name": name, "description": description, "parameters": params})
    if not isinstance(parallel, bool):
        raise APIError(400, "'parallel_tool_calls' must be a boolean", param="parallel_tool_calls")
    named = None
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        named = fn.get("name") if isinstance(fn, dict) else None
        if named not in seen:
            raise APIError(400, "'tool_choice' must name one of the 'tools' functions", param="tool_choice")
        choice = "function"
    elif choice not in ("auto", "none", "required"):
        raise APIError(400, "'tool_choice' must be 'auto', 'none', 'required' or {\"type\": \"function\", "
                            "\"function\": {\"name\": ...}}", param="tool_choice")
    return Tools(functions, choice, named, parallel)


def call_text(call: dict) -> str:
    """The ``<tool_call>`` text of one tool call, as a constrained answer writes it."""
    fn = call["function"]
    try:
        args = json.loads(fn.get("arguments") or "{}")
    except (TypeError, json.JSONDecodeError):
        args = fn.get("arguments")
    return "<tool_call>" + json.dumps({"name": fn.get("name"), "arguments": args}, ensure_ascii=False,
                                      separators=(", ", ": ")) + "</tool_call>"


def assistant_text(content: str | None, calls: list[dict]) -> str:
    """The text an assistant turn with tool ``calls`` renders as: the calls as the
    model wrote them. One rule for the prompt, for the ids a reply is remembered
    under and for the texts another ingress asks the reply store for."""
    return (content or "") + "\n".join(call_text(c) for c in calls)


def assistant_texts(messages: object) -> list[str]:
    """The assistant contents a chat body's template will render (tool calls as the
    text the model wrote, as ``plain_messages`` makes them); best effort: a
    malformed message is skipped here and refused by the chat endpoint."""
    texts = []
    for m in messages[-64:] if isinstance(messages, list) else ():
        if not isinstance(m, dict) or m.get("role") != "assistant":
            continue
        content, calls = m.get("content"), m.get("tool_calls")
        try:
            if calls:
                texts.append(assistant_text(content, calls))
            elif isinstance(content, str):
                texts.append(content)
        except (TypeError, AttributeError, KeyError):
            continue
    return texts


def plain_messages(messages: list[dict], tools: Tools | None, template_takes_tools: bool) -> list[dict]:
    """The agent loop's messages as (role, content) turns the chat template renders:
    an assistant's tool calls as the text it wrote, a ``tool`` result as a turn of
    its own, and (without template support) the tools' system text first."""
    out = []
    for i, m in enumerate(messages):
        role = m["role"]
        if role == "assistant" and m.get("tool_calls"):
            out.append({"role": "assistant", "content": assistant_text(m.get("content"), m["tool_calls"])})
        elif role == "tool":
            out.append({"role": "tool", "content": m["content"]})
        else:
            out.append({"role": role, "content": m["content"] or ""})
    if tools is not None and tools.active and not template_takes_tools:
        text = tools.prompt_text()
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def validate_tool_messages(messages: list[dict]) -> None:
    """The agent loop's extra message shapes: assistant ``tool_calls``, ``tool`` results."""
    for i, m in enumerate(messages):
        if m.get("role") == "tool":
            if not isinstance(m.get("tool_call_id", ""), str):
                raise APIError(400, f"'messages[{i}].tool_call_id' must be a string", param=f"messages[{i}].tool_call_id")
        calls = m.get("tool_calls")
        if calls is None:
            continue
        if m.get("role") != "assistant" or not isinstance(calls, list):
            raise APIError(400, f"'messages[{i}].tool_calls' must be a list on an assistant message",
                           param=f"messages[{i}].tool_calls")
        for j, c in enumerate(calls):
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
                    or not isinstance(fn.get("arguments", ""), str):
                raise APIError(400, f"'messages[{i}].tool_calls[{j}]' must have function.name and function.arguments "
                                    f"strings", param=f"messages[{i}].tool_calls[{j}]")
