"""The agent demo's calculator agent written against the ``openai`` client (``reinforge demo --agent --openai``).

The same task as the ``tool_agent`` rows: the agent asks the policy, runs the calculator on the row's problem when
the reply calls it, sends the result back as a tool message, and returns the final answer, which the demo's scorer
checks. Trained through the endpoint (``reinforge.serve``), its trajectories are ``tool_agent``'s, token for token.
"""

from __future__ import annotations

from typing import Any

from reinforge.demo.agent_task import calc


async def calc_agent(base_url: str, row: dict[str, Any]) -> Any:
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0)
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
    finally:
        await client.close()
