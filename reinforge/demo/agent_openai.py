"""The agent demo's calculator agent written against the ``openai`` client (``reinforge demo --agent --openai``).

The same task as the ``tool_agent`` rows: the agent asks the policy, runs the calculator on the row's problem when
the reply calls it, sends the result back as a tool message, and returns the final answer, which the demo's scorer
checks. Trained through the endpoint (``reinforge.serve``), its trajectories are ``tool_agent``'s, token for token.
"""

from __future__ import annotations

import asyncio
import weakref
from typing import Any

from reinforge.demo.agent_task import calc

_clients: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""One AsyncOpenAI client per event loop (making one takes about 50 ms, its TLS context; a rollout's trajectories share
it, each through ``with_options(base_url=...)``, which costs well under a millisecond)."""


def _client_for(base_url: str) -> Any:
    import openai

    loop = asyncio.get_running_loop()
    if loop not in _clients:
        _clients[loop] = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0)
    return _clients[loop].with_options(base_url=base_url)


async def calc_agent(base_url: str, row: dict[str, Any]) -> Any:
    import openai

    client = _client_for(base_url)
    messages = list(row["raw_prompt"])
    problem = row["extra_info"]["tools_kwargs"]["calc"]["execute_kwargs"]["e"]
    try:
        while True:
            response = await client.chat.completions.create(model="policy", messages=messages, tools=row.get("tools"))
            reply = response.choices[0].message
            messages.append(reply.model_dump(exclude_none=True))
            if not reply.tool_calls:
                return reply.content
            for call in reply.tool_calls:
                try:
                    result = calc(problem)
                except ValueError as error:
                    result = f"Error running tool 'calc': ValueError: {error}"
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    except openai.BadRequestError as error:
        if error.code != "trajectory_ended":
            raise
        return None
