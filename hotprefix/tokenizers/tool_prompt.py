"""Tools in the prompt, for chat templates that do not render them.

Models trained for tools ship a template that renders `tools` and tool turns; others
(SmolLM2's among them) would silently drop them. For those the conversation itself
carries the tools, in the Hermes convention (used by Qwen-family and Hermes models):
the definitions in a system message between <tools> tags, each call the assistant
made as a <tool_call> JSON block, and each tool answer as a user turn inside
<tool_response> tags. The rendering is deterministic, so identical tools give
identical leading tokens (and prefix-cache hits) from one agent step to the next.
"""

from __future__ import annotations

import json
from typing import Any

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOLS_INTRO = ("You can call functions to answer. Their signatures are between <tools> and </tools>, one JSON "
               "object a line:")
CALL_INSTRUCTIONS = ("To call a function, answer with a JSON object holding its name and its arguments between "
                     f"{TOOL_CALL_OPEN} and {TOOL_CALL_CLOSE}, one block a call:\n{TOOL_CALL_OPEN}\n"
                     '{"name": "<function name>", "arguments": {<the arguments>}}\n' + TOOL_CALL_CLOSE)


def tools_block(tools: list[dict[str, Any]]) -> str:
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return f"{TOOLS_INTRO}\n<tools>\n{lines}\n</tools>\n\n{CALL_INSTRUCTIONS}"


def call_block(call: dict[str, Any]) -> str:
    fn = call["function"]
    return f"{TOOL_CALL_OPEN}\n{json.dumps({'name': fn['name'], 'arguments': fn['arguments']}, ensure_ascii=False)}" \
           f"\n{TOOL_CALL_CLOSE}"


def with_tools(messages: list[dict[str, Any]], tools: list[dict[str, Any]], after: int = 0,
               own_turn: bool = True) -> list[dict[str, Any]]:
    """The conversation with the tools written into it (a new list): calls become
    <tool_call> blocks, tool answers become <tool_response> user turns, and the tools
    block ends the first system message (or is one), unless `after` > 0: the first
    `after` messages are the operator's (a gateway's forced system prompt) and the tools,
    which the client supplied, go after them: a system turn of their own, or, with
    `own_turn` False (for templates that take one system message only), the start of the
    first message after them. Then the operator's turns render exactly as without tools."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        elif m.get("tool_calls"):
            text = "\n".join([m["content"]] * bool(m["content"]) + [call_block(c) for c in m["tool_calls"]])
            out.append({"role": m["role"], "content": text})
        else:
            out.append({k: v for k, v in m.items() if k in ("role", "content", "name")})
    block = tools_block(tools)
    if after and own_turn:
        out.insert(after, {"role": "system", "content": block})
    elif after and after < len(out):
        out[after] = {**out[after], "content": f"{block}\n\n{out[after]['content'] or ''}"}
    elif after:
        out.append({"role": "user", "content": block})
    elif out and out[0]["role"] in ("system", "developer"):
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{block}" if out[0]["content"] else block}
    else:
        out.insert(0, {"role": "system", "content": block})
    return out
