"""An OpenAI-compatible endpoint on the rollout engine, for serving a model and for training external agents.

``reinforge serve MODEL`` answers OpenAI's chat and completions routes from the native engine (``app.py``,
``service.py``, ``chat.py``). During RL, ``register_openai_agent`` turns any OpenAI-client agent into an agent loop:
each trajectory gets its own base URL on an endpoint over the rollout engine, every call's prompt ids, sampled ids
and log-probs are recorded, and the trajectory is assembled from those records, token in and token out
(``trajectories.py``, ``agents.py``; see docs/openai_agents.md).
"""

from reinforge.serve.agents import OpenAIAgentLoop, register_openai_agent, run_agent_command
from reinforge.serve.app import OpenAIEndpoint
from reinforge.serve.chat import ChatCodec, RequestError
from reinforge.serve.service import GenerationService
from reinforge.serve.trajectories import TrajectorySession, assemble_segments

__all__ = ["ChatCodec", "GenerationService", "OpenAIAgentLoop", "OpenAIEndpoint", "RequestError", "TrajectorySession",
           "assemble_segments", "register_openai_agent", "run_agent_command"]
